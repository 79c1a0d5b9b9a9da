"""The simulated replica's other vLLM endpoints: Responses, Anthropic messages, pooling.

Shapes follow vLLM 0.32's protocol classes (``ResponsesResponse`` and its SSE events,
``AnthropicMessagesResponse`` and its events, ``EmbeddingResponse``, ``PoolingResponse``,
``/version``). Every request runs through the replica's engine like a completion, so it
fills (and hits) the prefix cache and publishes KV events: pooling requests prefill and
produce one token, as a pooling model only prefills.

Deviations, stated so nobody mistakes them for vLLM's:
- the response store is always on (vLLM needs ``VLLM_ENABLE_RESPONSES_API_STORE=1``) and
  keeps the last ``_STORE_MAX`` responses;
- ``DELETE /v1/responses/{id}`` is answered as OpenAI does (``{"id", "object":
  "response", "deleted": true}``); vLLM 0.32 has no such route (405);
- Responses input items other than messages, function calls and their outputs are refused;
  tools are accepted and ignored (never called); ``background`` is not simulated;
- embeddings and pooling data are a deterministic function of the prompt, 8 numbers long.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import struct
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from kvroute.bench.sim.http_common import (
    ApiError,
    error_response,
    json_response,
    opt_bool,
    read_body,
    run_to_end,
    sse_event,
    with_cancellation,
)
from kvroute.bench.sim.replica import Generation, InjectedError
from kvroute.bench.sim.scheduler import ReplicaDied

if TYPE_CHECKING:
    from kvroute.bench.sim.api import Handlers

__all__ = ["VLLM_VERSION", "MoreHandlers"]

VLLM_VERSION = "0.32.0"
_STORE_MAX = 4096
_DIM = 8


class MoreHandlers:
    def __init__(self, base: Handlers) -> None:
        self.base = base
        self.store: OrderedDict[str, tuple[dict[str, Any], list[dict[str, Any]]]] = OrderedDict()

    def routes(self) -> list[Route]:
        return [
            Route("/version", self.version, methods=["GET"]),
            Route("/v1/responses", with_cancellation(self.responses_create), methods=["POST"]),
            Route("/v1/responses/{response_id}", self.responses_get, methods=["GET"]),
            Route("/v1/responses/{response_id}", self.responses_delete, methods=["DELETE"]),
            Route("/v1/responses/{response_id}/cancel", self.responses_cancel, methods=["POST"]),
            Route("/v1/messages", with_cancellation(self.messages), methods=["POST"]),
            Route("/v1/embeddings", with_cancellation(self.embeddings), methods=["POST"]),
            Route("/pooling", with_cancellation(self.pooling), methods=["POST"]),
        ]

    # --- helpers ----------------------------------------------------------------------------

    async def _run(
        self, ids: list[int], max_tokens: int, salt: str | None, lora: str | None
    ) -> Generation:
        gen = self.base.r.generate(ids, max_tokens, cache_salt=salt, lora_name=lora)
        return await run_to_end(gen)

    def _ids_for_messages(self, body: dict[str, Any], messages: list[dict[str, Any]]) -> list[int]:
        chat = {
            "messages": messages,
            "chat_template_kwargs": body.get("chat_template_kwargs"),
        }
        return self.base.chat_ids(chat)

    # --- a batch of completion prompts -------------------------------------------------------

    async def completions_batch(
        self, body: dict[str, Any], prompts: list[list[int]], lora: str | None
    ) -> Response:
        """vLLM serves a batch on one engine, its prompts concurrently, choices in prompt
        order; its usage sums the prompts' tokens but reports the LAST prompt's cached tokens
        (vLLM 0.32 ``OpenAIServingCompletion``: ``last_final_res.num_cached_tokens``)."""
        if opt_bool(body, "stream", False):
            raise ApiError(
                "the simulator answers a batch of prompts whole, not streamed", param="stream"
            )
        max_tokens = self.base.max_tokens_of(body, "max_tokens")
        for ids in prompts:
            too_long = self.base.r.check_length(len(ids), max_tokens)
            if too_long:
                raise ApiError(too_long)
        salt = self.base.cache_salt_of(body)
        try:
            states = await asyncio.gather(
                *(self._run(ids, max_tokens, salt, lora) for ids in prompts)
            )
        except (InjectedError, ReplicaDied) as exc:
            return error_response(ApiError(str(exc), code=500))
        decode = self.base.r.tokenizer.decode
        choices = [
            {
                "index": i,
                "text": decode(state.output),
                "logprobs": None,
                "finish_reason": "length",
                "stop_reason": None,
                "prompt_logprobs": None,
            }
            for i, state in enumerate(states)
        ]
        prompt_tokens = sum(s.prompt_tokens for s in states)
        completion_tokens = sum(len(s.output) for s in states)
        out = {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.base.model,
            "choices": choices,
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": states[-1].cached_tokens},
            },
            "system_fingerprint": None,
            "service_tier": None,
            "kv_transfer_params": None,
        }
        return json_response(out)

    # --- /version -----------------------------------------------------------------------------

    async def version(self, request: Request) -> Response:
        return json_response({"version": VLLM_VERSION})

    # --- /v1/responses --------------------------------------------------------------------------

    def _messages(self, body: dict[str, Any]) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = []
        instructions = body.get("instructions")
        if instructions is not None and not isinstance(instructions, str):
            raise ApiError("instructions must be a string", param="instructions")
        if instructions:
            messages.append({"role": "system", "content": instructions})
        previous = body.get("previous_response_id")
        if previous is not None:
            stored = self.store.get(previous) if isinstance(previous, str) else None
            if stored is None:
                raise ApiError(
                    f"Response with id '{previous}' not found.",
                    code=404,
                    type_="invalid_request_error",
                    param="response_id",
                )
            old, history = stored
            messages.extend(m for m in history if m.get("role") != "system")
            messages.append({"role": "assistant", "content": _output_text(old)})
        value = body.get("input")
        if isinstance(value, str):
            messages.append({"role": "user", "content": value})
        elif isinstance(value, list) and value:
            for item in value:
                messages.append(_input_item(item))
        else:
            raise ApiError("input must be a string or a non-empty list of items", param="input")
        return messages

    async def responses_create(self, request: Request) -> Response:
        try:
            body = await read_body(request)
            lora = self.base.check_model(body)
            messages = self._messages(body)
            ids = self._ids_for_messages(body, messages)
            max_tokens = self.base.max_tokens_of(body, "max_output_tokens")
            too_long = self.base.r.check_length(len(ids), max_tokens)
            if too_long:
                raise ApiError(too_long)
            salt = self.base.cache_salt_of(body)
            stream = opt_bool(body, "stream", False)
            store = opt_bool(body, "store", True)
        except ApiError as err:
            return error_response(err)
        # History as the next turn sees it: what was rendered, less the previous answers'
        # own history (already inside ``messages``).
        response = self._response(body, max_tokens)
        if stream:
            return StreamingResponse(
                self._responses_stream(response, messages, ids, max_tokens, salt, lora, store),
                media_type="text/event-stream",
            )
        try:
            state = await self._run(ids, max_tokens, salt, lora)
        except (InjectedError, ReplicaDied) as exc:
            return error_response(ApiError(str(exc), code=500))
        self._finish(response, state)
        if store:
            self._store(response, messages)
        return json_response(response)

    def _response(self, body: dict[str, Any], max_tokens: int) -> dict[str, Any]:
        return {
            "id": f"resp_{uuid.uuid4().hex}",
            "created_at": int(time.time()),
            "incomplete_details": None,
            "instructions": body.get("instructions"),
            "metadata": body.get("metadata"),
            "model": self.base.model,
            "object": "response",
            "output": [],
            "parallel_tool_calls": True,
            "temperature": body.get("temperature", 1.0),
            "tool_choice": body.get("tool_choice", "auto"),
            "tools": body.get("tools") or [],
            "top_p": body.get("top_p", 1.0),
            "background": False,
            "max_output_tokens": max_tokens,
            "max_tool_calls": None,
            "previous_response_id": body.get("previous_response_id"),
            "prompt": None,
            "reasoning": None,
            "service_tier": "auto",
            "status": "in_progress",
            "text": None,
            "top_logprobs": None,
            "truncation": "disabled",
            "usage": None,
            "user": None,
        }

    def _finish(self, response: dict[str, Any], state: Generation) -> None:
        text = self.base.r.tokenizer.decode(state.output)
        response["output"] = [_message_item(f"msg_{uuid.uuid4().hex}", text, "completed")]
        # Every simulated generation stops at max_tokens: vLLM's "length" -> incomplete.
        response["status"] = "incomplete"
        response["incomplete_details"] = {"reason": "max_output_tokens"}
        response["usage"] = {
            "input_tokens": state.prompt_tokens,
            "input_tokens_details": {"cached_tokens": state.cached_tokens},
            "output_tokens": len(state.output),
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": state.prompt_tokens + len(state.output),
        }

    def _store(self, response: dict[str, Any], messages: list[dict[str, Any]]) -> None:
        self.store[response["id"]] = (response, messages)
        while len(self.store) > _STORE_MAX:
            self.store.popitem(last=False)

    async def _responses_stream(
        self,
        response: dict[str, Any],
        messages: list[dict[str, Any]],
        ids: list[int],
        max_tokens: int,
        salt: str | None,
        lora: str | None,
        store: bool,
    ) -> AsyncIterator[bytes]:
        seq = 0

        def event(kind: str, **fields: Any) -> bytes:
            nonlocal seq
            data = {"type": kind, "sequence_number": seq, **fields}
            seq += 1
            return sse_event(kind, data)

        if store:
            self._store(response, messages)
        yield event("response.created", response=response)
        yield event("response.in_progress", response=response)
        item_id = f"msg_{uuid.uuid4().hex}"
        yield event(
            "response.output_item.added",
            output_index=0,
            item=_message_item(item_id, "", "in_progress", parts=False),
        )
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        yield event(
            "response.content_part.added",
            item_id=item_id,
            output_index=0,
            content_index=0,
            part=part,
        )
        decode = self.base.r.tokenizer.decode
        state: Generation | None = None
        gen = self.base.r.generate(ids, max_tokens, cache_salt=salt, lora_name=lora)
        try:
            async with contextlib.aclosing(gen):
                async for item in gen:
                    state, new = item
                    yield event(
                        "response.output_text.delta",
                        item_id=item_id,
                        output_index=0,
                        content_index=0,
                        delta=decode(new),
                        logprobs=[],
                    )
        except (InjectedError, ReplicaDied):
            return  # the stream just stops, as when a process dies
        assert state is not None
        self._finish(response, state)
        text = response["output"][0]["content"][0]["text"]
        response["output"][0]["id"] = item_id
        yield event(
            "response.output_text.done",
            item_id=item_id,
            output_index=0,
            content_index=0,
            text=text,
            logprobs=[],
        )
        yield event(
            "response.content_part.done",
            item_id=item_id,
            output_index=0,
            content_index=0,
            part={**part, "text": text},
        )
        yield event("response.output_item.done", output_index=0, item=response["output"][0])
        yield event("response.completed", response=response)

    def _not_found(self, response_id: str) -> Response:
        return error_response(
            ApiError(
                f"Response with id '{response_id}' not found.",
                code=404,
                type_="invalid_request_error",
                param="response_id",
            )
        )

    async def responses_get(self, request: Request) -> Response:
        response_id = request.path_params["response_id"]
        stored = self.store.get(response_id)
        if stored is None:
            return self._not_found(response_id)
        return json_response(stored[0])

    async def responses_cancel(self, request: Request) -> Response:
        response_id = request.path_params["response_id"]
        stored = self.store.get(response_id)
        if stored is None:
            return self._not_found(response_id)
        if stored[0]["status"] not in ("queued", "in_progress"):
            return error_response(
                ApiError(
                    "Cannot cancel a synchronous response.",
                    type_="invalid_request_error",
                    param="response_id",
                )
            )
        stored[0]["status"] = "cancelled"
        return json_response(stored[0])

    async def responses_delete(self, request: Request) -> Response:
        response_id = request.path_params["response_id"]
        if self.store.pop(response_id, None) is None:
            return self._not_found(response_id)
        body = {"id": response_id, "object": "response", "deleted": True}
        return json_response(body)

    # --- /v1/messages (Anthropic) ---------------------------------------------------------------

    async def messages(self, request: Request) -> Response:
        try:
            body = await read_body(request)
            lora = self.base.check_model(body)
            chat = _anthropic_chat(body)
            ids = self._ids_for_messages(body, chat)
            max_tokens = self.base.max_tokens_of(body, "max_tokens")
            too_long = self.base.r.check_length(len(ids), max_tokens)
            if too_long:
                raise ApiError(too_long)
            stream = opt_bool(body, "stream", False)
            salt = self.base.cache_salt_of(body)
        except ApiError as err:
            return error_response(err)
        mid = f"msg_{uuid.uuid4().hex}"
        if stream:
            return StreamingResponse(
                self._messages_stream(mid, ids, max_tokens, salt, lora),
                media_type="text/event-stream",
            )
        try:
            state = await self._run(ids, max_tokens, salt, lora)
        except (InjectedError, ReplicaDied) as exc:
            return error_response(ApiError(str(exc), code=500))
        out = {
            "id": mid,
            "type": "message",
            "role": "assistant",
            "content": [{"type": "text", "text": self.base.r.tokenizer.decode(state.output)}],
            "model": self.base.model,
            "stop_reason": "max_tokens",
            "stop_sequence": None,
            "usage": _anthropic_usage(state),
        }
        return json_response(out)

    async def _messages_stream(
        self, mid: str, ids: list[int], max_tokens: int, salt: str | None, lora: str | None
    ) -> AsyncIterator[bytes]:
        def event(kind: str, data: dict[str, Any]) -> bytes:
            return sse_event(kind, data)

        decode = self.base.r.tokenizer.decode
        state: Generation | None = None
        gen = self.base.r.generate(ids, max_tokens, cache_salt=salt, lora_name=lora)
        try:
            async with contextlib.aclosing(gen):
                async for state, new in gen:
                    if len(state.output) == len(new):  # the first chunk: the message starts
                        start = {
                            "id": mid,
                            "type": "message",
                            "role": "assistant",
                            "content": [],
                            "model": self.base.model,
                            "stop_reason": None,
                            "stop_sequence": None,
                            "usage": _anthropic_usage(state, output=0),
                        }
                        yield event("message_start", {"type": "message_start", "message": start})
                        yield event(
                            "content_block_start",
                            {
                                "type": "content_block_start",
                                "index": 0,
                                "content_block": {"type": "text", "text": ""},
                            },
                        )
                    yield event(
                        "content_block_delta",
                        {
                            "type": "content_block_delta",
                            "index": 0,
                            "delta": {"type": "text_delta", "text": decode(new)},
                        },
                    )
        except (InjectedError, ReplicaDied):
            return
        assert state is not None
        yield event("content_block_stop", {"type": "content_block_stop", "index": 0})
        yield event(
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": "max_tokens", "stop_sequence": None},
                "usage": _anthropic_usage(state),
            },
        )
        yield event("message_stop", {"type": "message_stop"})

    # --- pooling: /v1/embeddings, /pooling --------------------------------------------------------

    async def embeddings(self, request: Request) -> Response:
        return await self._pool(request, embeddings=True)

    async def pooling(self, request: Request) -> Response:
        return await self._pool(request, embeddings=False)

    async def _pool(self, request: Request, *, embeddings: bool) -> Response:
        try:
            body = await read_body(request)
            lora = self.base.check_model(body)
            if body.get("messages") is not None:
                prompts = [
                    self.base.chat_ids(
                        {
                            "messages": body["messages"],
                            "add_generation_prompt": opt_bool(body, "add_generation_prompt", False),
                        },
                        add_special_tokens=opt_bool(body, "add_special_tokens", False),
                    )
                ]
            else:
                prompts = self._inputs(body)
            for ids in prompts:
                too_long = self.base.r.check_length(len(ids), 1)
                if too_long:
                    raise ApiError(too_long)
            fmt = body.get("encoding_format", "float")
            if fmt not in ("float", "base64"):
                raise ApiError(
                    "encoding_format must be 'float' or 'base64'", param="encoding_format"
                )
            salt = self.base.cache_salt_of(body)
        except ApiError as err:
            return error_response(err)
        try:
            await asyncio.gather(*(self._run(ids, 1, salt, lora) for ids in prompts))
        except (InjectedError, ReplicaDied) as exc:
            return error_response(ApiError(str(exc), code=500))
        data = []
        for i, ids in enumerate(prompts):
            vector = _vector(ids)
            value: Any = vector
            if fmt == "base64":
                value = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
            if embeddings:
                data.append({"index": i, "object": "embedding", "embedding": value})
            else:
                data.append({"index": i, "object": "pooling", "data": value})
        n = sum(len(ids) for ids in prompts)
        out = {
            "id": f"{'embd' if embeddings else 'pool'}-{uuid.uuid4().hex}",
            "object": "list",
            "created": int(time.time()),
            "model": self.base.model,
            "data": data,
            "usage": {
                "prompt_tokens": n,
                "total_tokens": n,
                "completion_tokens": 0,
                "prompt_tokens_details": None,
            },
        }
        return json_response(out)

    def _inputs(self, body: dict[str, Any]) -> list[list[int]]:
        value = body.get("input")
        special = opt_bool(body, "add_special_tokens", True)
        if isinstance(value, str) or (
            isinstance(value, list) and value and all(_is_id(t) for t in value)
        ):
            return [self.base.prompt_ids({"prompt": value}, add_special_tokens=special)]
        if isinstance(value, list) and value and all(isinstance(v, str | list) for v in value):
            return [self.base.prompt_ids({"prompt": v}, add_special_tokens=special) for v in value]
        raise ApiError(
            "input must be a string, a list of strings, token ids or lists of token ids",
            param="input",
        )


def _is_id(t: object) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


def _vector(ids: list[int]) -> list[float]:
    digest = hashlib.blake2b(struct.pack(f"<{len(ids)}I", *ids), digest_size=_DIM).digest()
    return [round(b / 255.0, 6) for b in digest]


def _message_item(item_id: str, text: str, status: str, *, parts: bool = True) -> dict[str, Any]:
    content = (
        [{"annotations": [], "text": text, "type": "output_text", "logprobs": None}]
        if parts
        else []
    )
    return {
        "id": item_id,
        "content": content,
        "role": "assistant",
        "status": status,
        "type": "message",
    }


def _output_text(response: dict[str, Any]) -> str:
    texts = [
        part.get("text", "")
        for item in response.get("output") or []
        for part in item.get("content") or []
        if part.get("type") == "output_text"
    ]
    return "".join(texts)


def _text_of(content: object) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(
            str(p.get("text", ""))
            for p in content
            if isinstance(p, dict) and p.get("type") in ("text", "input_text", "output_text")
        )
    return None


def _input_item(item: object) -> dict[str, Any]:
    if not isinstance(item, dict):
        raise ApiError("input items must be objects", param="input")
    kind = item.get("type")
    if kind == "function_call_output":
        return {
            "role": "tool",
            "content": str(item.get("output", "")),
            "tool_call_id": item.get("call_id"),
        }
    if kind == "function_call":
        return {
            "role": "assistant",
            "tool_calls": [
                {
                    "id": item.get("call_id"),
                    "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")},
                }
            ],
        }
    role = item.get("role")
    if not isinstance(role, str):
        raise ApiError(f"Unsupported input item type: {kind}", param="input")
    content = item.get("content")
    if role == "assistant" and isinstance(content, list) and content:
        content = content[0].get("text") if isinstance(content[0], dict) else None
    text = _text_of(content)
    if text is None:
        raise ApiError("message content must be a string or a list of parts", param="input")
    return {"role": role, "content": text}


def _anthropic_chat(body: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    system = body.get("system")
    if isinstance(system, list):
        system = "".join(
            b.get("text", "") for b in system if isinstance(b, dict) and b.get("type") == "text"
        )
    if system is not None and not isinstance(system, str):
        raise ApiError("system must be a string or a list of text blocks", param="system")
    if system:
        out.append({"role": "system", "content": system})
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError("messages must be a non-empty list", param="messages")
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError("each message must be an object with a string role", param="messages")
        content = m.get("content")
        if isinstance(content, list):
            texts = [
                b.get("text", "")
                for b in content
                if isinstance(b, dict) and b.get("type") == "text"
            ]
            content = texts[0] if len(texts) == 1 else "\n".join(texts)
        if not isinstance(content, str):
            raise ApiError("message content must be a string or a list of blocks", param="messages")
        out.append({"role": m["role"], "content": content})
    return out


def _anthropic_usage(state: Generation, *, output: int | None = None) -> dict[str, Any]:
    """vLLM's mapping: input_tokens excludes what was read from the cache."""
    return {
        "input_tokens": max(0, state.prompt_tokens - state.cached_tokens),
        "output_tokens": len(state.output) if output is None else output,
        "cache_read_input_tokens": state.cached_tokens,
    }
