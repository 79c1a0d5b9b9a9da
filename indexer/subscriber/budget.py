"""How many bytes of events one publisher may make the indexer decode per second.

A replica's event stream costs the indexer in proportion to its bytes (msgpack decoding and
index updates scale with the block hashes and token ids a batch carries). A real vLLM
replica sends well under 1 MiB/s even at full prefill speed on a fast GPU (one 64-bit hash
and ``block_size`` token ids per block, a few thousand blocks a second); a publisher far past
that is broken or hostile, and left alone it would take the index's lock and the process's
CPU from every other replica's feed. A token bucket per stream lets bursts through (a
replay, a long prefill) and drops the rest unread, before any decoding.
"""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["ByteBudget"]


class ByteBudget:
    """A token bucket in bytes: ``rate`` per second, holding at most ``burst``.

    ``take`` is for messages that may be refused (live events); ``charge`` for those that
    were already asked for and must be taken whole (a replay), which may leave the bucket in
    debt so that the live messages after it wait until it is paid.
    """

    def __init__(
        self, rate: float, burst: float, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if rate <= 0 or burst <= 0:
            raise ValueError("rate and burst must be positive")
        self.rate = float(rate)
        self.burst = float(burst)
        self._clock = clock
        self._level = self.burst
        self._at = clock()

    def _refill(self) -> None:
        now = self._clock()
        self._level = min(self.burst, self._level + (now - self._at) * self.rate)
        self._at = now

    def take(self, size: int) -> bool:
        """Spend ``size`` bytes if the bucket holds them; False (nothing spent) if not."""
        self._refill()
        if size > self._level:
            return False
        self._level -= size
        return True

    def charge(self, size: int, *, floor: float | None = None) -> None:
        """Spend ``size`` bytes unconditionally: the level may go below zero, down to
        ``floor`` when one is given."""
        self._refill()
        self._level -= size
        if floor is not None and self._level < floor:
            self._level = floor

    @property
    def level(self) -> float:
        self._refill()
        return self._level
