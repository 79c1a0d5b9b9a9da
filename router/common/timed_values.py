"""``TimedValues``: a count's recent changes, to read it as of a past moment.

A metrics page is a snapshot of one moment between the scrape's question and its answer;
what a router itself contributed to it (the device blocks its requests held, and its peers'
as last heard: router/routing/kv_room.py, router/fleet/replicas.py) has to be read as of that
window, not as of now. Changes older than ``horizon_s`` are dropped, but for the newest of
them (the value before the first kept change).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

__all__ = ["TimedValues"]


class TimedValues:
    """(time, value) after each change, oldest first, for ``horizon_s`` seconds."""

    __slots__ = ("_changes", "horizon_s")

    def __init__(self, horizon_s: float) -> None:
        self.horizon_s = horizon_s
        self._changes: deque[tuple[float, int]] = deque()

    def add(self, now: float, value: int) -> None:
        changes = self._changes
        changes.append((now, value))
        while len(changes) > 1 and changes[1][0] <= now - self.horizon_s:
            changes.popleft()

    def at(self, moment: float, until: float | None = None) -> int:
        """The value at ``moment`` (0 before the first change); with ``until``, the most it
        was from ``moment`` to ``until``."""
        most = 0
        for at, value in reversed(self._changes):
            if until is not None and moment < at <= until:
                most = max(most, value)
            elif at <= moment:
                return max(most, value)
        return most

    def __iter__(self) -> Iterator[tuple[float, int]]:
        return iter(self._changes)

    def __len__(self) -> int:
        return len(self._changes)
