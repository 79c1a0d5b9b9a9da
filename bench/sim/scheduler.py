"""The simulated engine's scheduler: a running limit, a FIFO waiting queue, shared prefill.

Like vLLM's scheduler, a request waits until it fits both the running limit
(``max_num_seqs``) and the device cache (the head of the queue blocks those behind it), then
holds its KV blocks until it finishes. Unlike vLLM it reserves the blocks for all its output
tokens at admission, so it never preempts; the capacity check is correspondingly stricter.

Prompt blocks are cached when a request is admitted, as vLLM caches blocks when it schedules
them (the whole prompt fits one step's token budget here; vLLM chunks longer ones). A request
admitted later may hit blocks still being computed; it then finishes its prefill no earlier
than the request computing them, as vLLM would run it in a later step.

Time is continuous. Prefills run as processor sharing: ``n`` concurrent prefills each progress
at 1/n of the engine's rate, the cost of chunked prefill batching them into the same steps.
Loads from CPU and STORAGE are part of a request's prefill work. Decoding is done by the
request's own coroutine (``decode_step`` per token), since it never delays anything else here.

Events: the cache's pending events are published as one batch after each scheduler action
(admission, prefill completion, finish), which is vLLM's one batch per engine step.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvroute.bench.sim.cache import Allocation, CachedBlock, TieredPrefixCache
from kvroute.bench.sim.hashing import EngineHasher
from kvroute.bench.sim.latency import LatencyModel
from kvroute.indexer.wire import Event, Medium

__all__ = ["EngineStats", "ReplicaDied", "Scheduler", "SimRequest"]


class ReplicaDied(RuntimeError):
    """The replica was killed while the request was queued or running."""


@dataclass(slots=True, eq=False)
class SimRequest:
    """A request as the engine sees it: token ids, their block digests, and its futures.

    Compared by identity (``eq=False``): two requests with the same prompt are still two
    requests, and a field-wise comparison would walk ``deps`` into other requests.
    """

    prompt: list[int]
    digests: list[bytes]
    extra_keys: list[tuple[Any, ...] | None] | None
    max_tokens: int
    lora_name: str | None = None
    id: int = field(default_factory=itertools.count().__next__)
    arrival: float = 0.0
    alloc: Allocation | None = None
    cached_tokens: int = 0
    cached_by_tier: dict[Medium, int] = field(default_factory=dict)
    work_left: float = 0.0
    prefilled: asyncio.Future[float] | None = None
    owned: list[CachedBlock] = field(default_factory=list, repr=False)
    deps: list[SimRequest] = field(default_factory=list, repr=False)
    settled: bool = False  # its prompt blocks are computed (or it was aborted)
    # P/D (bench/sim/disagg.py): a prefill leg keeps its blocks after it finishes, until
    # ``release_held``; a decode leg may pull this many prompt tokens from its prefill, and
    # reports the prefill's cached tokens as its own.
    hold: bool = False
    pull_tokens: int = 0
    remote_cached_tokens: int | None = None
    scheduled_at: float = 0.0  # simulated seconds, when admitted (vLLM's scheduled_ts)


@dataclass(slots=True)
class EngineStats:
    """Counters behind the replica's /metrics (token counts, as vLLM's)."""

    prefix_queries: int = 0
    prefix_hits: int = 0
    external_hits: int = 0
    # vLLM's per-source counters (vllm:prompt_tokens_by_source, ..._cached_by_source):
    # tokens computed, and hits the connector loaded from host RAM, disk, another instance
    computed_tokens: int = 0
    host_hits: int = 0
    disk_hits: int = 0
    p2p_hits: int = 0
    # vllm:request_prefill_time_seconds (scheduled -> first token, wall seconds)
    prefill_time_s: float = 0.0
    prefills: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    requests_finished: int = 0
    requests_failed: int = 0


class Scheduler:
    """One replica's engine loop; all methods run on the replica's asyncio loop."""

    def __init__(
        self,
        cache: TieredPrefixCache,
        latency: LatencyModel,
        *,
        max_num_seqs: int,
        publish: Callable[[list[Event]], None],
        hasher: EngineHasher,
    ) -> None:
        if max_num_seqs <= 0:
            raise ValueError("max_num_seqs must be positive")
        self.cache = cache
        self.latency = latency
        self.max_num_seqs = max_num_seqs
        self.hasher = hasher
        self.stats = EngineStats()
        self._publish = publish
        self._waiting: deque[SimRequest] = deque()
        self._prefilling: dict[int, SimRequest] = {}
        self._blocked: dict[int, SimRequest] = {}  # prefill done, waiting on others' blocks
        self._running: dict[int, SimRequest] = {}
        self._held: dict[int, SimRequest] = {}  # finished prefill legs, blocks kept
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._last = 0.0

    # --- public API ---------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def now(self) -> float:
        """Simulated seconds (wall seconds of the loop's clock / time_scale)."""
        return asyncio.get_running_loop().time() / self.latency.time_scale

    def start(self) -> None:
        if self._task is None:
            self._last = self.now()
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        """Stop the loop and fail every queued or running request (the process died)."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        for req in [*self._waiting, *self._running.values()]:
            self._settle(req)
            if req.prefilled is not None and not req.prefilled.done():
                req.prefilled.set_exception(ReplicaDied("replica died"))
        self._waiting.clear()
        self._prefilling.clear()
        self._blocked.clear()
        self._running.clear()

    async def prefill(self, req: SimRequest) -> float:
        """Queue ``req`` and wait for its prefill; returns the simulated time it ended.

        The caller must call ``finish`` (or ``abort``) afterwards, also on error.
        """
        if self._task is None:
            raise ReplicaDied("replica died")  # stopped: nothing would ever admit it
        req.arrival = self.now()
        req.prefilled = asyncio.get_running_loop().create_future()
        self._waiting.append(req)
        self._wake.set()
        return await req.prefilled

    def finish(self, req: SimRequest, output: list[int]) -> None:
        """The request produced ``output``: cache its full blocks and free its hold."""
        if self._running.pop(req.id, None) is None or req.alloc is None:
            return
        tokens = req.prompt + output
        digests = req.digests + self._output_digests(req, tokens)
        created = self.cache.commit(req.alloc, tokens, digests, req.extra_keys, req.lora_name)
        self.cache.write_through(created)
        if req.hold:
            self._held[req.id] = req  # a prefill leg: blocks kept for the decode's pull
        else:
            self.cache.release(req.alloc)
        self.stats.generation_tokens += len(output)
        self.stats.requests_finished += 1
        self._flush()
        self._wake.set()

    def release_held(self, req: SimRequest) -> None:
        """The decode replica pulled a prefill leg's blocks, or its lease ended."""
        if self._held.pop(req.id, None) is not None and req.alloc is not None:
            self.cache.release(req.alloc)
            self._flush()
            self._wake.set()

    def abort(self, req: SimRequest) -> None:
        """The client went away (or decoding failed): free whatever the request holds."""
        # Membership first: deque.remove's "not in deque" error formats the request's repr.
        if req in self._waiting:
            self._waiting.remove(req)
        self._prefilling.pop(req.id, None)
        self._blocked.pop(req.id, None)
        self._settle(req)
        if self._running.pop(req.id, None) is not None and req.alloc is not None:
            self.cache.release(req.alloc)
            self._flush()
        self.stats.requests_failed += 1
        self._wake.set()

    # --- the loop -----------------------------------------------------------------------------

    def _output_digests(self, req: SimRequest, tokens: list[int]) -> list[bytes]:
        """Digests of the blocks that generated tokens complete (vLLM caches those too)."""
        hasher = self.hasher
        bs = self.cache.block_size
        out: list[bytes] = []
        parent = req.digests[-1] if req.digests else None
        for i in range(len(req.digests), len(tokens) // bs):
            parent = hasher.block_digest(parent, tokens[i * bs : (i + 1) * bs], None)
            out.append(parent)
        return out

    def _flush(self) -> None:
        events = self.cache.take_events()
        if events:
            self._publish(events)

    def _admit(self) -> None:
        bs = self.cache.block_size
        while self._waiting and len(self._running) < self.max_num_seqs:
            req = self._waiting[0]
            total = -(-(len(req.prompt) + req.max_tokens) // bs)
            alloc = self.cache.allocate(req.digests, len(req.prompt), total)
            if alloc is None:
                break  # head-of-line blocking, as vLLM's FCFS policy
            self._waiting.popleft()
            req.alloc = alloc
            from_cpu = alloc.hit_blocks_in(Medium.CPU) * bs
            from_storage = alloc.hit_blocks_in(Medium.STORAGE) * bs
            req.cached_tokens = alloc.hit_blocks * bs
            req.cached_by_tier = {t: alloc.hit_blocks_in(t) * bs for t in Medium}
            pulled = max(0, req.pull_tokens - req.cached_tokens)
            uncached = len(req.prompt) - req.cached_tokens - pulled
            req.work_left = self.latency.prefill_work(uncached, from_cpu, from_storage, pulled)
            if req.remote_cached_tokens is not None:
                req.cached_tokens = req.remote_cached_tokens
            self.stats.prefix_queries += len(req.prompt)
            self.stats.prefix_hits += req.cached_by_tier[Medium.GPU]
            self.stats.external_hits += from_cpu + from_storage
            self.stats.prompt_tokens += len(req.prompt)
            self.stats.computed_tokens += uncached
            self.stats.host_hits += from_cpu
            self.stats.disk_hits += from_storage
            self.stats.p2p_hits += pulled
            req.scheduled_at = self.now()
            self._running[req.id] = req
            self._prefilling[req.id] = req
            req.deps = list({id(o): o for b in alloc.blocks if (o := b.owner) is not None}.values())
            req.owned = self.cache.commit(
                alloc, req.prompt, req.digests, req.extra_keys, req.lora_name
            )
            for block in req.owned:
                block.owner = req
        self._flush()

    def _advance(self, now: float) -> None:
        """Progress every prefill by the time since the last call (processor sharing)."""
        n = len(self._prefilling)
        if n and now > self._last:
            share = (now - self._last) / n
            for req in self._prefilling.values():
                req.work_left -= share
        self._last = now
        for req in [r for r in self._prefilling.values() if r.work_left <= 1e-9]:
            del self._prefilling[req.id]
            self._blocked[req.id] = req
        progress = True
        while progress:
            progress = False
            for req in list(self._blocked.values()):
                if all(d.settled for d in req.deps):
                    del self._blocked[req.id]
                    self.cache.write_through(req.owned)  # computed: on disk (if written so)
                    self._settle(req)
                    if req.prefilled is not None and not req.prefilled.done():
                        req.prefilled.set_result(now)
                    self.stats.prefills += 1
                    self.stats.prefill_time_s += (now - req.scheduled_at) * self.latency.time_scale
                    progress = True
        self._flush()  # what the settled prefills wrote through to the shared domain

    @staticmethod
    def _settle(req: SimRequest) -> None:
        """The request's prompt blocks are computed: nobody waits on them any longer."""
        req.settled = True
        for block in req.owned:
            if block.owner is req:
                block.owner = None
        req.owned = []
        req.deps = []

    async def _loop(self) -> None:
        while True:
            self._advance(self.now())
            self._admit()
            self._advance(self.now())
            timeout: float | None = None
            if self._prefilling:
                n = len(self._prefilling)
                next_done = min(r.work_left for r in self._prefilling.values()) * n
                timeout = max(next_done, 0.0) * self.latency.time_scale
            self._wake.clear()
            if timeout is None:
                await self._wake.wait()
            else:
                try:
                    await asyncio.wait_for(self._wake.wait(), timeout)
                except TimeoutError:
                    pass
