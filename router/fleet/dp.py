"""Data-parallel vLLM servers: one HTTP endpoint, N engine ranks, each its own routing target.

A server started with ``--data-parallel-size N`` runs N engines behind one API server. Each
engine has its own prefix cache and its own KV-event publisher (vLLM binds rank r on the
configured event and replay ports + r; the payload's third element is the rank), and a
request can be pinned to an engine with the ``X-data-parallel-rank`` header. Routing to the
server as one replica would let vLLM's own balancer (least loaded, blind to caches) pick the
engine, so a prefix cached on rank 0 would be recomputed on rank 1. Instead every rank is a
target of its own: ``<server>#dp<r>``, with the server's URL, its own event feed, and the
header on every request forwarded to it.

Where the ranks come from:
* ``dp=N`` on the replica (flag or file): ranks 0..N-1, events and replay on the given
  ports + r, as vLLM binds them.
* ``dp=auto``: the router asks the server's ``GET /kv_event_sources`` (vLLM 0.32: rank ->
  the publisher's resolved config, endpoints already offset, with the bind host ``*``) at
  start and then every ``refresh_s`` (every health interval until it first answers), and
  replaces the server's targets when the answer changes. The bind host is replaced by the
  replica URL's host.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import httpx

from kvroute.router.common.periodic import PeriodicTask
from kvroute.router.config import ConfigError, ReplicaConfig

__all__ = [
    "DataParallelDiscovery",
    "endpoint_for_rank",
    "parse_event_sources",
    "rank_name",
    "rank_targets",
    "static_targets",
]

log = logging.getLogger(__name__)

_WILDCARD_HOSTS = ("*", "0.0.0.0", "::", "[::]")


def rank_name(server: str, rank: int) -> str:
    return f"{server}#dp{rank}"


def endpoint_for_rank(endpoint: str | None, rank: int) -> str | None:
    """Where rank ``rank`` publishes when the server was given ``endpoint``: vLLM's rule (tcp
    port + rank, a tcp port 0 unchanged, ``_dp<rank>`` appended to an inproc name). vLLM
    refuses an ipc:// endpoint with data parallelism (its engines fail to start), so we do
    too."""
    if not endpoint or rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        base, sep, port = endpoint.rpartition(":")
        if not sep or not port.isdigit():
            raise ConfigError(f"event endpoint {endpoint!r} has no tcp port to offset")
        if int(port) == 0:
            return endpoint
        return f"{base}:{int(port) + rank}"
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{rank}"
    raise ConfigError(
        f"event endpoint {endpoint!r}: a data-parallel server publishes on tcp:// (vLLM offsets "
        "the port per rank and cannot offset other endpoints)"
    )


def _target(
    config: ReplicaConfig, rank: int, events: str | None, replay: str | None, topic: str
) -> ReplicaConfig:
    return dataclasses.replace(
        config,
        name=rank_name(config.key, rank),
        events=events,
        replay=replay,
        topic=topic,
        dp_rank=rank,
        server=config.key,
    )


def static_targets(config: ReplicaConfig) -> list[ReplicaConfig]:
    """The routing targets of a configured replica: itself, or one per rank for ``dp=N``
    (N >= 2). ``dp=auto`` starts as the server itself until discovery answers."""
    if not isinstance(config.dp, int) or config.dp < 2:
        return [config]
    return [
        _target(
            config,
            r,
            endpoint_for_rank(config.events, r),
            endpoint_for_rank(config.replay, r),
            config.topic,
        )
        for r in range(config.dp)
    ]


def _connectable(endpoint: str, host: str) -> str | None:
    """A bind address as vLLM reports it (``tcp://*:5557``) made connectable from here: the
    wildcard host becomes the replica's host; a tcp port 0 (chosen by the OS, not reported)
    cannot be reached."""
    if endpoint.startswith("tcp://"):
        addr, sep, port = endpoint[len("tcp://") :].rpartition(":")
        if not sep or not port.isdigit() or int(port) == 0:
            return None
        if addr in _WILDCARD_HOSTS or not addr:
            addr = host
        return f"tcp://{addr}:{port}"
    if endpoint.startswith("ipc://"):
        return endpoint  # a socket file: the same place for every process on the host
    return None  # inproc:// lives inside the server's process


def parse_event_sources(body: Any, url: str) -> dict[int, tuple[str | None, str | None, str]]:
    """``GET /kv_event_sources`` -> rank -> (events, replay, topic), connectable from here.

    vLLM answers ``{"<rank>": {"enable_kv_cache_events", "publisher", "endpoint",
    "replay_endpoint", "buffer_steps", "hwm", "max_queue_size", "topic"}, ...}`` (only ranks
    that publish; ``{}`` with events off). Raises ValueError on any other shape."""
    if not isinstance(body, dict):
        raise ValueError("/kv_event_sources is not a JSON object")
    parts = urlsplit(url)
    host = parts.hostname or "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    out: dict[int, tuple[str | None, str | None, str]] = {}
    for key, source in body.items():
        try:
            rank = int(key)
        except (TypeError, ValueError):
            raise ValueError(f"/kv_event_sources rank {key!r} is not an integer") from None
        if rank < 0 or not isinstance(source, dict):
            raise ValueError(f"/kv_event_sources entry {key!r} is not a publisher config")
        endpoint = source.get("endpoint")
        replay = source.get("replay_endpoint")
        topic = source.get("topic") or ""
        if not isinstance(topic, str):
            raise ValueError(f"/kv_event_sources rank {rank}: topic is not a string")
        events = None
        if source.get("publisher", "zmq") == "zmq" and isinstance(endpoint, str) and endpoint:
            events = _connectable(endpoint, host)
        replay_ep = _connectable(replay, host) if isinstance(replay, str) and replay else None
        out[rank] = (events, replay_ep if events else None, topic)
    return out


def rank_targets(
    config: ReplicaConfig, sources: dict[int, tuple[str | None, str | None, str]]
) -> list[ReplicaConfig]:
    """The targets of a ``dp=auto`` server from its advertised sources: one per rank (two or
    more), or the server itself with the one rank's feed. Ranks are taken as advertised: a
    missing rank (an engine that did not start) is not routed to."""
    if not sources:
        return [config]
    if len(sources) == 1 and 0 in sources:
        events, replay, topic = sources[0]
        return [dataclasses.replace(config, events=events, replay=replay, topic=topic)]
    return [
        _target(config, r, events, replay, topic)
        for r, (events, replay, topic) in sorted(sources.items())
    ]


class DataParallelDiscovery:
    """Asks ``dp=auto`` servers for their ranks and hands changed target lists to ``apply``.

    Runs on the router's event loop. Until a server first answers it is asked every
    ``interval_s``; afterwards every ``refresh_s`` (a restarted server may come back with
    another size). A server that does not answer keeps its current targets.
    """

    def __init__(
        self,
        client: httpx.AsyncClient,
        apply: Callable[[ReplicaConfig, list[ReplicaConfig]], None],
        *,
        interval_s: float = 2.0,
        refresh_s: float = 30.0,
        timeout_s: float = 2.0,
    ) -> None:
        self.client = client
        self.apply = apply
        self.refresh_s = refresh_s
        self.timeout = httpx.Timeout(timeout_s)
        self._servers: dict[str, ReplicaConfig] = {}
        self._current: dict[str, list[ReplicaConfig]] = {}
        self._asked_at: dict[str, float] = {}
        self.last_error: dict[str, str] = {}
        self._periodic = PeriodicTask("kvroute-dp-discovery", interval_s, self.run_once)

    def watch(self, config: ReplicaConfig) -> None:
        self._servers[config.key] = config
        self._current[config.key] = [config]
        self._asked_at.pop(config.key, None)

    def forget(self, key: str) -> None:
        for table in (self._servers, self._current, self._asked_at, self.last_error):
            table.pop(key, None)

    def targets(self, key: str) -> list[ReplicaConfig] | None:
        return self._current.get(key)

    async def discover(self, config: ReplicaConfig) -> list[ReplicaConfig]:
        resp = await self.client.get(f"{config.url}/kv_event_sources", timeout=self.timeout)
        if resp.status_code != 200:
            raise ValueError(f"/kv_event_sources answered {resp.status_code}")
        return rank_targets(config, parse_event_sources(resp.json(), config.url))

    async def _refresh(self, key: str, config: ReplicaConfig) -> None:
        try:
            targets = await self.discover(config)
        except (httpx.HTTPError, ValueError) as exc:
            self.last_error[key] = repr(exc)
            return
        self.last_error.pop(key, None)
        self._asked_at[key] = time.monotonic()
        if self._servers.get(key) is not config:
            return  # removed or replaced while we asked
        if targets != self._current.get(key):
            self._current[key] = targets
            log.info("replica %s: data-parallel targets %s", key, [t.key for t in targets])
            self.apply(config, targets)

    async def run_once(self) -> None:
        now = time.monotonic()
        due = [
            (key, config)
            for key, config in self._servers.items()
            if key not in self._asked_at or now - self._asked_at[key] >= self.refresh_s
        ]
        if due:
            await asyncio.gather(*(self._refresh(key, config) for key, config in due))

    def start(self) -> None:
        self._periodic.start()

    async def stop(self) -> None:
        await self._periodic.stop()
