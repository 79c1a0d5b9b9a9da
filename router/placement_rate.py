"""Where new prefixes were placed lately: the homes each replica took on, per second.

Prefix affinity makes placement sticky: a chat user, a document or a shared-prefix group
placed on a replica brings its later requests there too. The queue a new prefix sees at the
moment of its first request says little about that future load: a replica that is idle for
a second may already be home to more users than any other, and placing every new prefix on
whichever replica is cheapest at that instant lets homes pile up unevenly (measured: 6 of
32 shared-prefix groups on one replica of 8, 3 on another). Nor does the traffic a replica
was sent lately tell it early on: a group's first request is all its traffic so far. So the
router counts the homes it placed on each replica, decayed with a half-life of about a
session's length, and KvroutePolicy places a new prefix on the replica with the fewest among
those its cost bound allows.

Router-local, like the hints and homes: with several routers each counts its own
placements, which rank replicas alike when the routers see alike traffic.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

__all__ = ["PlacementRate"]


class PlacementRate:
    """Per-replica events per second (here: new homes), exponentially decayed."""

    __slots__ = ("_clock", "_decay", "_state", "half_life_s")

    def __init__(self, half_life_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if half_life_s <= 0:
            raise ValueError("half_life_s must be > 0")
        self.half_life_s = half_life_s
        self._decay = math.log(2.0) / half_life_s
        self._clock = clock
        self._state: dict[str, tuple[float, float]] = {}  # name -> (decayed count, at)

    def record(self, name: str) -> None:
        now = self._clock()
        count, at = self._state.get(name, (0.0, now))
        self._state[name] = (count * math.exp(-self._decay * (now - at)) + 1.0, now)

    def rate(self, name: str) -> float:
        """Events per second: the decayed count times the decay constant (a steady stream of
        r per second converges to r)."""
        entry = self._state.get(name)
        if entry is None:
            return 0.0
        count, at = entry
        return count * math.exp(-self._decay * (self._clock() - at)) * self._decay

    def forget(self, name: str) -> None:
        self._state.pop(name, None)
