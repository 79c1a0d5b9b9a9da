"""How late an asyncio loop runs its timers: the benchmark's check on its own machine.

The simulator's clock is the loop's clock, and the load generator stamps send and first-byte
times on its loop: when two cores also carry several routers, timers fire late and every
latency grows for reasons no routing policy controls. The routing benchmark reports each run's
lag next to its figures, so a reader can tell a policy's result from a starved machine's.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any

from kvroute.router.common.periodic import PeriodicTask

__all__ = ["LoopLagMonitor"]


class LoopLagMonitor:
    """Sleeps ``interval_s`` again and again on the running loop and records the overshoot
    (wall seconds); keeps the last ``max_samples``."""

    def __init__(self, interval_s: float = 0.01, max_samples: int = 200_000) -> None:
        if interval_s <= 0:
            raise ValueError("interval_s must be positive")
        self.interval_s = interval_s
        self._samples: deque[float] = deque(maxlen=max_samples)
        self._task = PeriodicTask("loop-lag", interval_s, self._tick)
        self._last: float | None = None  # loop time of the previous tick

    def start(self) -> None:
        self._last = asyncio.get_running_loop().time()
        self._task.start()

    async def stop(self) -> None:
        await self._task.stop()

    def reset(self) -> None:
        self._samples.clear()

    def record(self, lag_s: float) -> None:
        self._samples.append(max(0.0, lag_s))

    def snapshot(self) -> dict[str, Any]:
        """Percentiles of the lag in milliseconds since the last reset (zeros with no sample)."""
        xs = sorted(self._samples)
        if not xs:
            return {"samples": 0, "p50_ms": 0.0, "p99_ms": 0.0, "max_ms": 0.0}

        def pct(q: float) -> float:
            return round(xs[min(len(xs) - 1, int(q * len(xs)))] * 1000, 3)

        return {"samples": len(xs), "p50_ms": pct(0.5), "p99_ms": pct(0.99), "max_ms": pct(1.0)}

    async def _tick(self) -> None:
        """Runs right after each ``interval_s`` sleep: how much longer than that it took."""
        now = asyncio.get_running_loop().time()
        if self._last is not None:
            self.record(now - self._last - self.interval_s)
        self._last = now
