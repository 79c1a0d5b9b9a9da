"""The global prefix index: block key -> which replicas hold it, and in which tiers.

``PrefixIndex`` is the small interface the subscriber writes to and the router reads from;
``InMemoryPrefixIndex`` is its in-process backend. The index knows nothing of sockets or
sequence numbers: it applies decoded events of one replica in the order it is given them, and
answers lookups. Metrics and freshness live outside it (indexer/stats.py, indexer/subscriber.py).

What an event means depends on who published it, and the rules below are vLLM's (0.32/0.33),
read from its block pool and offloading connector (docs/indexer.md restates them):

- Keys are re-derived from token ids (kvroute.indexer.keys), never taken from vLLM's hashes. A store
  that carries ``extra_keys`` is keyed with them. A store in a lower tier that does not carry
  them (vLLM's offloading connector never does) is resolved through the replica's map from
  vLLM's block hash to key, built from the device events, and never re-keyed: re-keying it
  without its LoRA, cache_salt or multimodal keys would give its tier to the plain prefix.
- A tier-only store (``token_ids=[]``) names the last block of each offloaded chunk. Its
  chunk's other blocks are found by walking the device events' parent links back; how many
  blocks a chunk has is learned per replica and tier from the chain (docs/indexer.md).
- A hash stored more than once in one tier is held until removed as often (reference
  counts), as vLLM's event docs ask: its block pool keeps one copy per physical block and its
  offloading connector announces blocks shared by two chunks once per chunk. A device store
  from the start of the prompt (no parent) is idempotent instead: that is also the shape of
  vLLM's re-announcement of prefix-cache hits, which is never followed by a removal.
- ``AllBlocksCleared`` without a medium is the block pool's: the device tier only.
- A partial block (vLLM's prefix-match unit finer than its block size) is held under a key of
  its own (kvroute.indexer.keys.partial_key); a lookup probes it past the last full block.
- On a hybrid model a hit must end where every KV-cache group holds its block: the other
  groups' device blocks are tracked and cut the device prefix back (``_cap_hybrid``).
- Media whose publisher never removes anything (LMCache's, llm-d's FS backend) are held as
  *unconfirmed*: apart from the confirmed tiers, counted separately by lookups, and dropped
  after ``unconfirmed_ttl_s`` or beyond ``unconfirmed_max_blocks`` per replica. Chunks larger
  than the replica's block size (LMCache's 256 tokens) are re-chunked through their tokens.

Layout, chosen for memory and lookup speed:
- ``_masks``: key -> int bitmask, six bits per replica slot (confirmed GPU, CPU, STORAGE, then
  unconfirmed GPU, CPU, STORAGE). Masks are interned, so a fleet's few distinct masks are
  shared objects.
- per replica, ``engine_to_key``: vLLM's block hash -> our key, for blocks held in a confirmed
  tier. Insertion order is age, so the oldest entries go first when the entry cap is hit.
  Parent links are kept for the last few thousand device blocks (for all of them once the
  replica sends tier-only stores). Reference counts beyond one, resolved chunks, other KV
  cache groups' blocks and unconfirmed holdings are side tables that stay empty on replicas
  that do not need them.
"""

from __future__ import annotations

import math
import sys
import threading
import time
from abc import ABC, abstractmethod
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import islice
from typing import TYPE_CHECKING

from kvroute.indexer.keys import (
    RequestKeys,
    block_keys,
    event_extra_keys,
    pack_tokens,
    partial_key,
    root_key,
)
from kvroute.indexer.wire import AllBlocksCleared, BlockRemoved, BlockStored, Event, Medium

if TYPE_CHECKING:
    from kvroute.indexer.snapshot import ReplicaState

__all__ = [
    "DOMAIN_PREFIX",
    "ApplyResult",
    "DomainSummary",
    "InMemoryPrefixIndex",
    "IndexFigures",
    "PrefixIndex",
    "PrefixMatch",
    "ReplicaIndexSummary",
    "domain_key",
]

# The index key of a storage domain: a pseudo-replica whose STORAGE holdings are the domain's
# (its evictor's stream is applied under this name).
DOMAIN_PREFIX = "domain:"


def domain_key(domain: str) -> str:
    """The pseudo-replica a storage domain's holdings and its evictor's events live under."""
    return DOMAIN_PREFIX + domain


_TIERS = (Medium.GPU, Medium.CPU, Medium.STORAGE)
_W = 6  # bits per replica slot
_SLOT = (1 << _W) - 1
_CONFIRMED = 0b000111
_GPU = int(Medium.GPU)
_STORAGE = int(Medium.STORAGE)
# Walk limits: a chunk is never longer than this many blocks, and learning how long chunks
# are never walks further back than this.
_MAX_CHUNK_BLOCKS = 1024
_MAX_WALK = 8192
_GHOST_MAX = 8192
# Parent links kept before a replica sends its first tier-only store: enough for the chunks
# that store describes (vLLM offloads a chunk a step or two after computing it).
_WARM_CHAIN = 4096
_MAX_UNSIZED = 1024
_CLASS_NAMES = tuple(
    [t.name for t in (Medium.GPU, Medium.CPU, Medium.STORAGE)]
    + [t.name + "_UNCONFIRMED" for t in (Medium.GPU, Medium.CPU, Medium.STORAGE)]
)


def _cls(tier: Medium, confirmed: bool) -> int:
    return int(tier) if confirmed else int(tier) + 3


@dataclass(slots=True)
class PrefixMatch:
    """A replica's longest cached prefix of one request.

    ``blocks_by_tier[t]`` counts the prefix's blocks whose fastest confirmed copy is in tier t,
    ``unconfirmed_by_tier[t]`` those held only by a publisher that never announces removals;
    together they sum to ``blocks``. ``partial_tokens`` are device-tier tokens past the last
    full block (vLLM's finer prefix-match unit, ``partial_unit`` tokens).
    """

    replica: str
    block_size: int
    blocks: int
    blocks_by_tier: dict[Medium, int]
    unconfirmed_by_tier: dict[Medium, int] = field(default_factory=dict)
    partial_tokens: int = 0
    partial_unit: int | None = None

    @property
    def tokens(self) -> int:
        return self.blocks * self.block_size + self.partial_tokens

    def tokens_in(self, tier: Medium) -> int:
        """Confirmed tokens whose fastest copy is in ``tier``."""
        extra = self.partial_tokens if tier is Medium.GPU else 0
        return self.blocks_by_tier.get(tier, 0) * self.block_size + extra

    def unconfirmed_tokens_in(self, tier: Medium) -> int:
        return self.unconfirmed_by_tier.get(tier, 0) * self.block_size

    @property
    def unconfirmed_tokens(self) -> int:
        return sum(self.unconfirmed_by_tier.values()) * self.block_size


@dataclass(slots=True)
class ApplyResult:
    """What applying one batch did: counts, and the reason of every rejected event."""

    applied: int = 0
    blocks_stored: int = 0
    blocks_removed: int = 0
    cleared: int = 0
    device_cleared: int = 0  # AllBlocksCleared of the device tier: the prefix cache reset
    ignored: int = 0
    unresolved: int = 0
    partial_blocks: int = 0
    unconfirmed_blocks: int = 0
    rejected: list[str] = field(default_factory=list)

    def merge(self, other: ApplyResult) -> None:
        self.applied += other.applied
        self.blocks_stored += other.blocks_stored
        self.blocks_removed += other.blocks_removed
        self.cleared += other.cleared
        self.device_cleared += other.device_cleared
        self.ignored += other.ignored
        self.unresolved += other.unresolved
        self.partial_blocks += other.partial_blocks
        self.unconfirmed_blocks += other.unconfirmed_blocks
        self.rejected.extend(other.rejected)


@dataclass(slots=True)
class ReplicaIndexSummary:
    replica: str
    block_size: int | None
    entries: int
    entries_by_tier: dict[str, int]
    unconfirmed_by_tier: dict[str, int] = field(default_factory=dict)
    partial_unit: int | None = None
    chunk_blocks: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class DomainSummary:
    """A storage domain as the index sees it: blocks held, and the replicas attached."""

    domain: str
    block_size: int | None
    blocks: int
    attached: list[str]
    chunk_blocks: int | None = None


@dataclass(frozen=True, slots=True)
class IndexFigures:
    """Index-wide figures for ``/index/stats`` and the metrics: size, limits, evictions."""

    distinct_blocks: int
    estimated_bytes: int
    max_entries: int
    evicted_entries: int
    unconfirmed_ttl_s: float
    unconfirmed_max_blocks: int
    expired_unconfirmed_blocks: int


class PrefixIndex(ABC):
    """What the subscriber, the router and the stats need from an index backend, and all
    they may use: everything else about a backend is its own business."""

    @abstractmethod
    def apply(self, replica: str, events: Iterable[Event], *, source: str = "") -> ApplyResult:
        """Apply one replica's events in order; ``source`` names the event stream they came
        from when a replica has several (llm-d's FS backend publishes on a socket of its own)."""

    @abstractmethod
    def clear_replica(self, replica: str) -> None:
        """Forget everything the replica holds, keep the replica known (it will re-fill)."""

    @abstractmethod
    def clear_source(self, replica: str, source: str = "", *, restarted: bool) -> None:
        """A stream of the replica lost history: forget what it can no longer vouch for.

        Confirmed tiers depend on every removal being seen, so a gap in a stream that sent
        any confirmed event clears them; unconfirmed holdings never see removals, so only a
        restart of their publisher (``restarted``) drops them.
        """

    @abstractmethod
    def remove_replica(self, replica: str) -> None:
        """Forget the replica entirely."""

    @abstractmethod
    def lookup(
        self,
        tokens: Sequence[int] | RequestKeys,
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        replicas: Iterable[str] | None = None,
    ) -> dict[str, PrefixMatch]:
        """Per replica (``replicas``, or every known one), the longest cached prefix of the
        request, per tier. The router passes a ``RequestKeys`` (its keys are computed once
        per block size and shared with the router's other users); plain token ids are keyed
        here with ``lora_name`` and ``cache_salt``."""

    @abstractmethod
    def block_size(self, replica: str) -> int | None:
        """The block size learned from the replica's events (None until its first store)."""

    @abstractmethod
    def expire(self, replica: str | None = None) -> int:
        """Drop unconfirmed holdings past their time; returns how many blocks went."""

    @abstractmethod
    def summary(self) -> list[ReplicaIndexSummary]:
        """Entries per replica per tier."""

    @abstractmethod
    def stats(self) -> IndexFigures:
        """Index-wide figures: size in memory, limits, what the limits dropped."""

    def export_replica(self, replica: str) -> ReplicaState | None:
        """Everything known of the replica, for a peer router's warm start
        (indexer/snapshot.py); None when unknown, or when the backend cannot export."""
        return None

    def import_replica(self, replica: str, state: ReplicaState) -> int:
        """Replace what is known of the replica with ``state``, whole or not at all (raises
        ``SnapshotError``); returns the entries installed."""
        raise NotImplementedError(f"{type(self).__name__} cannot import a snapshot")

    def attach(self, replica: str, domain: str | None) -> None:
        """Attach the replica to a storage domain (None: detach). A backend without domains
        refuses: a shared prefix would silently count nowhere."""
        if domain is not None:
            raise NotImplementedError(f"{type(self).__name__} has no storage domains")

    def domains(self) -> list[DomainSummary]:
        """Every storage domain known (holding blocks, or with replicas attached)."""
        return []


@dataclass(slots=True)
class _Held:
    """An unconfirmed chunk: the keys it holds in one class, until it expires."""

    cls: int
    keys: tuple[int, ...]
    expires: float


class _ReplicaState:
    __slots__ = (
        "block_size",
        "chain",
        "chunk_blocks",
        "chunk_obs",
        "chunks",
        "confirmed_sources",
        "engine_to_key",
        "ghost",
        "groups",
        "held",
        "landing",
        "name",
        "partial_unit",
        "refs",
        "size_confirmed",
        "slot",
        "tier_counts",
        "unconfirmed_blocks",
        "unsized",
        "warm_chain",
        "whole_loads",
    )

    def __init__(self, name: str, slot: int) -> None:
        self.name = name
        self.slot = slot
        self.block_size: int | None = None
        # True once a device store of several blocks showed the block size is not vLLM's
        # finer prefix-match unit (partial blocks are published one at a time)
        self.size_confirmed = False
        self.partial_unit: int | None = None
        self.engine_to_key: dict[int, int] = {}
        self.tier_counts = [0] * _W
        # (key, class) -> holdings beyond the first (only keys stored more than once)
        self.refs: dict[tuple[int, int], int] = {}
        # block hash -> parent hash of device stores. Only the last ``_WARM_CHAIN`` or so
        # (``warm_chain``) until the replica sends a tier-only store, all of them after.
        self.chain: dict[int, int | None] = {}
        self.warm_chain = True
        # class -> hashes of the tier-only stores of the batch being applied: a chunk's walk
        # stops at them too, as vLLM announces one step's chunks in no particular order
        self.landing: dict[int, set[int]] = {}
        # class -> last hashes of chunks stored before the chunk length was learned
        self.unsized: dict[int, list[int]] = {}
        # classes published by vLLM's offloading connector (tier-only stores, or stores
        # without extra keys): it skips a load shorter than one chunk (see ``_trim``)
        self.whole_loads: set[int] = set()
        # class -> blocks per offloaded chunk, once learned; and the observations so far
        # (gcd of the walks, how many, the last chunk walked: the same chunk stored again is
        # not a second observation)
        self.chunk_blocks: dict[int, int] = {}
        self.chunk_obs: dict[int, tuple[int, int, int]] = {}
        # (class, chunk's last hash) -> [the chunk's block hashes, times stored], for tier-only
        # stores: their removal names the last hash only
        self.chunks: dict[tuple[int, int], list] = {}
        # hybrid models: group (> 0) -> vLLM hash -> [our key, holdings], and our key ->
        # holdings, of the device blocks that group caches (a Mamba group keeps its state at
        # a few positions only; vLLM's hit must end on one)
        self.groups: dict[int, tuple[dict[int, list[int]], dict[int, int]]] = {}
        # recently forgotten hash -> key; None until a store needs resolving by hash only
        self.ghost: dict[int, int] | None = None
        # source -> (class, chunk id) -> unconfirmed holding, oldest first
        self.held: dict[str, OrderedDict[tuple[int, int], _Held]] = {}
        self.confirmed_sources: set[str] = set()
        self.unconfirmed_blocks = 0


class InMemoryPrefixIndex(PrefixIndex):
    """Thread-safe in-memory backend (one lock; batches and lookups are short)."""

    def __init__(
        self,
        max_entries: int = 8_000_000,
        *,
        unconfirmed_ttl_s: float = 600.0,
        unconfirmed_max_blocks: int = 262_144,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_entries <= 0:
            raise ValueError("max_entries must be positive")
        if unconfirmed_ttl_s <= 0 or unconfirmed_max_blocks < 0:
            raise ValueError("unconfirmed_ttl_s must be > 0 and unconfirmed_max_blocks >= 0")
        self.max_entries = max_entries
        self.unconfirmed_ttl_s = unconfirmed_ttl_s
        self.unconfirmed_max_blocks = unconfirmed_max_blocks
        self._clock = clock
        self.evicted_entries = 0
        self.expired_blocks = 0
        self._masks: dict[int, int] = {}
        self._interned: dict[int, int] = {}
        self._replicas: dict[str, _ReplicaState] = {}
        self._free_slots: list[int] = []
        self._next_slot = 0
        self._entries = 0
        # replica -> the pseudo-replica of the storage domain it is attached to
        self._attached: dict[str, str] = {}
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

    def export_replica(self, replica: str) -> ReplicaState | None:
        from kvroute.indexer.snapshot import export_state  # it builds on this module

        with self._lock:
            return export_state(self, replica)

    def import_replica(self, replica: str, state: ReplicaState) -> int:
        from kvroute.indexer.snapshot import import_state

        with self._lock:
            return import_state(self, replica, state)

    def block_size(self, replica: str) -> int | None:
        state = self._replicas.get(replica)
        if state is not None and state.block_size is None:
            # A replica that stored nothing yet is as warm as its storage domain.
            domain = self._replicas.get(self._attached.get(replica, ""))
            return None if domain is None else domain.block_size
        return None if state is None else state.block_size

    def partial_unit(self, replica: str) -> int | None:
        state = self._replicas.get(replica)
        return None if state is None else state.partial_unit

    def clear_replica(self, replica: str, tier: Medium | None = None) -> None:
        """Forget the replica's holdings (``tier``: only that confirmed tier)."""
        with self._lock:
            state = self._replicas.get(replica)
            if state is None:
                return
            if tier is not None:
                self._clear_class(state, int(tier))
                return
            self._clear_confirmed(state)
            for source in list(state.held):
                self._drop_source_holdings(state, source)
            state.block_size = None
            state.size_confirmed = False
            state.partial_unit = None
            state.chunk_blocks = {}
            state.chunk_obs = {}

    def clear_source(self, replica: str, source: str = "", *, restarted: bool) -> None:
        with self._lock:
            state = self._replicas.get(replica)
            if state is None:
                return
            # A domain's holdings came from its replicas' streams: its evictor losing history
            # means removals may have been missed, whatever the evictor itself published.
            if source in state.confirmed_sources or replica.startswith(DOMAIN_PREFIX):
                self._clear_confirmed(state)
                if restarted and not replica.startswith(DOMAIN_PREFIX):
                    # A new process may run another configuration: learn it again.
                    state.block_size = None
                    state.size_confirmed = False
                    state.partial_unit = None
                    state.chunk_blocks = {}
                    state.chunk_obs = {}
            if restarted:
                self._drop_source_holdings(state, source)

    def remove_replica(self, replica: str) -> None:
        with self._lock:
            self._attached.pop(replica, None)
            state = self._replicas.get(replica)
            if state is None:
                return
            self.clear_replica(replica)
            del self._replicas[replica]
            self._free_slots.append(state.slot)

    # --- storage domains ----------------------------------------------------------------------

    def attach(self, replica: str, domain: str | None) -> None:
        """Attach ``replica`` to storage domain ``domain`` (None: detach): its STORAGE stores
        are held by the domain from now on, and its lookups see all the domain holds."""
        if replica.startswith(DOMAIN_PREFIX):
            raise ValueError(f"{replica!r}: a storage domain cannot be attached to another")
        with self._lock:
            if domain is None:
                self._attached.pop(replica, None)
                return
            self._attached[replica] = domain_key(domain)
            self._state(replica)
            self._state(domain_key(domain))

    def domains(self) -> list[DomainSummary]:
        with self._lock:
            attached: dict[str, list[str]] = {}
            for replica, key in self._attached.items():
                attached.setdefault(key, []).append(replica)
            return [
                DomainSummary(
                    domain=s.name[len(DOMAIN_PREFIX) :],
                    block_size=s.block_size,
                    blocks=s.tier_counts[_STORAGE],
                    attached=sorted(attached.get(s.name, ())),
                    chunk_blocks=s.chunk_blocks.get(_STORAGE),
                )
                for s in self._replicas.values()
                if s.name.startswith(DOMAIN_PREFIX)
            ]

    def _share(
        self, state: _ReplicaState, domain: _ReplicaState, event: BlockStored, result: ApplyResult
    ) -> None:
        """An attached replica stored ``event``'s STORAGE blocks (already applied to it):
        move them to its domain. A file in the domain is one file however often it was
        written, so the domain holds a block once (no reference counts) until removed."""
        if domain.block_size is None:
            domain.block_size = state.block_size
        elif state.block_size is not None and state.block_size != domain.block_size:
            raise ValueError(
                f"STORAGE block_size {state.block_size} differs from its storage domain's "
                f"{domain.block_size}"
            )
        n = state.chunk_blocks.get(_STORAGE)
        if n is not None and n > domain.chunk_blocks.get(_STORAGE, 0):
            domain.chunk_blocks[_STORAGE] = n
        if _STORAGE in state.whole_loads:
            domain.whole_loads.add(_STORAGE)
        masks = self._masks
        bit = 1 << (_W * state.slot + _STORAGE)
        scratch = ApplyResult()
        for h in event.block_hashes:
            rec = state.chunks.pop((_STORAGE, h), None)
            members: tuple[int, ...] = (h,) if rec is None else rec[0]
            if rec is not None:
                domain.chunks[(_STORAGE, h)] = [members, 1]
            for m in members:
                key = state.engine_to_key.get(m)
                if key is None:
                    continue
                self._hold(domain, m, key, _STORAGE, scratch, count_dup=False)
                mask = masks.get(key, 0)
                if mask & bit:
                    self._set_mask(key, mask & ~bit)
                    state.tier_counts[_STORAGE] -= 1
                    state.refs.pop((key, _STORAGE), None)
                    self._forget_if_unheld(state, m, key, mask & ~bit)

    def _clear_confirmed(self, state: _ReplicaState) -> None:
        shift = _W * state.slot
        self._drop_bits(state.engine_to_key.values(), _CONFIRMED << shift)
        self._entries -= len(state.engine_to_key)
        state.engine_to_key = {}
        for c in range(3):
            state.tier_counts[c] = 0
        state.refs = {k: v for k, v in state.refs.items() if k[1] >= 3}
        state.chunks = {}
        state.chain = {}
        state.unsized = {}
        state.groups = {}
        if state.ghost is not None:
            state.ghost = {}

    def _clear_class(self, state: _ReplicaState, cls: int) -> None:
        """Drop one confirmed class from every block of the replica (a tier's clear)."""
        bit = 1 << (_W * state.slot + cls)
        masks = self._masks
        for h, key in list(state.engine_to_key.items()):
            mask = masks.get(key, 0)
            if mask & bit:
                self._set_mask(key, mask & ~bit)
                state.refs.pop((key, cls), None)
                self._forget_if_unheld(state, h, key, mask & ~bit)
        state.tier_counts[cls] = 0
        state.chunks = {k: v for k, v in state.chunks.items() if k[0] != cls}

    def _drop_bits(self, keys: Iterable[int], bits: int) -> None:
        """Clear ``bits`` (already shifted to a replica's slot) from every key."""
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

    # --- events -------------------------------------------------------------------------------

    def _intern(self, mask: int) -> int:
        return self._interned.setdefault(mask, mask)

    def _set_mask(self, key: int, mask: int) -> None:
        if mask:
            self._masks[key] = self._interned.setdefault(mask, mask)
        else:
            self._masks.pop(key, None)

    def apply(self, replica: str, events: Iterable[Event], *, source: str = "") -> ApplyResult:
        result = ApplyResult()
        with self._lock:
            state = self._state(replica)
            shared = self._attached.get(replica)
            domain = None if shared is None else self._state(shared)
            if state.held:
                self._expire_state(state, self._clock())
            events = list(events)
            state.landing = self._landing(events)
            for event in events:
                try:
                    if isinstance(event, BlockStored):
                        if event.group_idx:
                            self._store_group(state, event, result)
                            continue
                        if event.confirmed:
                            state.confirmed_sources.add(source)
                            self._store(state, event, result)
                            if domain is not None and event.medium is Medium.STORAGE:
                                self._share(state, domain, event, result)
                        else:
                            self._store_unconfirmed(state, event, source, result)
                    elif isinstance(event, BlockRemoved):
                        if event.group_idx:
                            self._remove_group(state, event, result)
                            continue
                        if event.confirmed:
                            state.confirmed_sources.add(source)
                            # An attached replica's STORAGE removal (a bad file it deleted)
                            # leaves the domain.
                            target = state
                            if domain is not None and event.medium is Medium.STORAGE:
                                target = domain
                            self._remove(target, event, result)
                        else:
                            self._remove_unconfirmed(state, event, source, result)
                    elif isinstance(event, AllBlocksCleared):
                        state.confirmed_sources.add(source)
                        tier = Medium.GPU if event.medium is None else event.medium
                        self._clear_class(state, int(tier))
                        if tier is Medium.GPU:
                            state.groups = {}
                            result.device_cleared += 1
                        result.cleared += 1
                    else:
                        result.rejected.append(f"not an event: {type(event).__name__}")
                        continue
                except ValueError as exc:
                    result.rejected.append(str(exc))
                    continue
                result.applied += 1
            state.landing = {}
            if self._entries > self.max_entries:
                self._evict(self._entries - self.max_entries)
            if len(self._interned) > 1 << 16:
                self._interned.clear()  # interning only saves memory; masks stay valid
        return result

    # --- confirmed stores -----------------------------------------------------------------------

    def _store(self, state: _ReplicaState, event: BlockStored, result: ApplyResult) -> None:
        cls = int(event.medium)
        if not event.token_ids:
            if cls == _GPU:
                raise ValueError("device BlockStored without token_ids")
            self._store_tier_only(state, event.block_hashes, cls, result)
            return
        bs = event.block_size
        if cls == _GPU:
            self._store_device(state, event, result)
            return
        # A lower tier's self-describing store: one chunk per event, as every offloading
        # publisher sends them; its length is what the tier loads at once.
        self._chunk_seen(state, cls, len(event.block_hashes))
        engine_to_key = state.engine_to_key
        if event.extra_keys is None:
            # The publisher does not say which extra keys its blocks had (vLLM's offloading
            # connector): only blocks the device events keyed can be placed.
            state.whole_loads.add(cls)
            self._want_ghost(state)
            ghost = state.ghost
            for h in event.block_hashes:
                key = engine_to_key.get(h)
                if key is None and ghost is not None:
                    key = ghost.get(h)
                if key is None:
                    result.unresolved += 1
                    continue
                self._hold(state, h, key, cls, result, count_dup=True)
            return
        if state.block_size is None:
            # kvroute's connector announces the disk files it found at start-up before the
            # device stored anything: a self-describing store teaches the block size too.
            state.block_size = bs
        if bs != state.block_size:
            raise ValueError(
                f"{event.medium.name} BlockStored of block_size {bs}: the replica's is "
                f"{state.block_size}"
            )
        parent = self._parent_key(state, event.parent_block_hash)
        keys = block_keys(
            pack_tokens(event.token_ids), bs, parent=parent, extra_keys=event.extra_keys
        )
        for h, key in zip(event.block_hashes, keys, strict=True):
            known = engine_to_key.get(h)
            # The device events keyed this hash first: they are the authority on its key.
            self._hold(state, h, key if known is None else known, cls, result, count_dup=True)

    def _store_device(self, state: _ReplicaState, event: BlockStored, result: ApplyResult) -> None:
        bs = event.block_size
        hashes = event.block_hashes
        if state.block_size is not None and bs != state.block_size:
            self._device_block_size(state, event, result)
            return
        parent = self._parent_key(state, event.parent_block_hash)
        if state.block_size is None:
            state.block_size = bs
        if len(hashes) > 1:
            state.size_confirmed = True  # partial blocks come one at a time
        extra = event_extra_keys(event.extra_keys, event.lora_name, len(hashes))
        keys = block_keys(pack_tokens(event.token_ids), bs, parent=parent, extra_keys=extra)
        chain = state.chain
        chain.update(zip(hashes, (event.parent_block_hash, *hashes[:-1]), strict=False))
        if state.warm_chain and len(chain) > 2 * _WARM_CHAIN:
            state.chain = dict(islice(chain.items(), len(chain) - _WARM_CHAIN, None))
        # From the start of a prompt, a store of blocks already held is vLLM re-announcing a
        # prefix-cache hit (never removed): idempotent. Anywhere else it is another copy.
        self._hold_run(state, hashes, keys, _GPU, result, count_dup=parent is not None)

    def _device_block_size(
        self, state: _ReplicaState, event: BlockStored, result: ApplyResult
    ) -> None:
        """A device store whose block size is not the replica's: a partial block, or the
        first full block of a replica that so far only published partial ones."""
        bs, known = event.block_size, state.block_size
        assert known is not None
        if bs < known and known % bs == 0 and len(event.block_hashes) == 1:
            try:
                parent = self._parent_key(state, event.parent_block_hash)
            except ValueError:
                # The parent is a partial unit vLLM hashed but never published (a unit
                # below half the block): nothing to key this one with.
                result.unresolved += 1
                return
            if parent is None:
                parent = root_key(known)
            extra = event_extra_keys(event.extra_keys, event.lora_name, 1)
            key = partial_key(parent, event.token_ids, extra[0] if extra else None)
            state.partial_unit = bs
            h = event.block_hashes[0]
            state.chain[h] = event.parent_block_hash
            self._hold(state, h, key, _GPU, result, count_dup=False)
            result.partial_blocks += 1
            return
        if bs > known and bs % known == 0 and not state.size_confirmed:
            # What looked like the block size was vLLM's prefix-match unit: the replica's
            # first stores were partial blocks of short prompts. Start over at the real size.
            self._clear_confirmed(state)
            state.block_size = bs
            state.partial_unit = known
            self._store_device(state, event, result)
            return
        raise ValueError(f"block_size {bs} differs from the replica's {known}")

    @staticmethod
    def _chunk_seen(state: _ReplicaState, cls: int, blocks: int) -> None:
        if blocks > state.chunk_blocks.get(cls, 0):
            state.chunk_blocks[cls] = min(blocks, _MAX_CHUNK_BLOCKS)

    def _parent_key(self, state: _ReplicaState, parent_hash: int | None) -> int | None:
        if parent_hash is None:
            return None
        parent = state.engine_to_key.get(parent_hash)
        if parent is None and state.ghost is not None:
            parent = state.ghost.get(parent_hash)
        if parent is None and state.name in self._attached:
            # A chunk whose previous chunk only its storage domain holds (a replica announcing
            # the shared files it found at start-up, or storing after a domain hit).
            domain = self._replicas.get(self._attached[state.name])
            if domain is not None:
                parent = domain.engine_to_key.get(parent_hash)
        if parent is None:
            raise ValueError("BlockStored whose parent block is unknown (missed events?)")
        return parent

    def _want_ghost(self, state: _ReplicaState) -> None:
        if state.ghost is None:
            state.ghost = {}

    def _hold_run(
        self,
        state: _ReplicaState,
        hashes: list[int],
        keys: list[int],
        cls: int,
        result: ApplyResult,
        *,
        count_dup: bool,
    ) -> None:
        """``_hold`` for a run of blocks; the device's common path, kept tight."""
        engine_to_key = state.engine_to_key
        masks = self._masks
        interned = self._interned
        bit = 1 << (_W * state.slot + cls)
        added = 0
        for h, key in zip(hashes, keys, strict=True):
            old = engine_to_key.get(h)
            if old is None:
                self._entries += 1
            else:
                del engine_to_key[h]  # re-inserted below: now the youngest
                if old != key:
                    # vLLM reused a hash for other content: the old block is gone from here.
                    self._forget_key(state, old)
            engine_to_key[h] = key
            mask = masks.get(key, 0)
            if mask & bit:
                if count_dup and old == key:
                    refs = state.refs
                    refs[(key, cls)] = refs.get((key, cls), 0) + 1
                continue
            mask |= bit
            masks[key] = interned.setdefault(mask, mask)
            added += 1
        state.tier_counts[cls] += added
        result.blocks_stored += added

    def _hold(
        self,
        state: _ReplicaState,
        h: int,
        key: int,
        cls: int,
        result: ApplyResult,
        *,
        count_dup: bool,
    ) -> None:
        """One more holding of ``key`` (vLLM hash ``h``) in confirmed class ``cls``."""
        engine_to_key = state.engine_to_key
        old = engine_to_key.get(h)
        if old is None:
            self._entries += 1
            if state.ghost:
                state.ghost.pop(h, None)
        elif old != key:
            self._forget_key(state, old)
        engine_to_key[h] = key
        bit = 1 << (_W * state.slot + cls)
        mask = self._masks.get(key, 0)
        if mask & bit:
            # A storage domain holds a file once, however often it was announced.
            if count_dup and not state.name.startswith(DOMAIN_PREFIX):
                state.refs[(key, cls)] = state.refs.get((key, cls), 0) + 1
            return
        self._set_mask(key, mask | bit)
        state.tier_counts[cls] += 1
        result.blocks_stored += 1

    def _forget_key(self, state: _ReplicaState, key: int) -> None:
        """Drop every confirmed class of ``key`` on this replica (its hash now means another
        block)."""
        shift = _W * state.slot
        mask = self._masks.get(key, 0)
        bits = (mask >> shift) & _CONFIRMED
        for c in range(3):
            if bits >> c & 1:
                state.tier_counts[c] -= 1
                state.refs.pop((key, c), None)
        self._set_mask(key, mask & ~(_CONFIRMED << shift))

    def _forget_if_unheld(self, state: _ReplicaState, h: int, key: int, mask: int) -> None:
        """The block left a confirmed class: forget its hash when no confirmed class holds it."""
        if (mask >> (_W * state.slot)) & _CONFIRMED:
            return
        if state.engine_to_key.pop(h, None) is not None:
            self._entries -= 1
        state.chain.pop(h, None)
        ghost = state.ghost
        if ghost is not None:
            ghost[h] = key
            if len(ghost) > _GHOST_MAX:
                del ghost[next(iter(ghost))]

    # --- hybrid models: the device blocks of the other KV cache groups -----------------------

    def _store_group(self, state: _ReplicaState, event: BlockStored, result: ApplyResult) -> None:
        """A device store of KV cache group > 0 (Mamba, sliding window). Its blocks carry the
        same vLLM hashes as group 0's at the same positions, so they are placed through the
        replica's hash map; a lower tier of such a group is not tracked (never claimed)."""
        if event.medium is not Medium.GPU or not event.confirmed:
            result.ignored += 1
            return
        by_hash, by_key = state.groups.setdefault(event.group_idx, ({}, {}))
        for h in event.block_hashes:
            rec = by_hash.get(h)
            if rec is None:
                key = state.engine_to_key.get(h)
                if key is None:
                    result.unresolved += 1
                    continue
                by_hash[h] = [key, 1]
                by_key[key] = by_key.get(key, 0) + 1
            else:
                rec[1] += 1

    def _remove_group(self, state: _ReplicaState, event: BlockRemoved, result: ApplyResult) -> None:
        if event.medium is not Medium.GPU or not event.confirmed:
            result.ignored += 1
            return
        group = state.groups.get(event.group_idx)
        if group is None:
            result.unresolved += len(event.block_hashes)
            return
        by_hash, by_key = group
        for h in event.block_hashes:
            rec = by_hash.get(h)
            if rec is None:
                result.unresolved += 1
                continue
            rec[1] -= 1
            if rec[1] <= 0:
                del by_hash[h]
                key = rec[0]
                left = by_key.get(key, 0) - 1
                if left > 0:
                    by_key[key] = left
                else:
                    by_key.pop(key, None)

    def _cap_hybrid(
        self,
        request: RequestKeys,
        keys: Sequence[int],
        states: list[_ReplicaState],
        block_size: int,
        out: dict[str, PrefixMatch],
    ) -> None:
        """On a hybrid model vLLM's hit is the longest device prefix at whose end every other
        group holds its block too (a Mamba group's state at that point). Lower tiers of such
        replicas are not counted: their other groups' copies are not tracked."""
        for state in states:
            if not state.groups:
                continue
            holders = [by_key for _by_hash, by_key in state.groups.values()]
            match = out[state.name]
            device = match.blocks_by_tier.get(Medium.GPU, 0)
            if match.partial_tokens and device == match.blocks:
                unit = state.partial_unit or block_size
                pieces = dict(request.partial_keys(block_size, device, unit))
                key = pieces.get(match.partial_tokens)
                if key is not None and all(key in h for h in holders):
                    match.blocks_by_tier = {Medium.GPU: device}
                    match.unconfirmed_by_tier = {}
                    continue
            b = device
            while b and not all(keys[b - 1] in h for h in holders):
                b -= 1
            match.blocks = b
            match.blocks_by_tier = {Medium.GPU: b} if b else {}
            match.unconfirmed_by_tier = {}
            match.partial_tokens = 0
            match.partial_unit = None

    # --- tier-only stores: resolving offloaded chunks ------------------------------------------

    @staticmethod
    def _landing(events: list[Event]) -> dict[int, set[int]]:
        """Per class, the hashes a batch's tier-only stores name (see ``_chunk_members``)."""
        out: dict[int, set[int]] = {}
        for e in events:
            if isinstance(e, BlockStored) and not e.token_ids and not e.group_idx:
                out.setdefault(_cls(e.medium, e.confirmed), set()).update(e.block_hashes)
        return out

    def _store_tier_only(
        self, state: _ReplicaState, hashes: list[int], cls: int, result: ApplyResult
    ) -> None:
        state.warm_chain = False  # from now on every parent link is kept
        state.whole_loads.add(cls)
        for h in hashes:
            members = self._chunk_members(state, h, cls, result)
            if not members:
                result.unresolved += 1
                continue
            self._hold_chunk(state, h, members, cls, result)

    def _hold_chunk(
        self,
        state: _ReplicaState,
        h: int,
        members: tuple[int, ...],
        cls: int,
        result: ApplyResult,
    ) -> None:
        if len(members) > 1:
            rec = state.chunks.get((cls, h))
            if rec is None:
                state.chunks[(cls, h)] = [members, 1]
            else:
                members = rec[0]
                rec[1] += 1
        for m in members:
            key = state.engine_to_key.get(m)
            if key is None:
                result.unresolved += 1
                continue
            self._hold(state, m, key, cls, result, count_dup=True)

    def _chunk_members(
        self, state: _ReplicaState, h: int, cls: int, result: ApplyResult | None = None
    ) -> tuple[int, ...]:
        """The block hashes of the offloaded chunk whose last block is ``h``.

        Offloading stores a prompt's chunks in order, skipping those already held, so when a
        chunk lands the one before it is held in the same class, or lands in the same batch
        (vLLM announces one step's chunks in set order): the chunk is ``h`` and the blocks
        before it back to that one, at most a chunk's length. The length is learned per
        class: until two walks (back to the previous chunk, or to the prompt's start) agree
        on a gcd, only ``h`` is claimed, and the chunk is resolved again once the length is
        known. Claiming less than the replica holds only loses a prediction; the walk never
        claims a block past the previous chunk.
        """
        if h not in state.engine_to_key:
            return ()
        n = state.chunk_blocks.get(cls)
        if n is None:
            self._observe_chunk(state, h, cls)
            n = state.chunk_blocks.get(cls)
            if n is None or result is None:
                if n is None:
                    pending = state.unsized.setdefault(cls, [])
                    if len(pending) < _MAX_UNSIZED:
                        pending.append(h)
                return (h,)
            self._resolve_unsized(state, cls, n, result)
        return self._walk_chunk(state, h, cls, n)

    def _walk_chunk(self, state: _ReplicaState, h: int, cls: int, n: int) -> tuple[int, ...]:
        chain, engine_to_key = state.chain, state.engine_to_key
        landing = state.landing.get(cls, ())
        bit = 1 << (_W * state.slot + cls)
        masks = self._masks
        members = [h]
        cur = h
        while len(members) < n:
            parent = chain.get(cur)
            if parent is None or parent in landing:
                break
            key = engine_to_key.get(parent)
            if key is None or masks.get(key, 0) & bit:
                break
            members.append(parent)
            cur = parent
        return tuple(members)

    def _resolve_unsized(self, state: _ReplicaState, cls: int, n: int, result: ApplyResult) -> None:
        """The chunk length was just learned: claim the rest of the chunks stored before,
        which only their last block held so far."""
        bit = 1 << (_W * state.slot + cls)
        if cls >= 3:
            for h in state.unsized.pop(cls, ()):
                for held in state.held.values():
                    rec = held.get((cls, h))
                    if rec is None or len(rec.keys) != 1:
                        continue
                    members = self._walk_chunk(state, h, cls, n)
                    # ``h`` itself may have left the hash map since (its device copy was
                    # evicted); its key is the one its record holds. The walk checked the rest.
                    keys = (
                        *(state.engine_to_key[m] for m in reversed(members[1:])),
                        rec.keys[0],
                    )
                    if len(keys) > 1:
                        self._unhold(state, rec)
                        self._hold_unconfirmed(
                            state, held, (cls, h), keys, cls, rec.expires, result
                        )
            return
        for h in state.unsized.pop(cls, ()):
            key = state.engine_to_key.get(h)
            if key is None or not self._masks.get(key, 0) & bit or (cls, h) in state.chunks:
                continue
            members = self._walk_chunk(state, h, cls, n)
            if len(members) > 1:
                state.chunks[(cls, h)] = [members, 1]
                for m in members[1:]:
                    self._hold(state, m, state.engine_to_key[m], cls, result, count_dup=True)

    def _observe_chunk(self, state: _ReplicaState, h: int, cls: int) -> None:
        gcd, seen, last = state.chunk_obs.get(cls, (0, 0, -1))
        if h == last:
            return  # a re-store of the chunk just walked says nothing new about the length
        chain, engine_to_key = state.chain, state.engine_to_key
        landing = state.landing.get(cls, ())
        bit = 1 << (_W * state.slot + cls)
        masks = self._masks
        cur, steps = h, 0
        while steps < _MAX_WALK:
            if cur not in chain:
                return  # the chain was not tracked that far back
            parent = chain[cur]
            steps += 1
            if parent is None:
                break  # the start of the prompt
            if parent in landing:
                break  # the previous chunk, landing in the same batch
            key = engine_to_key.get(parent)
            if key is None:
                return
            if masks.get(key, 0) & bit:
                break  # the previous chunk, held in this class
            cur = parent
        else:
            return
        # Keep the gcd so far and how many observations made it.
        gcd, seen = math.gcd(gcd, steps), seen + 1
        state.chunk_obs[cls] = (gcd, seen, h)
        if seen >= 2 and gcd <= _MAX_CHUNK_BLOCKS:
            state.chunk_blocks[cls] = gcd

    # --- confirmed removals ---------------------------------------------------------------------

    def _remove(self, state: _ReplicaState, event: BlockRemoved, result: ApplyResult) -> None:
        cls = int(event.medium)
        engine_to_key = state.engine_to_key
        chunks = state.chunks
        removed = 0
        for h in event.block_hashes:
            members: tuple[int, ...] = (h,)
            rec = chunks.get((cls, h)) if chunks else None
            if rec is not None:
                members = rec[0]
                rec[1] -= 1
                if rec[1] <= 0:
                    del chunks[(cls, h)]
            for m in members:
                key = engine_to_key.get(m)
                if key is None:
                    result.unresolved += 1
                    continue
                removed += self._release(state, m, key, cls)
        result.blocks_removed += removed

    def _release(self, state: _ReplicaState, h: int, key: int, cls: int) -> int:
        """One holding of ``key`` in ``cls`` fewer; returns 1 when the class no longer holds it."""
        refs = state.refs
        if refs:
            extra = refs.get((key, cls))
            if extra:
                if extra == 1:
                    del refs[(key, cls)]
                else:
                    refs[(key, cls)] = extra - 1
                return 0
        bit = 1 << (_W * state.slot + cls)
        mask = self._masks.get(key, 0)
        if not mask & bit:
            return 0
        mask &= ~bit
        self._set_mask(key, mask)
        state.tier_counts[cls] -= 1
        self._forget_if_unheld(state, h, key, mask)
        return 1

    # --- unconfirmed holdings ------------------------------------------------------------------

    def _store_unconfirmed(
        self, state: _ReplicaState, event: BlockStored, source: str, result: ApplyResult
    ) -> None:
        cls = _cls(event.medium, confirmed=False)
        held = state.held.setdefault(source, OrderedDict())
        expires = self._clock() + self.unconfirmed_ttl_s
        if not event.token_ids:
            # Tier-only (llm-d's FS backend): chunks named by their last block hash.
            state.warm_chain = False
            state.whole_loads.add(cls)
            for h in event.block_hashes:
                rec = held.get((cls, h))
                if rec is not None:
                    rec.expires = expires
                    held.move_to_end((cls, h))
                    continue
                members = self._chunk_members(state, h, cls, result)
                if not members:
                    result.unresolved += 1
                    continue
                keys = tuple(state.engine_to_key[m] for m in members)
                self._hold_unconfirmed(state, held, (cls, h), keys, cls, expires, result)
            return
        # Self-describing chunks with the publisher's own hashes (LMCache): re-keyed through
        # their tokens at the replica's block size, chained through the parent chunk.
        bs = state.block_size
        if bs is None:
            raise ValueError("unconfirmed store before the replica's block size is known")
        n_hashes = len(event.block_hashes)
        size = event.block_size
        if size % bs and n_hashes > 1:
            raise ValueError(f"chunks of {size} tokens are not whole {bs}-token blocks")
        parent_hash = event.parent_block_hash
        parent: int | None = None
        if parent_hash is not None:
            prec = held.get((cls, parent_hash))
            if prec is None or not prec.keys:
                result.unresolved += n_hashes
                return
            parent = prec.keys[-1]
        # LMCache's chunks: their blocks are keyed at the replica's size, where its events say
        # nothing of extra keys but the LoRA name.
        extra = event_extra_keys(None, event.lora_name, size // bs)
        if size % bs == 0:
            self._chunk_seen(state, cls, size // bs)
        for i, h in enumerate(event.block_hashes):
            chunk = event.token_ids[i * size : (i + 1) * size]
            keys = tuple(block_keys(pack_tokens(chunk), bs, parent=parent, extra_keys=extra))
            if not keys:
                result.ignored += 1
                break
            rec = held.get((cls, h))
            if rec is not None:
                rec.expires = expires
                held.move_to_end((cls, h))
            else:
                self._hold_unconfirmed(state, held, (cls, h), keys, cls, expires, result)
            if size % bs:
                break  # a final partial chunk: nothing can chain from it
            parent = keys[-1]

    def _hold_unconfirmed(
        self,
        state: _ReplicaState,
        held: OrderedDict[tuple[int, int], _Held],
        chunk_id: tuple[int, int],
        keys: tuple[int, ...],
        cls: int,
        expires: float,
        result: ApplyResult,
    ) -> None:
        bit = 1 << (_W * state.slot + cls)
        masks, refs = self._masks, state.refs
        for key in keys:
            mask = masks.get(key, 0)
            if mask & bit:
                refs[(key, cls)] = refs.get((key, cls), 0) + 1
            else:
                self._set_mask(key, mask | bit)
                state.tier_counts[cls] += 1
        held[chunk_id] = _Held(cls, keys, expires)
        state.unconfirmed_blocks += len(keys)
        self._entries += len(keys)
        result.unconfirmed_blocks += len(keys)
        over = state.unconfirmed_blocks - self.unconfirmed_max_blocks
        while over > 0 and state.held:
            over -= self._drop_oldest_holding(state)

    def _remove_unconfirmed(
        self, state: _ReplicaState, event: BlockRemoved, source: str, result: ApplyResult
    ) -> None:
        """Publishers of unconfirmed media (as of vLLM 0.32) send no removals; honour one if
        they do."""
        cls = _cls(event.medium, confirmed=False)
        held = state.held.get(source)
        for h in event.block_hashes:
            rec = held.pop((cls, h), None) if held else None
            if rec is None:
                result.unresolved += 1
                continue
            result.blocks_removed += self._unhold(state, rec)

    def _unhold(self, state: _ReplicaState, rec: _Held) -> int:
        bit = 1 << (_W * state.slot + rec.cls)
        masks, refs = self._masks, state.refs
        gone = 0
        for key in rec.keys:
            extra = refs.get((key, rec.cls)) if refs else None
            if extra:
                if extra == 1:
                    del refs[(key, rec.cls)]
                else:
                    refs[(key, rec.cls)] = extra - 1
                continue
            mask = masks.get(key, 0)
            if mask & bit:
                self._set_mask(key, mask & ~bit)
                state.tier_counts[rec.cls] -= 1
                gone += 1
        state.unconfirmed_blocks -= len(rec.keys)
        self._entries -= len(rec.keys)
        return gone

    def _drop_oldest_holding(self, state: _ReplicaState) -> int:
        """Drop the replica's oldest unconfirmed holding (any source); returns its blocks."""
        oldest: tuple[float, str] | None = None
        for source, held in state.held.items():
            if held:
                first = next(iter(held.values()))
                if oldest is None or first.expires < oldest[0]:
                    oldest = (first.expires, source)
        if oldest is None:
            return 0
        held = state.held[oldest[1]]
        _, rec = held.popitem(last=False)
        self._unhold(state, rec)
        self.expired_blocks += len(rec.keys)
        return len(rec.keys)

    def _drop_source_holdings(self, state: _ReplicaState, source: str) -> None:
        held = state.held.pop(source, None)
        for rec in (held or {}).values():
            self._unhold(state, rec)

    def _expire_state(self, state: _ReplicaState, now: float) -> int:
        gone = 0
        for held in state.held.values():
            while held:
                rec = next(iter(held.values()))
                if rec.expires > now:
                    break
                held.popitem(last=False)
                self._unhold(state, rec)
                gone += len(rec.keys)
        self.expired_blocks += gone
        return gone

    def expire(self, replica: str | None = None) -> int:
        with self._lock:
            now = self._clock()
            states = (
                list(self._replicas.values())
                if replica is None
                else [s for s in (self._replicas.get(replica),) if s is not None]
            )
            return sum(self._expire_state(s, now) for s in states if s.held)

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

    # --- lookups ------------------------------------------------------------------------------

    def lookup(
        self,
        tokens: Sequence[int] | RequestKeys,
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        replicas: Iterable[str] | None = None,
    ) -> dict[str, PrefixMatch]:
        request = (
            tokens
            if isinstance(tokens, RequestKeys)
            else RequestKeys(tokens, lora_name=lora_name, cache_salt=cache_salt)
        )
        # Hashing the keys reads every token (about 0.1 ms per thousand): done before taking
        # the lock, so the event feeds apply meanwhile. The block sizes read here without the
        # lock are a hint (a list of a dict's values is taken whole under the GIL); a size
        # that appears in between is hashed under the lock as before.
        for size in {s.block_size for s in list(self._replicas.values())}:
            if size is not None:
                request.keys(size)
        with self._lock:
            wanted = (
                [s for s in self._replicas.values() if not s.name.startswith(DOMAIN_PREFIX)]
                if replicas is None
                else [self._replicas[r] for r in replicas if r in self._replicas]
            )
            by_size: dict[int, list[_ReplicaState]] = {}
            out: dict[str, PrefixMatch] = {}
            for state in wanted:
                block_size = self.block_size(state.name)
                if block_size is None:
                    out[state.name] = PrefixMatch(state.name, 0, 0, {})
                else:
                    by_size.setdefault(block_size, []).append(state)
            for block_size, states in by_size.items():
                keys = request.keys(block_size)
                out.update(self._walk(keys, states, block_size, self._lifted(states)))
                self._probe_partials(request, states, block_size, out)
                self._cap_hybrid(request, keys, states, block_size, out)
            return out

    def _probe_partials(
        self,
        request: RequestKeys,
        states: list[_ReplicaState],
        block_size: int,
        out: dict[str, PrefixMatch],
    ) -> None:
        get = self._masks.get
        for state in states:
            unit = state.partial_unit
            if unit is None:
                continue
            match = out[state.name]
            if match.blocks_by_tier.get(Medium.GPU, 0) != match.blocks:
                continue  # vLLM probes partial blocks right after its device prefix only
            bit = 1 << (_W * state.slot + _GPU)
            for tokens, key in reversed(request.partial_keys(block_size, match.blocks, unit)):
                if get(key, 0) & bit:
                    match.partial_tokens = tokens
                    match.partial_unit = unit
                    break

    def _lifted(self, states: list[_ReplicaState]) -> Callable[[int, int], int]:
        """``_masks.get``, with each storage domain's STORAGE bit copied to the STORAGE bit of
        the replicas among ``states`` attached to it: a lookup sees the domain's holdings as
        the replica's own STORAGE tier."""
        get = self._masks.get
        lifts: dict[int, int] = {}
        for state in states:
            domain = self._replicas.get(self._attached.get(state.name, ""))
            if domain is not None:
                dbit = 1 << (_W * domain.slot + _STORAGE)
                lifts[dbit] = lifts.get(dbit, 0) | 1 << (_W * state.slot + _STORAGE)
        if not lifts:
            return get
        pairs = tuple(lifts.items())
        memo: dict[int, int] = {}  # a fleet has few distinct masks (they are interned)

        def lifted(key: int, default: int = 0) -> int:
            mask = get(key, default)
            out = memo.get(mask)
            if out is None:
                out = mask
                for dbit, bits in pairs:
                    if mask & dbit:
                        out |= bits
                memo[mask] = out
            return out

        return lifted

    def _walk(
        self,
        keys: Sequence[int],
        states: list[_ReplicaState],
        block_size: int,
        get: Callable[[int, int], int] | None = None,
    ) -> dict[str, PrefixMatch]:
        """One pass over the request's keys, tracking what each replica can serve, the way
        vLLM serves it: its device prefix first, then, from the first block the device
        lacks, blocks a lower tier holds (a device copy after that point is no use: vLLM does
        not go back to its prefix cache after the connector's hit). The lower run ends on a
        whole chunk of its tier (``_trim``): offloading tiers load whole chunks.

        Consecutive blocks usually have the same mask, so the per-replica accounting runs once
        per run of equal masks, not once per block: a replica's phase can only change on the
        first block of a run.
        """
        counts = {s.slot: [0] * _W for s in states}
        ended: dict[int, int] = {}
        device = 0  # slots still in their device prefix, as bits at the slots' GPU positions
        for s in states:
            device |= 1 << (_W * s.slot)
        lower = 0  # slots past their device prefix, served by a lower tier
        alive_bits = device * _SLOT
        get = get or self._masks.get
        prev = -1
        run = 0
        for i, key in enumerate(keys):
            mask = get(key, 0) & alive_bits
            if mask == prev:
                run += 1
                continue
            if run:
                self._account(prev, run, device, counts)
            alive = device | lower
            in_lower = (mask >> 1 | mask >> 2 | mask >> 3 | mask >> 4 | mask >> 5) & alive
            still_device = mask & device
            lower = (lower | (device & ~still_device)) & in_lower
            device = still_device
            if device | lower != alive:
                gone = alive & ~(device | lower)
                while gone:
                    low = gone & -gone
                    ended[low.bit_length() // _W] = i
                    gone ^= low
                alive_bits = (device | lower) * _SLOT
                mask &= alive_bits
                if not alive_bits:
                    run = 0
                    break
            prev = mask
            run = 1
        if run and alive_bits:
            self._account(prev, run, device, counts)
        out: dict[str, PrefixMatch] = {}
        for s in states:
            c = counts[s.slot]
            blocks = ended.get(s.slot, len(keys))
            if blocks > c[0]:
                blocks = self._trim(s, keys, blocks, c, get)
            by_tier = {tier: c[tier] for tier in _TIERS if c[tier]}
            unconfirmed = {tier: c[tier + 3] for tier in _TIERS if c[tier + 3]}
            out[s.name] = PrefixMatch(s.name, block_size, blocks, by_tier, unconfirmed)
        return out

    @staticmethod
    def _account(mask: int, run: int, device: int, counts: dict[int, list[int]]) -> None:
        """Count ``run`` blocks of ``mask`` per slot: in the device prefix as GPU, past it as
        the fastest lower class holding them."""
        for slot, c in counts.items():
            shift = _W * slot
            if device >> shift & 1:
                c[0] += run
                continue
            bits = (mask >> shift) & (_SLOT & ~1)
            if bits:
                c[(bits & -bits).bit_length() - 1] += run

    def _trim(
        self,
        state: _ReplicaState,
        keys: Sequence[int],
        blocks: int,
        c: list[int],
        get: Callable[[int, int], int],
    ) -> int:
        """End a lower-tier run on a whole chunk of the tier its last block is in. vLLM's
        offloading connector also skips a load shorter than one chunk (a device prefix that
        ends inside the only held chunk), so for its tiers such a run counts nothing."""
        shift = _W * state.slot

        def fastest_lower(i: int) -> int:
            bits = (get(keys[i], 0) >> shift) & (_SLOT & ~1)
            return (bits & -bits).bit_length() - 1

        cls = fastest_lower(blocks - 1)
        # A storage domain's chunks are what its replicas wrote: their length is learned there.
        domain = self._replicas.get(self._attached.get(state.name, "")) if cls == _STORAGE else None
        learned = state if domain is None else domain
        n = learned.chunk_blocks.get(cls, 1)
        end = max(c[0], blocks // n * n)
        if cls in learned.whole_loads and end - c[0] < n:
            end = c[0]  # vLLM's offloading connector loads at least a chunk, or nothing
        for i in range(end, blocks):
            c[fastest_lower(i)] -= 1
        return end

    def block_tiers(
        self, replica: str, tokens: Sequence[int] | RequestKeys
    ) -> list[frozenset[str]]:
        """Per full block of ``tokens``, the classes the replica holds it in (``"CPU"``,
        ``"STORAGE_UNCONFIRMED"``...): what ``/debug`` pages and tests look at."""
        request = tokens if isinstance(tokens, RequestKeys) else RequestKeys(tokens)
        with self._lock:
            state = self._replicas.get(replica)
            block_size = self.block_size(replica)
            if state is None or block_size is None:
                return []
            shift = _W * state.slot
            get = self._lifted([state])
            out = []
            for key in request.keys(block_size):
                bits = (get(key, 0) >> shift) & _SLOT
                out.append(frozenset(_CLASS_NAMES[c] for c in range(_W) if bits >> c & 1))
            return out

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
        )

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
                if s.chain is not None:
                    size += sys.getsizeof(s.chain) + 36 * len(s.chain)
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
