"""The settings child (``python -m kvroute.deploy.router_process FILE``) serves the router on
the same event loop as ``kvroute serve``: the routing benchmark measures the product as it
runs, not a slower stand-in."""

from __future__ import annotations

import asyncio
import importlib.util

import pytest

from kvroute.deploy.router_process import _run


def test_the_settings_child_runs_on_uvloop_where_kvroute_serve_does() -> None:
    if importlib.util.find_spec("uvloop") is None:  # a dependency on every platform but Windows
        pytest.skip("uvloop is not installed on this platform; kvroute serve uses asyncio too")
    seen: list[str] = []

    async def main() -> None:
        seen.append(type(asyncio.get_running_loop()).__module__)

    _run(main())
    assert seen and seen[0].startswith("uvloop"), seen
