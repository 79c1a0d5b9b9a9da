"""A simulated replica's HTTP API: vLLM's OpenAI server as seen from outside.

Endpoints and shapes follow vLLM 0.32: /v1/completions and /v1/chat/completions (JSON or SSE
ending in ``data: [DONE]``, ``stream_options.include_usage``, ``usage.prompt_tokens_details.
cached_tokens``, ``return_token_ids``), /v1/models (the base model and its LoRA adapters),
/v1/load_lora_adapter and /v1/unload_lora_adapter, /tokenize, /detokenize, /metrics,
/health, /reset_prefix_cache, /version, vLLM's ``--api-key`` check
(``SimReplicaConfig.api_key``), and vLLM's error body ``{"error": {"message", "type",
"param", "code"}}``; the Responses API, Anthropic messages, embeddings and pooling are in
kvroute.bench.sim.more_api, the render endpoints in kvroute.bench.sim.render_api, the
completions and chat answers' shapes (JSON and SSE) in kvroute.bench.sim.answers. The
app is plain Starlette (what FastAPI runs on) with hand-written validation: a fleet runs
many replicas on one event loop, so per-request overhead matters more than schemas. Every
route records its POSTs in ``replica.seen`` and applies the replica's ``ReplicaFaults``
(kvroute.bench.sim.faults).

Deviations, stated so nobody mistakes them for vLLM's: the generated text is a deterministic
function of the prompt (see SimTokenizer.generate), every request generates exactly
``max_tokens`` tokens (finish_reason "length"; default ``default_max_tokens`` when absent),
``n``, ``logprobs``, ``best_of`` and streamed batches of prompts are refused with a 400, and a
wrong method is answered in vLLM's error schema (vLLM's own 404/405 are FastAPI's
``{"detail": ...}``). A batch of prompts (non-streamed) runs its prompts concurrently and
reports, as vLLM 0.32 does, the cached tokens of its last prompt only.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvroute.bench.sim.answers import AnswerShape, sse_answer, whole_answer
from kvroute.bench.sim.faults import SeenRequest
from kvroute.bench.sim.http_common import (
    ApiError,
    error_response,
    json_response,
    opt_bool,
    opt_int,
    read_body,
    run_to_end,
    with_cancellation,
)
from kvroute.bench.sim.more_api import MoreHandlers
from kvroute.bench.sim.render_api import RenderHandlers
from kvroute.bench.sim.replica import InjectedError, SimReplica
from kvroute.bench.sim.scheduler import ReplicaDied

__all__ = ["VllmKeyCheck", "create_app", "request_token_ids"]

_BAD_LORA = "InvalidUserInput"  # vLLM's error type for a bad LoRA (un)load request
# Endpoints that run the engine: ``ReplicaFaults.fail_status`` and ``headers`` apply to them.
_GENERATION_PATHS = frozenset(
    {"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages"}
)


class Handlers:
    """The core endpoints, and the request parsing every endpoint module shares."""

    def __init__(self, replica: SimReplica) -> None:
        self.r = replica
        self.more = MoreHandlers(self)
        self.render = RenderHandlers(self)

    @property
    def model(self) -> str:
        return self.r.config.model

    def check_model(self, body: dict[str, Any]) -> str | None:
        """Refuse a model this server does not serve; return the LoRA adapter asked for."""
        model = body.get("model")
        if model is None or model == self.model:
            return None
        if model in self.r.config.loras:
            return str(model)
        raise ApiError(f"The model `{model}` does not exist.", code=404, param="model")

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        """The server's tokenizer on prompt text (with an injected drift, if any)."""
        ids = self.r.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        prefix = self.r.faults.tokenizer_prefix
        return [*prefix, *ids] if prefix else ids

    def _unsupported(self, body: dict[str, Any]) -> None:
        n = body.get("n")
        if n not in (None, 1):
            raise ApiError("the simulator supports n=1 only", param="n")
        if body.get("best_of") not in (None, 1):
            raise ApiError("the simulator does not support best_of", param="best_of")
        if body.get("logprobs") not in (None, False):
            raise ApiError("the simulator does not return logprobs", param="logprobs")

    def max_tokens_of(self, body: dict[str, Any], *names: str) -> int:
        for name in names:
            value = opt_int(body, name, minimum=1)
            if value is not None:
                return value
        return self.r.config.default_max_tokens

    def cache_salt_of(self, body: dict[str, Any]) -> str | None:
        salt = body.get("cache_salt")
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise ApiError("cache_salt must be a non-empty string", param="cache_salt")
        return salt

    def chat_ids(self, body: dict[str, Any], *, add_special_tokens: bool = False) -> list[int]:
        """vLLM's chat path: render the template to text, then tokenize the text."""
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError("messages must be a non-empty list", param="messages")
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise ApiError(
                    "each message must be an object with a string role", param="messages"
                )
            content = m.get("content")
            if isinstance(content, list):
                # OpenAI content parts: the text parts, joined as vLLM does for text models.
                texts = [
                    p.get("text", "")
                    for p in content
                    if isinstance(p, dict) and p.get("type") == "text"
                ]
                m["content"] = "\n".join(texts)
            elif content is not None and not isinstance(content, str):
                raise ApiError(
                    "message content must be a string or a list of parts", param="messages"
                )
        kwargs = body.get("chat_template_kwargs")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise ApiError("chat_template_kwargs must be an object", param="chat_template_kwargs")
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise ApiError("tools must be a list", param="tools")
        try:
            text = self.r.tokenizer.render_chat(
                messages,
                add_generation_prompt=opt_bool(body, "add_generation_prompt", True),
                continue_final_message=opt_bool(body, "continue_final_message", False),
                chat_template_kwargs=kwargs,
                tools=tools,
                chat_template=self.r.config.chat_template,
            )
        except ValueError as exc:
            raise ApiError(str(exc), param="messages") from exc
        return self.encode(text, add_special_tokens=add_special_tokens)

    def prompt_ids(self, body: dict[str, Any], *, add_special_tokens: bool = True) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return self.encode(prompt, add_special_tokens=add_special_tokens)
        if (
            isinstance(prompt, list)
            and prompt
            and all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**32 for t in prompt
            )
        ):
            self.check_vocab(prompt, "prompt")
            return list(prompt)
        raise ApiError(
            "prompt must be a string or a non-empty list of token ids (batched prompts are not "
            "supported by the simulator)",
            param="prompt",
        )

    def _batch_ids(self, body: dict[str, Any]) -> list[list[int]] | None:
        """A batch's prompts (two or more strings or token lists), else None."""
        prompt = body.get("prompt")
        if not isinstance(prompt, list) or len(prompt) < 2:
            return None
        if not all(isinstance(p, str) for p in prompt) and not all(
            isinstance(p, list) for p in prompt
        ):
            return None
        special = opt_bool(body, "add_special_tokens", True)
        return [self.prompt_ids({"prompt": p}, add_special_tokens=special) for p in prompt]

    def check_vocab(self, ids: list[int], param: str) -> None:
        """vLLM's answer to a token id outside the vocabulary (a 400, not a crash)."""
        if not ids:
            return
        low, high = min(ids), max(ids)
        if low < 0:
            raise ApiError(f"Token id {low} is out of vocabulary", param=param)
        if high > self.r.tokenizer.max_token_id:
            raise ApiError(f"Token id {high} is out of vocabulary", param=param)

    # --- endpoints ----------------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        # A dying engine answers 503 while its server still stands, as vLLM's /health does
        # once the engine is dead (the router's probe of a 500 tells a dead engine so).
        return Response(status_code=200 if self.r.faults.healthy and self.r.alive else 503)

    async def models(self, request: Request) -> Response:
        return json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.model,
                        "object": "model",
                        "created": int(time.time()),
                        "owned_by": "vllm",
                        "root": str(self.r.tokenizer.model_dir),
                        "parent": None,
                        "max_model_len": self.r.config.max_model_len,
                    },
                    *(
                        {
                            "id": name,
                            "object": "model",
                            "created": int(time.time()),
                            "owned_by": "vllm",
                            "root": f"/loras/{name}",
                            "parent": self.model,
                            "max_model_len": self.r.config.max_model_len,
                        }
                        for name in self.r.config.loras
                    ),
                ],
            }
        )

    async def metrics(self, request: Request) -> Response:
        return Response(
            self.r.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8"
        )

    def request_ids(self, body: dict[str, Any]) -> list[int]:
        """The prompt's ids as vLLM's /tokenize computes them (chat defaults:
        add_generation_prompt=True, no special tokens)."""
        if "messages" in body:
            return self.chat_ids(
                body, add_special_tokens=opt_bool(body, "add_special_tokens", False)
            )
        return self.prompt_ids(body, add_special_tokens=opt_bool(body, "add_special_tokens", True))

    async def tokenize(self, request: Request) -> Response:
        if self.r.faults.tokenize_delay_s:
            await asyncio.sleep(self.r.faults.tokenize_delay_s)
        try:
            body = await read_body(request)
            self.check_model(body)
            ids = self.request_ids(body)
        except ApiError as err:
            return error_response(err)
        return json_response(
            {
                "count": len(ids),
                "max_model_len": self.r.config.max_model_len,
                "tokens": ids,
                "token_strs": None,
            }
        )

    async def detokenize(self, request: Request) -> Response:
        try:
            body = await read_body(request)
            self.check_model(body)
            tokens = body.get("tokens")
            if not isinstance(tokens, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in tokens
            ):
                raise ApiError("tokens must be a list of token ids", param="tokens")
            self.check_vocab(tokens, "tokens")
        except ApiError as err:
            return error_response(err)
        return json_response({"prompt": self.r.tokenizer.tok.decode(tokens)})

    async def load_lora_adapter(self, request: Request) -> Response:
        """vLLM's runtime LoRA loading (``VLLM_ALLOW_RUNTIME_LORA_UPDATING``): the adapter is
        listed and servable at once."""
        try:
            body = await read_body(request)
            name, path = body.get("lora_name"), body.get("lora_path")
            if not name or not path or not isinstance(name, str):
                raise ApiError(
                    "Both 'lora_name' and 'lora_path' must be provided.", type_=_BAD_LORA
                )
            if name == self.model:
                raise ApiError(
                    f"The lora adapter '{name}' conflicts with a served base model.",
                    type_=_BAD_LORA,
                )
            if name in self.r.config.loras and not body.get("load_inplace"):
                raise ApiError(
                    f"The lora adapter '{name}' has already been loaded. If you want to load "
                    "the adapter in place, set 'load_inplace' to True.",
                    type_=_BAD_LORA,
                )
        except ApiError as err:
            return error_response(err)
        if name not in self.r.config.loras:
            self.r.config.loras = (*self.r.config.loras, name)
        return Response(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_lora_adapter(self, request: Request) -> Response:
        try:
            body = await read_body(request)
            name = body.get("lora_name")
            if not name:
                raise ApiError(
                    "'lora_name' needs to be provided to unload a LoRA adapter.", type_=_BAD_LORA
                )
            if name not in self.r.config.loras:
                raise ApiError(f"The lora adapter '{name}' cannot be found.", code=404)
        except ApiError as err:
            return error_response(err)
        self.r.config.loras = tuple(n for n in self.r.config.loras if n != name)
        return Response(f"Success: LoRA adapter '{name}' removed successfully.")

    async def reset_prefix_cache(self, request: Request) -> Response:
        # vLLM 0.32 (entrypoints/serve/dev/cache): 200 {"success": false} while blocks are
        # in use; the router reads it (kvroute.router.serving.cache_resets.resets_device)
        return JSONResponse({"success": bool(self.r.reset_prefix_cache())})

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def _generate(self, request: Request, *, chat: bool) -> Response:
        try:
            body = await read_body(request)
            lora = self.check_model(body)
            self._unsupported(body)
            batch = None if chat else self._batch_ids(body)
            if batch is not None:
                return await self.more.completions_batch(body, batch, lora)
            ids = self.chat_ids(body) if chat else self.prompt_ids(body)
            max_tokens = (
                self.max_tokens_of(body, "max_completion_tokens", "max_tokens")
                if chat
                else self.max_tokens_of(body, "max_tokens")
            )
            too_long = self.r.check_length(len(ids), max_tokens)
            if too_long:
                raise ApiError(too_long)
            salt = self.cache_salt_of(body)
            stream = opt_bool(body, "stream", False)
            opts = body.get("stream_options") or {}
            if not isinstance(opts, dict):
                raise ApiError("stream_options must be an object", param="stream_options")
            want_ids = opt_bool(body, "return_token_ids", False)
        except ApiError as err:
            return error_response(err)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        kv = body.get("kv_transfer_params")
        kv = kv if isinstance(kv, dict) else None
        given = None if kv is None else kv.get("prompt_token_ids")
        if isinstance(given, list) and given and all(isinstance(t, int) for t in given):
            ids = given  # vLLM's P/D decode leg: the prompt as the prefill leg saw it
        gen = self.r.generate(
            ids, max_tokens, cache_salt=salt, lora_name=lora, kv_transfer_params=kv
        )
        shape = AnswerShape(
            rid, created, self.model, chat, self.r.tokenizer.decode, ids if want_ids else None
        )
        if stream:
            # Wait for the first token before answering, so errors found before any output
            # (injected faults, a dead replica) get a status code, as in vLLM.
            try:
                first = await anext(gen)
            except (InjectedError, ReplicaDied) as exc:
                return error_response(ApiError(str(exc), code=500))
            return StreamingResponse(
                sse_answer(
                    shape,
                    gen,
                    first,
                    self.r.faults,
                    include_usage=bool(opts.get("include_usage")),
                    continuous_usage=bool(opts.get("continuous_usage_stats")),
                ),
                media_type="text/event-stream",
            )
        try:
            state = await run_to_end(gen)
        except (InjectedError, ReplicaDied) as exc:
            return error_response(ApiError(str(exc), code=500))
        return json_response(whole_answer(shape, state))


def request_token_ids(replica: SimReplica, body: dict[str, Any]) -> list[int]:
    """The ids ``POST /tokenize`` answers for ``body`` (raises ApiError on a bad body)."""
    return Handlers(replica).request_ids(body)


Endpoint = Callable[[Request], Awaitable[Response]]


def _observed(replica: SimReplica, endpoint: Endpoint) -> Endpoint:
    """Record each POST in ``replica.seen`` and apply the faults of generation endpoints
    (forced status, extra headers)."""

    async def wrapped(request: Request) -> Response:
        path = request.url.path
        if request.method == "POST":
            try:
                body = await read_body(request)
            except ApiError:
                body = {}
            replica.seen.append(SeenRequest(path, body, dict(request.headers)))
        faults = replica.faults
        if path not in _GENERATION_PATHS:
            return await endpoint(request)
        if faults.fail_status is not None:
            message = f"injected failure on {replica.config.name}"
            response = error_response(ApiError(message, code=faults.fail_status))
        else:
            response = await endpoint(request)
        response.headers.update(faults.headers)
        return response

    return wrapped


# vLLM's AuthenticationMiddleware guards these prefixes only (/health, /metrics, /tokenize,
# /kv_event_sources stay open) and skips OPTIONS.
_GUARDED_PREFIXES = ("/v1", "/v2", "/inference", "/cohere")


class VllmKeyCheck:
    """vLLM's ``--api-key`` check as vLLM 0.32 does it: the same paths, the same
    ``{"error": "Unauthorized"}`` 401 (not OpenAI's error schema)."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app = app
        self.digest = hashlib.sha256(api_key.encode()).digest()

    def allows(self, scope: Any) -> bool:
        if scope.get("method") == "OPTIONS" or not scope["path"].startswith(_GUARDED_PREFIXES):
            return True
        value = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        scheme, _, token = value.decode("latin-1").partition(" ")
        given = hashlib.sha256(token.encode()).digest()
        return scheme.lower() == "bearer" and hmac.compare_digest(given, self.digest)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or self.allows(scope):
            await self.app(scope, receive, send)
            return
        await JSONResponse({"error": "Unauthorized"}, status_code=401)(scope, receive, send)


def create_app(replica: SimReplica) -> Starlette:
    h = Handlers(replica)
    routes = [
        Route("/health", h.health, methods=["GET"]),
        Route("/v1/models", h.models, methods=["GET"]),
        Route("/metrics", h.metrics, methods=["GET"]),
        Route("/tokenize", h.tokenize, methods=["POST"]),
        Route("/detokenize", h.detokenize, methods=["POST"]),
        Route("/reset_prefix_cache", h.reset_prefix_cache, methods=["POST"]),
        Route("/v1/load_lora_adapter", h.load_lora_adapter, methods=["POST"]),
        Route("/v1/unload_lora_adapter", h.unload_lora_adapter, methods=["POST"]),
        Route("/v1/completions", with_cancellation(h.completions), methods=["POST"]),
        Route("/v1/chat/completions", with_cancellation(h.chat_completions), methods=["POST"]),
        *h.more.routes(),
        *h.render.routes(),
    ]
    routes = [
        Route(r.path, _observed(replica, r.endpoint), methods=list(r.methods or ())) for r in routes
    ]
    app = Starlette(routes=routes)

    async def not_found(request: Request, exc: Exception) -> Response:
        return error_response(ApiError(f"no route {request.url.path}", code=404))

    async def not_allowed(request: Request, exc: Exception) -> Response:
        return error_response(
            ApiError(
                f"method {request.method} not allowed on {request.url.path}",
                code=405,
                type_="MethodNotAllowed",
            )
        )

    app.add_exception_handler(404, not_found)
    app.add_exception_handler(405, not_allowed)
    if replica.config.api_key:
        app.add_middleware(VllmKeyCheck, api_key=replica.config.api_key)
    return app
