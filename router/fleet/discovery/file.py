"""Watch the replicas file and apply its changes without a restart.

Polling (stat every ``interval_s``) rather than inotify: it works on every filesystem,
including the bind mounts and ConfigMap symlink swaps of container deployments, and a second
of delay is fine for fleet changes. A file that fails to parse is reported and ignored: the
fleet keeps its last good list, so a half-saved edit never drops every replica; an empty
file (a save read between its truncation and its write) is kept out the same way, and
``replicas: []`` is how every replica is removed.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

from kvroute.router.common.periodic import PeriodicTask
from kvroute.router.config import ConfigError, ReplicaConfig
from kvroute.router.specs import load_replicas_file, parse_replicas_text, read_replicas_file

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
        self._periodic = PeriodicTask("kvroute-replicas-file", interval_s, self._poll_round)

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
            # Read once: the emptiness checked is the text parsed.
            text = read_replicas_file(self.path)
            if not text.strip():
                # An editor's save truncates the file before writing it: read in between,
                # the file is empty, which would remove every replica. `replicas: []` says so.
                raise ConfigError(
                    f"replicas file {self.path} is empty "
                    "(write 'replicas: []' to remove every replica)"
                )
            replicas = parse_replicas_text(text, self.path)
        except ConfigError as exc:
            self.last_error = f"{exc}; keeping the last list"
            log.error("replicas file: %s", self.last_error)
            return False
        self.apply(replicas)
        self.loads += 1
        self.last_error = None
        return True

    async def _poll_round(self) -> None:
        self.poll()

    def start(self) -> None:
        self._periodic.start()

    async def stop(self) -> None:
        await self._periodic.stop()

    def status(self) -> dict[str, object]:
        return {"path": str(self.path), "loads": self.loads, "last_error": self.last_error}
