"""Requests that reset a replica's KV connector without any KV event, as vLLM 0.32's API server
defines them. The router forwards them like any other path; when the replica accepts one, the
index forgets what the reset emptied (``PrefixIndex.reset_connector``), since no event will.

Read from vLLM 0.32:

- ``POST /reset_prefix_cache?reset_external=true`` (``entrypoints/serve/dev/cache``):
  ``Scheduler.reset_prefix_cache(reset_connector=True)`` calls the connector's ``reset_cache``
  even when the device reset fails, and the answer is 200 ``{"success": false}`` then: any
  2xx counts.
- ``POST /pause`` (``entrypoints/rl/online``; ``clear_cache`` defaults to true, whatever the
  ``mode``): ``EngineCore._finish_pause`` -> ``_reset_caches(reset_connector=True)``.
- ``POST /sleep`` (``entrypoints/serve/dev/sleep``; ``level`` defaults to 1): a level of 1 or
  more pauses with ``clear_cache=True``.
- ``POST /release_kv_cache_memory``: ``_reset_caches()`` before dropping the KV cache.

What the connector's reset empties: vLLM's OffloadingConnector its CPU tier
(``TieringOffloadingManager.reset_cache``; the FS/OBJ tiers are kept), Mooncake's store
everything (``remove_all``), kvroute's connector both tiers (announced), the
SimpleCPUOffloadConnector its pool (announced by a bare clear). The device's own reset is
announced by vLLM's block pool (``AllBlocksCleared``), in the same scheduler call, just before
the connector's: when it succeeded (``resets_device``), that clear marks the connector's reset
in the replica's stream, after every batch published before it.
"""

from __future__ import annotations

import json
from urllib.parse import parse_qs

__all__ = ["resets_connector", "resets_device", "resets_device_only"]

# FastAPI's (pydantic's) bool query values; anything else is a 422 (no reset).
_TRUE = {"1", "true", "on", "yes", "t", "y"}
_FALSE = {"0", "false", "off", "no", "f", "n"}


def _flag(query: dict[str, list[str]], name: str, default: bool) -> bool | None:
    values = query.get(name)
    if not values:
        return default
    value = values[-1].strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    return None


def resets_connector(method: str, path: str, query_string: bytes) -> bool:
    """Whether vLLM resets its KV connector when it accepts this request."""
    if method.upper() != "POST":
        return False
    path = path.rstrip("/") or "/"
    query = parse_qs(query_string.decode("latin-1"), keep_blank_values=True)
    if path == "/reset_prefix_cache":
        return _flag(query, "reset_external", False) is True
    if path == "/pause":
        return _flag(query, "clear_cache", True) is True
    if path == "/sleep":
        level = query.get("level", ["1"])[-1]
        return level.strip().isdigit() and int(level) >= 1
    return path == "/release_kv_cache_memory"


def resets_device(path: str, body: bytes) -> bool:
    """Whether an accepted connector reset (``resets_connector``) also reset the device's
    prefix cache, so that vLLM's block pool published ``AllBlocksCleared`` at its place in the
    stream: ``/reset_prefix_cache`` answers ``{"success": true}`` then (false: blocks still in
    use, the connector was reset alone); ``/pause``, ``/sleep`` and
    ``/release_kv_cache_memory`` reset with ``reset_running_requests=True``, which succeeds or
    fails the request (``EngineCore._reset_caches``)."""
    path = path.rstrip("/") or "/"
    if path != "/reset_prefix_cache":
        return True
    try:
        answer = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return False
    return isinstance(answer, dict) and answer.get("success") is True


def resets_device_only(method: str, path: str, query_string: bytes) -> bool:
    """Whether this request resets the device's prefix cache and no connector (plain
    ``POST /reset_prefix_cache``): the index is told, so that the clear it brings does not
    look like a connector reset sent to the replica directly."""
    path = path.rstrip("/") or "/"
    if method.upper() != "POST" or path != "/reset_prefix_cache":
        return False
    return not resets_connector(method, path, query_string)
