"""What every simulated endpoint shares: vLLM's error body, JSON and SSE encoding, request
parsing, running a generation to its end, and vLLM's cancellation of a handler whose client
went away.

One place for each, so the handler modules (kvroute.bench.sim.api, .more_api, .render_api)
only hold what is specific to their endpoints.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from kvroute.bench.sim.replica import Generation

__all__ = [
    "ApiError",
    "error_response",
    "json_response",
    "opt_bool",
    "opt_int",
    "read_body",
    "run_to_end",
    "sse_data",
    "sse_event",
    "with_cancellation",
]

_json = msgspec.json.Encoder()
_decode = msgspec.json.Decoder()


class ApiError(Exception):
    """An error to answer in vLLM's schema."""

    def __init__(
        self, message: str, *, code: int = 400, type_: str | None = None, param: str | None = None
    ):
        super().__init__(message)
        self.message = message
        self.code = code
        self.type = type_ or {
            400: "BadRequestError",
            403: "PermissionDeniedError",
            404: "NotFoundError",
        }.get(code, "InternalServerError")
        self.param = param


def error_response(err: ApiError) -> Response:
    body = {
        "error": {"message": err.message, "type": err.type, "param": err.param, "code": err.code}
    }
    return Response(_json.encode(body), status_code=err.code, media_type="application/json")


def json_response(body: Any) -> Response:
    return Response(_json.encode(body), media_type="application/json")


def sse_data(obj: Any) -> bytes:
    """One OpenAI-style SSE event (``data: <json>``)."""
    return b"data: " + _json.encode(obj) + b"\n\n"


def sse_event(kind: str, data: Any) -> bytes:
    """One named SSE event (``event: <kind>`` then ``data: <json>``), as the Responses and
    Anthropic streams send them."""
    return b"event: " + kind.encode() + b"\ndata: " + _json.encode(data) + b"\n\n"


async def read_body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    try:
        body = _decode.decode(raw)
    except msgspec.DecodeError as exc:
        raise ApiError(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise ApiError("request body must be a JSON object")
    return body


def opt_int(body: dict[str, Any], name: str, *, minimum: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ApiError(f"{name} must be an integer >= {minimum}", param=name)
    return value


def opt_bool(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ApiError(f"{name} must be a boolean", param=name)
    return value


async def run_to_end(gen: AsyncIterator[tuple[Generation, list[int]]]) -> Generation:
    """Drive a replica's generation to its end (a non-streamed answer) and return its state;
    the generation is closed (its blocks released) also when this is cancelled."""
    state: Generation | None = None
    async with contextlib.aclosing(gen):  # type: ignore[type-var]
        async for item in gen:
            state = item[0]
    assert state is not None
    return state


Handler = Callable[[Request], Awaitable[Response]]


def with_cancellation(handler: Handler) -> Handler:
    """vLLM's ``with_cancellation``: the handler is cancelled when its client disconnects
    before it answered, so an abandoned request stops using the engine. A streamed answer is
    stopped by Starlette itself once it has started."""

    async def wrapped(request: Request) -> Response:
        await request.body()  # read (and kept by Starlette) before listening for disconnects
        work = asyncio.ensure_future(handler(request))
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not work.done():
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work
            return Response(status_code=499)
        return work.result()

    return wrapped


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
