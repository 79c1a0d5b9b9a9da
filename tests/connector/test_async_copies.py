"""The asynchronous (CUDA) copy path's bookkeeping, run on CPU with a fake device.

The copies themselves are exact on CPU tensors; the fake events complete only when the
test says so, which checks what the CUDA path promises: a store is reported (and its
file written) only after its event completed, the forward waits on the device for the
gathers and loads it needs and for nothing else, and a slot is never written while a
copy still reads it.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from kvroute.connector.copiers import AsyncCopier, LoadItem, StoreItem, SyncCopier, make_copier
from kvroute.connector.copy_ledger import DONE, PendingStore, SlotFences, StoreLedger
from kvroute.connector.disk_tier import unlink_chunk_all_ranks
from kvroute.connector.identity import RankInfo
from kvroute.connector.plan import LOADED, STORED
from kvroute.indexer.tiers import Tier
from tests.connector.fake_device import FakeBackend
from tests.connector.helpers import (
    BPC,
    CHUNK,
    block_data,
    block_hashes,
    make_executor,
    make_paged,
    make_planner,
)


def _prompt(seed: int, n_chunks: int) -> tuple[list[int], list[bytes]]:
    tokens = [seed * 7919 + i for i in range(n_chunks * CHUNK + 1)]
    return tokens, block_hashes(tokens)


def _chunk_bytes(paged) -> int:
    return paged.num_layers * BPC * paged.block_bytes()


# ---------------------------------------------------------------------------- ledger
def test_store_ledger_releases_in_issue_order_once_complete() -> None:
    be = FakeBackend()
    evs = [be.new_event() for _ in range(3)]
    ledger = StoreLedger()
    for i, ev in enumerate(evs):
        ledger.add(PendingStore(bytes([i]), i, ev))
    evs[1].done = True  # a later one cannot overtake an earlier one on the same stream
    assert ledger.take_completed() == []
    evs[0].done = True
    assert [s.slot for s in ledger.take_completed()] == [0, 1]
    assert len(ledger) == 1
    assert [s.slot for s in ledger.take_completed(wait=True)] == [2]
    assert evs[2].synchronized and len(ledger) == 0


def test_slot_fences_name_only_copies_still_in_flight() -> None:
    be = FakeBackend()
    f = SlotFences()
    w, r = be.new_event(), be.new_event()
    f.wrote(3, w)
    f.read(3, r)
    assert f.before_write(3) == [r, w]  # readers and the last writer
    assert f.before_read(3) == [w]
    assert f.before_write(4) == [] and f.before_read(4) == []
    w.done = r.done = True
    assert f.before_write(3) == [] and f.pending() == 0  # completed fences are forgotten


def test_make_copier_keeps_the_cpu_path_synchronous() -> None:
    assert isinstance(make_copier(make_paged(), BPC), SyncCopier)
    assert SyncCopier(make_paged()).store([0, 1], 0, torch.empty(2, BPC, 2, 4, 8)) is DONE


# ---------------------------------------------------------------------------- copies
@pytest.mark.parametrize("block_dim", [0, 1])
def test_async_copier_round_trip_is_exact(block_dim: int) -> None:
    paged = make_paged(block_dim=block_dim)
    be = FakeBackend()
    cp = AsyncCopier(paged, BPC, be)
    shape = paged.chunk_shape(BPC)
    slot = torch.empty(shape, dtype=paged.dtype)
    src_blocks = [9, 3]  # scattered, out of order
    want = block_data(paged, src_blocks)
    cp.store(src_blocks, 0, slot)
    # a load of the chunk's second block only (a local hit covered the first)
    cp.load(0, slot, 1, [40])
    cp.loads_issued()
    got = block_data(paged, [40])
    for w, g in zip(want, got, strict=True):
        assert torch.equal(w.narrow(block_dim, 1, 1), g)
    # a chunk read from disk (host buffer) into fresh blocks
    cp.load_host_chunk(slot, 0, [50, 51], after=None)
    for w, g in zip(want, block_data(paged, [50, 51]), strict=True):
        assert torch.equal(w, g)


def test_forward_waits_for_gathers_and_loads_only_where_needed() -> None:
    paged = make_paged()
    be = FakeBackend()
    cp = AsyncCopier(paged, BPC, be)
    slots = torch.empty((3, *paged.chunk_shape(BPC)), dtype=paged.dtype)
    done = cp.store([0, 1], 0, slots[0])
    log = list(be.log)
    gathered = log[log.index(("use", "copy1", "")) + 1][2]
    # the store stream starts after the forward that wrote the blocks
    assert log[0] == ("wait_stream", "copy1", "compute")
    # the compute stream waits for the gather (blocks may be reused), not for the D2H
    assert be.waits_of("compute") == [gathered]
    assert done.name != gathered
    be.log.clear()
    cp.loads_issued()  # a step without loads: no wait at all
    assert be.log == []
    be.complete_all()
    cp.load(0, slots[0], 0, [10, 11])
    cp.load(1, slots[1], 0, [12, 13])
    assert ("wait_stream", "copy2", "compute") in be.log
    assert be.waits_of("compute") == []  # nothing until the step's loads are all issued
    cp.loads_issued()
    last_load = be.events[-1].name
    assert be.waits_of("compute") == [last_load]  # one wait, on the last load


class _CountingMover:
    """The per-layer mover, counting launches and the index each one got."""

    name = "counting"

    def __init__(self, paged) -> None:
        from kvroute.connector.block_kernels import TorchBlockMover

        self.inner = TorchBlockMover(paged)
        self.calls: list[tuple[str, list[int]]] = []

    def gather(self, index: torch.Tensor, out: torch.Tensor) -> None:
        self.calls.append(("gather", index.tolist()))
        self.inner.gather(index, out)

    def scatter(self, index: torch.Tensor, src: torch.Tensor) -> None:
        self.calls.append(("scatter", index.tolist()))
        self.inner.scatter(index, src)


def test_a_steps_stores_share_one_wait_and_one_index_and_stay_exact() -> None:
    paged = make_paged()
    be = FakeBackend()
    mover = _CountingMover(paged)
    cp = AsyncCopier(paged, BPC, be, mover)
    slots = torch.empty((3, *paged.chunk_shape(BPC)), dtype=paged.dtype)
    chunks = [[7, 2], [0, 9], [5, 4]]
    want = [block_data(paged, c) for c in chunks]
    dones = cp.store_many([StoreItem(c, i, slots[i]) for i, c in enumerate(chunks)])
    assert [c for _, c in mover.calls] == chunks  # one launch per chunk, its own blocks
    assert [e for e in be.log if e[0] == "wait_stream"] == [("wait_stream", "copy1", "compute")]
    assert [e for e in be.log if e[0] == "use"] == [("use", "copy1", "")]
    records = [e[2] for e in be.log if e[0] == "record"]
    gathered = be.waits_of("compute")
    # the forward waits once, for the last gather; each chunk has its own `done`
    assert len(gathered) == 1 and records == [
        *(d.name for d in dones[:2]),
        gathered[0],
        dones[2].name,
    ]
    mover.calls.clear()
    be.complete_all()
    cp.load_many([LoadItem(i, slots[i], 0, [20 + 2 * i, 21 + 2 * i]) for i in range(3)])
    cp.loads_issued()
    assert [c for _, c in mover.calls] == [[20, 21], [22, 23], [24, 25]]
    assert be.waits_of("compute")[-1] == be.events[-1].name  # the last load only
    for i, w in enumerate(want):
        for a, b in zip(w, block_data(paged, [20 + 2 * i, 21 + 2 * i]), strict=True):
            assert torch.equal(a, b)


def test_a_slot_is_written_only_after_copies_still_reading_it() -> None:
    paged = make_paged()
    be = FakeBackend()
    cp = AsyncCopier(paged, BPC, be)
    slot = torch.empty(paged.chunk_shape(BPC), dtype=paged.dtype)
    store = cp.store([0, 1], 5, slot)
    cp.load(5, slot, 0, [20, 21])  # the load from a slot waits for the store filling it
    assert store.name in be.waits_of("copy2")
    load_ev = be.events[-1]
    be.log.clear()
    cp.store([2, 3], 5, slot)  # slot reused while the load may still read it
    assert load_ev.name in be.waits_of("copy1")
    be.complete_all()
    be.log.clear()
    cp.store([4, 5], 5, slot)  # completed copies are not waited for
    assert be.waits_of("copy1") == []


# ---------------------------------------------------------------------------- executor
def test_store_is_reported_and_written_only_after_its_event_completed(tmp_path: Path) -> None:
    paged = make_paged()
    be = FakeBackend()
    nbytes = _chunk_bytes(paged)
    p = make_planner(
        num_slots=4,
        disk_enabled=True,
        disk_capacity_bytes=1 << 20,
        payload_bytes=nbytes,
        unlink=lambda k: unlink_chunk_all_ranks(tmp_path, [RankInfo()], k),
    )
    ex = make_executor(paged, num_slots=4, disk_dir=tmp_path, copier=AsyncCopier(paged, BPC, be))
    tokens, hashes = _prompt(1, 1)
    want = block_data(paged, [0, 1])
    p.on_scheduled("a", [0, 1], hashes, tokens, len(tokens))
    plan = p.take_plan()
    ex.before_forward(plan)
    ex.after_forward(plan)
    assert ex.take_reports() == []  # the D2H copy may still run: not STORED yet
    time.sleep(0.05)
    assert list((tmp_path / "tp0-pp0").iterdir()) == []  # nor is the slot written out
    be.complete_all()
    reports = ex.take_reports()
    assert [(r.kind, r.tier) for r in reports] == [(STORED, Tier.CPU)]
    p.on_reports(reports)
    ex.writer.flush(10)
    p.on_reports(ex.take_reports())
    assert [(e.kind, e.tier) for e in p.take_events()] == [
        ("stored", Tier.CPU),
        ("stored", Tier.STORAGE),
    ]
    # and the landed chunk loads back exactly
    res = p.lookup("b", hashes, tokens, len(tokens), 0)
    p.on_alloc("b", [30, 31, 32], res.num_tokens)
    plan = p.take_plan()
    ex.before_forward(plan)
    assert [(r.kind, r.ok) for r in ex.take_reports()] == [(LOADED, True)]
    for w, g in zip(want, block_data(paged, [30, 31]), strict=True):
        assert torch.equal(w, g)
    ex.close()


def test_wait_idle_waits_for_stores_in_flight() -> None:
    paged = make_paged()
    be = FakeBackend()
    p = make_planner(num_slots=4, payload_bytes=_chunk_bytes(paged))
    ex = make_executor(paged, num_slots=4, copier=AsyncCopier(paged, BPC, be))
    tokens, hashes = _prompt(2, 2)
    p.on_scheduled("a", list(range(2 * BPC)), hashes, tokens, len(tokens))
    plan = p.take_plan()
    ex.after_forward(plan)
    assert ex.take_reports() == []
    ex.wait_idle()  # the host waits for the two D2H copies (their `done` events)
    assert sum(ev.synchronized for ev in be.events) == 2
    assert [r.kind for r in ex.take_reports()] == [STORED, STORED]
    ex.close()


def test_disk_load_waits_for_the_compute_marker_on_its_reader_thread(tmp_path: Path) -> None:
    paged = make_paged(block_dim=1)  # not a direct-I/O layout: goes through the copier
    be = FakeBackend()
    nbytes = _chunk_bytes(paged)
    kw = dict(disk_enabled=True, disk_capacity_bytes=1 << 20, payload_bytes=nbytes)
    p = make_planner(num_slots=4, **kw)
    ex = make_executor(paged, num_slots=4, disk_dir=tmp_path, copier=AsyncCopier(paged, BPC, be))
    tokens, hashes = _prompt(3, 1)
    want = block_data(paged, [0, 1])
    p.on_scheduled("a", [0, 1], hashes, tokens, len(tokens))
    plan = p.take_plan()
    ex.after_forward(plan)
    be.complete_all()
    ex.wait_idle()
    p.on_reports(ex.take_reports())
    p.reset_cpu()  # only the file is left
    be.log.clear()
    n_events = len(be.events)
    res = p.lookup("b", hashes, tokens, len(tokens), 0)
    assert res.is_async
    p.on_alloc("b", [40, 41, 42], res.num_tokens)
    ex.before_forward(p.take_plan())
    ex.wait_idle()
    assert ex.take_finished_loads() == {"b"} and ex.take_load_errors() == set()
    marker = be.events[n_events]
    assert be.log[0] == ("record", "compute", marker.name)
    reader_waits = [e for kind, s, e in be.log if kind == "wait_event" and s.startswith("copy")]
    assert reader_waits == [marker.name]
    assert be.events[-1].synchronized  # the reader thread waited, not the forward
    for w, g in zip(want, block_data(paged, [40, 41]), strict=True):
        assert torch.equal(w, g)
    ex.close()
