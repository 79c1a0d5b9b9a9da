"""Admission when every replica is saturated: a bounded, ordered queue instead of a refusal.

With ``--max-pending-per-replica`` set, a replica at the bound takes no new request. Without
this module the router then refused at once (503), though the fleet finishes a request every
few hundred milliseconds and the client would have waited. vLLM itself never refuses for
load (its own queue is unbounded), so a vLLM user expects a short wait, not an error: the
router holds the request here until a replica has room, and refuses (429 with
``Retry-After`` in OpenAI's schema) only what cannot start in time: the queue is full, the
request's deadline passed, or the queue's measured drain rate says it would pass.

Which waiting request goes first when a slot frees (``order="cost"``, the default):

1. the priority class: vLLM's ``priority`` field (lower first, as in vLLM), or the
   ``x-kvroute-priority`` header. Strict between classes: a lower class waits while a
   higher one queues, bounded by its own deadline (it is shed, never held forever).
2. the tenant (the ``x-kvroute-tenant`` header, else the API key): round-robin between the
   tenants with requests queued in the class, so one tenant's burst does not starve the
   others. A tenant that comes back after an idle spell starts level with the others, not
   with credit banked while it was away.
3. the cost: the router's own estimate of the work the best replica does for the request
   (uncached prefill and KV loads: a long prefix cached somewhere is cheap, a cold long
   prompt expensive), less ``aging`` seconds per second waited. Cheap work first serves
   more requests per second of fleet time when capacity is short; the aging term makes a
   request that has waited longer than its cost outrank every newcomer (whose score is at
   least 0), so nothing starves.

``order="fifo"`` (arrival order only) and ``order="priority"`` (class, then arrival) exist
for comparison (``kvroute bench admission``) and for operators who want them.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvroute.router.common.admission_queue import (
    ORDERS,
    AdmissionQueue,
    AdmissionSettings,
    Shed,
    Waiter,
)
from kvroute.router.errors import RouterError

__all__ = [
    "ORDERS",
    "Admission",
    "AdmissionQueue",
    "AdmissionSettings",
    "Shed",
    "Ticket",
    "Waiter",
    "class_label",
    "disconnect_watch",
    "ticket_of",
    "work_s",
]

_LABELLED = range(-16, 17)
# Admission rate: admissions within this many seconds count (an old burst says nothing).
_RATE_WINDOW_S = 10.0
_RATE_MIN_SAMPLES = 4
_TICK_S = 0.01  # how often a non-empty queue checks deadlines and scraped room


def class_label(priority: int) -> str:
    return str(priority) if priority in _LABELLED else "other"


class AdmissionMetrics:
    """Queue depth per class, waits and shed counts (``kvroute_admission_*``)."""

    def __init__(self, registry: Any) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        self.depth = Gauge(
            "kvroute_admission_queued",
            "Requests waiting in the admission queue, per priority class",
            ["priority"],
            registry=registry,
        )
        self.wait = Histogram(
            "kvroute_admission_wait_seconds",
            "Time a request waited in the admission queue, per class and outcome",
            ["priority", "outcome"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=registry,
        )
        self.shed = Counter(
            "kvroute_admission_shed_total",
            "Requests refused with 429 by admission, per class and reason",
            ["priority", "reason"],
            registry=registry,
        )


class Admission:
    """The queues (one per model: replicas serve one model's requests) and their pump."""

    def __init__(
        self,
        settings: AdmissionSettings,
        limit: int,
        retry_after_s: int,
        prefill_s_per_token: float = 1e-4,
        metrics: AdmissionMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.limit = limit  # --max-pending-per-replica (0: nothing is ever saturated)
        self.retry_after_s = retry_after_s
        self.prefill_s_per_token = prefill_s_per_token
        self.metrics = metrics
        self.clock = clock
        self.queues: dict[str, AdmissionQueue] = {}
        self._room: dict[str, Callable[[int], int]] = {}  # free slots for a priority
        self.reserved: dict[str, int] = {}  # admitted, not yet sent to a replica
        self._admitted_at: deque[float] = deque(maxlen=256)
        self._ticker: asyncio.Task[None] | None = None
        self.counts = {"queued": 0, "admitted": 0, "shed": 0, "disconnected": 0}
        self.shed_by_reason: dict[str, int] = {}
        self._labels: set[str] = set()  # the depth gauge's classes so far (reset to 0)

    # --- the request side -----------------------------------------------------------------

    def bound(self, priority: int) -> int:
        """The pending bound a request of ``priority`` may fill: the last ``reserve`` slots
        of each replica (at most all but one) are kept for urgent requests (priority < 0,
        ahead of vLLM's default 0), so one finds room at once instead of waiting for a slot
        to free behind the normal traffic."""
        if priority < 0:
            return self.limit
        return self.limit - min(self.settings.reserve, max(0, self.limit - 1))

    def with_room(self, candidates: Sequence[Any], priority: int = 0) -> list[Any]:
        if not self.limit:
            return list(candidates)
        bound = self.bound(priority)
        return [r for r in candidates if r.pending_fresh < bound]

    async def decide(
        self,
        model: str,
        candidates: Sequence[Any],
        ticket: Ticket,
        rank: Callable[[list[Any]], Awaitable[Any]],
    ) -> Any:
        """``rank`` the candidates with room; when none has (or others already wait), wait
        here in order until one has. Raises RouterError (429; 503 with admission off)."""
        room = self.with_room(candidates, ticket.priority)
        queue = self.queues.get(model)
        if room and not (queue and len(queue)):
            return await rank(room)
        if not self.settings.enabled:
            raise RouterError(
                503,
                f"every replica serving `{model}` has {self.limit} or more requests pending; "
                "retry later",
                headers={"retry-after": str(self.retry_after_s)},
            )
        # What it costs the fleet orders the queue: the ranking over every candidate.
        cost = work_s(await rank(list(candidates)), self.prefill_s_per_token)
        self._room[model] = lambda priority: sum(
            max(0, math.ceil(self.bound(priority) - r.pending_fresh)) for r in candidates
        )
        await self.wait(model, ticket, cost)
        try:
            # Room was counted when it was admitted; a scrape since may disagree: go anyway.
            return await rank(self.with_room(candidates, ticket.priority) or list(candidates))
        finally:
            self.started(model)

    async def wait(self, model: str, ticket: Ticket, cost_s: float) -> None:
        """Queue and wait for a slot; raises RouterError(429) when shed."""
        s = self.settings
        now = self.clock()
        max_wait = s.max_wait_s
        if ticket.max_wait_s is not None:
            max_wait = min(ticket.max_wait_s, max_wait)
        queue = self.queues.get(model)
        if queue is None:
            queue = self.queues[model] = AdmissionQueue(s.max_queued, s.order, s.aging)
        w = Waiter(ticket.priority, ticket.tenant, max(0.0, cost_s), now, now + max_wait)
        w.future = asyncio.get_running_loop().create_future()
        queue.number(w)
        rate = self.rate(now)
        if rate is not None and (queue.ahead_of(w, now) + 1) / rate > max_wait:
            self._refuse(w, "predicted", queue, now)
        try:
            displaced = queue.push(w, now)
        except Shed as exc:
            self._refuse(w, exc.reason, queue, now)
        if displaced is not None:
            self._shed(displaced, "displaced", queue, now)
        self.counts["queued"] += 1
        self._depth(model)
        self._ensure_ticker()
        self.pump(model)
        try:
            if ticket.disconnected is None:
                await w.future
            else:
                await _first(w.future, ticket.disconnected)
                if not w.future.done():
                    self._leave(model, w, "disconnected")
                    self.counts["disconnected"] += 1
                    from kvroute.router.serving.proxy import ClientGone

                    raise ClientGone()
        except asyncio.CancelledError:
            self._leave(model, w, "cancelled")
            raise
        finally:
            self._depth(model)
        w.future.result()  # raises RouterError when shed

    def started(self, model: str) -> None:
        """An admitted request has its replica: its reserved slot is the replica's now."""
        if self.reserved.get(model, 0) > 0:
            self.reserved[model] -= 1

    # --- the slot side --------------------------------------------------------------------

    def pump(self, model: str | None = None) -> None:
        """Admit as many waiters as there are free slots (call when capacity may have
        freed: a request ended, a scrape came, a tick)."""
        now = self.clock()
        for name in [model] if model is not None else list(self.queues):
            queue = self.queues.get(name)
            if not queue:
                continue
            for w in queue.expired(now):
                self._shed(w, "deadline", queue, now)
            room = self._room.get(name)
            while room is not None and (head := queue.peek(now)) is not None:
                if room(head.priority) - self.reserved.get(name, 0) <= 0:
                    break  # the head waits; nobody overtakes it
                w = queue.pop(now)
                assert w is head and w.future is not None
                if w.future.done():
                    continue
                w.future.set_result(None)
                self.reserved[name] = self.reserved.get(name, 0) + 1
                self._admitted_at.append(now)
                self.counts["admitted"] += 1
                self._observe(w, "admitted", now)
            self._depth(name)

    def rate(self, now: float) -> float | None:
        """Admissions per second lately (None: too few to say)."""
        recent = [t for t in self._admitted_at if now - t <= _RATE_WINDOW_S]
        if len(recent) < _RATE_MIN_SAMPLES or recent[-1] <= recent[0]:
            return None
        return (len(recent) - 1) / (recent[-1] - recent[0])

    def retry_after(self, queue: AdmissionQueue, now: float) -> int:
        """Seconds until the queue has drained by its current length (whole, >= 1), from
        the measured admission rate; the configured --retry-after-s without one."""
        rate = self.rate(now)
        if rate is None:
            return self.retry_after_s
        return max(1, min(300, math.ceil((len(queue) + 1) / rate)))

    def _refuse(self, w: Waiter, reason: str, queue: AdmissionQueue, now: float) -> None:
        self._count_shed(w, reason)
        raise self._error(reason, queue, now)

    def _shed(self, w: Waiter, reason: str, queue: AdmissionQueue, now: float) -> None:
        self._count_shed(w, reason)
        self._observe(w, "shed", now)
        if w.future is not None and not w.future.done():
            w.future.set_exception(self._error(reason, queue, now))

    def _count_shed(self, w: Waiter, reason: str) -> None:
        self.counts["shed"] += 1
        self.shed_by_reason[reason] = self.shed_by_reason.get(reason, 0) + 1
        if self.metrics is not None:
            self.metrics.shed.labels(class_label(w.priority), reason).inc()

    def _error(self, reason: str, queue: AdmissionQueue, now: float) -> RouterError:
        why = {
            "full": "the admission queue is full",
            "displaced": "the admission queue is full and a request of higher priority came",
            "deadline": "the request could not start within its deadline",
            "predicted": "the request would not start within its deadline at the current rate",
        }[reason]
        return RouterError(
            429,
            f"every replica is saturated and {why}; retry later",
            headers={"retry-after": str(self.retry_after(queue, now))},
        )

    def _leave(self, model: str, w: Waiter, outcome: str) -> None:
        queue = self.queues.get(model)
        if queue is not None and queue.remove(w):
            self._observe(w, outcome, self.clock())
        elif w.future is not None and w.future.done() and w.future.exception() is None:
            self.started(model)  # admitted just as it left: give the slot back
            self.pump(model)

    def _observe(self, w: Waiter, outcome: str, now: float) -> None:
        if self.metrics is not None:
            self.metrics.wait.labels(class_label(w.priority), outcome).observe(now - w.arrived)

    def _depth(self, model: str) -> None:
        if self.metrics is None:
            return
        by_class: dict[str, int] = {}
        for queue in self.queues.values():
            for w in queue.waiters():
                label = class_label(w.priority)
                by_class[label] = by_class.get(label, 0) + 1
        self._labels.update(by_class)
        for label in self._labels:
            self.metrics.depth.labels(label).set(by_class.get(label, 0))

    def _ensure_ticker(self) -> None:
        if self._ticker is None or self._ticker.done():
            self._ticker = asyncio.get_running_loop().create_task(self._tick())

    async def _tick(self) -> None:
        """While anything waits: deadlines, and room that a scrape (not a request's end)
        revealed."""
        while any(len(q) for q in self.queues.values()):
            await asyncio.sleep(_TICK_S)
            self.pump()

    async def close(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ticker

    def stats(self) -> dict[str, Any]:
        """The ``admission`` part of ``GET /index/stats``."""
        now = self.clock()
        s = self.settings
        models = {}
        for model, queue in self.queues.items():
            waiters = queue.waiters()
            models[model] = {
                "queued": len(queue),
                "queued_by_priority": {str(p): n for p, n in queue.depth_by_class().items()},
                "tenants": len({w.tenant for w in waiters}),
                "oldest_wait_s": round(max((now - w.arrived for w in waiters), default=0.0), 3),
                "reserved": self.reserved.get(model, 0),
            }
        rate = self.rate(now)
        return {
            "enabled": s.enabled and bool(self.limit),
            "max_pending_per_replica": self.limit,
            "max_queued": s.max_queued,
            "max_wait_s": s.max_wait_s,
            "order": s.order,
            "aging": s.aging,
            "reserve": s.reserve,
            "admissions_per_s": None if rate is None else round(rate, 3),
            **self.counts,
            "shed_by_reason": dict(self.shed_by_reason),
            "models": models,
        }


@dataclass(frozen=True, slots=True)
class Ticket:
    """What admission knows of a request: its class, tenant, deadline and how to tell that
    its client has gone."""

    priority: int = 0
    tenant: str = ""
    max_wait_s: float | None = None
    disconnected: Callable[[], Awaitable[None]] | None = None


async def _first(future: asyncio.Future[None], disconnected: Callable[[], Awaitable[None]]) -> None:
    """Wait for ``future`` or the client's disconnect, whichever comes first."""
    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({future, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await watcher


def work_s(decision: Any, prefill_s_per_token: float) -> float:
    """What a request costs the fleet: the least uncached-prefill-plus-load seconds the
    cost model estimated over the candidates (its best replica's work, queue aside: every
    replica is saturated, the queue is the same for all); for a policy without estimates,
    the uncached tokens of the best match at the configured prefill rate."""
    work = [
        v.compute_s + v.load_s
        for v in decision.views
        if v.compute_s is not None and v.load_s is not None
    ]
    if work:
        return min(work)
    cached = max((v.predicted_cached_tokens for v in decision.views), default=0)
    return max(0, (decision.prompt_tokens or 0) - cached) * prefill_s_per_token


def _bad(message: str, param: str) -> RouterError:
    return RouterError(400, message, param=param)


def ticket_of(
    settings: AdmissionSettings,
    headers: Sequence[tuple[bytes, bytes]],
    body: dict[str, Any],
    disconnected: Callable[[], Awaitable[None]] | None = None,
) -> Ticket:
    """The request's class (header, else the body's ``priority``, else 0), tenant (header,
    else a digest of its bearer key) and max wait (header); 400 in OpenAI's schema for a
    value that is not one."""
    found = {k.lower(): v for k, v in headers}
    priority: Any = body.get("priority", 0)
    raw = found.get(settings.priority_header.encode())
    param = "priority"
    if raw is not None:
        param = settings.priority_header
        try:
            priority = int(raw.decode("latin-1").strip())
        except ValueError:
            raise _bad(f"{settings.priority_header} must be an integer", param) from None
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise _bad("priority must be an integer (lower is served first)", param)
    tenant_raw = found.get(settings.tenant_header.encode())
    if tenant_raw is not None:
        tenant = tenant_raw.decode("latin-1")[:256]
    else:
        auth = found.get(b"authorization", b"")
        tenant = hashlib.sha256(auth).hexdigest()[:16] if auth else ""
    max_wait = None
    raw_wait = found.get(settings.max_wait_header.encode())
    if raw_wait is not None:
        try:
            max_wait = float(raw_wait.decode("latin-1").strip())
        except ValueError:
            max_wait = -1.0
        if not (max_wait >= 0 and math.isfinite(max_wait)):
            raise _bad(
                f"{settings.max_wait_header} must be a number of seconds >= 0",
                settings.max_wait_header,
            )
    return Ticket(priority, tenant, max_wait, disconnected)


def disconnect_watch(
    receive: Callable[[], Awaitable[dict[str, Any]]],
) -> Callable[[], Awaitable[None]]:
    """An awaitable that returns once the ASGI client has disconnected (the body is read by
    then, so every further message is the disconnect)."""

    async def watch() -> None:
        while True:
            message = await receive()
            if message.get("type") == "http.disconnect":
                return

    return watch
