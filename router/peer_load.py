"""Load that several routers share: each router's in-flight requests per replica, polled from
its peers, so every router sees the queue all of them built.

Why: a replica's queue, as one router sees it (``Replica.pending``), is vLLM's last gauges
plus what this router sent since that scrape. Behind a load balancer, N routers each send
about 1/N of the traffic: every request the others sent since the last scrape is invisible,
so a router picks near-equals on a queue that is shorter than the replica's, spills a hot
prefix late or early, and learns a per-request queue delay from first bytes that waited
behind requests it never counted (router/queue_model.py). Measured: two routers' TTFT p90
was 5-15% (chat) and 40-60% (shared_prefix) worse than one router's on the same fleet.

Protocol: ``GET /peer/load`` (behind the API key, like every non-monitoring path) answers
``{"router": ID, "replicas": {name: in_flight}, "unstored_blocks": {name: blocks}}``: the
requests this router is proxying to each replica right now, and the blocks it sent each
replica to compute that the replica's feed has not announced yet (router/placement.py:
new prefixes are balanced on them; ``unstored_blocks`` is optional, an older router omits
it). Each router polls its peers (``--peer`` and the routers discovery
found, the warm-start list) every ``peer_load_interval_s`` and adds their counts to its own
(``Replica.peer_in_flight``); every request to a replica passes through some router, so the
sum is the replica's queue without the scrape's delay. A peer that stops answering counts
for nothing after ``stale_after_s`` (its requests end or are retried elsewhere), and an
answer from this router itself (a discovery list that includes it) is recognised by its id
and ignored. Replicas are matched by name, which every router derives alike (flags, the
replicas file, Kubernetes discovery); a name this router does not know is skipped.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvroute.router.replicas import Replica

__all__ = ["PeerAnswer", "PeerLoad", "PeerReport", "load_body", "parse_load"]

log = logging.getLogger(__name__)

# Bounds on what one peer may report: a forged or broken answer cannot make a replica look
# busier than this many requests per peer, nor name more replicas than a fleet has.
MAX_IN_FLIGHT = 1_000_000
MAX_UNSTORED_BLOCKS = 1_000_000_000
MAX_REPLICAS = 100_000


class PeerLoadError(ValueError):
    """Why a peer's answer was not used."""


def load_body(
    router_id: str, replicas: Iterable[Replica], unstored: Mapping[str, int] | None = None
) -> dict[str, Any]:
    """This router's ``GET /peer/load`` answer."""
    body: dict[str, Any] = {
        "router": router_id,
        "replicas": {r.name: r.in_flight for r in replicas},
    }
    if unstored is not None:
        body["unstored_blocks"] = {name: n for name, n in unstored.items() if n}
    return body


@dataclass(frozen=True, slots=True)
class PeerAnswer:
    """A peer's ``GET /peer/load`` answer, checked."""

    router: str
    in_flight: dict[str, int]
    unstored_blocks: dict[str, int] = field(default_factory=dict)


def _counts(value: object, what: str, limit: int) -> dict[str, int]:
    if not isinstance(value, dict):
        raise PeerLoadError(f"'{what}' is not an object")
    if len(value) > MAX_REPLICAS:
        raise PeerLoadError(f"more than {MAX_REPLICAS} replicas")
    out: dict[str, int] = {}
    for name, n in value.items():
        if isinstance(n, bool) or not isinstance(n, int | float) or not math.isfinite(n):
            raise PeerLoadError(f"replica {name!r}: {what} count is not a number")
        if n < 0 or n > limit:
            raise PeerLoadError(f"replica {name!r}: {what} count {n} out of range")
        out[str(name)] = int(n)
    return out


def parse_load(body: object) -> PeerAnswer:
    """A peer's answer; PeerLoadError if it is not one."""
    if not isinstance(body, dict):
        raise PeerLoadError("not a JSON object")
    router, replicas = body.get("router"), body.get("replicas")
    if not isinstance(router, str) or not router or not isinstance(replicas, dict):
        raise PeerLoadError("needs 'router' (a string) and 'replicas' (an object)")
    unstored = body.get("unstored_blocks")
    return PeerAnswer(
        router,
        _counts(replicas, "in-flight", MAX_IN_FLIGHT),
        {} if unstored is None else _counts(unstored, "unstored_blocks", MAX_UNSTORED_BLOCKS),
    )


@dataclass(slots=True)
class PeerReport:
    """The last answer of one peer URL, or why there is none."""

    router: str | None = None
    in_flight: dict[str, int] = field(default_factory=dict)
    unstored_blocks: dict[str, int] = field(default_factory=dict)
    received_at: float | None = None
    error: str | None = None
    polls: int = 0
    failures: int = 0


class PeerLoad:
    """Polls the peers and keeps each replica's ``peer_in_flight`` up to date."""

    def __init__(
        self,
        *,
        interval_s: float,
        timeout_s: float,
        api_key: str | None = None,
        router_id: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        # Three missed rounds, and never under a second: a peer busy for a moment still counts.
        self.stale_after_s = max(1.0, 3 * interval_s)
        self.router_id = router_id or uuid.uuid4().hex
        self._headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self._clock = clock
        self.peers: dict[str, PeerReport] = {}

    async def poll(self, client: httpx.AsyncClient, urls: list[str]) -> None:
        """Ask every peer in ``urls`` at once; forget peers no longer listed."""
        for gone in set(self.peers) - set(urls):
            del self.peers[gone]
        await asyncio.gather(*(self._poll_one(client, url) for url in urls))

    async def _poll_one(self, client: httpx.AsyncClient, url: str) -> None:
        report = self.peers.setdefault(url, PeerReport())
        report.polls += 1
        try:
            resp = await client.get(
                url.rstrip("/") + "/peer/load", headers=self._headers, timeout=self.timeout_s
            )
            if resp.status_code != 200:
                raise PeerLoadError(f"answered {resp.status_code}")
            answer = parse_load(resp.json())
        except (httpx.HTTPError, ValueError) as exc:  # JSON errors are ValueErrors too
            report.failures += 1
            if report.error is None:
                log.warning("peer load: %s: %s", url, _describe(exc))
            report.error = _describe(exc)
            return
        if report.error is not None:
            log.info("peer load: %s answers again", url)
        report.router, report.in_flight = answer.router, answer.in_flight
        report.unstored_blocks, report.error = answer.unstored_blocks, None
        report.received_at = self._clock()

    def apply(self, replicas: Iterable[Replica]) -> None:
        """Set each replica's ``peer_in_flight`` and ``peer_unstored_blocks`` to the sums of
        the fresh peers' counts."""
        now = self._clock()
        peers = self.peers.values()
        fresh = [p for p in peers if self._fresh(p, now) and p.router != self.router_id]
        for replica in replicas:
            replica.peer_in_flight = sum(p.in_flight.get(replica.name, 0) for p in fresh)
            replica.peer_unstored_blocks = sum(
                p.unstored_blocks.get(replica.name, 0) for p in fresh
            )

    def _fresh(self, report: PeerReport, now: float) -> bool:
        return report.received_at is not None and now - report.received_at <= self.stale_after_s

    def to_dict(self) -> dict[str, Any]:
        """``/index/stats``' ``peer_load``: each peer's state (never its counts' history)."""
        now = self._clock()
        return {
            "router": self.router_id,
            "interval_s": self.interval_s,
            "peers": {
                url: {
                    "router": p.router,
                    "self": p.router == self.router_id,
                    "age_s": None if p.received_at is None else round(now - p.received_at, 3),
                    "fresh": self._fresh(p, now),
                    "in_flight": sum(p.in_flight.values()),
                    "unstored_blocks": sum(p.unstored_blocks.values()),
                    "polls": p.polls,
                    "failures": p.failures,
                    "error": p.error,
                }
                for url, p in self.peers.items()
            },
        }


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
