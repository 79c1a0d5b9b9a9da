"""The simulated replica's render endpoints (vLLM 0.32's scale-out API):
``POST /v1/chat/completions/render`` and ``POST /v1/completions/render``.

They answer what the generation endpoints would feed the engine: the prompt's token ids
(after ``truncate_prompt_tokens``) and its multimodal features. A server started without
``--enable-scale-out`` (``SimReplicaConfig.scale_out`` False, the default) answers them 403
with vLLM's message, as vLLM does.

Deviation, stated so nobody mistakes it for vLLM's: the simulated model is text-only, so an
image part adds no tokens; its feature is one placeholder of length 1 per image, at offsets
0, 1, ..., its hash the xxh3 of the image URL.
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any

import xxhash
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from kvroute.bench.sim.http_common import ApiError, error_response, json_response, read_body

if TYPE_CHECKING:
    from kvroute.bench.sim.api import Handlers

__all__ = ["RenderHandlers"]

_DISABLED = (
    "Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out to enable them."
)


class RenderHandlers:
    def __init__(self, base: Handlers) -> None:
        self.base = base

    def routes(self) -> list[Route]:
        return [
            Route("/v1/chat/completions/render", self.render_chat, methods=["POST"]),
            Route("/v1/completions/render", self.render_completion, methods=["POST"]),
        ]

    async def render_chat(self, request: Request) -> Response:
        return await self._render(request, chat=True)

    async def render_completion(self, request: Request) -> Response:
        return await self._render(request, chat=False)

    async def _render(self, request: Request, *, chat: bool) -> Response:
        if not self.base.r.config.scale_out:
            return error_response(ApiError(_DISABLED, code=403))
        try:
            body = await read_body(request)
            self.base.check_model(body)
            features = _image_features(body) if chat else None  # before parts become text
            tokens = self.base.chat_ids(body) if chat else self.base.prompt_ids(body)
        except ApiError as err:
            return error_response(err)
        keep = body.get("truncate_prompt_tokens")
        if isinstance(keep, int) and not isinstance(keep, bool) and 0 <= keep < len(tokens):
            tokens = tokens[len(tokens) - keep :] if keep else []
        out = {
            "request_id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            "token_ids": tokens,
            "features": features,
            "model": body.get("model"),
            "stream": bool(body.get("stream")),
        }
        return json_response(out if chat else [out])


def _image_features(body: dict[str, Any]) -> dict[str, Any] | None:
    urls = [
        part["image_url"]["url"]
        for m in body.get("messages") or ()
        if isinstance(m, dict) and isinstance(m.get("content"), list)
        for part in m["content"]
        if isinstance(part, dict)
        and part.get("type") == "image_url"
        and isinstance(part.get("image_url"), dict)
        and isinstance(part["image_url"].get("url"), str)
    ]
    if not urls:
        return None
    return {
        "mm_hashes": {"image": [xxhash.xxh3_64_hexdigest(u.encode()) for u in urls]},
        "mm_placeholders": {"image": [{"offset": i, "length": 1} for i in range(len(urls))]},
    }
