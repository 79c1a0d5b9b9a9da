"""Connector resets (``reset_prefix_cache(reset_connector=True)``) and drops in flight.

A reset forgets both tiers: every chunk that was announced gets a ``BlockRemoved``,
disk files are removed, and copies still in flight are accounted for when they report
(never announced, never served, their files removed, their slots reused only once
nothing reads them).
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from kvroute.connector import disk_tier
from kvroute.connector.disk_tier import unlink_chunk_all_ranks
from kvroute.connector.identity import RankInfo
from kvroute.connector.plan import LOADED, STORED, Report
from kvroute.indexer.tiers import Tier
from tests.connector.helpers import (
    BPC,
    CHUNK,
    block_hashes,
    make_executor,
    make_paged,
    make_planner,
    step,
)


def _req(seed: int, n_chunks: int = 1) -> tuple[list[int], list[bytes]]:
    tokens = [seed * 1000 + i for i in range(n_chunks * CHUNK + 1)]
    return tokens, block_hashes(tokens)


def _kinds(p) -> list[tuple[str, str]]:
    return sorted((e.kind, e.tier) for e in p.take_events())


def _files(tmp_path: Path) -> list[Path]:
    return sorted(tmp_path.glob("*/*.kvc"))


def _disk_planner(tmp_path: Path, paged, **kw):
    return make_planner(
        disk_enabled=True,
        disk_capacity_bytes=1 << 20,
        payload_bytes=paged.num_layers * BPC * paged.block_bytes(),
        unlink=lambda k: unlink_chunk_all_ranks(tmp_path, [RankInfo()], k),
        **kw,
    )


def test_reset_announces_every_forgotten_chunk_and_removes_its_files(tmp_path: Path) -> None:
    paged = make_paged()
    p = _disk_planner(tmp_path, paged, num_slots=4)
    ex = make_executor(paged, num_slots=4, disk_dir=tmp_path)
    tokens, hashes = _req(1, 2)
    p.on_scheduled("a", list(range(2 * BPC)), hashes, tokens, len(tokens))
    step(p, ex)
    step(p, ex)
    assert _kinds(p) == [("stored", Tier.CPU)] * 2 + [("stored", Tier.STORAGE)] * 2
    assert len(_files(tmp_path)) == 2
    p.reset()
    assert _kinds(p) == [("removed", Tier.CPU)] * 2 + [("removed", Tier.STORAGE)] * 2
    assert _files(tmp_path) == []
    assert p.lookup("b", hashes, tokens, len(tokens), 0).num_tokens == 0
    assert p.slots.num_free == 4 and p.disk.used == 0 and p.cpu.used == 0
    ex.close()


def test_a_write_in_flight_at_reset_is_never_announced_and_its_file_goes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = threading.Event()
    real_write = disk_tier.write_chunk_file

    def slow_write(*args, **kwargs):
        gate.wait(10)
        return real_write(*args, **kwargs)

    monkeypatch.setattr(disk_tier, "write_chunk_file", slow_write)
    paged = make_paged()
    p = _disk_planner(tmp_path, paged, num_slots=1)
    ex = make_executor(paged, num_slots=1, disk_dir=tmp_path)
    tokens, hashes = _req(2)
    p.on_scheduled("a", [0, 1], hashes, tokens, len(tokens))
    step(p, ex, wait=False)  # RAM landed; the file is still being written from the slot
    assert _kinds(p) == [("stored", Tier.CPU)]
    p.reset()
    assert _kinds(p) == [("removed", Tier.CPU)]  # the pending file was never announced
    assert p.slots.num_free == 0  # the writer still reads the slot: not reusable yet
    t2, h2 = _req(3)
    p.on_scheduled("b", [2, 3], h2, t2, len(t2))
    assert p.take_plan().stores == []  # no slot for it while the write reads the only one
    gate.set()
    ex.wait_idle()
    p.on_reports(ex.take_reports())
    assert p.take_events() == []  # landed after its entry was dropped: not announced...
    assert _files(tmp_path) == []  # ...and removed
    assert p.slots.num_free == 1
    ex.close()


def test_a_slot_still_loading_at_reset_is_reused_only_after_the_load_reported() -> None:
    p = make_planner(num_slots=1)
    a, b = _req(4), _req(5)
    p.on_scheduled("a", [0, 1], a[1], a[0], len(a[0]))
    p.on_reports([Report(STORED, s.key, Tier.CPU) for s in p.take_plan().stores])
    res = p.lookup("x", a[1], a[0], len(a[0]), 0)
    p.on_alloc("x", [10, 11, 12], res.num_tokens)
    (load,) = p.take_plan().cpu_loads
    p.take_events()
    p.reset()
    assert _kinds(p) == [("removed", Tier.CPU)]
    p.on_scheduled("b", [2, 3], b[1], b[0], len(b[0]))
    assert p.take_plan().stores == []  # the load may still read the only slot
    p.on_reports([Report(LOADED, load.key, Tier.CPU, req_id="x")])
    assert p.slots.num_free == 1
    c = _req(6)
    p.on_scheduled("c", [4, 5], c[1], c[0], len(c[0]))
    assert [s.slot for s in p.take_plan().stores] == [load.slot]


def test_late_reports_of_a_dropped_store_never_confirm_a_newer_one() -> None:
    p = make_planner(num_slots=4)
    a = _req(7)
    p.on_scheduled("a", [0, 1], a[1], a[0], len(a[0]))
    (old,) = p.take_plan().stores
    p.reset()  # the store is still in flight (no report yet)
    assert p.take_events() == []
    p.on_resumed("a", [0, 1])
    p.on_scheduled("a", None, a[1], a[0], len(a[0]))
    assert p.take_plan().stores == []  # not while the old store may still report
    assert p.stats.store_skipped_in_flight == 1
    p.on_reports([Report(STORED, old.key, Tier.CPU)])  # the old store's report: swallowed
    assert p.take_events() == [] and old.key not in p.cpu
    p.on_resumed("a", [0, 1])
    p.on_scheduled("a", None, a[1], a[0], len(a[0]))
    (new,) = p.take_plan().stores
    p.on_reports([Report(STORED, new.key, Tier.CPU)])
    assert _kinds(p) == [("stored", Tier.CPU)]


def test_a_write_failed_on_one_rank_drops_the_chunk_on_all_ranks() -> None:
    unlinked: list[bytes] = []
    p = make_planner(
        num_slots=4,
        disk_enabled=True,
        disk_capacity_bytes=1 << 20,
        num_workers=2,
        files_per_chunk=2,
        unlink=unlinked.append,
    )
    a = _req(8)
    p.on_scheduled("a", [0, 1], a[1], a[0], len(a[0]))
    (s,) = p.take_plan().stores
    p.on_reports([Report(STORED, s.key, Tier.CPU)] * 2)
    assert p.slots.num_free == 3  # the write-through still reads the slot
    p.on_reports([Report(STORED, s.key, Tier.STORAGE, ok=False, error="io")])  # rank 0
    assert s.key not in p.disk and unlinked == [s.key]
    p.on_reports([Report(STORED, s.key, Tier.STORAGE)])  # rank 1 wrote its file: removed
    assert unlinked == [s.key, s.key]
    assert _kinds(p) == [("stored", Tier.CPU)]  # the disk copy was never announced
    p.reset_cpu()
    assert p.slots.num_free == 4  # both writes reported: the slot is free again


def test_a_resumed_request_offers_its_chunks_again() -> None:
    p = make_planner(num_slots=4)
    a = _req(9, 2)
    p.on_scheduled("a", list(range(2 * BPC)), a[1], a[0], len(a[0]))
    p.on_reports([Report(STORED, s.key, Tier.CPU) for s in p.take_plan().stores])
    p.reset()
    p.take_events()
    # preempted (e.g. by reset_running_requests) and recomputed: stored again
    p.on_resumed("a", list(range(10, 10 + 2 * BPC)))
    p.on_scheduled("a", None, a[1], a[0], len(a[0]))
    assert [st.block_ids for st in p.take_plan().stores] == [[10, 11], [12, 13]]
