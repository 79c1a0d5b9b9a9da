"""Token ids of a request exactly as the replica will compute them, in process.

The index is keyed by token ids, so a router whose ids differ from the replica's by a single
token finds nothing: silent zero hits, the most common complaint about cache-aware routers.
``LocalTokenizer`` therefore copies vLLM's rules (0.32):
- completions: ``tokenizer(prompt, add_special_tokens=True)`` (the request may override it);
  token-id prompts are used as given.
- chat: the conversation rebuilt as vLLM rebuilds it (``router/tokens/chat_render.py``: content
  format "string" or "openai" detected from the template, the developer role, tool-call
  arguments), then ``apply_chat_template(conversation, tools=..., add_generation_prompt=...,
  continue_final_message=..., **chat_template_kwargs the template reads, tokenize=False)``
  and ``tokenizer(text, add_special_tokens=False)``. The template is the request's
  ``chat_template``, else the one this tokenizer was given (the replicas'
  ``--chat-template``), else the tokenizer's own.
- ``truncate_prompt_tokens``: the last k ids are kept (``truncation_side: "right"``: the
  first k), special tokens kept as HF's left truncation keeps them.
- transformers 5: we never ask ``apply_chat_template`` for ids (it may return a BatchEncoding),
  we render text and encode it ourselves.

Other tokenizers: ``RemoteTokenizer`` (``router/tokens/remote_tokens.py``) asks a replica (render
endpoint, else ``/tokenize``); ``FleetTokenizer`` (``router/tokens/model_tokenizers.py``) picks one
per model and keeps the local ones checked against the replicas on live traffic
(``router/tokens/token_check.py``). ``self_check`` compares ids with a replica on built-in samples.

Multi-turn chats: the rendered text is split at the tokenizer's added tokens (``<|im_start|>``
and friends), which HF tokenizers never merge across, and each piece is encoded once and
cached. A new turn then encodes only its new pieces. The split is only used when a probe at
load time shows it gives the same ids as encoding the whole text.
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import json
import logging
import re
from collections.abc import Sequence
from typing import Any

import httpx
import msgspec

from kvroute.router.common.lru import LRU, frozen_ids, token_list_bytes
from kvroute.router.errors import RouterError
from kvroute.router.tokens.chat_render import (
    ContentFormat,
    conversation,
    detect_content_format,
    filter_template_kwargs,
    map_developer_role,
    truncate_ids,
)
from kvroute.router.tokens.remote_tokens import RemoteTokenizer, replica_tokenize, tokenize_body
from kvroute.router.tokens.requests import ParsedRequest
from kvroute.router.tokens.token_types import Prompt, TokenizerBase, check_ids, too_long

__all__ = [
    "LocalTokenizer",
    "Prompt",
    "RemoteTokenizer",
    "TokenizerBase",
    "first_difference",
    "flatten_messages",
    "replica_tokenize",
    "self_check",
    "tokenize_body",
]

log = logging.getLogger(__name__)

# Encoding long texts blocks the event loop; above this many characters to encode (not found
# in the caches) it runs in a thread. About 8k tokens, a few ms of encoding: under load a hop
# to a thread and back, each side waiting for the GIL behind the event-feed threads, took
# longer than that (docs/benchmarks.md, "Routers on a core of their own").
_INLINE_CHARS = 32768
# A chat is rendered on the loop (to find what its encoding would cost) up to this size.
_RENDER_INLINE_CHARS = 1 << 20
# A text longer than the context length times this is first counted on its head only: past
# the model's limit there, the whole is too long too, and tokenizing 1M words took 7.6 s.
_HEAD_CHARS_PER_TOKEN = 8
# BPE tokens may merge across the cut: the head's count may exceed its share by a few.
_CUT_MARGIN = 8


_SELF_CHECK_SAMPLES: list[dict[str, Any]] = [
    {"prompt": "The quick brown fox jumps over the lazy dog. 12345 <b>tags</b> \u00e9t\u00e9"},
    {
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Write a haiku about caches.\nTwo lines at most."},
            {"role": "assistant", "content": "Blocks stay warm in HBM"},
            {"role": "user", "content": [{"type": "text", "text": "Another, please."}]},
        ]
    },
]


def flatten_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as vLLM hands them to a "string"-format chat template."""
    return conversation(messages, "string")


class LocalTokenizer(TokenizerBase):
    mode = "local"

    def __init__(
        self,
        name_or_path: str,
        *,
        cache_entries: int = 4096,
        segment_cache_entries: int = 65536,
        tokenizer: Any = None,
        chat_template: str | None = None,
        content_format: str = "auto",
        direct_encode: bool = True,
    ) -> None:
        """``chat_template``: the template text the replicas were started with
        (``--chat-template``), overriding the tokenizer's; ``content_format``: their
        ``--chat-template-content-format`` ("auto": detected from the template);
        ``direct_encode``: call the Rust tokenizer directly where a probe shows the same ids
        (False: always through transformers, as the benchmark's baseline)."""
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(name_or_path)
        if content_format not in ("auto", "string", "openai"):
            raise ValueError(f"content_format must be auto, string or openai: {content_format!r}")
        self.name = name_or_path
        self.tok = tokenizer
        self.chat_template = chat_template
        self.content_format = content_format
        self._accepted_kwargs = _template_call_params(tokenizer)
        # Bounded in bytes too (approximate; router/common/lru.py): 64 + 32 + 32 MiB at most.
        # The ids are kept as tuples (``frozen_ids``): the garbage collector stops tracking a
        # tuple of ints, so a full collection does not walk millions of cached ids.
        self._text_cache: LRU[tuple[str, bool], tuple[int, ...]] = LRU(
            cache_entries,
            max_weight=64 * 2**20,
            weigh=lambda k, v: 49 + len(k[0]) + token_list_bytes(v),
        )
        self._render_cache: LRU[bytes, str] = LRU(
            cache_entries, max_weight=32 * 2**20, weigh=lambda k, v: 82 + len(v)
        )
        self._segment_cache: LRU[str, tuple[int, ...]] = LRU(
            segment_cache_entries,
            max_weight=32 * 2**20,
            weigh=lambda k, v: 49 + len(k) + token_list_bytes(v),
        )
        added = dict(self.tok.get_added_vocab())
        self._added_ids = added
        self._split_re: re.Pattern[str] | None = None
        if added:
            pattern = "|".join(re.escape(t) for t in sorted(added, key=len, reverse=True))
            self._split_re = re.compile(f"({pattern})")
        self._direct: Any = _direct_backend(tokenizer) if direct_encode else None
        if self._direct is not None and not self._probe_direct():
            self._direct = None
        self.segmented = self._split_re is not None and self._probe_segmentation()

    # --- raw encoding ---------------------------------------------------------------------

    def _encode_text(self, text: str, add_special_tokens: bool) -> list[int]:
        if self._direct is not None:
            # encode_batch, not encode: only the batch call lets go of the GIL while Rust
            # works, which a long prompt encoded in a worker thread needs (the loop runs on).
            batch = self._direct.encode_batch([text], add_special_tokens=add_special_tokens)
            ids: list[int] = batch[0].ids
            return ids
        return self._encode_hf(text, add_special_tokens)

    def _encode_hf(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self.tok(text, add_special_tokens=add_special_tokens)["input_ids"])

    def _probe_direct(self) -> bool:
        """Does the Rust tokenizer, called directly, give the ids transformers gives?"""
        specials = list(self._added_ids)[:4]
        texts = [
            "",
            " ",
            "The quick brown fox jumps over the lazy dog.\n12345 <b>tags</b>",
            "\u00e9t\u00e9 caf\u00e9 \U0001f600 \u4e2d\u6587 \u0645\u0631\u062d\u0628\u0627",
            "  leading and trailing spaces\n\n\tand tabs  ",
            "".join(f"{s}user\n Hello{s} \n" for s in specials) + "tail",
            "word " * 600,
        ]
        try:
            for text in texts:
                for special in (False, True):
                    direct = self._direct.encode_batch([text], add_special_tokens=special)
                    if direct[0].ids != self._encode_hf(text, special):
                        log.info(
                            "tokenizer %s: encoding through transformers (ids differ)", self.name
                        )
                        return False
        except Exception:  # an unusual backend: transformers' own path always works
            log.exception("tokenizer %s: direct-encoding probe failed", self.name)
            return False
        return True

    def _encode_segmented(self, text: str) -> list[int]:
        assert self._split_re is not None
        out: list[int] = []
        cache = self._segment_cache
        for i, piece in enumerate(self._split_re.split(text)):
            if not piece:
                continue
            if i % 2:  # the captured group: an added token
                out.append(self._added_ids[piece])
                continue
            ids = cache.get(piece)
            if ids is None:
                ids = frozen_ids(self._encode_text(piece, False))
                cache.put(piece, ids)
            out.extend(ids)
        return out

    def _probe_segmentation(self) -> bool:
        """Is encoding pieces between added tokens the same as encoding the whole text?"""
        specials = list(self._added_ids)[:3]
        texts = [
            f"{s}system\nHello there, friend.{s} \n  {s}user\n x  y{s}assistant\n" for s in specials
        ]
        texts.append("".join(f"{s} word{s}\n\n{s}" for s in specials) + " tail  ")
        try:
            for text in texts:
                if self._encode_segmented(text) != self._encode_hf(text, False):
                    log.info("tokenizer %s: segment cache disabled (ids differ)", self.name)
                    self._segment_cache.clear()
                    return False
        except Exception:  # a tokenizer we cannot probe: use the whole-text path
            log.exception("tokenizer %s: segmentation probe failed", self.name)
            return False
        self._segment_cache.clear()
        return True

    def encode_text(self, text: str, add_special_tokens: bool) -> list[int]:
        """The ids of ``text``: a list of the caller's own (the cache keeps a tuple)."""
        key = (text, add_special_tokens)
        cached = self._text_cache.get(key)
        if cached is not None:
            return list(cached)
        if self.segmented and not add_special_tokens:
            ids = self._encode_segmented(text)
        else:
            ids = self._encode_text(text, add_special_tokens)
        self._text_cache.put(key, frozen_ids(ids))
        return ids

    # --- requests -------------------------------------------------------------------------

    def template_for(self, req: ParsedRequest) -> str | None:
        """The template vLLM resolves: the request's, else the server's, else the
        tokenizer's own (by name for tool use when it has several)."""
        if req.chat_template:
            return req.chat_template
        if self.chat_template:
            return self.chat_template
        try:
            return self.tok.get_chat_template(None, tools=req.tools)
        except Exception:  # no template at all: apply_chat_template will say so
            return None

    def format_for(self, template: str | None) -> ContentFormat:
        if self.content_format in ("string", "openai"):
            return self.content_format  # type: ignore[return-value]
        return detect_content_format(template) if template else "string"

    def render_chat(self, req: ParsedRequest) -> str:
        assert req.messages is not None
        key = hashlib.blake2b(
            msgspec.msgpack.encode(
                [
                    req.messages,
                    req.tools,
                    req.add_generation_prompt,
                    req.continue_final_message,
                    req.chat_template,
                    req.chat_template_kwargs,
                    req.body.get("documents"),
                    req.body.get("reasoning_effort"),
                ]
            ),
            digest_size=16,
        ).digest()
        text = self._render_cache.get(key)
        if text is not None:
            return text
        template = self.template_for(req)
        try:
            conv = map_developer_role(
                conversation(req.messages, self.format_for(template)), template
            )
            kwargs = filter_template_kwargs(_template_kwargs(req), template, self._accepted_kwargs)
            text = self.tok.apply_chat_template(
                conv, tools=req.tools, chat_template=template, tokenize=False, **kwargs
            )
        except RouterError:
            raise
        except Exception as exc:  # odd part values, jinja errors, template raise_exception()
            raise RouterError(
                400, f"cannot apply the chat template: {exc}", param="messages"
            ) from exc
        if not isinstance(text, str):
            raise RouterError(500, "chat template rendered something other than text")
        self._render_cache.put(key, text)
        return text

    def encode_sync(self, req: ParsedRequest, max_model_len: int | None = None) -> list[int]:
        keep, side = req.truncate_prompt_tokens, req.truncation_side
        if req.kind == "completion":
            prompt = req.prompt
            if isinstance(prompt, list):
                if keep is None:
                    check_ids(prompt, max_model_len)
                return truncate_ids(prompt, keep, side, max_model_len)
            assert isinstance(prompt, str)
            text, param = prompt, "prompt"
        else:
            text, param = self.render_chat(req), "messages"
        if (
            keep is None
            and max_model_len is not None
            and len(text) > max_model_len * _HEAD_CHARS_PER_TOKEN
        ):
            head = self._encode_text(text[: max_model_len * _HEAD_CHARS_PER_TOKEN], False)
            if len(head) - _CUT_MARGIN > max_model_len:
                raise too_long(max_model_len, len(head) - _CUT_MARGIN, param)
        ids = self.encode_text(text, req.add_special_tokens)
        if keep is None:
            return ids
        if keep < 0:
            keep = max_model_len
        if keep is None or len(ids) <= keep:
            return ids
        if req.add_special_tokens and side is None:
            return self._truncate_with_specials(text, ids, keep)
        return truncate_ids(ids, keep, side, max_model_len)

    def _truncate_with_specials(self, text: str, ids: list[int], keep: int) -> list[int]:
        """HF's left truncation (vLLM's default side): the special tokens the tokenizer adds
        stay, the text's ids lose their head."""
        plain = self.encode_text(text, False)
        extra = len(ids) - len(plain)
        start = next((i for i in range(extra + 1) if ids[i : i + len(plain)] == plain), None)
        if start is None:  # specials inside the text's ids: plain slicing is all we know
            return ids[len(ids) - keep :]
        prefix, suffix = ids[:start], ids[start + len(plain) :]
        room = max(0, keep - len(prefix) - len(suffix))
        return [*prefix, *(plain[len(plain) - room :] if room else []), *suffix]

    async def encode(self, req: ParsedRequest, max_model_len: int | None = None) -> list[int]:
        """``encode_sync`` on the loop when little is left to encode, else in a thread.

        A thread hop is not free: the worker and then the loop each wait for the GIL, behind
        the event-feed threads (up to a 5 ms switch interval per runnable thread); under
        load that was most of a chat request's decision time. A returning chat's rendered
        text is mostly pieces the segment cache already holds, so it is encoded here when
        its uncached pieces are short."""
        if req.kind == "completion" and isinstance(req.prompt, list):
            return self.encode_sync(req, max_model_len)
        size = len(req.prompt) if isinstance(req.prompt, str) else _messages_chars(req.messages)
        if size <= _INLINE_CHARS or self._uncached_chars(req, size, max_model_len) <= _INLINE_CHARS:
            return self.encode_sync(req, max_model_len)
        return await asyncio.to_thread(self.encode_sync, req, max_model_len)

    def _uncached_chars(self, req: ParsedRequest, size: int, max_model_len: int | None) -> int:
        """About how many characters ``encode_sync`` would have to run through the tokenizer
        (``size`` when unknown): those of a chat's rendered pieces not in the caches."""
        if req.kind != "chat" or not self.segmented or size > _RENDER_INLINE_CHARS:
            return size
        if req.truncate_prompt_tokens is not None:
            return size  # truncation re-encodes: not worth predicting
        text = self.render_chat(req)
        if max_model_len is not None and len(text) > max_model_len * _HEAD_CHARS_PER_TOKEN:
            return len(text)  # its head is encoded uncached, to check the length
        if (text, req.add_special_tokens) in self._text_cache:
            return 0
        if req.add_special_tokens or self._split_re is None:
            return len(text)
        cache = self._segment_cache
        return sum(
            len(piece)
            for i, piece in enumerate(self._split_re.split(text))
            if i % 2 == 0 and piece and piece not in cache
        )

    def stats(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "tokenizer": self.name,
            "segmented": self.segmented,
            "direct_encode": self._direct is not None,
            "text_cache": {
                "entries": len(self._text_cache),
                "hits": self._text_cache.hits,
                "misses": self._text_cache.misses,
            },
            "segment_cache": {
                "entries": len(self._segment_cache),
                "hits": self._segment_cache.hits,
                "misses": self._segment_cache.misses,
            },
        }


def _direct_backend(tok: Any) -> Any:
    """The Rust ``tokenizers.Tokenizer`` behind a transformers fast tokenizer, when calling it
    directly is what transformers' ``__call__`` does (else None).

    transformers' call for a fast tokenizer resets truncation and padding, sets
    ``encode_special_tokens`` and calls ``encode_batch`` on this object (which, unlike
    ``encode``, releases the GIL while it runs); the Python around it
    costs about 25 us per call plus a third of the Rust time again (argument checks, building
    a BatchEncoding with attention masks), which a chat's dozens of uncached pieces pay each.
    A subclass that overrides the call, or a backend configured to truncate or pad, keeps
    transformers' path; ``_probe_direct`` then checks the ids on sample texts."""
    try:
        from tokenizers import Tokenizer
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return None
    backend = getattr(tok, "_tokenizer", None)
    if not isinstance(tok, TokenizersBackend) or not isinstance(backend, Tokenizer):
        return None
    cls = type(tok)
    for name in ("__call__", "_encode_plus"):
        if getattr(cls, name) is not getattr(TokenizersBackend, name):
            return None
    if backend.truncation is not None or backend.padding is not None:
        return None
    if backend.encode_special_tokens != bool(getattr(tok, "split_special_tokens", False)):
        return None
    return backend


def _template_call_params(tok: Any) -> frozenset[str]:
    """Parameters ``apply_chat_template`` itself takes: request kwargs of these names reach
    it even when the template does not read them (vLLM lets HF's standard ones through)."""
    try:
        params = inspect.signature(tok.apply_chat_template).parameters.values()
    except (TypeError, ValueError):
        return frozenset()
    skip = (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)
    names = {p.name for p in params if p.kind not in skip}
    return frozenset(names - {"chat_template", "tokenize", "conversation"})


def _template_kwargs(req: ParsedRequest) -> dict[str, Any]:
    """What vLLM passes the template besides the messages (``build_chat_params``): the
    request's ``chat_template_kwargs``, overridden by ``documents``, ``reasoning_effort``
    (which also turns ``enable_thinking`` on unless given) and the generation-prompt flags."""
    kwargs = dict(req.chat_template_kwargs or {})
    if "tokenize" in kwargs:
        raise RouterError(
            400,
            "Found unexpected chat template kwargs from request: {'tokenize'}",
            param="chat_template_kwargs",
        )
    kwargs.pop("chat_template", None)
    effort = req.body.get("reasoning_effort")
    if effort is not None and "enable_thinking" not in kwargs:
        kwargs["enable_thinking"] = effort != "none"
    extra = {
        "add_generation_prompt": req.add_generation_prompt,
        "continue_final_message": req.continue_final_message,
        "documents": req.body.get("documents"),
        "reasoning_effort": effort,
    }
    kwargs.update({k: v for k, v in extra.items() if v is not None and v != "auto"})
    return kwargs


def _messages_chars(messages: list[dict[str, Any]] | None) -> int:
    total = 0
    for m in messages or ():
        content = m.get("content")
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            total += sum(len(str(p.get("text", ""))) for p in content)
    return total


def first_difference(ours: Sequence[int], theirs: Sequence[int]) -> int | None:
    """The first position where two id lists differ (a length difference counts), or None."""
    first = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), None)
    if first is None and len(ours) != len(theirs):
        return min(len(ours), len(theirs))
    return first


async def self_check(
    tokenizer: TokenizerBase,
    client: httpx.AsyncClient,
    url: str,
    model: str,
    samples: Sequence[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Compare the router's ids with the replica's ``/tokenize`` on the same requests.

    Returns ``{"ok": bool, "replica": url, "results": [...]}``; each result names the first
    differing position so a template or special-token mismatch is easy to see.
    """
    from kvroute.router.tokens.requests import parse_body

    results = []
    ok = True
    for sample in samples or _SELF_CHECK_SAMPLES:
        kind = "chat" if "messages" in sample else "completion"
        req = parse_body(json.dumps({"model": model, **sample}).encode(), kind)
        try:
            ours = await tokenizer.encode(req)
            theirs = await replica_tokenize(client, url, tokenize_body(req))
        except RouterError as exc:
            ok = False
            results.append({"kind": kind, "ok": False, "error": exc.message})
            continue
        first_diff = first_difference(ours, theirs)
        same = first_diff is None
        ok &= same
        results.append(
            {
                "kind": kind,
                "ok": same,
                "router_tokens": len(ours),
                "replica_tokens": len(theirs),
                "first_difference": first_diff,
            }
        )
    return {"ok": ok, "replica": url, "mode": tokenizer.mode, "results": results}
