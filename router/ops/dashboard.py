"""``GET /dashboard``: a live page for operators, and ``GET /dashboard/data``, its JSON.

The page is one HTML file with its script and style beside it (``router/ops/static/``, package
data): plain JavaScript drawing inline SVG, no build step and nothing fetched from elsewhere, so it
works on an air-gapped cluster. It polls ``/dashboard/data`` (kvroute.router.ops.dashboard_data)
every few seconds. ``add_dashboard`` takes the data as a callable so the page can be served over any
data (tests render 100 replicas without running 100).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from importlib import resources
from typing import Any

from fastapi import FastAPI
from starlette.responses import JSONResponse, Response

__all__ = ["ASSETS", "add_dashboard", "asset"]

# name -> media type; only these are served (no path from the URL ever reaches the disk).
ASSETS = {
    "dashboard.html": "text/html; charset=utf-8",
    "dashboard.js": "text/javascript; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
}
_NO_CACHE = {"cache-control": "no-cache"}


@cache
def asset(name: str) -> bytes:
    """A file of the page, read once from the installed package."""
    return resources.files("kvroute.router.ops").joinpath("static", name).read_bytes()


def add_dashboard(app: FastAPI, data: Callable[[], dict[str, Any]]) -> None:
    """Add the page's routes to ``app`` (before any catch-all route)."""

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard_page() -> Response:
        return Response(asset("dashboard.html"), media_type=ASSETS["dashboard.html"])

    @app.get("/dashboard/dashboard.js", include_in_schema=False)
    async def dashboard_js() -> Response:
        return Response(asset("dashboard.js"), media_type=ASSETS["dashboard.js"], headers=_NO_CACHE)

    @app.get("/dashboard/dashboard.css", include_in_schema=False)
    async def dashboard_css() -> Response:
        return Response(
            asset("dashboard.css"), media_type=ASSETS["dashboard.css"], headers=_NO_CACHE
        )

    @app.get("/dashboard/data", include_in_schema=False)
    async def dashboard_data() -> Response:
        return JSONResponse(data(), headers={"cache-control": "no-store"})
