"""``HotPaths``: the proxied endpoints' requests go straight to their endpoint.

Why: the proxied endpoints (kvroute.router.serving.endpoints) are raw ASGI callables that
answer every error themselves, in OpenAI's schema, so FastAPI's middleware stack (server
errors, exception handlers, the exit stack) and the route table's walk do nothing for them
but cost: a quarter of the router's own time per request on an instant upstream, measured
with py-spy under ``kvroute bench proxy``. Every other request, and every request this cannot
match exactly (another method, a ``root_path``, a path with parameters), takes the app's
ordinary stack, so the routes' behaviour is the one FastAPI would give.

The API key check (kvroute.router.serving.auth) still guards each endpoint: a guarded app
passes ``guard``, which wraps each endpoint the way it wraps the app.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

__all__ = ["HotPaths"]

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class HotPaths:
    def __init__(
        self,
        app: ASGIApp,
        routes: dict[tuple[str, str], ASGIApp],
        guard: Callable[[ASGIApp], ASGIApp] | None = None,
    ) -> None:
        """``routes``: (path, METHOD) -> endpoint, literal paths only."""
        self.app = app
        self.routes = {
            key: endpoint if guard is None else guard(endpoint) for key, endpoint in routes.items()
        }

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not scope.get("root_path"):
            endpoint = self.routes.get((scope["path"], scope["method"]))
            if endpoint is not None:
                await endpoint(scope, receive, send)
                return
        await self.app(scope, receive, send)
