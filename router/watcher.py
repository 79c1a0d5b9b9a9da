"""Watch the replicas file and apply its changes without a restart.

Polling (stat every ``interval_s``) rather than inotify: it works on every filesystem,
including the bind mounts and ConfigMap symlink swaps of container deployments, and a second
of delay is fine for fleet changes. A file that fails to parse is reported and ignored: the
fleet keeps its last good list, so a half-saved edit never drops every replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable
from pathlib import Path

from router.config import ConfigError, ReplicaConfig, load_replicas_file

__all__ = ["ReplicasFileWatcher"]

log = logging.getLogger(__name__)


class ReplicasFileWatcher:
    def __init__(
        self,
        path: str | Path,
        apply: Callable[[list[ReplicaConfig]], None],
        *,
        interval_s: float = 1.0,
    ) -> None:
        self.path = Path(path)
        self.apply = apply
        self.interval_s = interval_s
        self.last_error: str | None = None
        self.loads = 0
        self._stamp: tuple[int, int, int] | None = None
        self._task: asyncio.Task[None] | None = None

    def _stat(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)  # follows symlinks: a swapped target is a change
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def load_now(self) -> list[ReplicaConfig]:
        """Read and apply the file; raises ConfigError (used at startup, where it must)."""
        self._stamp = self._stat()
        replicas = load_replicas_file(self.path)
        self.apply(replicas)
        self.loads += 1
        self.last_error = None
        return replicas

    def poll(self) -> bool:
        """Apply the file if it changed since the last look; True when it was applied."""
        stamp = self._stat()
        if stamp == self._stamp:
            return False
        self._stamp = stamp
        if stamp is None:
            self.last_error = f"replicas file {self.path} is missing; keeping the last list"
            log.error(self.last_error)
            return False
        try:
            replicas = load_replicas_file(self.path)
        except ConfigError as exc:
            self.last_error = f"{exc}; keeping the last list"
            log.error("replicas file: %s", self.last_error)
            return False
        self.apply(replicas)
        self.loads += 1
        self.last_error = None
        return True

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                self.poll()
            except Exception:
                log.exception("replicas file watcher failed")

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="kvroute-replicas-file")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def status(self) -> dict[str, object]:
        return {"path": str(self.path), "loads": self.loads, "last_error": self.last_error}
