"""A background asyncio task that runs one step every ``interval_s`` until stopped.

Shared by the health checker and the replicas-file watcher: a failing step is logged and the
loop goes on, because one bad round must not stop health checking or file watching for good.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

__all__ = ["PeriodicTask"]

log = logging.getLogger(__name__)


class PeriodicTask:
    def __init__(self, name: str, interval_s: float, step: Callable[[], Awaitable[object]]) -> None:
        self.name = name
        self.interval_s = interval_s
        self._step = step
        self._task: asyncio.Task[None] | None = None

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self._step()
            except Exception:
                log.exception("%s: round failed", self.name)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name=self.name)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
