"""What is where: an LRU index of chunks for one tier, with capacity and pins.

The index lives on the scheduler side (the single place that decides). Workers only
execute the copies they are told to, then report back; an entry therefore goes
PENDING (ordered, not yet landed) -> READY (landed, may be served), and only READY
entries are offered to lookups. Pinned entries (a load or a disk write reads them) and
PENDING entries are never evicted, so a worker never reads a slot or file that was
given away.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field

from kvroute.connector.keys import ChunkInfo
from kvroute.indexer.tiers import Tier


class EntryState(enum.Enum):
    PENDING = "pending"
    READY = "ready"


@dataclass
class TierEntry:
    info: ChunkInfo
    size: int  # capacity units used: 1 slot for RAM, bytes for disk
    state: EntryState = EntryState.PENDING
    slot: int = -1  # RAM slot number (RAM tier only)
    pins: int = 0
    # Number of worker confirmations still expected before READY (one per worker).
    confirmations_left: int = 1
    extra: dict = field(default_factory=dict)


class TierIndex:
    """LRU-ordered index bounded by ``capacity`` units.

    Iteration order of the OrderedDict is the LRU order (first = least recently used).
    """

    def __init__(self, tier: Tier, capacity: int) -> None:
        self.tier = tier
        self.capacity = capacity
        self.used = 0
        self._entries: OrderedDict[bytes, TierEntry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def get(self, key: bytes) -> TierEntry | None:
        return self._entries.get(key)

    def ready(self, key: bytes) -> TierEntry | None:
        e = self._entries.get(key)
        return e if e is not None and e.state is EntryState.READY else None

    def keys_lru(self) -> list[bytes]:
        return list(self._entries)

    def entries(self) -> Iterator[TierEntry]:
        return iter(list(self._entries.values()))

    def touch(self, key: bytes) -> None:
        if key in self._entries:
            self._entries.move_to_end(key)

    def plan_room(self, size: int) -> list[bytes] | None:
        """Victims (LRU first) to evict so ``size`` more units fit, or None if even
        evicting every evictable entry would not make room. Side-effect free."""
        if size > self.capacity:
            return None
        need = self.used + size - self.capacity
        victims: list[bytes] = []
        if need <= 0:
            return victims
        for key, e in self._entries.items():
            if e.state is EntryState.READY and e.pins == 0:
                victims.append(key)
                need -= e.size
                if need <= 0:
                    return victims
        return None

    def add(self, entry: TierEntry) -> None:
        if entry.info.key in self._entries:
            raise KeyError("duplicate key")
        if self.used + entry.size > self.capacity:
            raise ValueError(f"{self.tier.name}: over capacity")
        self._entries[entry.info.key] = entry
        self.used += entry.size

    def remove(self, key: bytes) -> TierEntry | None:
        e = self._entries.pop(key, None)
        if e is not None:
            self.used -= e.size
        return e


class SlotAllocator:
    """Free list of RAM pool slots (lowest slot first, so reuse is predictable).

    A slot may still be read by the worker after its entry left the index: a load
    planned before a reset, or a write-through disk write that reads the slot without
    a copy. Such readers ``hold`` the slot; ``free`` of a held slot parks it, and it
    returns to the free list when the last hold is released, so a store never
    overwrites a slot something still reads.
    """

    def __init__(self, num_slots: int) -> None:
        self._free = list(range(num_slots - 1, -1, -1))
        self._holds: dict[int, int] = {}
        self._parked: set[int] = set()

    def alloc(self) -> int | None:
        return self._free.pop() if self._free else None

    def free(self, slot: int) -> None:
        if self._holds.get(slot, 0) > 0:
            self._parked.add(slot)
        else:
            self._free.append(slot)

    def hold(self, slot: int) -> None:
        self._holds[slot] = self._holds.get(slot, 0) + 1

    def unhold(self, slot: int) -> None:
        left = self._holds.get(slot, 0) - 1
        if left > 0:
            self._holds[slot] = left
            return
        self._holds.pop(slot, None)
        if slot in self._parked:
            self._parked.discard(slot)
            self._free.append(slot)

    def is_held(self, slot: int) -> bool:
        return self._holds.get(slot, 0) > 0

    @property
    def num_free(self) -> int:
        return len(self._free)
