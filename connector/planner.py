"""Scheduler-side bookkeeping and planning: what is where, what to copy, which events.

This is the only place that decides. It keeps one ``TierIndex`` for RAM (capacity in
slots) and one for disk (capacity in bytes), answers lookups, reserves space (evicting
LRU entries, demoting RAM victims to disk), and turns worker reports into tier events:

* ``BlockStored`` only when the worker confirms the chunk landed in the tier,
* ``BlockRemoved`` when the index drops a chunk (eviction decision, bad file, reset).

That mirrors vLLM's block pool, which emits at state changes. No vLLM import here: the
adapter converts ``TierEvent`` into vLLM's event classes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from kvroute.connector.bookkeeping import EntryState, SlotAllocator, TierEntry, TierIndex
from kvroute.connector.disk_format import header_for_chunk, max_file_size
from kvroute.connector.keys import NO_EXTRAS, ChunkInfo, ExtrasSource, chunk_info, chunk_key
from kvroute.connector.plan import (
    LOADED,
    REMOVED,
    STORED,
    DemoteOp,
    LoadOp,
    Report,
    StepPlan,
    StoreOp,
)
from kvroute.connector.planner_records import (
    Hit,
    LookupResult,
    PlannerStats,
    ReqState,
    TierEvent,
)
from kvroute.connector.shared_store import SharedStore
from kvroute.indexer.tiers import Tier

logger = logging.getLogger(__name__)


class Planner:
    """Decides tier placement and builds one ``StepPlan`` per scheduler step.

    ``num_workers`` workers execute every plan (TP x PP ranks): an entry is READY only
    when all of them confirmed it. ``files_per_chunk`` is how many files a chunk takes
    on disk (one per rank), for the disk byte bound.
    """

    def __init__(
        self,
        *,
        block_size: int,
        blocks_per_chunk: int,
        num_slots: int,
        chunk_payload_bytes: int,
        identity: str,
        disk_capacity_bytes: int = 0,
        disk_enabled: bool = False,
        disk_policy: str = "write_through",
        num_workers: int = 1,
        files_per_chunk: int = 1,
        disk_full_retry_s: float = 30.0,
        unlink: Callable[[bytes], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        shared: SharedStore | None = None,
    ) -> None:
        self.block_size = block_size
        self.bpc = blocks_per_chunk
        self.chunk_tokens = block_size * blocks_per_chunk
        self.payload_bytes = chunk_payload_bytes
        self.identity = identity
        self.num_workers = num_workers
        self.files_per_chunk = files_per_chunk
        self.cpu = TierIndex(Tier.CPU, num_slots)
        self.slots = SlotAllocator(num_slots)
        self.disk_enabled = disk_enabled
        self.disk = TierIndex(Tier.STORAGE, disk_capacity_bytes if disk_enabled else 0)
        self.disk_policy = disk_policy
        self.disk_full_retry_s = disk_full_retry_s
        self._disk_blocked_until = 0.0
        self._unlink = unlink or (lambda key: None)
        # A shared storage domain: the directory, not ``self.disk``, says what exists;
        # ``self.disk`` only indexes the chunks THIS replica wrote (and announced).
        self.shared = shared
        self._clock = clock
        self._plan = StepPlan()
        self._events: list[TierEvent] = []
        self._reqs: dict[str, ReqState] = {}
        # Loads in flight: req_id -> (tier, entry) pinned for it. The entry object, not
        # its key: a reset may drop it and a new entry may take the same key.
        self._pinned: dict[str, list[tuple[Tier, TierEntry]]] = {}
        self._load_reports_left: dict[tuple[str, bytes], int] = {}
        # Write-through disk writes read their RAM slot without a copy: key -> [slot,
        # reports still to come]. The slot is held until every worker reported.
        self._slot_writes: dict[bytes, list[int]] = {}
        # Reports still to come for entries dropped while in flight (reset, failure on
        # another worker): (tier, key) -> count. They must not confirm a newer entry of
        # the same key, and a file that lands after its entry was dropped is removed.
        self._orphans: dict[tuple[Tier, bytes], int] = {}
        self.stats = PlannerStats()

    # ------------------------------------------------------------------ startup
    def add_disk_entries(self, entries: Sequence[tuple[ChunkInfo, int]]) -> None:
        """Register files found by the start-up scan as READY (they are complete on
        every rank; ``size`` is their bytes over all ranks)."""
        for info, size in entries:
            if info.key in self.disk or self.disk.used + size > self.disk.capacity:
                self._unlink(info.key)
                continue
            self.disk.add(TierEntry(info=info, size=size, state=EntryState.READY))
            self._events.append(TierEvent("stored", Tier.STORAGE, info))

    # ------------------------------------------------------------------ lookup
    def lookup(
        self,
        req_id: str,
        block_hashes: Sequence[bytes],
        token_ids: Sequence[int],
        num_tokens: int,
        num_computed: int,
    ) -> LookupResult:
        """Chunks available past ``num_computed`` (side-effect free apart from caching
        the answer for ``on_alloc``). At least one token is always left to compute, as
        vLLM needs a token to sample from."""
        hits: list[Hit] = []
        end = num_computed
        c = num_computed // self.chunk_tokens
        if self.shared is not None:
            self.shared.heartbeat()
        while True:
            c_end = (c + 1) * self.chunk_tokens
            if c_end > num_tokens - 1 or (c + 1) * self.bpc > len(block_hashes):
                break
            key = chunk_key(block_hashes, self.bpc, c)
            tier = Tier.CPU
            e = self.cpu.ready(key)
            if e is None and self._disk_readable():
                tier, e = Tier.STORAGE, self._disk_entry(key)
            if e is None:
                break
            # Guard against hash collisions and foreign entries: the chunk's own tokens
            # must match (the hash chain covers everything before it).
            if list(e.info.token_ids) != list(token_ids[c * self.chunk_tokens : c_end]):
                break
            offset = max(0, num_computed // self.block_size - c * self.bpc)
            hits.append(Hit(info=e.info, tier=tier, block_offset=offset, entry=e))
            end = c_end
            c += 1
        result = LookupResult(num_computed=num_computed, hits=hits, num_tokens=end - num_computed)
        st = self._reqs.setdefault(req_id, ReqState(req_id))
        st.lookup = result
        return result

    def hit_split(self, req_id: str, num_external_tokens: int) -> dict[str, int]:
        """Tokens of the last lookup's hit per tier (RAM first), for vLLM's per-source
        hit metrics; the counts add up to ``num_external_tokens``."""
        st = self._reqs.get(req_id)
        out: dict[str, int] = {}
        left = num_external_tokens
        for h in st.lookup.hits if st is not None and st.lookup is not None else []:
            if left <= 0:
                break
            n = min(left, (self.bpc - h.block_offset) * self.block_size)
            out[h.tier] = out.get(h.tier, 0) + n
            left -= n
        if left > 0:
            out[Tier.CPU] = out.get(Tier.CPU, 0) + left
        return out

    def _disk_readable(self) -> bool:
        return self.disk_enabled and (self.shared is not None or len(self.disk) > 0)

    def _disk_entry(self, key: bytes) -> TierEntry | None:
        """The READY disk entry of ``key``. With a shared domain the files decide: an
        own entry whose file is gone (the domain's evictor removed it and announced
        it) is forgotten silently; a chunk another replica wrote gets an entry that is
        pinned for the load but never indexed or announced here."""
        e = self.disk.get(key)
        if self.shared is None:
            return e if e is not None and e.state is EntryState.READY else None
        if e is not None and e.state is not EntryState.READY:
            return None  # our own write is in flight
        found = self.shared.probe(key)
        if found is None:
            if e is not None and e.pins == 0:
                self.disk.remove(key)
                self.stats.shared_files_gone += 1
            return None
        if e is not None:
            return e
        info, size = found
        return TierEntry(info=info, size=size, state=EntryState.READY)

    # ------------------------------------------------------------------ alloc
    def on_alloc(self, req_id: str, block_ids: Sequence[int], num_external_tokens: int) -> bool:
        """Blocks were allocated; plan the loads for ``num_external_tokens``.
        Returns True when loads were planned."""
        st = self._reqs.setdefault(req_id, ReqState(req_id))
        st.block_ids = list(block_ids)
        if num_external_tokens <= 0 or st.loading:
            return False
        res = st.lookup
        if res is None or not res.hits:
            logger.warning("kvroute: alloc with external tokens but no lookup for %s", req_id)
            return False
        remaining = num_external_tokens
        pins: list[tuple[Tier, TierEntry]] = []
        loads: list[tuple[Hit, list[int]]] = []
        for h in res.hits:
            if remaining <= 0:
                break
            c = h.info.index
            b0 = c * self.bpc + h.block_offset
            nblocks = min(self.bpc - h.block_offset, remaining // self.block_size)
            if nblocks <= 0:
                break
            targets = list(block_ids[b0 : b0 + nblocks])
            if len(targets) != nblocks:
                break
            remaining -= nblocks * self.block_size
            loads.append((h, targets))
        disk_ops: list[LoadOp] = []
        for h, targets in loads:
            idx = self.cpu if h.tier == Tier.CPU else self.disk
            e = idx.get(h.info.key)
            if e is None and h.entry is not None and h.tier == Tier.STORAGE:
                e = h.entry  # another replica's file in a shared domain
                self.stats.shared_foreign_hits += 1
            assert e is not None and e.state is EntryState.READY
            e.pins += 1  # a pinned source is never evicted (slot reused / file removed)
            if h.info.key in idx:
                idx.touch(h.info.key)
            pins.append((h.tier, e))
            # Every worker reports each load once; unpin after the last report.
            k = (req_id, h.info.key)
            self._load_reports_left[k] = self._load_reports_left.get(k, 0) + self.num_workers
            if h.tier == Tier.CPU:
                # The slot outlives its entry until the load reported (see reset).
                self.slots.hold(e.slot)
                self._plan.cpu_loads.append(
                    LoadOp(req_id, h.info.key, Tier.CPU, e.slot, h.block_offset, targets)
                )
                self.stats.cpu_hits_tokens += len(targets) * self.block_size
            else:
                disk_ops.append(
                    LoadOp(req_id, h.info.key, Tier.STORAGE, -1, h.block_offset, targets)
                )
                self.stats.disk_hits_tokens += len(targets) * self.block_size
        if disk_ops:
            self._plan.disk_loads[req_id] = disk_ops
        if pins:  # added to any still held (a request allocated again before reports)
            self._pinned.setdefault(req_id, []).extend(pins)
        st.loading = bool(disk_ops)
        # Promotion of disk hits into RAM needs no extra read: once the load completed
        # the chunks sit in the request's device blocks, and ``on_scheduled`` stores every
        # full chunk that is not in RAM yet (RAM-loaded chunks are, and are skipped).
        return bool(loads)

    # ------------------------------------------------------------------ stores
    def on_scheduled(
        self,
        req_id: str,
        block_ids: Sequence[int] | None,
        block_hashes: Sequence[bytes],
        token_ids: Sequence[int],
        num_computed_after: int,
        extras: ExtrasSource | None = None,
    ) -> None:
        """The request will have ``num_computed_after`` tokens of KV after this step:
        store the full chunks that became complete. ``extras`` describes a block range
        of the request as vLLM's events do (LoRA, extra keys); without it a chunk is
        described by hashes and tokens only."""
        st = self._reqs.setdefault(req_id, ReqState(req_id))
        if block_ids is not None:
            st.block_ids = list(block_ids)
        n_full = min(num_computed_after // self.block_size, len(block_hashes), len(st.block_ids))
        n_chunks = n_full // self.bpc
        while st.next_store_chunk < n_chunks:
            c = st.next_store_chunk
            st.next_store_chunk += 1
            key = chunk_key(block_hashes, self.bpc, c)
            if key in self.cpu:
                self.cpu.touch(key)
                continue
            if (Tier.CPU, key) in self._orphans:
                # An older store of this key is still reporting: its report must not
                # be taken for this one's.
                self.stats.store_skipped_in_flight += 1
                continue
            b0 = c * self.bpc
            info = chunk_info(
                block_hashes,
                token_ids,
                self.block_size,
                self.bpc,
                c,
                extras(b0, b0 + self.bpc) if extras is not None else NO_EXTRAS,
            )
            slot = self._reserve_cpu(info)
            if slot < 0:
                self.stats.store_skipped_full += 1
                continue
            header = None
            if self.disk_policy == "write_through" and key not in self.disk:
                header = self._reserve_disk(info)
            if header is not None:
                # The worker writes the file straight from the slot.
                self._slot_writes[key] = [slot, self.num_workers]
                self.slots.hold(slot)
            self._plan.stores.append(
                StoreOp(key, slot, list(st.block_ids[b0 : b0 + self.bpc]), header)
            )
            self.stats.stores += 1

    def on_resumed(self, req_id: str, block_ids: Sequence[int]) -> None:
        """A preempted request comes back: its KV is rebuilt from chunk 0 (recomputed or
        loaded), so every chunk is offered to the tiers again (already stored ones are
        only touched)."""
        st = self._reqs.setdefault(req_id, ReqState(req_id))
        st.block_ids = list(block_ids)
        st.next_store_chunk = 0

    def on_new_blocks(self, req_id: str, new_block_ids: Sequence[int]) -> None:
        st = self._reqs.setdefault(req_id, ReqState(req_id))
        st.block_ids.extend(new_block_ids)

    def request_finished(self, req_id: str) -> None:
        self._reqs.pop(req_id, None)

    # ------------------------------------------------------------------ reservations
    def _header(self, info: ChunkInfo) -> dict:
        return header_for_chunk(info, identity=self.identity, payload_bytes=self.payload_bytes)

    def _reserve_cpu(self, info: ChunkInfo) -> int:
        """Add a PENDING RAM entry for ``info`` and return its slot (or -1)."""
        victims = self.cpu.plan_room(1)
        if victims is None:
            return -1
        for key in victims:
            self._evict_cpu(key)
        slot = self.slots.alloc()
        if slot is None:
            return -1
        self.cpu.add(TierEntry(info=info, size=1, slot=slot, confirmations_left=self.num_workers))
        return slot

    def _evict_cpu(self, key: bytes) -> None:
        e = self.cpu.remove(key)
        assert e is not None
        self.stats.evictions_cpu += 1
        self._events.append(TierEvent("removed", Tier.CPU, e.info))
        if self.disk_enabled and self.disk_policy == "demote" and key not in self.disk:
            header = self._reserve_disk(e.info)
            if header is not None:
                # The worker snapshots the slot before any store of this step reuses it.
                self._plan.demotes.append(DemoteOp(key, e.slot, header))
        # A slot still read by a write-through write or a load is parked until then.
        self.slots.free(e.slot)

    def _reserve_disk(self, info: ChunkInfo) -> dict | None:
        """Add a PENDING disk entry and return the file header to write, or None."""
        if not self.disk_enabled or self._clock() < self._disk_blocked_until:
            return None
        if (Tier.STORAGE, info.key) in self._orphans:
            return None  # an older write of this key is still reporting
        if self.shared is not None and self.shared.probe(info.key) is not None:
            # Another replica wrote it already (and announced it): writing it again
            # would be harmless (atomic rename) but wasted.
            self.stats.shared_writes_skipped_present += 1
            return None
        try:
            header = self._header(info)
        except TypeError as exc:  # extra keys that a file header cannot hold
            logger.warning("kvroute: chunk kept out of the disk tier: %s", exc)
            return None
        size = self.files_per_chunk * max_file_size(header, self.payload_bytes)
        victims = self.disk.plan_room(size)
        if victims is None:
            return None
        for key in victims:
            # Shared: the domain's evictor owns the files; only our index forgets.
            self._drop_disk(key, unlink=self.shared is None, announce=self.shared is None)
            self.stats.evictions_disk += 1
        self.disk.add(TierEntry(info=info, size=size, confirmations_left=self.num_workers))
        self.stats.disk_writes += 1
        return header

    def _drop_disk(self, key: bytes, *, unlink: bool, announce: bool = True) -> None:
        e = self.disk.remove(key)
        if e is None:
            return
        if e.state is EntryState.READY:
            if announce:
                self._events.append(TierEvent("removed", Tier.STORAGE, e.info))
        else:
            self._orphan(Tier.STORAGE, key, e.confirmations_left)
        if unlink:
            self._unlink(key)

    def _orphan(self, tier: Tier, key: bytes, reports: int) -> None:
        if reports > 0:
            self._orphans[(tier, key)] = self._orphans.get((tier, key), 0) + reports

    # ------------------------------------------------------------------ reports
    def on_reports(self, reports: Sequence[Report]) -> None:
        for r in reports:
            if r.kind == STORED:
                self._on_stored(r)
            elif r.kind == LOADED:
                self._on_loaded(r)
            elif r.kind == REMOVED and r.tier == Tier.STORAGE:
                if self.shared is not None:
                    self._shared_file_removed(r)
                    continue
                # A bad file on one rank: the chunk can no longer be served from any,
                # so every rank's file goes and the entry is not offered again.
                self._drop_disk(r.key, unlink=True)

    def _shared_file_removed(self, r: Report) -> None:
        """A load in a shared domain found its file missing or bad. Missing: removed
        by the evictor (which announces it) or another replica: forget it silently.
        Bad: the worker removed it, so the chunk is gone from the domain: remove every
        rank's file and announce it, whoever wrote it."""
        assert self.shared is not None
        e = self.disk.get(r.key)
        info = e.info if e is not None else self.shared.cached_info(r.key)
        self.shared.forget(r.key)
        if r.error == "missing":
            if e is not None and e.state is EntryState.READY:
                self.disk.remove(r.key)
                self.stats.shared_files_gone += 1
            return
        if e is not None:
            self._drop_disk(r.key, unlink=True)
            return
        self._unlink(r.key)
        if info is not None:
            self._events.append(TierEvent("removed", Tier.STORAGE, info))

    def _write_reported(self, key: bytes) -> None:
        """One worker finished (or gave up) a disk write of ``key``: release the slot a
        write-through read once all workers did."""
        w = self._slot_writes.get(key)
        if w is None:
            return
        w[1] -= 1
        if w[1] <= 0:
            del self._slot_writes[key]
            self.slots.unhold(w[0])

    def _take_orphan(self, r: Report) -> bool:
        n = self._orphans.get((r.tier, r.key), 0)
        if n <= 0:
            return False
        if n == 1:
            del self._orphans[(r.tier, r.key)]
        else:
            self._orphans[(r.tier, r.key)] = n - 1
        if r.tier == Tier.STORAGE and r.ok:
            self._unlink(r.key)  # landed after its entry was dropped: never served
        return True

    def _on_stored(self, r: Report) -> None:
        if r.tier == Tier.STORAGE:
            self._write_reported(r.key)
        if self._take_orphan(r):
            return
        idx = self.cpu if r.tier == Tier.CPU else self.disk
        e = idx.get(r.key)
        if e is None or e.state is EntryState.READY:
            return
        if not r.ok:
            # The chunk cannot land on every worker: drop it; the other workers'
            # reports are orphans (a disk file of theirs that lands is removed).
            if r.tier == Tier.STORAGE:
                self.stats.disk_write_failures += 1
                if r.error == "disk_full":
                    self.stats.disk_full_events += 1
                    self._disk_blocked_until = self._clock() + self.disk_full_retry_s
                    logger.warning(
                        "kvroute: disk tier full; pausing disk writes for %.0f s "
                        "(serving continues)",
                        self.disk_full_retry_s,
                    )
                self.disk.remove(r.key)
                self._orphan(Tier.STORAGE, r.key, e.confirmations_left - 1)
                if self.shared is None:
                    # Shared: another replica may have written the same chunk's files
                    # meanwhile; our rank files that landed are only a miss.
                    self._unlink(r.key)
            else:
                self.cpu.remove(r.key)
                self._orphan(Tier.CPU, r.key, e.confirmations_left - 1)
                self.slots.free(e.slot)
            return
        e.confirmations_left -= 1
        if e.confirmations_left <= 0:
            e.state = EntryState.READY
            self._events.append(TierEvent("stored", r.tier, e.info))

    def _on_loaded(self, r: Report) -> None:
        if not r.ok:
            self.stats.load_failures += 1
        if r.req_id is None:
            return
        pins = self._pinned.get(r.req_id)
        if pins is None:
            return
        left = self._load_reports_left.get((r.req_id, r.key), 0) - 1
        if left > 0:
            self._load_reports_left[(r.req_id, r.key)] = left
            return
        self._load_reports_left.pop((r.req_id, r.key), None)
        # Release the source pin of this key (on the entry object: it may have been
        # dropped by a reset since, and its slot is only reusable now).
        kept: list[tuple[Tier, TierEntry]] = []
        for tier, e in pins:
            if e.info.key != r.key:
                kept.append((tier, e))
                continue
            if e.pins > 0:
                e.pins -= 1
            if tier == Tier.CPU:
                self.slots.unhold(e.slot)
        if kept:
            self._pinned[r.req_id] = kept
        else:
            del self._pinned[r.req_id]
            st = self._reqs.get(r.req_id)
            if st is not None:
                st.loading = False

    # ------------------------------------------------------------------ resets
    def reset_cpu(self) -> None:
        """Forget every RAM entry. Announced ones get ``BlockRemoved(CPU)``; pending
        ones were never announced and their late reports are swallowed. A slot that a
        load or a write-through write still reads is reused only after it reported."""
        for e in self.cpu.entries():
            self.cpu.remove(e.info.key)
            if e.state is EntryState.READY:
                self._events.append(TierEvent("removed", Tier.CPU, e.info))
            else:
                self._orphan(Tier.CPU, e.info.key, e.confirmations_left)
            self.slots.free(e.slot)

    def reset_disk(self) -> None:
        """Forget every disk entry and remove its files on every rank. Announced ones
        get ``BlockRemoved(STORAGE)``; a pending write's file is removed when it lands.
        A load already reading a file either finishes or fails and is recomputed."""
        if self.shared is not None:
            self._reset_shared()
            return
        for e in self.disk.entries():
            self._drop_disk(e.info.key, unlink=True)

    def _reset_shared(self) -> None:
        """Shared domain: nothing present now is served by this replica again (by
        inode), but no file is removed and nothing is announced: other replicas of the
        domain may still use those files, and the domain's index stays true. Own
        writes still in flight are removed when they land (their KV predates the
        reset); a chunk recomputed after the reset is written again (a new file)."""
        assert self.shared is not None
        for e in self.disk.entries():
            self.disk.remove(e.info.key)
            if e.state is not EntryState.READY:
                self._orphan(Tier.STORAGE, e.info.key, e.confirmations_left)
        n = self.shared.forget_present()
        logger.info(
            "kvroute: storage domain %s: reset: %d files present are no longer served by "
            "this replica (left for the others)",
            self.shared.domain,
            n,
        )

    def reset(self) -> None:
        """``reset_prefix_cache(reset_connector=True)``: nothing cached before may be
        served after (weights may have changed), so both tiers are emptied."""
        self.reset_cpu()
        self.reset_disk()

    # ------------------------------------------------------------------ misc
    def take_plan(self) -> StepPlan:
        plan, self._plan = self._plan, StepPlan()
        return plan

    def take_events(self) -> list[TierEvent]:
        ev, self._events = self._events, []
        return ev
