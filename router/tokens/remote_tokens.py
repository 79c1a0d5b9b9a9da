"""Token ids from a replica: its render endpoints when it serves them, else ``/tokenize``.

vLLM 0.32+ serves ``POST /v1/chat/completions/render`` and ``POST /v1/completions/render``:
the request body in, the engine's prompt out (token ids, plus multimodal hashes and
placeholder ranges), rendered by the server's own code without running the model. That is
exact by construction: its chat template, tools, content parts, images, truncation. A
replica started without ``--enable-scale-out`` (and not a render/tokens-only server)
answers 403 there; an older one 404. Such a replica/model pair is remembered and asked
through ``/tokenize`` from then on (``tokenize_body``: the chat-template options of the
request), with ``truncate_prompt_tokens`` applied here, as vLLM applies it after
tokenizing.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from typing import Any

import httpx
import msgspec

from kvroute.router.common.lru import LRU, frozen_ids, token_list_bytes
from kvroute.router.errors import RouterError
from kvroute.router.tokens.chat_render import truncate_ids
from kvroute.router.tokens.requests import ParsedRequest
from kvroute.router.tokens.token_types import MMItem, Prompt, TokenizerBase, check_ids

__all__ = ["RemoteTokenizer", "parse_render", "replica_tokenize", "tokenize_body"]

log = logging.getLogger(__name__)

# Statuses that mean "this server has no render endpoint": disabled (403, vLLM without
# --enable-scale-out), unknown path (404, older vLLM), or method/implementation missing.
_NO_RENDER = frozenset({403, 404, 405, 501})
_RENDER_PATHS = {"chat": "/v1/chat/completions/render", "completion": "/v1/completions/render"}


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


def _error_message(resp: httpx.Response) -> str:
    try:
        return str(resp.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return resp.text


async def _post(client: httpx.AsyncClient, url: str, path: str, body: Any) -> httpx.Response:
    try:
        return await client.post(f"{url}{path}", json=body)
    except httpx.HTTPError as exc:
        raise RouterError(502, f"tokenizing on {url} failed: {exc!r}") from exc


def _raise_for(resp: httpx.Response, what: str) -> None:
    """A client error there is the client's (same status), anything else a 502. A 401 or
    403 is about the router's own key (the client's is never sent there): a 502 too."""
    if resp.status_code in (401, 403):
        raise RouterError(
            502,
            f"replica {what}: the replica refused the router's API key "
            f"(HTTP {resp.status_code}): check --replica-api-key",
        )
    if resp.status_code >= 400:
        status = resp.status_code if resp.status_code < 500 else 502
        raise RouterError(status, f"replica {what}: {_error_message(resp)}")


async def replica_tokenize(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> list[int]:
    """POST a replica's /tokenize; a client error there is the client's (400), else 502."""
    resp = await _post(client, url, "/tokenize", body)
    _raise_for(resp, "/tokenize")
    tokens = resp.json().get("tokens")
    if not isinstance(tokens, list):
        raise RouterError(502, f"replica /tokenize at {url} returned no token list")
    return tokens


def parse_render(data: Any) -> Prompt:
    """A render answer (vLLM's ``GenerateRequest``; completions: a list, the first prompt
    is the one routed) as a ``Prompt`` with its multimodal items sorted by offset."""
    if isinstance(data, list):
        data = data[0] if data else None
    tokens = data.get("token_ids") if isinstance(data, dict) else None
    if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
        raise RouterError(502, "replica render returned no token_ids")
    items: list[MMItem] = []
    features = data.get("features")
    if isinstance(features, dict):
        hashes = features.get("mm_hashes") or {}
        places = features.get("mm_placeholders") or {}
        for modality, ids in hashes.items():
            for ident, place in zip(ids, places.get(modality) or (), strict=False):
                items.append(MMItem(str(ident), int(place["offset"]), int(place["length"])))
    items.sort(key=lambda item: item.offset)
    return Prompt(list(tokens), items, source="render")


class RemoteTokenizer(TokenizerBase):
    """Ask a healthy replica (render, else ``/tokenize``); answers cached by content."""

    mode = "remote"

    def __init__(
        self,
        client: httpx.AsyncClient,
        pick_url: Callable[[str], str | None],
        *,
        cache_entries: int = 4096,
        use_render: bool = True,
    ) -> None:
        self.client = client
        self.pick_url = pick_url
        self.use_render = use_render
        # (ids, multimodal items, source): the ids as a tuple (router/common/lru.py,
        # ``frozen_ids``: not walked by every full garbage collection)
        self._cache: LRU[bytes, tuple[tuple[int, ...], tuple[MMItem, ...], str]] = LRU(
            cache_entries,
            max_weight=64 * 2**20,
            weigh=lambda k, v: 97 + token_list_bytes(v[0]) + 64 * len(v[1]),
        )
        # (replica url, model) -> why render is not used there (asked once, then remembered)
        self.no_render: dict[tuple[str, str], str] = {}
        self.calls = {"render": 0, "tokenize": 0}

    def _key(self, req: ParsedRequest) -> bytes:
        body = req.body
        fields = [
            req.kind,
            tokenize_body(req),
            req.truncate_prompt_tokens,
            req.truncation_side,
            # what else the server's renderer reads
            [body.get(k) for k in ("documents", "reasoning_effort", "mm_processor_kwargs")],
        ]
        return hashlib.blake2b(msgspec.msgpack.encode(fields), digest_size=16).digest()

    async def prompt(self, req: ParsedRequest, max_model_len: int | None = None) -> Prompt:
        if req.kind == "completion" and isinstance(req.prompt, list):
            check_ids(req.prompt, max_model_len)
            ids = truncate_ids(
                req.prompt, req.truncate_prompt_tokens, req.truncation_side, max_model_len
            )
            return Prompt(ids, source="given")
        key = self._key(req)
        cached = self._cache.get(key)
        if cached is not None:
            ids, mm, source = cached
            return Prompt(list(ids), list(mm), source)
        found = await self.fetch(req, max_model_len=max_model_len)
        self._cache.put(key, (frozen_ids(found.tokens), tuple(found.mm), found.source))
        return found

    async def encode(self, req: ParsedRequest, max_model_len: int | None = None) -> list[int]:
        return (await self.prompt(req, max_model_len)).tokens

    async def fetch(
        self, req: ParsedRequest, *, url: str | None = None, max_model_len: int | None = None
    ) -> Prompt:
        """A fresh answer from ``url`` (default: a healthy replica serving the model)."""
        url = url or self.pick_url(req.model)
        if url is None:
            raise RouterError(
                503, "no healthy replica to tokenize on", headers={"retry-after": "2"}
            )
        if self.use_render and (url, req.model) not in self.no_render:
            rendered = await self._render(req, url)
            if rendered is not None:
                return rendered
        self.calls["tokenize"] += 1
        ids = await replica_tokenize(self.client, url, tokenize_body(req))
        ids = truncate_ids(ids, req.truncate_prompt_tokens, req.truncation_side, max_model_len)
        return Prompt(ids, source="tokenize")

    async def _render(self, req: ParsedRequest, url: str) -> Prompt | None:
        """The server's own rendering of the request body, or None where it serves none."""
        self.calls["render"] += 1
        resp = await _post(self.client, url, _RENDER_PATHS[req.kind], req.body)
        if resp.status_code in _NO_RENDER and not _model_missing(resp):
            reason = f"{resp.status_code}: {_error_message(resp)[:200]}"
            self.no_render[(url, req.model)] = reason
            log.info(
                "replica %s serves no render endpoint for %s (%s); using its /tokenize",
                url,
                req.model,
                reason,
            )
            return None
        _raise_for(resp, "render")
        try:
            return parse_render(resp.json())
        except (ValueError, KeyError, TypeError) as exc:
            raise RouterError(502, f"replica render at {url} answered badly: {exc!r}") from exc

    def stats(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "render": self.use_render,
            "calls": dict(self.calls),
            "no_render": [
                {"replica": url, "model": model, "reason": why}
                for (url, model), why in sorted(self.no_render.items())
            ],
            "cache": {
                "entries": len(self._cache),
                "hits": self._cache.hits,
                "misses": self._cache.misses,
            },
        }


def _model_missing(resp: httpx.Response) -> bool:
    """vLLM's 404 for an unknown model (a client error, not a missing endpoint)."""
    return resp.status_code == 404 and "does not exist" in _error_message(resp)
