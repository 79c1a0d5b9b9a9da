"""Token ids of a request exactly as the replica will compute them.

The index is keyed by token ids, so a router whose ids differ from the replica's by a single
token finds nothing: silent zero hits, the most common complaint about cache-aware routers.
This module therefore copies vLLM's rules (0.32):
- completions: ``tokenizer(prompt, add_special_tokens=True)`` (the request may override it);
  token-id prompts are used as given.
- chat: ``apply_chat_template(messages, tools=..., add_generation_prompt=True,
  continue_final_message=..., **chat_template_kwargs, tokenize=False)`` then
  ``tokenizer(text, add_special_tokens=False)``. List contents are flattened the way vLLM's
  "string" content format does (text parts joined by newlines), and tool-call arguments
  given as JSON strings are parsed to objects, as vLLM does before rendering.
- transformers 5: we never ask ``apply_chat_template`` for ids (it may return a BatchEncoding),
  we render text and encode it ourselves.

``LocalTokenizer`` does this in-process; ``RemoteTokenizer`` asks a replica's ``/tokenize``
(always right, one extra round trip). ``self_check`` compares the two on the same request.

Multi-turn chats: the rendered text is split at the tokenizer's added tokens (``<|im_start|>``
and friends), which HF tokenizers never merge across, and each piece is encoded once and
cached. A new turn then encodes only its new pieces. The split is only used when a probe at
load time shows it gives the same ids as encoding the whole text.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

import httpx
import msgspec

from router.errors import RouterError
from router.lru import LRU
from router.requests import ParsedRequest

__all__ = [
    "LocalTokenizer",
    "RemoteTokenizer",
    "TokenizerBase",
    "flatten_messages",
    "replica_tokenize",
    "self_check",
    "tokenize_body",
]

log = logging.getLogger(__name__)

# Encoding long texts blocks the event loop; above this many characters it runs in a thread.
_INLINE_CHARS = 4096
# A text longer than the context length times this is first counted on its head only: past
# the model's limit there, the whole is too long too, and tokenizing 1M words took 7.6 s.
_HEAD_CHARS_PER_TOKEN = 8
# BPE tokens may merge across the cut: the head's count may exceed its share by a few.
_CUT_MARGIN = 8


def too_long(limit: int, at_least: int, param: str) -> RouterError:
    """vLLM's answer to a prompt past the context length, given before tokenizing it all."""
    return RouterError(
        400,
        f"This model's maximum context length is {limit} tokens. However, your prompt has "
        f"at least {at_least} tokens.",
        param=param,
    )


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
    out: list[dict[str, Any]] = []
    for message in messages:
        msg = dict(message)
        content = msg.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.get("type") == "text":
                    texts.append(str(part.get("text", "")))
                elif part.get("type") == "refusal":
                    texts.append(str(part.get("refusal", "")))
            msg["content"] = "\n".join(texts)
        tool_calls = msg.get("tool_calls")
        if isinstance(tool_calls, list):
            calls = []
            for call in tool_calls:
                call = dict(call) if isinstance(call, dict) else call
                fn = call.get("function") if isinstance(call, dict) else None
                if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                    fn = dict(fn)
                    try:
                        fn["arguments"] = json.loads(fn["arguments"])
                    except ValueError:
                        pass
                    call["function"] = fn
                calls.append(call)
            msg["tool_calls"] = calls
        out.append(msg)
    return out


def tokenize_body(req: ParsedRequest) -> dict[str, Any]:
    """The ``/tokenize`` body that asks a replica for this request's prompt ids."""
    if req.kind == "completion":
        return {
            "model": req.model,
            "prompt": req.prompt,
            "add_special_tokens": req.add_special_tokens,
        }
    body: dict[str, Any] = {
        "model": req.model,
        "messages": req.messages,
        "add_generation_prompt": req.add_generation_prompt,
        "continue_final_message": req.continue_final_message,
        "add_special_tokens": req.add_special_tokens,
    }
    if req.chat_template_kwargs:
        body["chat_template_kwargs"] = req.chat_template_kwargs
    if req.tools:
        body["tools"] = req.tools
    if req.chat_template:
        body["chat_template"] = req.chat_template
    return body


async def replica_tokenize(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> list[int]:
    """POST a replica's /tokenize; a client error there is the client's (400), else 502."""
    try:
        resp = await client.post(f"{url}/tokenize", json=body)
    except httpx.HTTPError as exc:
        raise RouterError(502, f"tokenizing on {url} failed: {exc!r}") from exc
    if resp.status_code >= 400:
        message = resp.text
        try:
            message = resp.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            pass
        status = resp.status_code if resp.status_code < 500 else 502
        raise RouterError(status, f"replica /tokenize: {message}")
    tokens = resp.json().get("tokens")
    if not isinstance(tokens, list):
        raise RouterError(502, f"replica /tokenize at {url} returned no token list")
    return tokens


class TokenizerBase(ABC):
    mode: str

    @abstractmethod
    async def encode(self, req: ParsedRequest, max_model_len: int | None = None) -> list[int]:
        """The prompt ids the replica will see (the first prompt of a batch). With
        ``max_model_len``, a prompt that certainly exceeds it is a 400 (``too_long``)."""

    def stats(self) -> dict[str, Any]:
        return {"mode": self.mode}


class LocalTokenizer(TokenizerBase):
    mode = "local"

    def __init__(
        self,
        name_or_path: str,
        *,
        cache_entries: int = 4096,
        segment_cache_entries: int = 65536,
        tokenizer: Any = None,
    ) -> None:
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(name_or_path)
        self.name = name_or_path
        self.tok = tokenizer
        self._text_cache: LRU[tuple[str, bool], list[int]] = LRU(cache_entries)
        self._render_cache: LRU[bytes, str] = LRU(cache_entries)
        self._segment_cache: LRU[str, list[int]] = LRU(segment_cache_entries)
        added = dict(self.tok.get_added_vocab())
        self._added_ids = added
        self._split_re: re.Pattern[str] | None = None
        if added:
            pattern = "|".join(re.escape(t) for t in sorted(added, key=len, reverse=True))
            self._split_re = re.compile(f"({pattern})")
        self.segmented = self._split_re is not None and self._probe_segmentation()

    # --- raw encoding ---------------------------------------------------------------------

    def _encode_text(self, text: str, add_special_tokens: bool) -> list[int]:
        ids = self.tok(text, add_special_tokens=add_special_tokens)["input_ids"]
        return list(ids)

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
                ids = self._encode_text(piece, False)
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
                if self._encode_segmented(text) != self._encode_text(text, False):
                    log.info("tokenizer %s: segment cache disabled (ids differ)", self.name)
                    self._segment_cache.clear()
                    return False
        except Exception:  # a tokenizer we cannot probe: use the whole-text path
            log.exception("tokenizer %s: segmentation probe failed", self.name)
            return False
        self._segment_cache.clear()
        return True

    def encode_text(self, text: str, add_special_tokens: bool) -> list[int]:
        key = (text, add_special_tokens)
        ids = self._text_cache.get(key)
        if ids is None:
            if self.segmented and not add_special_tokens:
                ids = self._encode_segmented(text)
            else:
                ids = self._encode_text(text, add_special_tokens)
            self._text_cache.put(key, ids)
        return ids

    # --- requests -------------------------------------------------------------------------

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
                ]
            ),
            digest_size=16,
        ).digest()
        text = self._render_cache.get(key)
        if text is not None:
            return text
        kwargs = dict(req.chat_template_kwargs or {})
        try:
            text = self.tok.apply_chat_template(
                flatten_messages(req.messages),
                tools=req.tools,
                chat_template=req.chat_template,
                add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message,
                tokenize=False,
                **kwargs,
            )
        except Exception as exc:  # jinja errors, bad roles, template raise_exception(...)
            raise RouterError(
                400, f"cannot apply the chat template: {exc}", param="messages"
            ) from exc
        if not isinstance(text, str):
            raise RouterError(500, "chat template rendered something other than text")
        self._render_cache.put(key, text)
        return text

    def encode_sync(self, req: ParsedRequest, max_model_len: int | None = None) -> list[int]:
        if req.kind == "completion":
            prompt = req.prompt
            if isinstance(prompt, list):
                _check_ids(prompt, max_model_len)
                return prompt
            assert isinstance(prompt, str)
            text, param = prompt, "prompt"
        else:
            text, param = self.render_chat(req), "messages"
        if max_model_len is not None and len(text) > max_model_len * _HEAD_CHARS_PER_TOKEN:
            head = self._encode_text(text[: max_model_len * _HEAD_CHARS_PER_TOKEN], False)
            if len(head) - _CUT_MARGIN > max_model_len:
                raise too_long(max_model_len, len(head) - _CUT_MARGIN, param)
        return self.encode_text(text, req.add_special_tokens)

    async def encode(self, req: ParsedRequest, max_model_len: int | None = None) -> list[int]:
        if req.kind == "completion" and isinstance(req.prompt, list):
            _check_ids(req.prompt, max_model_len)
            return req.prompt
        size = len(req.prompt) if isinstance(req.prompt, str) else _messages_chars(req.messages)
        if size <= _INLINE_CHARS:
            return self.encode_sync(req, max_model_len)
        return await asyncio.to_thread(self.encode_sync, req, max_model_len)

    def stats(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "tokenizer": self.name,
            "segmented": self.segmented,
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


def _check_ids(prompt: list[int], max_model_len: int | None) -> None:
    if max_model_len is not None and len(prompt) > max_model_len:
        raise too_long(max_model_len, len(prompt), "prompt")


def _messages_chars(messages: list[dict[str, Any]] | None) -> int:
    total = 0
    for m in messages or ():
        content = m.get("content")
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            total += sum(len(str(p.get("text", ""))) for p in content)
    return total


class RemoteTokenizer(TokenizerBase):
    """Ask a healthy replica's ``/tokenize`` (cached by request content)."""

    mode = "remote"

    def __init__(
        self,
        client: httpx.AsyncClient,
        pick_url: Callable[[str], str | None],
        *,
        cache_entries: int = 4096,
    ) -> None:
        self.client = client
        self.pick_url = pick_url
        self._cache: LRU[bytes, list[int]] = LRU(cache_entries)

    async def encode(self, req: ParsedRequest, max_model_len: int | None = None) -> list[int]:
        if req.kind == "completion" and isinstance(req.prompt, list):
            _check_ids(req.prompt, max_model_len)
            return req.prompt
        body = tokenize_body(req)
        key = hashlib.blake2b(msgspec.msgpack.encode(body), digest_size=16).digest()
        tokens = self._cache.get(key)
        if tokens is not None:
            return tokens
        url = self.pick_url(req.model)
        if url is None:
            raise RouterError(
                503, "no healthy replica to tokenize on", headers={"retry-after": "2"}
            )
        tokens = await replica_tokenize(self.client, url, body)
        self._cache.put(key, tokens)
        return tokens

    def stats(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "cache": {
                "entries": len(self._cache),
                "hits": self._cache.hits,
                "misses": self._cache.misses,
            },
        }


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
    from router.requests import parse_body

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
        first_diff = next(
            (i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b),
            None if len(ours) == len(theirs) else min(len(ours), len(theirs)),
        )
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
