"""Errors in OpenAI's schema, the one shape every client library knows how to read.

vLLM writes ``{"error": {"message", "type", "param", "code"}}``; clients such as the official
``openai`` package map the HTTP status to an exception class and show ``message``. Keeping the
router's own errors in that shape means a client cannot tell a router refusal from a replica's.
"""

from __future__ import annotations

import json
from http import HTTPStatus

from starlette.responses import Response

__all__ = ["RouterError", "error_body", "error_response", "sse_error"]

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowed",
    413: "RequestEntityTooLarge",
    415: "UnsupportedMediaType",
    422: "BadRequestError",
    429: "RateLimitError",
    500: "InternalServerError",
    502: "BadGateway",
    503: "ServiceUnavailable",
    504: "GatewayTimeout",
}


class RouterError(Exception):
    """A request the router refuses or cannot serve; becomes an OpenAI error response."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        type_: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type_ or _TYPES.get(status, HTTPStatus(status).phrase.replace(" ", ""))
        self.headers = headers or {}

    def body(self) -> dict[str, dict[str, object]]:
        return error_body(self.status, self.message, param=self.param, type_=self.type)

    def response(self, request_id: str | None = None) -> Response:
        headers = dict(self.headers)
        if request_id:
            headers["x-request-id"] = request_id
        return error_response(
            self.status, self.message, param=self.param, type_=self.type, headers=headers
        )


def error_body(
    status: int, message: str, *, param: str | None = None, type_: str | None = None
) -> dict[str, dict[str, object]]:
    return {
        "error": {
            "message": message,
            "type": type_ or _TYPES.get(status, "Error"),
            "param": param,
            "code": status,
        }
    }


def error_response(
    status: int,
    message: str,
    *,
    param: str | None = None,
    type_: str | None = None,
    headers: dict[str, str] | None = None,
) -> Response:
    payload = json.dumps(error_body(status, message, param=param, type_=type_)).encode()
    return Response(payload, status_code=status, media_type="application/json", headers=headers)


def sse_error(status: int, message: str) -> bytes:
    """The SSE frames vLLM sends when a stream fails after it started: an error event, then
    ``[DONE]`` so that clients waiting for the terminator stop instead of hanging."""
    body = json.dumps(error_body(status, message))
    return f"data: {body}\n\ndata: [DONE]\n\n".encode()
