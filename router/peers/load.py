"""Load that several routers share: each router's in-flight requests per replica, followed
from its peers, so every router sees the queue all of them built.

Why: a replica's queue, as one router sees it (``Replica.pending``), is vLLM's last gauges
plus what this router sent since that scrape. Behind a load balancer, N routers each send
about 1/N of the traffic: every request the others sent since the last scrape is invisible,
so a router picks near-equals on a queue that is shorter than the replica's, spills a hot
prefix late or early, and learns a per-request queue delay from first bytes that waited
behind requests it never counted (router/routing/queue_model.py). Measured: two routers' TTFT p90
was 5-15% (chat) and 40-60% (shared_prefix) worse than one router's on the same fleet.

The answer's wire, built and checked: router/peers/load_wire.py.

Protocol: ``GET /peer/load`` (behind the API key, like every non-monitoring path) answers
``{"router": ID, "replicas": {name: in_flight}, "unstored_blocks": {name: blocks}}``: the
requests this router is proxying to each replica right now, and the blocks it sent each
replica to compute that the replica's feed has not announced yet (router/routing/placement.py:
new prefixes are balanced on them; ``unstored_blocks`` is optional, an older router omits
it). Each router polls its peers (``--peer`` and the routers discovery
found, the warm-start list) every ``peer_load_interval_s`` and adds their counts to its own
(``Replica.peer_in_flight``); every request to a replica passes through some router, so the
sum is the replica's queue without the scrape's delay. A peer that stops answering counts
for nothing after ``stale_after_s`` (its requests end or are retried elsewhere), and an
answer from this router itself (a discovery list that includes it) is recognised by its id
and ignored. Replicas are matched by name, which every router derives alike (flags, the
replicas file, Kubernetes discovery); a name this router does not know is skipped.

Followed, not polled (``peer_load_mode="follow"``, the default): a poll every 0.1 s showed a
peer's requests 50 ms late on average, and with four routers three quarters of the fleet's
requests are a peer's: on the chat preset, four polling routers' picks had 11-14% more
prefill queued ahead of them than one router's; following, the same as one router's
(docs/benchmarks.md, "Routers on a core of their own"). So the
answer carries a ``version`` (a digest of the in-flight counts), and a request with
``?wait_s=W&seen=V`` is held until the counts differ from version V or W seconds passed
(woken where the counts change, ``replicas.LoadSignal``: a held request costs nothing
meanwhile).

Streamed, not asked again (the follower's default): with four routers on one core, a
router's own follower requests (an httpx request per peer per change) took a third of its
event loop's busy time, delaying the requests it proxies. So ``?stream=1`` answers with
``application/x-ndjson``: one answer per line, a line each time the version changes (at
most one per ``MIN_ASK_INTERVAL_S``: changes in between come together) and a heartbeat
line every ``wait_s`` when nothing does. Each router keeps one stream open per peer: a
peer's request is seen within 10 ms, and a line costs a write on one side and a parsed line
on the other. A stream never ends by itself; the follower opens it again when it does (the
peer restarted) and after ``peer_load_interval_s`` when it fails. A peer that answers with a
single JSON object instead (an older router, which ignores ``stream``) is followed with
held requests: one open per peer, asked again as soon as it is answered (at most every
``MIN_ASK_INTERVAL_S``). An answer without a version (an older router still, which ignores
the parameters and answers at once) makes the follower poll that peer every
``peer_load_interval_s``.

Device-cache room rides along too (router/routing/kv_room.py): ``kv_held_blocks`` (optional)
are the device blocks this router's requests hold on each replica now. ``kv_frees`` (optional)
says when they should free them: per replica, up to ``KV_FREES_SENT`` ``[blocks, seconds from
the answer]`` pairs, soonest first, neighbours merged at the later time. A peer's requests
then free their blocks in another router's reckoning when that peer predicts, as its own do;
without them (an older router) its holdings are taken to free evenly over one answer. Every
router prices a request that does not fit a replica's device cache by what is held there,
and without its peers' holdings it would take their requests that ended since the replica's
last scrape as still holding their blocks (``Replica.peer_kv_held``).

Queue samples ride along (router/routing/queue_model.py): each router numbers the first-byte samples
it takes, and an asker that passes ``samples_from=K`` (the ``next`` of its last answer from
that peer) gets ``"samples": {"next": N, "values": [[replica, seconds], ...]}``: the peer's
samples K to N-1 (those still in its log); on a stream, each line carries those since the
line before. A new sample changes the ``version`` as well, so it is sent at once. Without
``samples_from`` (a first ask) only ``next`` comes back: a peer's old samples are not
replayed. The asker applies the values to its own estimates, so every router learns from
every first byte in the fleet.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvroute.router.fleet.replicas import LoadSignal, Replica
from kvroute.router.peers.load_wire import (
    KV_FREES_SENT,
    PeerAnswer,
    PeerLoadError,
    load_body,
    load_version,
    parse_load,
)

__all__ = [
    "KV_FREES_SENT",
    "MAX_WAIT_S",
    "MIN_ASK_INTERVAL_S",
    "STREAM_MEDIA_TYPE",
    "PeerAnswer",
    "PeerLoad",
    "PeerLoadError",
    "PeerReport",
    "load_body",
    "load_lines",
    "load_version",
    "parse_load",
]

log = logging.getLogger(__name__)

# A follower asks one peer at most this often; a held ``GET /peer/load`` waits at most this.
MIN_ASK_INTERVAL_S = 0.01
MAX_WAIT_S = 5.0
STREAM_MEDIA_TYPE = "application/x-ndjson"


async def load_lines(
    answer: Callable[[int | None], dict[str, Any]],
    version: Callable[[], str],
    signal: LoadSignal,
    heartbeat_s: float,
    samples_from: int | None,
) -> AsyncIterator[bytes]:
    """A streamed ``GET /peer/load``: ``answer(since)`` as one JSON line now, then again each
    time ``version()`` changes (at most once per ``MIN_ASK_INTERVAL_S``: changes in between
    come together) or ``heartbeat_s`` passed without a change. Each line's queue samples are
    those since the previous line (the first line's: since ``samples_from``). Ends only when
    the asker goes away (or the router shuts down: router/serving/http_protocol.py)."""
    since = samples_from
    while True:
        body = answer(since)
        since, seen = body["samples"]["next"], body["version"]
        yield (json.dumps(body, separators=(",", ":")) + "\n").encode()
        sent = time.monotonic()
        await asyncio.sleep(MIN_ASK_INTERVAL_S)
        while version() == seen:
            left = sent + heartbeat_s - time.monotonic()
            if left <= 0:
                break
            await signal.wait(left)


@dataclass(slots=True)
class PeerReport:
    """The last answer of one peer URL, or why there is none."""

    router: str | None = None
    in_flight: dict[str, int] = field(default_factory=dict)
    unstored_blocks: dict[str, int] = field(default_factory=dict)
    kv_held_blocks: dict[str, int] = field(default_factory=dict)
    kv_frees: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    received_at: float | None = None
    error: str | None = None
    polls: int = 0
    failures: int = 0
    followed: bool = False  # its last answer had a version: it holds requests until a change
    next_sample: int | None = None  # where its next answer's queue samples start
    samples_received: int = 0
    streamed: bool = False  # its answers come as a stream (``?stream=1``)


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
        on_samples: Callable[[list[tuple[str, float]]], None] | None = None,
        on_rate_samples: Callable[[list[tuple[str, tuple[float, ...]]]], None] | None = None,
        on_homes: Callable[[list[tuple[str, bytes]]], None] | None = None,
    ) -> None:
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        # Three missed rounds, and never under a second: a peer busy for a moment still counts.
        self.stale_after_s = max(1.0, 3 * interval_s)
        self.router_id = router_id or uuid.uuid4().hex
        self._headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self._clock = clock
        self.peers: dict[str, PeerReport] = {}
        # Where a peer's queue samples go (the router's LearnedQueueDelay); None: not asked.
        self.on_samples = on_samples
        self.on_rate_samples = on_rate_samples
        self.on_homes = on_homes

    async def poll(self, client: httpx.AsyncClient, urls: list[str]) -> None:
        """Ask every peer in ``urls`` at once; forget peers no longer listed."""
        for gone in set(self.peers) - set(urls):
            del self.peers[gone]
        await asyncio.gather(*(self._poll_one(client, url) for url in urls))

    async def _poll_one(self, client: httpx.AsyncClient, url: str) -> None:
        await self._ask(client, url, {}, self.timeout_s, follow=False)

    @property
    def wait_s(self) -> float:
        """How long a followed peer holds an unchanged answer: half the staleness bound, so
        an idle peer still answers in time to stay fresh."""
        return min(MAX_WAIT_S, self.stale_after_s / 2)

    async def follow(
        self, client: httpx.AsyncClient, url: str, on_answer: Callable[[], None]
    ) -> None:
        """Follow ``url``'s load as a stream (``?stream=1``): one line each time its counts
        change, a heartbeat every ``wait_s``; ``on_answer`` runs after each line (the service
        applies the sums there). A stream that ends is opened again at once (at most once
        per ``MIN_ASK_INTERVAL_S``), one that fails after ``interval_s``. A peer that answers
        with one JSON object instead (an older router) is followed with held requests
        (``_follow_held``). Runs until cancelled."""
        while True:
            opened = time.monotonic()
            streamed = await self._stream(client, url, on_answer)
            if streamed is False:
                await asyncio.sleep(self.interval_s)
                continue
            await asyncio.sleep(max(0.0, opened + MIN_ASK_INTERVAL_S - time.monotonic()))
            if streamed is None:
                await self._follow_held(client, url, on_answer)

    async def _stream(
        self, client: httpx.AsyncClient, url: str, on_answer: Callable[[], None]
    ) -> bool | None:
        """One streamed question: True when it ended after answering, False on an error, None
        when the peer answered once instead of streaming (that answer applied)."""
        report = self.peers.setdefault(url, PeerReport())
        report.polls += 1
        params: dict[str, Any] = {"stream": "1", "wait_s": self.wait_s}
        if self.on_samples is not None and report.next_sample is not None:
            params["samples_from"] = report.next_sample
        timeout = httpx.Timeout(self.timeout_s, read=self.timeout_s + self.wait_s)
        first = True
        try:
            async with client.stream(
                "GET",
                url.rstrip("/") + "/peer/load",
                params=params,
                headers=self._headers,
                timeout=timeout,
            ) as resp:
                if resp.status_code != 200:
                    raise PeerLoadError(f"answered {resp.status_code}")
                report.streamed = resp.headers.get("content-type", "").startswith(STREAM_MEDIA_TYPE)
                if not report.streamed:
                    await resp.aread()
                    self._record(url, report, parse_load(resp.json()), params, follow=False)
                    on_answer()
                    return None
                async for line in resp.aiter_lines():
                    if not line.strip():
                        continue
                    # After its first line, a stream's samples follow on from the line before.
                    asked = params if first else {"samples_from": report.next_sample}
                    self._record(url, report, parse_load(json.loads(line)), asked, follow=True)
                    first = False
                    on_answer()
        except (httpx.HTTPError, ValueError) as exc:  # JSON errors are ValueErrors too
            self._failed(url, report, exc)
            return False
        return True

    async def _follow_held(
        self, client: httpx.AsyncClient, url: str, on_answer: Callable[[], None]
    ) -> None:
        """Keep asking ``url`` with the version of its last answer, each time at once (at
        most once per ``MIN_ASK_INTERVAL_S``): the peer answers when its counts change (or after
        ``wait_s``). On an error, or a peer that answers without a version, waits
        ``interval_s`` before asking again. Runs until cancelled."""
        version: str | None = None
        while True:
            asked = time.monotonic()
            params: dict[str, Any] = {}
            if version is not None:
                params = {"wait_s": self.wait_s, "seen": version}
            answer = await self._ask(client, url, params, self.timeout_s + self.wait_s, follow=True)
            if answer is not None:
                on_answer()
            version = None if answer is None else answer.version
            if version is None:
                await asyncio.sleep(self.interval_s)
            else:
                # A peer whose counts change on every answer (heavy traffic) is asked at most
                # once per MIN_ASK_INTERVAL_S, as a held answer is checked: not once per round trip.
                await asyncio.sleep(max(0.0, asked + MIN_ASK_INTERVAL_S - time.monotonic()))

    def forget(self, url: str) -> None:
        """A peer no longer listed (its follower stopped)."""
        self.peers.pop(url, None)

    async def _ask(
        self,
        client: httpx.AsyncClient,
        url: str,
        params: dict[str, Any],
        timeout_s: float,
        *,
        follow: bool,
    ) -> PeerAnswer | None:
        report = self.peers.setdefault(url, PeerReport())
        report.polls += 1
        if self.on_samples is not None and report.next_sample is not None:
            params = {**params, "samples_from": report.next_sample}
        try:
            resp = await client.get(
                url.rstrip("/") + "/peer/load",
                params=params,
                headers=self._headers,
                timeout=timeout_s,
            )
            if resp.status_code != 200:
                raise PeerLoadError(f"answered {resp.status_code}")
            answer = parse_load(resp.json())
        except (httpx.HTTPError, ValueError) as exc:  # JSON errors are ValueErrors too
            self._failed(url, report, exc)
            return None
        self._record(url, report, answer, params, follow=follow)
        return answer

    def _failed(self, url: str, report: PeerReport, exc: BaseException) -> None:
        report.failures += 1
        if report.error is None:
            log.warning("peer load: %s: %s", url, _describe(exc))
        report.error = _describe(exc)

    def _record(
        self,
        url: str,
        report: PeerReport,
        answer: PeerAnswer,
        params: Mapping[str, Any],
        *,
        follow: bool,
    ) -> None:
        """Keep ``answer`` as the peer's last; apply its queue samples when they are the
        ones asked for (``samples_from`` in ``params``) from the same peer as before."""
        if report.error is not None:
            log.info("peer load: %s answers again", url)
        same_peer = report.router == answer.router  # not restarted: its sample numbers go on
        report.router, report.in_flight = answer.router, answer.in_flight
        report.unstored_blocks, report.error = answer.unstored_blocks, None
        report.kv_held_blocks, report.kv_frees = answer.kv_held_blocks, answer.kv_frees
        report.received_at = self._clock()
        report.followed = follow and answer.version is not None
        asked_samples = params.get("samples_from") is not None
        if asked_samples and same_peer and answer.router != self.router_id:
            report.samples_received += (
                len(answer.samples) + len(answer.rate_samples) + len(answer.homes)
            )
            if self.on_samples is not None and answer.samples:
                self.on_samples(answer.samples)
            if self.on_rate_samples is not None and answer.rate_samples:
                self.on_rate_samples(answer.rate_samples)
            if self.on_homes is not None and answer.homes:
                self.on_homes(answer.homes)
        # A restarted peer (a new id) numbers from 0 again: go on from its answer either way.
        report.next_sample = answer.next_sample

    def apply(self, replicas: Iterable[Replica]) -> None:
        """Set each replica's ``peer_in_flight``, ``peer_unstored_blocks`` and
        ``peer_kv_held`` to the sums of the fresh peers' counts, and ``peer_kv_frees`` to
        when their holdings free (their ``kv_frees``, in this router's clock)."""
        now = self._clock()
        peers = self.peers.values()
        fresh = [p for p in peers if self._fresh(p, now) and p.router != self.router_id]
        for replica in replicas:
            replica.peer_in_flight = sum(p.in_flight.get(replica.name, 0) for p in fresh)
            replica.peer_unstored_blocks = sum(
                p.unstored_blocks.get(replica.name, 0) for p in fresh
            )
            replica.set_peer_kv_held(sum(p.kv_held_blocks.get(replica.name, 0) for p in fresh))
            replica.peer_kv_frees = sorted(
                (p.received_at + seconds, blocks)  # type: ignore[operator]
                for p in fresh
                for blocks, seconds in p.kv_frees.get(replica.name, ())
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
                    "followed": p.followed,
                    "streamed": p.streamed,
                    "queue_samples_received": p.samples_received,
                    "error": p.error,
                }
                for url, p in self.peers.items()
            },
        }


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
