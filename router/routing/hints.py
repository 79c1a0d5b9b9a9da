"""Burst hints: what the router just sent where, until the replica's own events say so.

A burst of siblings (same long prefix, arriving within milliseconds) would otherwise be
scattered: the first one's blocks reach the index only after that replica prefilled them and
published the events, so every sibling before that sees no match anywhere and is routed by
load. When a request is sent to replica R the router records the request's block keys as
"about to be cached on R" for ``ttl_s`` seconds; lookups take max(index match, hint match).
Hints are router-local, cost nothing on the wire, and expire on their own, so a wrong one
(the request failed, the replica evicted) misleads for a few seconds at most.

Layout: per replica, a dict of block key -> expiry, and one FIFO of insertions (for expiry
and the size cap) in three typed arrays, consumed from a head index. None of them holds a
container, so the garbage collector tracks none of them: a full collection does not walk
the hints (at the default cap, 500,000 hints in a dict of tuples and a deque cost 6.5 ms per
full collection).
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Sequence

__all__ = ["BurstHints"]

# Consumed FIFO entries are dropped from the arrays' front once this many have gathered
_COMPACT = 4096


class BurstHints:
    def __init__(self, ttl_s: float = 5.0, max_keys: int = 500_000) -> None:
        self.ttl_s = ttl_s
        self.max_keys = max_keys
        self._expiry: dict[str, dict[int, float]] = {}
        self._count = 0  # hints in ``_expiry``
        # The FIFO: when each hint was set to expire, its key, its replica's number
        self._when = array("d")
        self._keys = array("Q")
        self._who = array("L")
        self._head = 0
        self._names: list[str] = []
        self._number: dict[str, int] = {}

    def __len__(self) -> int:
        return self._count

    def _expire(self, now: float) -> None:
        when, keys, who, names = self._when, self._keys, self._who, self._names
        head, end = self._head, len(when)
        while head < end and (when[head] <= now or self._count > self.max_keys):
            held = self._expiry.get(names[who[head]])
            key = keys[head]
            if held is not None and held.get(key) == when[head]:
                del held[key]
                self._count -= 1
            head += 1
        if head == end or (head >= _COMPACT and 2 * head >= end):  # amortized: O(1) a hint
            del when[:head], keys[:head], who[:head]
            head = 0
        self._head = head

    def record(self, replica: str, keys: Sequence[int], now: float | None = None) -> None:
        if self.ttl_s <= 0 or not keys:
            return
        fifo_keys = array("Q", keys)  # block keys are 64-bit hashes (indexer/keys.py)
        now = time.monotonic() if now is None else now
        when = now + self.ttl_s
        number = self._number.get(replica)
        if number is None:
            number = self._number[replica] = len(self._names)
            self._names.append(replica)
        held = self._expiry.setdefault(replica, {})
        before = len(held)
        for key in keys:
            held[key] = when
        self._count += len(held) - before
        self._when.extend([when] * len(keys))
        self._keys.extend(fifo_keys)
        self._who.extend([number] * len(keys))
        self._expire(now)

    def match(
        self, replicas: Sequence[str], keys: Sequence[int], now: float | None = None
    ) -> dict[str, int]:
        """Per replica, how many leading blocks of ``keys`` it holds a live hint for."""
        out = dict.fromkeys(replicas, 0)
        if not self._count:
            return out
        now = time.monotonic() if now is None else now
        for name in replicas:
            held = self._expiry.get(name)
            if not held:
                continue
            get = held.get
            n = 0
            for key in keys:
                if get(key, 0.0) <= now:
                    break
                n += 1
            out[name] = n
        return out

    def forget(self, replica: str) -> None:
        """Drop a removed replica's hints (its entries in the FIFO are skipped as they come)."""
        held = self._expiry.pop(replica, None)
        if held is not None:
            self._count -= len(held)
