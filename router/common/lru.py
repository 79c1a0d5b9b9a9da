"""A small bounded LRU map (the tokenization caches and the routing-history tables)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

__all__ = ["LRU", "frozen_ids", "token_list_bytes"]

K = TypeVar("K")
V = TypeVar("V")


def token_list_bytes(ids: Sequence[int]) -> int:
    """What a list (or tuple) of token ids holds in CPython: a pointer each, and an int object
    for every id past the 256 small ints the interpreter shares (most of a vocabulary)."""
    return 56 + 36 * len(ids)


def frozen_ids(ids: Sequence[int]) -> tuple[int, ...]:
    """Token ids as a cache should keep them: a tuple. A list is a container the garbage
    collector tracks for as long as it lives, and a full collection visits each of its items
    (about 8 ns each: a router's token caches, up to a few million ids, stall the event loop
    for tens of ms at every full collection); a tuple of ints is untracked by the first
    collection that sees it, and is never visited again. Callers get lists of their own."""
    return tuple(ids)


class LRU(Generic[K, V]):
    """Thread-safe (long prompts are tokenized in worker threads while the loop serves short
    ones from the same caches); each operation holds the lock only for a dict operation.

    Bounded by entries and, with ``weigh``, by total weight (approximate bytes): a count
    alone does not bound memory when one entry may be a 100-token chat turn or a 100k-token
    document. An entry heavier than a quarter of ``max_weight`` is not kept at all.
    """

    __slots__ = ("_data", "_lock", "_weigh", "hits", "max_weight", "maxsize", "misses", "weight")

    def __init__(
        self,
        maxsize: int,
        *,
        max_weight: int | None = None,
        weigh: Callable[[K, V], int] | None = None,
    ) -> None:
        if maxsize <= 0:
            raise ValueError("maxsize must be positive")
        if (max_weight is None) != (weigh is None) or (max_weight is not None and max_weight <= 0):
            raise ValueError("give both max_weight (> 0) and weigh, or neither")
        self.maxsize = maxsize
        self.max_weight = max_weight
        self._weigh = weigh
        self._data: OrderedDict[K, tuple[V, int]] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        self.weight = 0

    def get(self, key: K) -> V | None:
        with self._lock:
            item = self._data.get(key)
            if item is None:
                self.misses += 1
                return None
            self._data.move_to_end(key)
            self.hits += 1
            return item[0]

    def put(self, key: K, value: V) -> None:
        weight = 0 if self._weigh is None else self._weigh(key, value)
        if self.max_weight is not None and weight * 4 > self.max_weight:
            return
        with self._lock:
            data = self._data
            old = data.pop(key, None)
            if old is not None:
                self.weight -= old[1]
            data[key] = (value, weight)
            self.weight += weight
            while len(data) > self.maxsize or (
                self.max_weight is not None and self.weight > self.max_weight
            ):
                _, (_, gone) = data.popitem(last=False)
                self.weight -= gone

    def __len__(self) -> int:
        return len(self._data)

    def __contains__(self, key: object) -> bool:
        """Whether ``key`` is kept, without counting a hit or a miss or touching its age."""
        return key in self._data

    def clear(self) -> None:
        with self._lock:
            self._data.clear()
            self.weight = 0
