"""How late an asyncio loop runs its timers: the benchmark's check on its own machine.

The simulator's clock is the loop's clock, and the load generator stamps send and first-byte
times on its loop: when two cores also carry several routers, timers fire late and every
latency grows for reasons no routing policy controls. The routing benchmark reports each run's
lag next to its figures, so a reader can tell a policy's result from a starved machine's.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from typing import Any

__all__ = ["LoopLagMonitor"]


class LoopLagMonitor:
    """Sleeps ``interval_s`` again and again on the running loop and records the overshoot
    (wall seconds); keeps the last ``max_samples``."""

    def __init__(self, interval_s: float = 0.01, max_samples: int = 200_000) -> None:
        if interval_s <= 0:
            raise ValueError("interval_s must be positive")
        self.interval_s = interval_s
        self._samples: deque[float] = deque(maxlen=max_samples)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

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

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            before = loop.time()
            await asyncio.sleep(self.interval_s)
            self.record(loop.time() - before - self.interval_s)
