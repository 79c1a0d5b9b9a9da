"""One replica's index state as a versioned msgpack record, for a router's warm start.

A router that starts while a peer runs copies the peer's index instead of replaying every
replica's whole history (router/peers/warm_start.py). What it copies must keep the index resolving
chains exactly as the peer would: besides which keys the replica holds in which class, the
hash -> key map, parent links, reference counts, chunk records and lengths, hybrid groups,
the ghost map and unconfirmed holdings. So a record is the replica's whole ``_ReplicaState``
(every field: ``export_state`` refuses a state with a field it does not know, so a field
added later cannot be silently dropped), taken under the index's lock.

Unconfirmed holdings expire on the index's monotonic clock, which means nothing in another
process: a record carries each one's remaining seconds instead.

``import_state`` validates a record completely before touching the index (counts are
recomputed from the bits and must agree with what the record claims) and then installs it
under the lock in one go: a replica is imported whole or not at all.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable
from typing import TYPE_CHECKING

import msgspec

from kvroute.indexer.index.state import (
    _MAX_CHUNK_BLOCKS,
    _SLOT,
    _W,
    _Held,
    _LossWindow,
    _ReplicaState,
)

if TYPE_CHECKING:
    from kvroute.indexer.index import InMemoryPrefixIndex

__all__ = [
    "STATE_VERSION",
    "HeldRecord",
    "ReplicaState",
    "SnapshotError",
    "export_state",
    "import_state",
    "validate",
]

# Bumped whenever ReplicaState's meaning changes: a peer on another version is not imported.
STATE_VERSION = 1
_U64 = (1 << 64) - 1
# Every field of _ReplicaState, and what a record does with it. "landing" is per batch (empty
# between batches), "name" and "slot" are the importing index's own.
_KNOWN_FIELDS = frozenset(
    {
        "block_size",
        "chain",
        "chunk_blocks",
        "chunk_obs",
        "chunks",
        "confirmed_sources",
        "device_history",
        "doubted",
        "engine_to_key",
        "ghost",
        "group_specs",
        "groups",
        "held",
        "landing",
        "loss",
        "name",
        "partial_unit",
        "pool_tiers",
        "primary",
        "refs",
        "reset_pending",
        "size_confirmed",
        "slot",
        "tier_counts",
        "unconfirmed_blocks",
        "uncounted",
        "unplaced",
        "unsized",
        "warm_chain",
        "whole_loads",
    }
)


class SnapshotError(ValueError):
    """A snapshot record that cannot be exported or imported, with the reason."""


class HeldRecord(msgspec.Struct, array_like=True, frozen=True):
    """One unconfirmed holding of a stream, oldest first."""

    source: str
    cls: int
    chunk: int
    keys: list[int]
    ttl_s: float


class GroupRecord(msgspec.Struct, array_like=True, frozen=True):
    """A hybrid model's KV-cache group: (hash, key, holdings) triples."""

    group: int
    blocks: list[tuple[int, int, int]]


class ReplicaState(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Everything the index knows of one replica (see the module's docstring)."""

    version: int
    block_size: int | None
    size_confirmed: bool
    partial_unit: int | None
    warm_chain: bool
    # Insertion order is age (the entry cap drops the oldest first): kept.
    engine_hashes: list[int]
    engine_keys: list[int]
    # Each key the replica holds, with its six class bits (see indexer/index/state.py's layout).
    bit_keys: list[int]
    bit_values: list[int]
    tier_counts: list[int]
    unconfirmed_blocks: int
    refs: list[tuple[int, int, int]]
    chain: list[tuple[int, int | None]]
    unsized: list[tuple[int, list[int]]]
    whole_loads: list[int]
    chunk_blocks: list[tuple[int, int]]
    chunk_obs: list[tuple[int, int, int, int]]
    chunks: list[tuple[int, int, list[int], int]]
    groups: list[GroupRecord]
    ghost: list[tuple[int, int]] | None
    held: list[HeldRecord]
    confirmed_sources: list[str]
    pool_tiers: list[int] = []
    # Hybrid models: the keyed KV cache group, and each group's (kind, window, block size).
    # Absent from a record of a router before them: group 0 keyed, kinds unknown.
    primary: int | None = None
    group_specs: list[tuple[int, str | None, int | None, int]] = []
    # Batches lost at their source (indexer/index/losses.py): seconds since each open window
    # opened, the first first. What they proved held is not carried: the importer keeps, at a
    # window's end, only what it sees stored after the import.
    loss_ages_s: list[float] = []

    @property
    def entries(self) -> int:
        return len(self.engine_hashes) + self.unconfirmed_blocks


def _attached(index: InMemoryPrefixIndex, replica: str) -> bool:
    return replica in getattr(index, "_attached", ())


def export_state(index: InMemoryPrefixIndex, replica: str) -> ReplicaState | None:
    """The replica's state (None when the index does not know it, or when it is attached to
    a storage domain: part of what it holds is the domain's, which a record does not carry).
    Call with the index's lock held, or through ``InMemoryPrefixIndex.export_replica``."""
    state = index._replicas.get(replica)
    if state is None or _attached(index, replica):
        return None
    unknown = set(_ReplicaState.__slots__) - _KNOWN_FIELDS
    if unknown:
        raise SnapshotError(f"index state has fields a snapshot does not carry: {sorted(unknown)}")
    if state.landing:
        raise SnapshotError("index state taken in the middle of a batch")
    shift = _W * state.slot
    masks = index._masks
    keys = set(state.engine_to_key.values())
    for held in state.held.values():
        for rec in held.values():
            keys.update(rec.keys)
    bits = {k: b for k in keys if (b := (masks.get(k, 0) >> shift) & _SLOT)}
    if _counts(bits.values()) != state.tier_counts:
        # A holding neither map names: take every key with the replica's bits.
        bits = {k: b for k, m in masks.items() if (b := (m >> shift) & _SLOT)}
    now = index._clock()
    return ReplicaState(
        version=STATE_VERSION,
        block_size=state.block_size,
        size_confirmed=state.size_confirmed,
        partial_unit=state.partial_unit,
        warm_chain=state.warm_chain,
        engine_hashes=list(state.engine_to_key),
        engine_keys=list(state.engine_to_key.values()),
        bit_keys=list(bits),
        bit_values=list(bits.values()),
        tier_counts=list(state.tier_counts),
        unconfirmed_blocks=state.unconfirmed_blocks,
        refs=[(k, c, n) for (k, c), n in state.refs.items()],
        chain=list(state.chain.items()),
        unsized=[(c, list(hs)) for c, hs in state.unsized.items()],
        whole_loads=sorted(state.whole_loads),
        chunk_blocks=list(state.chunk_blocks.items()),
        chunk_obs=[(c, *obs) for c, obs in state.chunk_obs.items()],
        chunks=[(c, h, list(rec[0]), rec[1]) for (c, h), rec in state.chunks.items()],
        groups=[
            GroupRecord(g, [(h, rec[0], rec[1]) for h, rec in by_hash.items()])
            for g, (by_hash, _by_key) in state.groups.items()
        ],
        ghost=None if state.ghost is None else list(state.ghost.items()),
        held=[
            HeldRecord(source, rec.cls, chunk, list(rec.keys), max(0.0, rec.expires - now))
            for source, held in state.held.items()
            for (_cls, chunk), rec in held.items()
        ],
        confirmed_sources=sorted(state.confirmed_sources),
        pool_tiers=sorted(state.pool_tiers),
        primary=state.primary,
        group_specs=[(g, *spec) for g, spec in state.group_specs.items()],
        loss_ages_s=_loss_ages(state, now),
    )


def _loss_ages(state: _ReplicaState, now: float) -> list[float]:
    window, ages = state.loss, []
    while window is not None:
        ages.append(max(0.0, now - window.opened))
        window = window.next
    return ages


def _counts(bit_values: Iterable[int]) -> list[int]:
    """Blocks per class (a fleet has few distinct bit patterns: count those)."""
    counts = [0] * _W
    for b, n in Counter(bit_values).items():
        for c in range(_W):
            if b >> c & 1:
                counts[c] += n
    return counts


def _u64(value: object) -> bool:
    return type(value) is int and 0 <= value <= _U64


def validate(rec: ReplicaState) -> None:
    """Refuse a record the index could not hold consistently (SnapshotError says why): a
    forged or corrupted one must fail here, before anything is installed."""
    if rec.version != STATE_VERSION:
        raise SnapshotError(f"index state version {rec.version}, this router reads {STATE_VERSION}")
    for name, value in (("block_size", rec.block_size), ("partial_unit", rec.partial_unit)):
        if value is not None and not 0 < value <= 1 << 20:
            raise SnapshotError(f"{name} {value} out of range")
    if len(rec.engine_hashes) != len(rec.engine_keys):
        raise SnapshotError("engine hashes and keys differ in length")
    if len(set(rec.engine_hashes)) != len(rec.engine_hashes):
        raise SnapshotError("an engine hash appears twice")
    if len(rec.bit_keys) != len(rec.bit_values) or len(set(rec.bit_keys)) != len(rec.bit_keys):
        raise SnapshotError("class bits malformed (lengths differ or a key appears twice)")
    for ints in (rec.engine_hashes, rec.engine_keys, rec.bit_keys):
        if ints and (min(ints) < 0 or max(ints) > _U64):
            raise SnapshotError("a hash or key is not a 64-bit unsigned integer")
    if any(not 0 < b <= _SLOT for b in rec.bit_values):
        raise SnapshotError("class bits out of range")
    if any(
        len(link) != 2 or not _u64(link[0]) or not (link[1] is None or _u64(link[1]))
        for link in rec.chain
    ):
        raise SnapshotError("a chain link is not a 64-bit hash and its parent (or None)")
    if len(rec.tier_counts) != _W or _counts(rec.bit_values) != rec.tier_counts:
        raise SnapshotError("tier counts disagree with the class bits")
    if sum(len(h.keys) for h in rec.held) != rec.unconfirmed_blocks:
        raise SnapshotError("unconfirmed block count disagrees with the holdings")
    classes = range(_W)
    if any(c not in classes for c in (*rec.whole_loads, *rec.pool_tiers)) or any(
        h.cls not in range(3, _W) for h in rec.held
    ):
        raise SnapshotError("a class out of range")
    if any(c not in classes or not 0 < n <= _MAX_CHUNK_BLOCKS for c, n in rec.chunk_blocks):
        raise SnapshotError("a chunk length out of range")
    if any(c not in classes or n < 1 for _k, c, n in rec.refs):
        raise SnapshotError("a reference count out of range")
    if len(rec.loss_ages_s) > 2 or not all(0 <= a < float("inf") for a in rec.loss_ages_s):
        raise SnapshotError("lost batches' windows malformed")


def import_state(index: InMemoryPrefixIndex, replica: str, rec: ReplicaState) -> int:
    """Install ``rec`` as everything the index knows of ``replica`` (what it held before is
    dropped); returns the entries installed. Validates first: nothing is changed when the
    record is refused. Call with the index's lock held, or through
    ``InMemoryPrefixIndex.import_replica``."""
    validate(rec)
    if _attached(index, replica):
        raise SnapshotError(f"{replica} is attached to a storage domain here")
    if replica in index._replicas:
        index.remove_replica(replica)
    state = index._state(replica)
    state.block_size = rec.block_size
    state.size_confirmed = rec.size_confirmed
    state.partial_unit = rec.partial_unit
    state.warm_chain = rec.warm_chain
    # Not carried: whether the peer saw every device store since the device was last empty.
    # Taken as not (confirmed.py: stores from the prompt's start are then never counted twice).
    state.device_history = False
    engine_to_key = state.engine_to_key  # the index's kind of table, empty
    for h, key in zip(rec.engine_hashes, rec.engine_keys, strict=True):
        engine_to_key[h] = key
    shift = _W * state.slot
    masks = index._masks
    for key, bits in zip(rec.bit_keys, rec.bit_values, strict=True):
        index._set_mask(key, masks.get(key, 0) | bits << shift)
    state.tier_counts = list(rec.tier_counts)
    state.unconfirmed_blocks = rec.unconfirmed_blocks
    state.refs = {(k, c): n for k, c, n in rec.refs}
    state.chain.update(rec.chain)  # the index's kind of table, empty
    state.unsized = {c: list(hs) for c, hs in rec.unsized}
    state.whole_loads = set(rec.whole_loads)
    state.chunk_blocks = dict(rec.chunk_blocks)
    state.chunk_obs = {c: (g, n, last) for c, g, n, last in rec.chunk_obs}
    state.chunks = {(c, h): [tuple(members), n] for c, h, members, n in rec.chunks}
    for group in rec.groups:
        by_hash: dict[int, list[int]] = {}
        by_key: dict[int, int] = {}
        for h, key, n in group.blocks:
            by_hash[h] = [key, n]
            by_key[key] = by_key.get(key, 0) + 1
        state.groups[group.group] = (by_hash, by_key)
    state.ghost = None if rec.ghost is None else dict(rec.ghost)
    now = index._clock()
    ttl = index.unconfirmed_ttl_s
    for h in rec.held:
        held = state.held.setdefault(h.source, OrderedDict())
        held[(h.cls, h.chunk)] = _Held(h.cls, tuple(h.keys), now + min(h.ttl_s, ttl))
    state.confirmed_sources = set(rec.confirmed_sources)
    state.pool_tiers = set(rec.pool_tiers)
    state.primary = rec.primary
    state.group_specs = {g: (kind, window, size) for g, kind, window, size in rec.group_specs}
    if rec.loss_ages_s:
        first, *later = (_LossWindow(now - min(age, ttl)) for age in rec.loss_ages_s)
        first.next = later[0] if later else None
        state.loss = first
    index._entries += rec.entries
    if index._entries > index.max_entries:
        index._evict(index._entries - index.max_entries)
    return rec.entries
