"""The simulated engine's scheduler: a running limit, a FIFO waiting queue, shared prefill.

Like vLLM's scheduler, a request waits until it fits both the running limit
(``max_num_seqs``) and the device cache (the head of the queue blocks those behind it), then
holds its KV blocks until it finishes. Unlike vLLM it reserves the blocks for all its output
tokens at admission, so it never preempts; the capacity check is correspondingly stricter.

Prompt blocks are cached when a request is admitted, as vLLM caches blocks when it schedules
them (the whole prompt fits one step's token budget here; vLLM chunks longer ones). A request
admitted later may hit blocks still being computed; it then finishes its prefill no earlier
than the request computing them, as vLLM would run it in a later step.

Time is continuous. Two models of how the engine is shared (``LatencyModel``):

* processor sharing (the default, ``max_num_batched_tokens`` 0): ``n`` concurrent prefills
  each progress at 1/n of the engine's rate, and decoding is done by the request's own
  coroutine (``decode_step`` per token), never delayed by a prefill;
* vLLM's step scheduler (``max_num_batched_tokens`` > 0, the token budget of a step):
  vLLM 0.32's ``Scheduler.schedule`` (vllm/v1/core/sched/scheduler.py) gives the step's
  budget to the RUNNING requests first, in order, each taking up to its remaining prompt
  (``long_prefill_token_threshold`` is 0 by default), then admits WAITING requests with
  what is left: a prompt that arrives behind a running one waits for it, so prefills run
  in order here, each costing its tokens plus one decode step per budget's worth of them
  (a forward pass's fixed cost). Decodes ride in the same steps, so each decode step also
  waits for the step's prefill chunk (``prefill_step_s``). A decode leg's NIXL pull does
  not occupy the engine: NixlConnector's ``get_num_new_matched_tokens`` answers
  ``load_kv_async`` and the request waits in ``WAITING_FOR_REMOTE_KVS`` while other
  requests run (``ready_at``), then its remaining tokens are computed like any prefill.

Loads from CPU and STORAGE are part of a request's prefill work in both models.

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
    # The step model (``LatencyModel.max_num_batched_tokens``): when its NIXL pull ends and
    # it may be computed (vLLM's WAITING_FOR_REMOTE_KVS until then).
    ready_at: float = 0.0


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
    # NixlConnector's failure counters (vllm:nixl_num_failed_transfers on the decode side,
    # its handshakes included; vllm:nixl_num_kv_expired_reqs on the prefill side)
    nixl_failed_transfers: int = 0
    nixl_expired_reqs: int = 0


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
            lat = self.latency
            if lat.step_budget:
                # vLLM: the pull runs beside the engine (the request waits in
                # WAITING_FOR_REMOTE_KVS), then the rest is computed in steps that each
                # cost a decode step of the running batch on top of their tokens.
                req.ready_at = self.now() + pulled * lat.transfer_s_per_token
                steps = max(1, -(-uncached // lat.step_budget))
                req.work_left = lat.prefill_work(
                    uncached, from_cpu, from_storage
                ) + steps * lat.decode_step(len(self._running))
            else:
                req.work_left = lat.prefill_work(uncached, from_cpu, from_storage, pulled)
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

    def _queue(self, t: float) -> list[SimRequest]:
        """The step model's prefills that may run at ``t``, in the order vLLM runs them:
        the running ones first, in the order they became runnable (a pulled request joins
        after the pull)."""
        ready = [r for r in self._prefilling.values() if r.ready_at <= t + 1e-12]
        return sorted(ready, key=lambda r: r.ready_at)  # stable: admission order

    def prefill_step_s(self) -> float:
        """Step model: what the prefill chunk of the step now running adds to its decodes'
        step (vLLM batches decodes with the chunk, so each of them waits for it); 0 in the
        processor-sharing model, or with no prefill running."""
        lat = self.latency
        if not lat.step_budget:
            return 0.0
        now = self.now()
        elapsed, work = max(0.0, now - self._last), 0.0  # work done since the last advance
        for req in self._queue(now):
            done = min(max(req.work_left, 0.0), elapsed)
            elapsed -= done
            work += req.work_left - done
        return min(work, lat.step_budget * lat.prefill_s_per_token)

    def _advance_steps(self, now: float) -> None:
        """Step model: the engine works on the first runnable prefill until it is done,
        then the next (vLLM's scheduler gives the running requests the step's budget
        first, in order, and admits waiting ones with what is left)."""
        t = self._last
        while t < now:
            queue = self._queue(t)
            if not queue:
                later = [r.ready_at for r in self._prefilling.values() if r.ready_at > t]
                if not later:
                    break
                t = min(min(later), now)
                continue
            head = queue[0]
            dt = min(max(head.work_left, 0.0), now - t)
            head.work_left -= dt
            t += dt
            if head.work_left <= 1e-9:
                head.work_left = 0.0
                del self._prefilling[head.id]
                self._blocked[head.id] = head

    def _next_event_s(self, now: float) -> float | None:
        """Simulated seconds until a prefill may finish or a pull ends (None: never)."""
        if not self._prefilling:
            return None
        if not self.latency.step_budget:
            return min(r.work_left for r in self._prefilling.values()) * len(self._prefilling)
        queue = self._queue(now)
        waits = [r.ready_at - now for r in self._prefilling.values() if r.ready_at > now]
        if queue:
            waits.append(queue[0].work_left)
        return min(waits)

    def _advance(self, now: float) -> None:
        """Progress every prefill by the time since the last call (processor sharing, or
        the step model's order)."""
        if self.latency.step_budget:
            self._advance_steps(now)
        else:
            n = len(self._prefilling)
            if n and now > self._last:
                share = (now - self._last) / n
                for req in self._prefilling.values():
                    req.work_left -= share
        self._last = now
        done = [r for r in self._prefilling.values() if r.work_left <= 1e-9 and r.ready_at <= now]
        for req in done:
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
            next_s = self._next_event_s(self.now())
            if next_s is not None:
                timeout = max(next_s, 0.0) * self.latency.time_scale
            self._wake.clear()
            if timeout is None:
                await self._wake.wait()
            else:
                try:
                    await asyncio.wait_for(self._wake.wait(), timeout)
                except TimeoutError:
                    pass
