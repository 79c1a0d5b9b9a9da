"""The admission queue's order and bound, without asyncio or a clock (times are arguments),
so its rules are tested directly; router/serving/admission.py says why they are what they are
and runs it (the waiting, the pump, the shedding)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

__all__ = ["ORDERS", "AdmissionQueue", "AdmissionSettings", "Shed", "Waiter"]

ORDERS = ("cost", "priority", "fifo")


# Priority values outside this range share one metric label (bounded label sets).
@dataclass(frozen=True, slots=True)
class AdmissionSettings:
    """``kvroute serve --admission*`` (docs/router.md, "Admission")."""

    # Queue when every replica is at --max-pending-per-replica; off: refuse at once (503).
    enabled: bool = True
    max_queued: int = 1024  # per model; past it the worst-placed request is shed (429)
    # The longest a request waits here; a client's max-wait header may ask for less.
    max_wait_s: float = 30.0
    order: str = "cost"
    aging: float = 1.0  # cost seconds forgiven per second waited
    # Slots of each replica's pending bound only urgent requests (priority < 0) may take.
    reserve: int = 0
    priority_header: str = "x-kvroute-priority"
    tenant_header: str = "x-kvroute-tenant"
    max_wait_header: str = "x-kvroute-max-wait-s"

    def __post_init__(self) -> None:
        if self.max_queued < 0:
            raise ValueError("admission max_queued must be >= 0")
        if not self.max_wait_s > 0:
            raise ValueError("admission max_wait_s must be > 0")
        if self.order not in ORDERS:
            raise ValueError(f"admission order must be one of {', '.join(ORDERS)}")
        if self.aging < 0:
            raise ValueError("admission aging must be >= 0")
        if self.reserve < 0:
            raise ValueError("admission reserve must be >= 0")


class Shed(Exception):
    """A queued request that cannot start in time: its reason (``full``, ``deadline``,
    ``predicted``, ``displaced``)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(slots=True, eq=False)
class Waiter:
    """One queued request."""

    priority: int
    tenant: str
    cost_s: float
    arrived: float
    deadline: float  # the monotonic time by which it must have started
    seq: int = 0
    future: asyncio.Future[None] | None = field(default=None, repr=False)


class AdmissionQueue:
    """One model's waiting requests: priority class, then tenants in turn, then cost less
    aging (``order="cost"``); bounded by ``max_queued``."""

    def __init__(self, max_queued: int, order: str = "cost", aging: float = 1.0) -> None:
        self.max_queued = max_queued
        self.order = order
        self.aging = aging
        # class -> tenant -> its waiters (arrival order)
        self._classes: dict[int, dict[str, list[Waiter]]] = {}
        # class -> tenant -> requests admitted while it had some queued (round-robin)
        self._served: dict[int, dict[str, int]] = {}
        self._seq = 0
        self.size = 0

    def __len__(self) -> int:
        return self.size

    def waiters(self) -> list[Waiter]:
        return [w for tenants in self._classes.values() for ws in tenants.values() for w in ws]

    def depth_by_class(self) -> dict[int, int]:
        return {p: sum(len(ws) for ws in t.values()) for p, t in self._classes.items()}

    def _key_class(self, w: Waiter) -> int:
        return 0 if self.order == "fifo" else w.priority

    def score(self, w: Waiter, now: float) -> tuple[float, int]:
        """Lower goes first within a tenant of a class."""
        if self.order != "cost":
            return (0.0, w.seq)
        return (w.cost_s - self.aging * (now - w.arrived), w.seq)

    def _rank(self, w: Waiter, now: float) -> tuple[int, float, int]:
        """A total order for choosing whom to displace when full (fairness aside)."""
        return (self._key_class(w), *self.score(w, now))

    def number(self, w: Waiter) -> None:
        """Give ``w`` its arrival number (ties go to the earlier), once."""
        if not w.seq:
            self._seq += 1
            w.seq = self._seq

    def push(self, w: Waiter, now: float) -> Waiter | None:
        """Queue ``w``; when full, the worst-placed waiter (``w`` itself when nothing ranks
        below it) is returned shed. Raises ``Shed("full")`` for ``w``."""
        self.number(w)
        displaced = None
        if self.size >= self.max_queued:
            worst = max(self.waiters(), key=lambda x: self._rank(x, now), default=None)
            if worst is None or self._rank(worst, now) <= self._rank(w, now):
                raise Shed("full")
            self.remove(worst)
            displaced = worst
        cls = self._key_class(w)
        tenants = self._classes.setdefault(cls, {})
        served = self._served.setdefault(cls, {})
        if w.tenant not in tenants:
            # Level with the tenants already waiting: no credit banked while away.
            served[w.tenant] = min(served.values(), default=0)
            tenants[w.tenant] = []
        tenants[w.tenant].append(w)
        self.size += 1
        return displaced

    def remove(self, w: Waiter) -> bool:
        cls = self._key_class(w)
        tenants = self._classes.get(cls)
        queue = None if tenants is None else tenants.get(w.tenant)
        if not queue or w not in queue:
            return False
        queue.remove(w)
        self.size -= 1
        if not queue:
            del tenants[w.tenant]  # type: ignore[union-attr]
            del self._served[cls][w.tenant]
            if not tenants:
                del self._classes[cls]
                del self._served[cls]
        return True

    def peek(self, now: float) -> Waiter | None:
        """Who ``pop`` would admit now."""
        if not self._classes:
            return None
        cls = min(self._classes)
        tenants = self._classes[cls]
        served = self._served[cls]
        tenant = min(tenants, key=lambda t: (served[t], min(w.seq for w in tenants[t])))
        return min(tenants[tenant], key=lambda w: self.score(w, now))

    def pop(self, now: float) -> Waiter | None:
        w = self.peek(now)
        if w is None:
            return None
        self._served[self._key_class(w)][w.tenant] += 1
        self.remove(w)
        return w

    def expired(self, now: float) -> list[Waiter]:
        """Remove and return the waiters whose deadline has passed."""
        late = [w for w in self.waiters() if w.deadline <= now]
        for w in late:
            self.remove(w)
        return late

    def ahead_of(self, w: Waiter, now: float) -> int:
        """About how many waiters go before ``w``: every one of a better class, and those of
        its class that rank above it (tenants aside)."""
        cls = self._key_class(w)
        mine = self.score(w, now)
        n = 0
        for c, tenants in self._classes.items():
            for ws in tenants.values():
                if c < cls:
                    n += len(ws)
                elif c == cls:
                    n += sum(1 for x in ws if x is not w and self.score(x, now) < mine)
        return n
