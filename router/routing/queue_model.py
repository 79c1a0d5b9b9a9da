"""What one request ahead in a replica's queue costs a new request, learned from the replica.

The cost model's queue term is ``seconds per pending request x pending``. A fixed constant
cannot be right for every fleet: behind a request that decodes 32 tokens in a replica whose
KV cache holds two running prompts, a new request waits most of a second; behind short
chat turns on a large GPU it waits milliseconds. A constant that is too small makes a
shared system prompt attract every new user to the replica that cached it first, and a
returning user stay on a replica whose queue has grown longer than recomputing their whole
history elsewhere would take (measured in docs/benchmarks.md).

So the router learns it from what it sees: for each streamed response it knows the queue it
sent the request into (``pending``), the prefill and load time its cost model predicted,
and when the first byte came back. The time not explained by prefill and loads, divided by
the requests that were ahead, is one sample of the per-request delay; an exponentially
weighted average per replica follows changes in load. Without fresh samples an estimate
relaxes back to the configured prior (half-life ``half_life_s``), so a replica that was
congested once is not shunned forever. Requests sent into an empty queue carry no
information about queueing and are not samples.

Several routers learn together: behind a load balancer each router sees the first bytes of
its share of the traffic only, so on its own it would learn from 1/N of the samples, N times
slower, and each router would price the same queue differently. So every sample a router
takes is also kept in a short numbered log, and its peers fetch what they have not seen with
the shared load (router/peers/load.py) and apply it as their own (``observe_shared``): every
router's estimate follows every first byte in the fleet, as one router's would. Shared
samples are not logged again (no echo between peers). The same numbered log carries this
router's samples of each replica's prefill and load rates (router/routing/calibration.py,
``log_rates``), so that peers learn those from every answer in the fleet too.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["SAMPLE_LOG_MAX", "LearnedQueueDelay"]

# Samples a router keeps for its peers: at the ~100 first bytes per second of a busy router,
# 10 s of them, far more than a follower (asking every 10 ms) or a poller lags behind.
SAMPLE_LOG_MAX = 1024
# (replica, queue sample or None, a rate sample, a home's affinity, or None)
LogEntry = tuple[str, float | None, tuple[float, ...] | bytes | None]


@dataclass(slots=True)
class _Estimate:
    value: float
    at: float
    samples: int = 0


class LearnedQueueDelay:
    """Per-replica seconds per pending request: prior, learned average, decay to the prior."""

    def __init__(
        self,
        prior_s: float,
        *,
        weight: float = 0.1,
        half_life_s: float = 30.0,
        max_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if prior_s < 0 or max_s < prior_s:
            raise ValueError("need 0 <= prior_s <= max_s")
        if not 0.0 < weight <= 1.0:
            raise ValueError("weight must be in (0, 1]")
        if half_life_s <= 0:
            raise ValueError("half_life_s must be > 0")
        self.prior_s = prior_s
        self.weight = weight
        self.half_life_s = half_life_s
        self.max_s = max_s
        self._clock = clock
        self._by_replica: dict[str, _Estimate] = {}
        # This router's own samples, numbered from 0; the log keeps the last of them.
        # (replica, queue sample or None, a rate sample (floats), a new home's affinity
        # (bytes: router/routing/router.py's homes) or None)
        self._log: deque[LogEntry] = deque(maxlen=SAMPLE_LOG_MAX)
        self._log_next = 0
        self.shared_applied = 0  # samples taken from peers
        # Called after each own sample (the service wakes held peer-load requests there).
        self.on_sample: Callable[[], None] | None = None

    def _relaxed(self, est: _Estimate, now: float) -> float:
        keep = math.exp(-math.log(2.0) * max(0.0, now - est.at) / self.half_life_s)
        return self.prior_s + (est.value - self.prior_s) * keep

    def per_request_s(self, replica: str) -> float:
        est = self._by_replica.get(replica)
        return self.prior_s if est is None else self._relaxed(est, self._clock())

    def observe(
        self, replica: str, pending: float, explained_s: float, first_byte_s: float
    ) -> None:
        """One streamed response: sent into ``pending`` requests, ``explained_s`` of its
        time to first byte predicted for prefill and loads, first byte after
        ``first_byte_s``."""
        if pending < 1.0 or not math.isfinite(first_byte_s) or first_byte_s < 0:
            return
        sample = min(self.max_s, max(0.0, first_byte_s - max(0.0, explained_s)) / pending)
        self._apply(replica, sample)
        self._append((replica, sample, None))

    def log_rates(self, replica: str, values: tuple[float, ...]) -> None:
        """A sample of the replica's prefill and load rates, numbered with the queue samples
        for the peers (``entries_since``); learned by the caller."""
        self._append((replica, None, values))

    def log_home(self, replica: str, affinity: bytes) -> None:
        """A prefix's new home (the replica its first request went to), numbered with the
        samples for the peers, so that every router sends a conversation to one home."""
        self._append((replica, None, affinity))

    def _append(self, entry: LogEntry) -> None:
        self._log.append(entry)
        self._log_next += 1
        if self.on_sample is not None:
            self.on_sample()

    def observe_shared(self, replica: str, sample_s: float) -> None:
        """A sample a peer router took (its ``samples_since``): applied like an own one,
        never passed on."""
        if not math.isfinite(sample_s):
            return
        self._apply(replica, min(self.max_s, max(0.0, sample_s)))
        self.shared_applied += 1

    @property
    def next_sample(self) -> int:
        """The number the next own sample will get (the count taken so far)."""
        return self._log_next

    def samples_since(self, first: int) -> list[tuple[str, float]]:
        """Own queue samples numbered ``first`` and later, oldest first (``entries_since``
        without the rate samples)."""
        return [(n, q) for n, q, _ in self.entries_since(first) if q is not None]

    def entries_since(self, first: int) -> list[LogEntry]:
        """Own samples of both kinds numbered ``first`` and later, oldest first; those already
        dropped from the log are skipped (a peer that far behind catches up on the rest)."""
        start = self._log_next - len(self._log)
        if first >= self._log_next:
            return []
        skip = max(0, first - start)
        return list(itertools.islice(self._log, skip, None))

    def _apply(self, replica: str, sample: float) -> None:
        now = self._clock()
        est = self._by_replica.get(replica)
        if est is None:
            est = self._by_replica[replica] = _Estimate(self.prior_s, now)
        current = self._relaxed(est, now)
        est.value = current + self.weight * (sample - current)
        est.at = now
        est.samples += 1

    def forget(self, replica: str) -> None:
        self._by_replica.pop(replica, None)

    def to_dict(self) -> dict[str, dict[str, float | int]]:
        now = self._clock()
        return {
            name: {"queue_s_per_request": round(self._relaxed(e, now), 6), "samples": e.samples}
            for name, e in self._by_replica.items()
        }
