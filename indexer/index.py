"""The global prefix index: block key -> which replicas hold it, and in which tiers.

``PrefixIndex`` is the small interface the subscriber writes to and the router reads from;
``InMemoryPrefixIndex`` is its in-process backend. The index knows nothing of sockets or
sequence numbers: it applies decoded events of one replica in the order it is given them, and
answers lookups. Metrics and freshness live outside it (indexer.stats, indexer.subscriber).

Layout, chosen for memory (<= 200 bytes per (block, replica) entry) and lookup speed:
- ``_masks``: key -> int bitmask, three bits per replica slot (GPU, CPU, STORAGE at bit
  3*slot + Medium). Masks are interned, so a fleet's few distinct masks are shared objects.
- per replica, ``engine_to_key``: vLLM's block hash -> our key. Built from BlockStored token
  ids, it resolves BlockRemoved and tier-only stores (``token_ids=[]``). Insertion order is age,
  so the oldest entries go first when the entry cap is hit.
"""

from __future__ import annotations

import sys
import threading
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from indexer.keys import ExtraKeys, block_keys, pack_tokens, request_extra_keys
from indexer.wire import AllBlocksCleared, BlockRemoved, BlockStored, Event, Medium

__all__ = [
    "ApplyResult",
    "InMemoryPrefixIndex",
    "PrefixIndex",
    "PrefixMatch",
    "ReplicaIndexSummary",
]

_TIERS = (Medium.GPU, Medium.CPU, Medium.STORAGE)


@dataclass(slots=True)
class PrefixMatch:
    """A replica's longest cached prefix of one request.

    ``blocks_by_tier[t]`` counts the prefix's blocks whose fastest copy is in tier t; their sum
    is ``blocks``. Tokens are ``blocks * block_size``.
    """

    replica: str
    block_size: int
    blocks: int
    blocks_by_tier: dict[Medium, int]

    @property
    def tokens(self) -> int:
        return self.blocks * self.block_size

    def tokens_in(self, tier: Medium) -> int:
        return self.blocks_by_tier.get(tier, 0) * self.block_size


@dataclass(slots=True)
class ApplyResult:
    """What applying one batch did: counts, and the reason of every rejected event."""

    applied: int = 0
    blocks_stored: int = 0
    blocks_removed: int = 0
    cleared: int = 0
    ignored: int = 0
    unresolved: int = 0
    rejected: list[str] = field(default_factory=list)

    def merge(self, other: ApplyResult) -> None:
        self.applied += other.applied
        self.blocks_stored += other.blocks_stored
        self.blocks_removed += other.blocks_removed
        self.cleared += other.cleared
        self.ignored += other.ignored
        self.unresolved += other.unresolved
        self.rejected.extend(other.rejected)


@dataclass(slots=True)
class ReplicaIndexSummary:
    replica: str
    block_size: int | None
    entries: int
    entries_by_tier: dict[str, int]


class PrefixIndex(ABC):
    """What the subscriber and the router need from an index backend."""

    @abstractmethod
    def apply(self, replica: str, events: Iterable[Event]) -> ApplyResult:
        """Apply one replica's events in order."""

    @abstractmethod
    def clear_replica(self, replica: str) -> None:
        """Forget everything the replica holds, keep the replica known (it will re-fill)."""

    @abstractmethod
    def remove_replica(self, replica: str) -> None:
        """Forget the replica entirely."""

    @abstractmethod
    def lookup(
        self,
        tokens: Sequence[int],
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        replicas: Iterable[str] | None = None,
    ) -> dict[str, PrefixMatch]:
        """Per replica, the longest consecutive cached prefix of ``tokens``."""

    @abstractmethod
    def block_size(self, replica: str) -> int | None:
        """The block size learned from the replica's events (None until its first store)."""

    @abstractmethod
    def summary(self) -> list[ReplicaIndexSummary]:
        """Entries per replica per tier."""

    @abstractmethod
    def estimated_bytes(self) -> int:
        """Memory the index holds, estimated."""


class _ReplicaState:
    __slots__ = ("block_size", "engine_to_key", "name", "slot", "tier_counts")

    def __init__(self, name: str, slot: int) -> None:
        self.name = name
        self.slot = slot
        self.block_size: int | None = None
        self.engine_to_key: dict[int, int] = {}
        self.tier_counts = [0, 0, 0]


class InMemoryPrefixIndex(PrefixIndex):
    """Thread-safe in-memory backend (one lock; batches and lookups are short)."""

    def __init__(self, max_entries: int = 8_000_000) -> None:
        if max_entries <= 0:
            raise ValueError("max_entries must be positive")
        self.max_entries = max_entries
        self.evicted_entries = 0
        self._masks: dict[int, int] = {}
        self._interned: dict[int, int] = {}
        self._replicas: dict[str, _ReplicaState] = {}
        self._free_slots: list[int] = []
        self._next_slot = 0
        self._entries = 0
        self._lock = threading.RLock()

    # --- replicas -----------------------------------------------------------------------------

    def _state(self, replica: str) -> _ReplicaState:
        state = self._replicas.get(replica)
        if state is None:
            if self._free_slots:
                slot = self._free_slots.pop()
            else:
                slot = self._next_slot
                self._next_slot += 1
            state = self._replicas[replica] = _ReplicaState(replica, slot)
        return state

    def add_replica(self, replica: str) -> None:
        with self._lock:
            self._state(replica)

    def replicas(self) -> list[str]:
        with self._lock:
            return list(self._replicas)

    def block_size(self, replica: str) -> int | None:
        state = self._replicas.get(replica)
        return None if state is None else state.block_size

    def _drop_bits(self, state: _ReplicaState, keys: Iterable[int], bits: int) -> None:
        """Clear ``bits`` (already shifted to the replica's slot) from every key."""
        masks, intern = self._masks, self._intern
        keep = ~bits
        for key in keys:
            mask = masks.get(key)
            if mask is None:
                continue
            mask &= keep
            if mask:
                masks[key] = intern(mask)
            else:
                del masks[key]

    def clear_replica(self, replica: str, tier: Medium | None = None) -> None:
        with self._lock:
            state = self._replicas.get(replica)
            if state is None:
                return
            if tier is None:
                self._drop_bits(state, state.engine_to_key.values(), 0b111 << (3 * state.slot))
                self._entries -= len(state.engine_to_key)
                state.engine_to_key = {}
                state.tier_counts = [0, 0, 0]
                state.block_size = None
                return
            self._remove_tier(state, list(state.engine_to_key), tier)

    def remove_replica(self, replica: str) -> None:
        with self._lock:
            state = self._replicas.get(replica)
            if state is None:
                return
            self.clear_replica(replica)
            del self._replicas[replica]
            self._free_slots.append(state.slot)

    # --- events -------------------------------------------------------------------------------

    def _intern(self, mask: int) -> int:
        return self._interned.setdefault(mask, mask)

    def apply(self, replica: str, events: Iterable[Event]) -> ApplyResult:
        result = ApplyResult()
        with self._lock:
            state = self._state(replica)
            for event in events:
                try:
                    if isinstance(event, BlockStored):
                        self._store(state, event, result)
                    elif isinstance(event, BlockRemoved):
                        self._remove(state, event, result)
                    elif isinstance(event, AllBlocksCleared):
                        self.clear_replica(replica, event.medium)
                        state = self._state(replica)
                        result.cleared += 1
                    else:
                        result.rejected.append(f"not an event: {type(event).__name__}")
                        continue
                except ValueError as exc:
                    result.rejected.append(str(exc))
                    continue
                result.applied += 1
            if self._entries > self.max_entries:
                self._evict(self._entries - self.max_entries)
            if len(self._interned) > 1 << 16:
                self._interned.clear()  # interning only saves memory; masks stay valid
        return result

    def _store(self, state: _ReplicaState, event: BlockStored, result: ApplyResult) -> None:
        if event.group_idx:
            # Only the full-attention group (0) decides prefix hits we can predict.
            result.ignored += 1
            return
        bit = 1 << (3 * state.slot + event.medium)
        engine_to_key = state.engine_to_key
        if not event.token_ids:
            # Tier-only update: the blocks must already be known from earlier events.
            keys: list[int] = []
            for engine_hash in event.block_hashes:
                key = engine_to_key.get(engine_hash)
                if key is None:
                    result.unresolved += 1
                else:
                    keys.append(key)
            self._set_bit(state, [], keys, bit, event.medium, result)
            return
        if state.block_size is None:
            state.block_size = event.block_size
        elif event.block_size != state.block_size:
            raise ValueError(
                f"block_size {event.block_size} differs from the replica's {state.block_size}"
            )
        if event.parent_block_hash is None:
            parent = None
        else:
            parent = engine_to_key.get(event.parent_block_hash)
            if parent is None:
                raise ValueError("BlockStored whose parent block is unknown (missed events?)")
        extra: list[ExtraKeys] | None = event.extra_keys
        if extra is None and event.lora_name:
            extra = [(event.lora_name,)] * len(event.block_hashes)
        keys = block_keys(
            pack_tokens(event.token_ids), event.block_size, parent=parent, extra_keys=extra
        )
        self._set_bit(state, event.block_hashes, keys, bit, event.medium, result)

    def _set_bit(
        self,
        state: _ReplicaState,
        engine_hashes: list[int],
        keys: list[int],
        bit: int,
        medium: Medium,
        result: ApplyResult,
    ) -> None:
        """Mark ``keys`` held in one tier; ``engine_hashes`` (same length, or empty) map to them."""
        masks, engine_to_key = self._masks, state.engine_to_key
        slot_bits = 0b111 << (3 * state.slot)
        added = 0
        interned = self._interned
        for i, key in enumerate(keys):
            if engine_hashes:
                engine_hash = engine_hashes[i]
                old = engine_to_key.get(engine_hash)
                if old is None:
                    self._entries += 1
                else:
                    del engine_to_key[engine_hash]  # re-inserted below: now the youngest
                    if old != key:
                        # vLLM reused a hash for other tokens: the old block is gone from here.
                        self._drop_bits(state, (old,), slot_bits)
                        self._recount(state)
                engine_to_key[engine_hash] = key
            mask = masks.get(key, 0)
            if not mask & bit:
                mask |= bit
                masks[key] = interned.setdefault(mask, mask)
                added += 1
        state.tier_counts[medium] += added
        result.blocks_stored += added

    def _remove(self, state: _ReplicaState, event: BlockRemoved, result: ApplyResult) -> None:
        if event.group_idx:
            result.ignored += 1
            return
        removed = self._remove_tier(state, event.block_hashes, event.medium)
        result.blocks_removed += removed
        result.unresolved += len(event.block_hashes) - removed

    def _remove_tier(self, state: _ReplicaState, engine_hashes: list[int], medium: Medium) -> int:
        masks, intern, engine_to_key = self._masks, self._intern, state.engine_to_key
        bit = 1 << (3 * state.slot + medium)
        slot_bits = 0b111 << (3 * state.slot)
        removed = 0
        for engine_hash in engine_hashes:
            key = engine_to_key.get(engine_hash)
            if key is None:
                continue
            mask = masks.get(key, 0)
            if mask & bit:
                removed += 1
                mask &= ~bit
                if mask:
                    masks[key] = intern(mask)
                else:
                    del masks[key]
            if not mask & slot_bits:
                del engine_to_key[engine_hash]
                self._entries -= 1
        state.tier_counts[medium] -= removed
        return removed

    def _recount(self, state: _ReplicaState) -> None:
        counts = [0, 0, 0]
        shift = 3 * state.slot
        masks = self._masks
        for key in state.engine_to_key.values():
            bits = (masks.get(key, 0) >> shift) & 0b111
            for tier in _TIERS:
                if bits >> tier & 1:
                    counts[tier] += 1
        state.tier_counts = counts

    def _evict(self, count: int) -> None:
        """Drop the oldest entries of the largest replicas until ``count`` entries are gone."""
        while count > 0 and self._replicas:
            state = max(self._replicas.values(), key=lambda s: len(s.engine_to_key))
            engine_to_key = state.engine_to_key
            if not engine_to_key:
                return
            batch = min(count, max(1, len(engine_to_key) // 8))
            victims = []
            for engine_hash in engine_to_key:
                victims.append(engine_hash)
                if len(victims) >= batch:
                    break
            shift = 3 * state.slot
            for engine_hash in victims:
                key = engine_to_key.pop(engine_hash)
                mask = self._masks.get(key, 0)
                bits = (mask >> shift) & 0b111
                for tier in _TIERS:
                    if bits >> tier & 1:
                        state.tier_counts[tier] -= 1
                mask &= ~(0b111 << shift)
                if mask:
                    self._masks[key] = self._intern(mask)
                else:
                    self._masks.pop(key, None)
            self._entries -= len(victims)
            self.evicted_entries += len(victims)
            count -= len(victims)

    # --- lookups ------------------------------------------------------------------------------

    def lookup(
        self,
        tokens: Sequence[int],
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        replicas: Iterable[str] | None = None,
    ) -> dict[str, PrefixMatch]:
        packed = pack_tokens(tokens)
        with self._lock:
            wanted = (
                list(self._replicas.values())
                if replicas is None
                else [self._replicas[r] for r in replicas if r in self._replicas]
            )
            by_size: dict[int, list[_ReplicaState]] = {}
            out: dict[str, PrefixMatch] = {}
            for state in wanted:
                if state.block_size is None:
                    out[state.name] = PrefixMatch(state.name, 0, 0, {})
                else:
                    by_size.setdefault(state.block_size, []).append(state)
            for block_size, states in by_size.items():
                n_blocks = len(tokens) // block_size
                extra = request_extra_keys(n_blocks, lora_name=lora_name, cache_salt=cache_salt)
                keys = block_keys(packed, block_size, extra_keys=extra)
                out.update(self._walk(keys, states, block_size))
            return out

    def lookup_keys(
        self, keys: Sequence[int], replicas: Sequence[str], block_size: int
    ) -> dict[str, PrefixMatch]:
        """Lookup of precomputed keys (all replicas must share ``block_size``)."""
        with self._lock:
            states = [self._replicas[r] for r in replicas if r in self._replicas]
            return self._walk(keys, states, block_size)

    def _walk(
        self, keys: Sequence[int], states: list[_ReplicaState], block_size: int
    ) -> dict[str, PrefixMatch]:
        """One pass over the request's keys, tracking which replicas still match.

        Consecutive blocks usually have the same mask, so the per-replica tier accounting runs
        once per run of equal masks, not once per block.
        """
        counts = {s.slot: [0, 0, 0] for s in states}
        ended: dict[int, int] = {}
        alive = 0
        for s in states:
            alive |= 1 << (3 * s.slot)
        alive3 = alive * 0b111
        get = self._masks.get
        prev = -1
        run = 0
        for i, key in enumerate(keys):
            mask = get(key, 0) & alive3
            if mask == prev:
                run += 1
                continue
            if run:
                self._account(prev, run, counts)
            held = (mask | mask >> 1 | mask >> 2) & alive
            if held != alive:
                gone = alive & ~held
                while gone:
                    low = gone & -gone
                    ended[low.bit_length() // 3] = i
                    gone ^= low
                alive = held
                alive3 = alive * 0b111
                mask &= alive3
                if not alive:
                    run = 0
                    break
            prev = mask
            run = 1
        if run and alive:
            self._account(prev, run, counts)
        out: dict[str, PrefixMatch] = {}
        for s in states:
            c = counts[s.slot]
            by_tier = {tier: c[tier] for tier in _TIERS if c[tier]}
            blocks = ended.get(s.slot, len(keys))
            out[s.name] = PrefixMatch(s.name, block_size, blocks, by_tier)
        return out

    @staticmethod
    def _account(mask: int, run: int, counts: dict[int, list[int]]) -> None:
        for slot, c in counts.items():
            bits = (mask >> (3 * slot)) & 0b111
            if bits:
                c[(bits & -bits).bit_length() - 1] += run

    # --- stats --------------------------------------------------------------------------------

    def summary(self) -> list[ReplicaIndexSummary]:
        with self._lock:
            return [
                ReplicaIndexSummary(
                    replica=s.name,
                    block_size=s.block_size,
                    entries=len(s.engine_to_key),
                    entries_by_tier={t.name: s.tier_counts[t] for t in _TIERS},
                )
                for s in self._replicas.values()
            ]

    @property
    def entries(self) -> int:
        return self._entries

    @property
    def distinct_blocks(self) -> int:
        return len(self._masks)

    def estimated_bytes(self) -> int:
        """Dict tables plus the int objects they own (64-bit ints are 36 bytes in CPython)."""
        with self._lock:
            size = sys.getsizeof(self._masks) + 36 * len(self._masks)
            size += sum(sys.getsizeof(m) for m in self._interned.values())
            for s in self._replicas.values():
                size += sys.getsizeof(s.engine_to_key) + 36 * len(s.engine_to_key)
            return size

    def tier_histogram(self) -> Counter[str]:
        with self._lock:
            totals: Counter[str] = Counter()
            for s in self._replicas.values():
                for t in _TIERS:
                    totals[t.name] += s.tier_counts[t]
            return totals
