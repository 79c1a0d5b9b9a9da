"""``PrefillBacklog``: the prefill work this router sent each replica and has not seen done.

The P/D decider (router/routing/disagg.py) compares two waits that a count of pending
requests cannot tell apart. vLLM 0.32's scheduler (``Scheduler.schedule``,
vllm/v1/core/sched/scheduler.py) gives each step's token budget to the RUNNING requests
first, a decode taking one token, then admits WAITING requests with what is left: a new
prompt on a decode replica starts at once beside its running decodes (it stalls them, it
does not wait for them), and waits only for the prefills ahead of it. A prefill replica's
requests are all prefills: a new one waits for the work of those ahead, which is seconds
for long prompts and milliseconds for short ones. So the wait is the prefill *work* ahead,
not ``seconds per request x pending``; and a prefill leg answers once, not as a stream, so
the queue model (router/routing/queue_model.py) never learns a prefill replica's queue.

The router knows the work it sends: each committed request's prefill and load estimate
(``add``). A replica prefills in order (FCFS: vLLM's running requests keep the budget
first), so the backlog drains like one server's: ``busy_until`` moves on by each request's
work, and a request's first byte (or its prefill leg's answer, or an unstreamed answer:
``done``) says everything committed before it is done too and re-bases the rest on now. A
request never reported done is dropped ``stale_after_s`` after its predicted end. What it
does not see: other routers' requests (their counts are in the replica's gauges, priced by
the caller).

A prefill replica may also serve whole requests (the decider's ``whole_on_prefill``): each
decodes there after its prefill, and every prefill sent there later stalls it. ``serving``
and ``ended`` bracket such a request; ``decoding`` counts those past their prefill (reported
done, or their predicted end passed: an unstreamed answer reports no first byte).
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

__all__ = ["PrefillBacklog"]


@dataclass(slots=True)
class _Entry:
    work_s: float
    ends_at: float  # its predicted end when it was added


@dataclass(slots=True)
class _Replica:
    busy_until: float = 0.0
    entries: OrderedDict[Hashable, _Entry] = field(default_factory=OrderedDict)
    incoming: dict[Hashable, float] = field(default_factory=dict)  # decode legs: when due
    whole: dict[Hashable, float] = field(default_factory=dict)  # whole requests: prefill end
    # No entry can be stale before this (a lower bound: removals only raise the true one), so
    # the scan for stale entries runs only when one may be.
    prune_at: float = math.inf


class PrefillBacklog:
    """Per replica: prefills in flight (in the order sent) and when their work should end."""

    def __init__(
        self, *, stale_after_s: float = 10.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.stale_after_s = stale_after_s
        self._clock = clock
        self._by_replica: dict[str, _Replica] = {}

    def add(self, replica: str, key: Hashable, work_s: float) -> None:
        """``key`` (a request's decision) was sent to ``replica`` with ``work_s`` of prefill
        and loads; no work (a decode leg whose prompt is pulled beside the engine) is no
        prefill ahead of anyone."""
        if work_s <= 0.0:
            return
        now = self._clock()
        r = self._by_replica.setdefault(replica, _Replica())
        self._prune(r, now)
        r.busy_until = max(now, r.busy_until) + work_s
        r.entries.pop(key, None)
        r.entries[key] = _Entry(work_s, r.busy_until)
        r.prune_at = min(r.prune_at, r.busy_until + self.stale_after_s)

    def done(self, replica: str, key: Hashable) -> None:
        """``key``'s prefill ended on ``replica`` (first byte, or the prefill leg's answer):
        it and everything sent there before it are done; what is left starts now."""
        r = self._by_replica.get(replica)
        if r is None or key not in r.entries:
            return
        while r.entries:
            first, _ = r.entries.popitem(last=False)
            if first == key:
                break
        now = self._clock()
        r.busy_until = now + sum(e.work_s for e in r.entries.values())

    def drop(self, replica: str, key: Hashable) -> None:
        """``key`` failed without an answer: its work is not known to be done, nor anything
        before it; only it stops counting (its predicted work stays in ``busy_until``)."""
        r = self._by_replica.get(replica)
        if r is not None:
            r.entries.pop(key, None)

    def expect(self, replica: str, key: Hashable, in_s: float) -> None:
        """A split request's decode leg will come to ``replica`` in about ``in_s`` (when its
        prefill leg answers): a prompt computed there meanwhile may delay its first token."""
        r = self._by_replica.setdefault(replica, _Replica())
        r.incoming[key] = self._clock() + max(0.0, in_s)

    def arrived(self, replica: str, key: Hashable) -> None:
        """The decode leg was sent (it now counts in the replica's pending), or given up."""
        r = self._by_replica.get(replica)
        if r is not None:
            r.incoming.pop(key, None)

    def incoming(self, replica: str) -> list[float]:
        """Seconds until each decode leg on its way to ``replica`` lands (0: due now)."""
        r = self._by_replica.get(replica)
        if r is None:
            return []
        now = self._clock()
        for key in [k for k, at in r.incoming.items() if at + self.stale_after_s * 6 < now]:
            del r.incoming[key]  # a leg never reported (its request ended unseen)
        return [max(0.0, at - now) for at in r.incoming.values()]

    def serving(self, replica: str, key: Hashable) -> None:
        """``key``, committed to ``replica`` (``add``), is served whole there: once its
        prefill is done it decodes there until ``ended``."""
        r = self._by_replica.setdefault(replica, _Replica())
        entry = r.entries.get(key)
        r.whole[key] = self._clock() if entry is None else entry.ends_at

    def ended(self, replica: str, key: Hashable) -> None:
        """The whole request ``key`` on ``replica`` ended (answered, failed or cancelled)."""
        r = self._by_replica.get(replica)
        if r is not None:
            r.whole.pop(key, None)

    def decoding(self, replica: str) -> int:
        """Whole requests decoding on ``replica``: served there, past their prefill."""
        r = self._by_replica.get(replica)
        if r is None or not r.whole:
            return 0
        now = self._clock()
        return sum(1 for k, end in r.whole.items() if k not in r.entries or end <= now)

    def wait_s(self, replica: str) -> float:
        """Seconds before a prefill sent now would start on ``replica``."""
        r = self._by_replica.get(replica)
        if r is None:
            return 0.0
        now = self._clock()
        self._prune(r, now)
        return max(0.0, r.busy_until - now)

    def count(self, replica: str) -> int:
        """Requests sent to ``replica`` whose prefill is not known to be done."""
        r = self._by_replica.get(replica)
        if r is None:
            return 0
        self._prune(r, self._clock())
        return len(r.entries)

    def forget(self, replica: str) -> None:
        self._by_replica.pop(replica, None)

    def _prune(self, r: _Replica, now: float) -> None:
        """Drop requests never reported done (failed, or cancelled before an answer) long
        after their predicted end: they hold no work and must not count as prefills forever."""
        if now <= r.prune_at:
            return
        stale = [k for k, e in r.entries.items() if e.ends_at + self.stale_after_s < now]
        for k in stale:
            del r.entries[k]
        r.prune_at = min((e.ends_at for e in r.entries.values()), default=math.inf)
        r.prune_at += self.stale_after_s
