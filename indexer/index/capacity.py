"""The entry cap, and the figures of what the index holds.

An entry is a hash a replica holds in a confirmed class, or a block of one of its unconfirmed
holdings. A batch that leaves more than ``max_entries`` evicts the oldest entries of the
largest replicas; the figures (``summary``, ``stats``...) only read.
"""

from __future__ import annotations

import sys
from collections import Counter
from typing import TYPE_CHECKING

from kvroute.indexer.index.api import DOMAIN_PREFIX, IndexFigures, ReplicaIndexSummary
from kvroute.indexer.index.state import (
    _CLASS_NAMES,
    _CONFIRMED,
    _SLOT,
    _TIERS,
    _W,
    IndexStore,
    _ReplicaState,
)
from kvroute.indexer.wire import Medium

__all__ = ["Capacity"]


def _table_bytes(table: object) -> int:
    size = sys.getsizeof(table)
    return size + 36 * len(table) if type(table) is dict else size  # type: ignore[arg-type]


class Capacity(IndexStore):
    """Eviction under the entry cap; sizes and per-tier counts."""

    if TYPE_CHECKING:  # unconfirmed holdings (unconfirmed.py)

        def _drop_oldest_holding(self, state: _ReplicaState) -> int: ...

    # --- the entry cap --------------------------------------------------------------------------

    def _evict(self, count: int) -> None:
        """Drop the oldest entries of the largest replicas until ``count`` entries are gone."""
        while count > 0 and self._replicas:
            state = max(
                self._replicas.values(),
                key=lambda s: len(s.engine_to_key) + s.unconfirmed_blocks,
            )
            if state.unconfirmed_blocks >= len(state.engine_to_key) and state.held:
                gone = self._drop_oldest_holding(state)
                self.evicted_entries += gone
                count -= max(gone, 1)
                continue
            engine_to_key = state.engine_to_key
            if not engine_to_key:
                return
            batch = min(count, max(1, len(engine_to_key) // 8))
            victims = []
            for engine_hash in engine_to_key:
                victims.append(engine_hash)
                if len(victims) >= batch:
                    break
            shift = _W * state.slot
            refs = state.refs
            for engine_hash in victims:
                key = engine_to_key.pop(engine_hash)
                mask = self._masks.get(key, 0)
                bits = (mask >> shift) & _CONFIRMED
                for c in range(3):
                    if bits >> c & 1:
                        state.tier_counts[c] -= 1
                        if refs:
                            refs.pop((key, c), None)
                self._set_mask(key, mask & ~(_CONFIRMED << shift))
                state.chain.pop(engine_hash, None)
            self._entries -= len(victims)
            self.evicted_entries += len(victims)
            count -= len(victims)

    # --- stats --------------------------------------------------------------------------------

    def summary(self) -> list[ReplicaIndexSummary]:
        """Every replica's (storage domains are in ``domains()``)."""
        with self._lock:
            return [
                ReplicaIndexSummary(
                    replica=s.name,
                    block_size=s.block_size,
                    entries=len(s.engine_to_key) + s.unconfirmed_blocks,
                    entries_by_tier={t.name: s.tier_counts[t] for t in _TIERS},
                    unconfirmed_by_tier={t.name: s.tier_counts[t + 3] for t in _TIERS},
                    partial_unit=s.partial_unit,
                    chunk_blocks={_CLASS_NAMES[c]: n for c, n in s.chunk_blocks.items()},
                )
                for s in self._replicas.values()
                if not s.name.startswith(DOMAIN_PREFIX)
            ]

    def stats(self) -> IndexFigures:
        return IndexFigures(
            distinct_blocks=len(self._masks),
            estimated_bytes=self.estimated_bytes(),
            max_entries=self.max_entries,
            evicted_entries=self.evicted_entries,
            unconfirmed_ttl_s=self.unconfirmed_ttl_s,
            unconfirmed_max_blocks=self.unconfirmed_max_blocks,
            expired_unconfirmed_blocks=self.expired_blocks,
            index_core="python" if self._native is None else "native",
            refuted_cpu_blocks=self.refuted_blocks,
        )

    @property
    def entries(self) -> int:
        return self._entries

    @property
    def distinct_blocks(self) -> int:
        return len(self._masks)

    def estimated_bytes(self) -> int:
        """The tables plus the int objects a dict owns (64-bit ints are 36 bytes in CPython;
        the native tables keep raw words, and ``getsizeof`` counts all they allocate)."""
        with self._lock:
            size = _table_bytes(self._masks)
            size += sum(sys.getsizeof(m) for m in self._interned.values())
            for s in self._replicas.values():
                size += _table_bytes(s.engine_to_key)
                size += _table_bytes(s.chain)
                size += sys.getsizeof(s.refs) + sys.getsizeof(s.chunks)
                size += 120 * sum(len(h) for h in s.held.values()) + 8 * s.unconfirmed_blocks
            return size

    def tier_histogram(self) -> Counter[str]:
        with self._lock:
            totals: Counter[str] = Counter()
            for s in self._replicas.values():
                for t in _TIERS:
                    totals[t.name] += s.tier_counts[t]
                    if s.tier_counts[t + 3]:
                        totals[t.name + "_UNCONFIRMED"] += s.tier_counts[t + 3]
            return totals

    def sole_holdings(self) -> dict[str, dict[Medium, int]]:
        """Per replica, the blocks no other replica and no storage domain holds, by the
        fastest tier it holds each in (confirmed or not): what the fleet loses when that
        replica goes. Counted per distinct mask (masks are interned: a fleet has few), so the
        scan is one C-speed count over the table, under the lock."""
        with self._lock:
            by_slot = {s.slot: s for s in self._replicas.values()}
            counts = Counter(self._masks.values())
        out: dict[str, dict[Medium, int]] = {}
        for mask, blocks in counts.items():
            slot, bits = divmod(mask.bit_length() - 1, _W)
            if mask >> (slot * _W) << (slot * _W) != mask:
                continue  # bits in more than one slot: held elsewhere too
            state = by_slot.get(slot)
            if state is None or state.name.startswith(DOMAIN_PREFIX):
                continue  # a storage domain's blocks outlive any one replica
            bits = (mask >> (slot * _W)) & _SLOT
            classes = bits | (bits >> 3)  # unconfirmed classes count as their tier
            fastest = next(t for t in _TIERS if classes & (1 << int(t)))
            tiers = out.setdefault(state.name, {})
            tiers[fastest] = tiers.get(fastest, 0) + blocks
        return out
