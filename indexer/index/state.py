"""The shared store of ``InMemoryPrefixIndex``: the tables every concern of the index reads and
writes, the constants of their layout, and the primitives that keep masks.

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
- ``_masks``, ``engine_to_key`` and ``chain`` (the tables that grow with what a fleet holds)
  are the native core's ``MaskMap`` and ``U64Map`` where it runs (raw 64-bit words, about a
  third of a dict's bytes; indexer/native/tables.h), dicts where the Python core runs; the
  code here and in every mixin uses only what both do.

indexer/snapshot.py copies this layout whole (a replica's ``_ReplicaState`` and its bits).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from kvroute.indexer.wire import Medium

_TIERS = (Medium.GPU, Medium.CPU, Medium.STORAGE)
_W = 6  # bits per replica slot
_SLOT = (1 << _W) - 1
_CONFIRMED = 0b000111
_GPU = int(Medium.GPU)
_CPU = int(Medium.CPU)
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
_MAX_UNPLACED = 1024
_CLASS_NAMES = tuple(
    [t.name for t in (Medium.GPU, Medium.CPU, Medium.STORAGE)]
    + [t.name + "_UNCONFIRMED" for t in (Medium.GPU, Medium.CPU, Medium.STORAGE)]
)


def _cls(tier: Medium, confirmed: bool) -> int:
    return int(tier) if confirmed else int(tier) + 3


@dataclass(slots=True)
class _Held:
    """An unconfirmed chunk: the keys it holds in one class, until it expires."""

    cls: int
    keys: tuple[int, ...]
    expires: float


@dataclass(slots=True)
class _LossWindow:
    """Since a batch of the replica's stream was lost at its source (losses.py): when the
    window opened, what the events since proved held ((class, group) -> vLLM hashes stored;
    group -> parents of device stores), and the window a later loss opened meanwhile."""

    opened: float
    kept: dict[tuple[int, int], set[int]] = field(default_factory=dict)
    parents: dict[int, set[int]] = field(default_factory=dict)
    next: _LossWindow | None = None


class _ReplicaState:
    __slots__ = (
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
    )

    def __init__(
        self, name: str, slot: int, table: Callable[[], MutableMapping[int, Any]] = dict
    ) -> None:
        # ``table``: the kind of table of the two per-block maps below, a dict or the native
        # core's U64Map (the same operations, about a third of the bytes)
        self.name = name
        self.slot = slot
        self.block_size: int | None = None
        # True once a device store of several blocks showed the block size is not vLLM's
        # finer prefix-match unit (partial blocks are published one at a time)
        self.size_confirmed = False
        self.partial_unit: int | None = None
        self.engine_to_key: MutableMapping[int, int] = table()
        self.tier_counts = [0] * _W
        # (key, class) -> holdings beyond the first (only keys stored more than once)
        self.refs: dict[tuple[int, int], int] = {}
        # block hash -> parent hash of device stores. Only the last ``_WARM_CHAIN`` or so
        # (``warm_chain``) until the replica sends a tier-only store, all of them after.
        self.chain: MutableMapping[int, int | None] = table()
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
        self.chunks: dict[tuple[int, int], list[Any]] = {}
        # hybrid models: the KV cache group whose device stores are keyed from their tokens
        # (full attention; None until known), and each group's (kind, sliding window, block
        # size) as its stores announce them (hybrid.py)
        self.primary: int | None = None
        self.group_specs: dict[int, tuple[str | None, int | None, int]] = {}
        # the other groups: group -> vLLM hash -> [our key, holdings], and our key ->
        # holdings, of the device blocks that group caches (a Mamba group keeps its state at
        # a few positions only, a sliding-window group the blocks of its window; vLLM's hit
        # must satisfy every group's rule)
        self.groups: dict[int, tuple[dict[int, list[int]], dict[int, int]]] = {}
        # (group, vLLM hash) -> holdings of other groups' blocks whose hash no keyed store
        # has placed yet (a partial block resolved later), oldest first, at most _MAX_UNPLACED
        self.unplaced: dict[tuple[int, int], int] = {}
        # recently forgotten hash -> key; None until a store needs resolving by hash only
        self.ghost: dict[int, int] | None = None
        # source -> (class, chunk id) -> unconfirmed holding, oldest first
        self.held: dict[str, OrderedDict[tuple[int, int], _Held]] = {}
        self.confirmed_sources: set[str] = set()
        self.unconfirmed_blocks = 0
        # classes a lower-tier block pool stored in (SimpleCPUOffloadConnector): a bare
        # AllBlocksCleared may be its reset (resets.py)
        self.pool_tiers: set[int] = set()
        # True while the index has applied every device store since the device was last
        # empty (a device clear, a new process): False after its stream lost history, when a
        # block the index does not hold may be held since before (confirmed.py)
        self.device_history = True
        # what the router said the next device clear is (resets.py): 0 nothing, 1 a connector
        # reset with the device's (its AllBlocksCleared marks where the reset happened in
        # the stream), 2 a device-only reset (the connectors keep their tiers)
        self.reset_pending = 0
        # vLLM hash -> when its CPU holding ages out: CPU blocks of a connector that resets
        # without a word (vLLM's OffloadingConnector), held at a device clear the router did
        # not forward (perhaps a connector reset sent to the replica directly): dropped then
        # unless stored again (resets.py)
        self.doubted: dict[int, float] = {}
        # open while what a batch lost at its source removed may still be believed (losses.py)
        self.loss: _LossWindow | None = None
        # keys of device blocks a store from the prompt's start named while held, taken once:
        # vLLM may hold a second copy the index does not count (confirmed.py), so their absence
        # from the index is no proof a later store of them is a computation (hybrid.py)
        self.uncounted: dict[int, None] = {}

    def forget_configuration(self) -> None:
        """Forget what the replica's events taught of its configuration (block size, prefix-
        match unit, hybrid groups, chunk lengths, a lower-tier block pool): a cleared replica,
        or a restarted process, may run another one and is learned again."""
        self.block_size = None
        self.size_confirmed = False
        self.partial_unit = None
        self.primary = None
        self.group_specs = {}
        self.chunk_blocks = {}
        self.chunk_obs = {}
        self.pool_tiers = set()


class IndexStore:
    """The index-wide tables, as ``InMemoryPrefixIndex.__init__`` (memory.py) sets them, and the
    primitives that write masks. Each concern's mixin builds on this class; memory.py composes
    them into the backend."""

    max_entries: int
    unconfirmed_ttl_s: float
    unconfirmed_max_blocks: int
    evicted_entries: int
    expired_blocks: int
    refuted_blocks: int
    _clock: Callable[[], float]
    _masks: MutableMapping[int, int]
    _interned: dict[int, int]
    _replicas: dict[str, _ReplicaState]
    _free_slots: list[int]
    _next_slot: int
    _entries: int
    # replica -> the pseudo-replica of the storage domain it is attached to
    _attached: dict[str, str]
    _lock: threading.RLock
    # the native core's module (indexer/native_core.py), None where the Python core runs
    _native: Any
    # changes of what lookups' plans depend on (plans.py): replicas, their configuration,
    # attachments; and the plans
    _layout_epoch: int
    _plans: dict[Any, Any]

    def _intern(self, mask: int) -> int:
        return self._interned.setdefault(mask, mask)

    def _set_mask(self, key: int, mask: int) -> None:
        if mask:
            self._masks[key] = self._interned.setdefault(mask, mask)
        else:
            self._masks.pop(key, None)

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
