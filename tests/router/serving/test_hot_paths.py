"""``HotPaths`` (router/serving/hot_paths.py): exact (path, method) hits go to their endpoint,
guarded like the app; everything else takes the app's own stack."""

from __future__ import annotations

import asyncio
from typing import Any

from kvroute.router.serving.hot_paths import HotPaths


def _recorder(name: str, seen: list[str]) -> Any:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        seen.append(name)

    return app


def _guard(seen: list[str]) -> Any:
    def wrap(app: Any) -> Any:
        async def guarded(scope: dict[str, Any], receive: Any, send: Any) -> None:
            seen.append("guard")
            await app(scope, receive, send)

        return guarded

    return wrap


def _call(app: HotPaths, **scope: Any) -> None:
    async def nothing() -> dict[str, Any]:
        return {}

    async def drop(message: Any) -> None:
        return None

    asyncio.run(app({"type": "http", "headers": [], **scope}, nothing, drop))


def test_exact_hits_skip_the_stack_and_everything_else_takes_it() -> None:
    seen: list[str] = []
    app = HotPaths(
        _recorder("stack", seen),
        {("/v1/completions", "POST"): _recorder("completions", seen)},
        _guard(seen),
    )
    _call(app, path="/v1/completions", method="POST")
    assert seen == ["guard", "completions"]
    for scope in (
        {"path": "/v1/completions", "method": "GET"},  # another method: the catch-all's
        {"path": "/v1/completions/", "method": "POST"},  # not exact: the app redirects or not
        {"path": "/v1/completions", "method": "POST", "root_path": "/api"},
        {"path": "/index/stats", "method": "GET"},
    ):
        seen.clear()
        _call(app, **scope)
        assert seen == ["stack"], scope
    seen.clear()
    lifespan: dict[str, Any] = {"type": "lifespan"}
    asyncio.run(app(lifespan, None, None))  # type: ignore[arg-type]
    assert seen == ["stack"]


def test_without_a_guard_the_endpoint_is_called_as_is() -> None:
    seen: list[str] = []
    app = HotPaths(_recorder("stack", seen), {("/tokenize", "POST"): _recorder("tok", seen)})
    _call(app, path="/tokenize", method="POST")
    assert seen == ["tok"]
