"""``InMemoryPrefixIndex``: the in-process backend of ``PrefixIndex``.

It is the store of state.py with one mixin per concern of the index (README.md maps them):
this module keeps the replicas (their slots, clears and snapshots) and applies a batch of one
replica's events in order, each by the rules of its concern, under one lock that lookups take
too. What a clear, a silent connector reset or an unknown event means is resets.py's.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, MutableMapping
from itertools import islice
from typing import TYPE_CHECKING, Any

from kvroute.indexer.index.api import DOMAIN_PREFIX, ApplyResult, PrefixIndex
from kvroute.indexer.index.capacity import Capacity
from kvroute.indexer.index.chunks import OffloadedChunks
from kvroute.indexer.index.confirmed import ConfirmedHoldings
from kvroute.indexer.index.domains import StorageDomains
from kvroute.indexer.index.drafts import SpeculativeDrafts
from kvroute.indexer.index.hybrid import HybridGroups
from kvroute.indexer.index.lookup import Lookups
from kvroute.indexer.index.losses import SourceLosses
from kvroute.indexer.index.native_runs import NativeRuns
from kvroute.indexer.index.plans import LookupPlan, layout_of
from kvroute.indexer.index.resets import Resets
from kvroute.indexer.index.state import _W, _ReplicaState
from kvroute.indexer.index.unconfirmed import UnconfirmedHoldings
from kvroute.indexer.native_core import NATIVE, UNAVAILABLE
from kvroute.indexer.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    Medium,
    UnknownEvent,
)

if TYPE_CHECKING:
    from kvroute.indexer.snapshot import ReplicaState

__all__ = ["InMemoryPrefixIndex"]

# The default entry cap: what fits in about 8 GiB at each core's bytes per entry, measured
# (docs/benchmarks.md: the native tables 55-69 bytes, dicts 145-186), so a thousand GPU
# replicas holding 30,000 device and 100,000 CPU blocks each (130M entries) fit in the native
# core's default (134M entries); the Python core's is 44.7M.
DEFAULT_INDEX_BYTES = 8 << 30
_BYTES_PER_ENTRY = {"native": 64, "python": 192}


# The mixins come before PrefixIndex: its abstract methods would hide their implementations.
class InMemoryPrefixIndex(
    ConfirmedHoldings,
    NativeRuns,
    OffloadedChunks,
    HybridGroups,
    UnconfirmedHoldings,
    StorageDomains,
    SpeculativeDrafts,
    Resets,
    SourceLosses,
    Capacity,
    Lookups,
    PrefixIndex,
):
    """Thread-safe in-memory backend (one lock; batches and lookups are short)."""

    def __init__(
        self,
        max_entries: int | None = None,
        *,
        unconfirmed_ttl_s: float = 600.0,
        unconfirmed_max_blocks: int = 262_144,
        clock: Callable[[], float] = time.monotonic,
        core: str | None = None,
    ) -> None:
        # core: "native" (the C++ walk; an error where the extension is missing), "python"
        # (the specification), None: native where it was built (indexer/native_core.py)
        if core not in (None, "native", "python"):
            raise ValueError("core must be 'native', 'python' or None")
        if core == "native" and NATIVE is None:
            raise RuntimeError(f"the native index core is not available: {UNAVAILABLE}")
        self._native = None if core == "python" else NATIVE
        if max_entries is None:
            core_name = "python" if self._native is None else "native"
            max_entries = DEFAULT_INDEX_BYTES // _BYTES_PER_ENTRY[core_name]
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
        self.refuted_blocks = 0
        # the two big tables: native (raw 64-bit words, about a third of a dict's bytes) where
        # the native core runs, dicts otherwise; the same operations on both (state.py)
        self._masks: MutableMapping[int, int] = (
            {} if self._native is None else self._native.MaskMap()
        )
        self._hash_table: Callable[[], MutableMapping[int, Any]] = (
            dict if self._native is None else self._native.U64Map
        )
        self._interned: dict[int, int] = {}
        self._replicas: dict[str, _ReplicaState] = {}
        self._free_slots: list[int] = []
        self._next_slot = 0
        self._entries = 0
        # replica -> the pseudo-replica of the storage domain it is attached to
        self._attached: dict[str, str] = {}
        # replica -> its EAGLE-style speculative method (drafts.py): a setting, kept across
        # clears and restarts as attachments are
        self._drafts = {}
        self._deferred = []
        self._starts = []
        self._computed = set()
        self._last_full = self._prev_full = None
        self._lock = threading.RLock()
        # lookups' plans (plans.py), and the count of layout changes that ages them
        self._plans: dict[tuple[str, ...] | None, LookupPlan] = {}
        self._layout_epoch = 0

    def _intern_limit(self) -> int:
        """Distinct masks kept interned before the table is dropped: masks a batch replaced
        stay in it until then, and a mask is 6 bits per replica slot wide (750 bytes at 1,000
        replicas), so the limit keeps the table near 16 MiB whatever the fleet."""
        width = self._next_slot * _W // 8 + 32
        return min(1 << 16, max(1024, (16 << 20) // width))

    # --- replicas -----------------------------------------------------------------------------

    def _state(self, replica: str) -> _ReplicaState:
        state = self._replicas.get(replica)
        if state is None:
            if self._free_slots:
                slot = self._free_slots.pop()
            else:
                slot = self._next_slot
                self._next_slot += 1
            state = self._replicas[replica] = _ReplicaState(replica, slot, self._hash_table)
            self._layout_epoch += 1
        return state

    def add_replica(self, replica: str) -> None:
        with self._lock:
            self._state(replica)

    def replicas(self) -> list[str]:
        with self._lock:
            return list(self._replicas)

    def export_replica(self, replica: str) -> ReplicaState | None:
        from kvroute.indexer.snapshot import export_state  # it builds on this package

        with self._lock:
            return export_state(self, replica)

    def import_replica(self, replica: str, state: ReplicaState) -> int:
        from kvroute.indexer.snapshot import import_state

        with self._lock:
            self._layout_epoch += 1
            try:
                return import_state(self, replica, state)
            finally:
                self._layout_epoch += 1

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
            self._layout_epoch += 1  # the configuration is forgotten (plans.py)
            state = self._replicas.get(replica)
            if state is None:
                return
            if tier is not None:
                self._clear_class(state, int(tier))
                return
            self._clear_confirmed(state)
            state.device_history = False  # its device may still hold what was forgotten
            for source in list(state.held):
                self._drop_source_holdings(state, source)
            state.forget_configuration()

    def clear_source(self, replica: str, source: str = "", *, restarted: bool) -> None:
        with self._lock:
            self._layout_epoch += 1  # the configuration may be forgotten (plans.py)
            # A domain's evictor stream vouches for every layout of the domain.
            for layout in self._layouts(replica):
                self._clear_confirmed(layout)
                if restarted:
                    self._drop_source_holdings(layout, source)
            state = self._replicas.get(replica)
            if state is None:
                return
            # A domain's holdings came from its replicas' streams: its evictor losing history
            # means removals may have been missed, whatever the evictor itself published.
            if source in state.confirmed_sources or replica.startswith(DOMAIN_PREFIX):
                self._clear_confirmed(state)
                # A new process starts with an empty device; after a gap it still holds what
                # the index forgot (confirmed.py, stores from the prompt's start).
                state.device_history = restarted
                if restarted and not replica.startswith(DOMAIN_PREFIX):
                    # A new process may run another configuration: learn it again.
                    state.forget_configuration()
            if restarted:
                self._drop_source_holdings(state, source)

    def remove_replica(self, replica: str) -> None:
        with self._lock:
            self._attached.pop(replica, None)
            self._drafts.pop(replica, None)
            state = self._replicas.get(replica)
            if state is None:
                return
            self.clear_replica(replica)
            del self._replicas[replica]
            self._free_slots.append(state.slot)
            self._layout_epoch += 1

    # --- events -------------------------------------------------------------------------------

    def apply(self, replica: str, events: Iterable[Event], *, source: str = "") -> ApplyResult:
        result = ApplyResult()
        with self._lock:
            state = self._state(replica)
            shared = self._attached.get(replica)
            domain = None if shared is None else self._state(shared)
            now = self._clock()
            # A domain's evictor stream: its removals apply to every layout of the domain.
            layouts = self._layouts(replica)
            # what lookups' plans depend on (plans.py), to compare after the batch
            touched = [state, domain, *layouts]
            before = [layout_of(s) for s in touched]
            if state.held:
                self._expire_state(state, now)
            if domain is not None and domain.held:
                self._expire_state(domain, now)
            events = list(events)
            if state.loss is not None:
                self._note_kept(state, events)
            state.landing = self._landing(events)
            self._last_full = None
            numbered = enumerate(events)
            for i, event in numbered:
                # a keyed device store is remembered for the event right after it only
                self._prev_full, self._last_full = self._last_full, None
                if not layouts and type(event) is BlockRemoved:
                    run = self._remove_device_run(state, events, i, source, result)
                    if run:
                        if run > 1:
                            self._prev_full = None
                            # the run's other events, applied by the native core: skipped
                            next(islice(numbered, run - 2, None), None)
                        continue
                try:
                    if isinstance(event, BlockStored):
                        if event.medium is Medium.GPU and event.confirmed:
                            self._learn_group(state, event)
                        if not self._keyed(state, event.group_idx):
                            self._store_group(state, event, result)
                            continue
                        if event.pool_tier:
                            self._note_pool_tier(state, event)
                        if event.confirmed:
                            state.confirmed_sources.add(source)
                            self._store(state, event, result)
                            if domain is not None and event.medium is Medium.STORAGE:
                                self._share(state, domain, event, result)
                        elif (
                            domain is not None
                            and event.medium is Medium.STORAGE
                            and not event.engine_hashes
                        ):
                            # llm-d's FS backend on a shared volume: the domain's chunks
                            self._store_unconfirmed(state, event, source, result, into=domain)
                        else:
                            self._store_unconfirmed(state, event, source, result)
                            if (
                                domain is not None
                                and event.medium is Medium.STORAGE
                                and event.locality == "REMOTE"
                            ):
                                # vLLM's FS tier on a shared directory: the domain's files
                                self._share_unconfirmed(state, domain, event, source)
                    elif isinstance(event, BlockRemoved):
                        if not self._keyed(state, event.group_idx):
                            self._remove_group(state, event, result)
                            continue
                        if layouts:
                            if event.confirmed:
                                state.confirmed_sources.add(source)
                            self._remove_from_layouts([state, *layouts], event, source, result)
                        elif event.confirmed:
                            state.confirmed_sources.add(source)
                            # An attached replica's STORAGE removal (a bad file it deleted)
                            # leaves the domain.
                            target = state
                            if domain is not None and event.medium is Medium.STORAGE:
                                target = domain
                            self._remove(target, event, result)
                            if state.held and event.medium is not Medium.GPU:
                                self._release_engine_holdings(state, event, source, result)
                        else:
                            self._remove_unconfirmed(state, event, source, result)
                    elif isinstance(event, AllBlocksCleared):
                        state.confirmed_sources.add(source)
                        self._clear(state, events, i, result)
                    elif isinstance(event, UnknownEvent):
                        self._distrust(state, source, result)
                    else:
                        result.rejected.append(f"not an event: {type(event).__name__}")
                        continue
                except ValueError as exc:
                    result.rejected.append(str(exc))
                    continue
                result.applied += 1
            state.landing = {}
            if self._deferred or self._starts or state.unplaced:
                self._place_deferred(state, result)
            self._computed.clear()
            if self._entries > self.max_entries:
                self._evict(self._entries - self.max_entries)
            if [layout_of(s) for s in touched] != before:
                self._layout_epoch += 1
            if len(self._interned) > self._intern_limit():
                self._interned.clear()  # interning only saves memory; masks stay valid
        return result
