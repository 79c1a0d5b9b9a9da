"""Burst hints: what the router just sent where, until the replica's own events say so.

A burst of siblings (same long prefix, arriving within milliseconds) would otherwise be
scattered: the first one's blocks reach the index only after that replica prefilled them and
published the events, so every sibling before that sees no match anywhere and is routed by
load. When a request is sent to replica R the router records the request's block keys as
"about to be cached on R" for ``ttl_s`` seconds; lookups take max(index match, hint match).
Hints are router-local, cost nothing on the wire, and expire on their own, so a wrong one
(the request failed, the replica evicted) misleads for a few seconds at most.

Layout: one flat dict ``(block key, replica) -> expiry`` plus a FIFO of insertions for
expiry and the size cap. Flat, because its entries hold no containers, so the garbage
collector has one object to look at instead of one per block.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence

__all__ = ["BurstHints"]


class BurstHints:
    def __init__(self, ttl_s: float = 5.0, max_keys: int = 500_000) -> None:
        self.ttl_s = ttl_s
        self.max_keys = max_keys
        self._expiry: dict[tuple[int, str], float] = {}
        self._order: deque[tuple[float, int, str]] = deque()

    def __len__(self) -> int:
        return len(self._expiry)

    def _expire(self, now: float) -> None:
        order, expiry = self._order, self._expiry
        while order and (order[0][0] <= now or len(expiry) > self.max_keys):
            when, key, replica = order.popleft()
            if expiry.get((key, replica)) == when:
                del expiry[(key, replica)]

    def record(self, replica: str, keys: Sequence[int], now: float | None = None) -> None:
        if self.ttl_s <= 0 or not keys:
            return
        now = time.monotonic() if now is None else now
        when = now + self.ttl_s
        expiry, order = self._expiry, self._order
        for key in keys:
            expiry[(key, replica)] = when
            order.append((when, key, replica))
        self._expire(now)

    def match(
        self, replicas: Sequence[str], keys: Sequence[int], now: float | None = None
    ) -> dict[str, int]:
        """Per replica, how many leading blocks of ``keys`` it holds a live hint for."""
        out = dict.fromkeys(replicas, 0)
        if not self._expiry:
            return out
        now = time.monotonic() if now is None else now
        get = self._expiry.get
        for name in replicas:
            n = 0
            for key in keys:
                if get((key, name), 0.0) <= now:
                    break
                n += 1
            out[name] = n
        return out

    def forget(self, replica: str) -> None:
        """Drop a removed replica's hints."""
        for pair in [p for p in self._expiry if p[1] == replica]:
            del self._expiry[pair]
