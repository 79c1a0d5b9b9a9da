"""Scheduler-side bookkeeping: lookups, capacity, LRU order, pins, events, disk full."""

from __future__ import annotations

from kvroute.connector.bookkeeping import EntryState
from kvroute.connector.plan import LOADED, REMOVED, STORED, Report
from kvroute.indexer.tiers import Tier
from tests.connector.helpers import BLOCK, BPC, CHUNK, block_hashes, make_planner


def _req(seed: int, n_chunks: int) -> tuple[list[int], list[bytes]]:
    tokens = [seed * 1000 + i for i in range(n_chunks * CHUNK + 1)]
    return tokens, block_hashes(tokens)


def _store(p, req_id: str, tokens, hashes, block_ids=None) -> list:
    block_ids = block_ids if block_ids is not None else list(range(len(hashes)))
    p.on_scheduled(req_id, block_ids, hashes, tokens, len(tokens))
    plan = p.take_plan()
    return plan.stores


def _confirm(p, stores, tier=Tier.CPU) -> None:
    p.on_reports([Report(STORED, s.key, tier) for s in stores])


def test_store_events_only_after_worker_confirms() -> None:
    p = make_planner(num_slots=8)
    tokens, hashes = _req(1, 2)
    stores = _store(p, "a", tokens, hashes)
    assert [s.block_ids for s in stores] == [[0, 1], [2, 3]]
    assert p.take_events() == []  # ordered, not landed
    assert p.lookup("b", hashes, tokens, len(tokens), 0).num_tokens == 0  # PENDING not served
    _confirm(p, stores)
    ev = p.take_events()
    assert [(e.kind, e.tier) for e in ev] == [("stored", Tier.CPU)] * 2
    assert ev[0].info.parent_hash is None and ev[1].info.parent_hash == hashes[BPC - 1]
    assert list(ev[1].info.block_hashes) == hashes[BPC : 2 * BPC]
    assert list(ev[1].info.token_ids) == tokens[CHUNK : 2 * CHUNK]
    res = p.lookup("b", hashes, tokens, len(tokens), 0)
    assert res.num_tokens == 2 * CHUNK and not res.is_async


def test_lookup_leaves_one_token_and_starts_after_local_hit() -> None:
    p = make_planner(num_slots=8)
    tokens, hashes = _req(2, 3)
    _confirm(p, _store(p, "a", tokens, hashes))
    exact = tokens[: 2 * CHUNK]  # prompt ends exactly on a chunk boundary
    assert p.lookup("b", hashes[: 2 * BPC], exact, len(exact), 0).num_tokens == CHUNK
    res = p.lookup("c", hashes, tokens, len(tokens), BLOCK)  # local hit of one block
    assert res.num_tokens == 3 * CHUNK - BLOCK
    assert res.hits[0].block_offset == 1
    p.on_alloc("c", list(range(100, 100 + 3 * BPC + 1)), res.num_tokens)
    plan = p.take_plan()
    assert [op.block_ids for op in plan.cpu_loads] == [[101], [102, 103], [104, 105]]
    assert [op.block_offset for op in plan.cpu_loads] == [1, 0, 0]


def test_token_mismatch_is_a_miss() -> None:
    p = make_planner(num_slots=8)
    tokens, hashes = _req(3, 1)
    _confirm(p, _store(p, "a", tokens, hashes))
    other = list(tokens)
    other[0] += 1  # same hashes (forged), different tokens: must not be served
    assert p.lookup("b", hashes, other, len(other), 0).num_tokens == 0


def test_cpu_capacity_and_lru_eviction_order() -> None:
    p = make_planner(num_slots=3)
    reqs = [_req(10 + i, 1) for i in range(3)]
    for i, (t, h) in enumerate(reqs):
        _confirm(p, _store(p, f"r{i}", t, h))
    p.take_events()
    # touch r0 (a hit) so r1 becomes least recently used
    res = p.lookup("x", reqs[0][1], reqs[0][0], len(reqs[0][0]), 0)
    p.on_alloc("x", list(range(BPC + 1)), res.num_tokens)
    p.on_reports([Report(LOADED, reqs[0][1][BPC - 1], Tier.CPU, req_id="x")])
    p.take_plan()
    t3, h3 = _req(13, 1)
    stores = _store(p, "r3", t3, h3)
    assert len(stores) == 1
    ev = p.take_events()
    assert [(e.kind, e.tier, e.info.key) for e in ev] == [
        ("removed", Tier.CPU, reqs[1][1][BPC - 1])
    ]
    assert p.cpu.used == 3
    assert stores[0].slot == p.cpu.get(h3[BPC - 1]).slot


def test_pinned_and_pending_entries_are_not_evicted() -> None:
    p = make_planner(num_slots=2)
    a, b = _req(20, 1), _req(21, 1)
    _confirm(p, _store(p, "a", *a))
    pending = _store(p, "b", *b)  # not confirmed: PENDING
    res = p.lookup("x", a[1], a[0], len(a[0]), 0)
    p.on_alloc("x", list(range(BPC + 1)), res.num_tokens)  # pins a
    c = _req(22, 1)
    assert _store(p, "c", *c) == []  # nothing evictable: skipped, not blocked
    assert p.stats.store_skipped_full == 1
    p.on_reports([Report(LOADED, a[1][BPC - 1], Tier.CPU, req_id="x")])
    _confirm(p, pending)
    p.take_events()
    d = _req(23, 1)
    assert len(_store(p, "d", *d)) == 1  # room again: pins released
    # a was touched by its hit after b was stored, so b is the least recently used
    assert [e.info.key for e in p.take_events() if e.kind == "removed"] == [b[1][BPC - 1]]


def test_demotion_to_disk_and_disk_hit_with_promotion() -> None:
    removed: list[bytes] = []
    p = make_planner(
        num_slots=1,
        disk_enabled=True,
        disk_capacity_bytes=10 * 4096,
        disk_policy="demote",
        unlink=removed.append,
    )
    a, b = _req(30, 1), _req(31, 1)
    _confirm(p, _store(p, "a", *a))
    stores = _store(p, "b", *b)
    p2 = p.take_plan()
    assert p2.is_empty()
    # the demotion was planned together with b's store, in the same plan
    p._plan.stores.extend(stores)  # (re-queue: _store consumed the plan)
    ka = a[1][BPC - 1]
    assert ka in p.disk and p.disk.get(ka).state is EntryState.PENDING
    p.on_reports([Report(STORED, ka, Tier.STORAGE)])
    _confirm(p, stores)
    kinds = [(e.kind, e.tier) for e in p.take_events()]
    assert (
        ("removed", Tier.CPU) in kinds
        and ("stored", Tier.STORAGE) in kinds
        and ("stored", Tier.CPU) in kinds
    )
    # a is now only on disk: lookup is async; the load pins the file
    res = p.lookup("x", a[1], a[0], len(a[0]), 0)
    assert res.num_tokens == CHUNK and res.is_async
    p.on_alloc("x", list(range(BPC + 1)), res.num_tokens)
    plan = p.take_plan()
    (op,) = plan.disk_loads["x"]
    assert op.source == Tier.STORAGE and op.block_ids == [0, 1]
    assert p.disk.get(ka).pins == 1
    p.on_reports([Report(LOADED, ka, Tier.STORAGE, req_id="x")])
    assert p.disk.get(ka).pins == 0
    # Promotion: when the loaded request runs, its chunk is stored into RAM from the
    # device blocks (evicting b, which goes to disk by demotion).
    p.on_scheduled("x", list(range(BPC + 1)), a[1], a[0], len(a[0]))
    plan = p.take_plan()
    assert [s.key for s in plan.stores] == [ka] and plan.stores[0].disk_header is None
    assert [d.key for d in plan.demotes] == [b[1][BPC - 1]]
    p.on_reports([Report(STORED, ka, Tier.CPU)])
    assert p.cpu.ready(ka) is not None


def test_disk_full_pauses_writes_and_serving_goes_on() -> None:
    now = [0.0]
    p = make_planner(
        num_slots=4,
        disk_enabled=True,
        disk_capacity_bytes=1 << 20,
        disk_full_retry_s=10,
        clock=lambda: now[0],
    )
    a = _req(40, 1)
    stores = _store(p, "a", *a)
    assert stores[0].disk_header is not None  # write-through
    ka = a[1][BPC - 1]
    p.on_reports(
        [
            Report(STORED, ka, Tier.CPU),
            Report(STORED, ka, Tier.STORAGE, ok=False, error="disk_full"),
        ]
    )
    assert p.stats.disk_full_events == 1 and ka not in p.disk
    b = _req(41, 1)
    stores_b = _store(p, "b", *b)
    assert stores_b[0].disk_header is None  # writes paused
    assert p.lookup("x", a[1], a[0], len(a[0]), 0).num_tokens == CHUNK  # RAM still serves
    now[0] = 11.0
    c = _req(42, 1)
    assert _store(p, "c", *c)[0].disk_header is not None  # retried after the pause


def test_disk_capacity_evicts_lru_files() -> None:
    unlinked: list[bytes] = []
    p = make_planner(num_slots=8, disk_enabled=True, disk_capacity_bytes=1, unlink=unlinked.append)
    size = None
    reqs = [_req(50 + i, 1) for i in range(3)]
    for i, r in enumerate(reqs):
        st = _store(p, f"r{i}", *r)
        if size is None:
            # first write did not fit a 1-byte disk: nothing planned; grow the disk to 2 files
            assert st[0].disk_header is None
            size = p._header(p.cpu.get(r[1][BPC - 1]).info)
            from kvroute.connector.disk_format import max_file_size

            p.disk.capacity = 2 * max_file_size(size, p.payload_bytes)
            continue
        p.on_reports([Report(STORED, s.key, Tier.STORAGE) for s in st])
    assert len(p.disk) == 2
    r3 = _req(60, 1)
    _store(p, "r3", *r3)
    assert unlinked == [reqs[1][1][BPC - 1]]  # oldest file removed from disk


def test_corrupt_file_report_drops_entry_with_event() -> None:
    p = make_planner(num_slots=4, disk_enabled=True, disk_capacity_bytes=1 << 20)
    a = _req(70, 1)
    from kvroute.connector.keys import chunk_info

    info = chunk_info(a[1], a[0], BLOCK, BPC, 0)
    p.add_disk_entries([(info, 1000)])
    assert [(e.kind, e.tier) for e in p.take_events()] == [("stored", Tier.STORAGE)]
    res = p.lookup("x", a[1], a[0], len(a[0]), 0)
    p.on_alloc("x", list(range(BPC + 1)), res.num_tokens)
    p.take_plan()
    p.on_reports(
        [
            Report(REMOVED, info.key, Tier.STORAGE, ok=False, error="corrupt"),
            Report(STORED, info.key, Tier.CPU, ok=False, error="corrupt"),
            Report(LOADED, info.key, Tier.STORAGE, ok=False, req_id="x", error="corrupt"),
        ]
    )
    assert info.key not in p.disk and info.key not in p.cpu
    assert [(e.kind, e.tier) for e in p.take_events()] == [("removed", Tier.STORAGE)]
    assert p.lookup("y", a[1], a[0], len(a[0]), 0).num_tokens == 0
    assert p.slots.num_free == 4


def test_slot_with_pending_write_through_is_reused_only_after_the_write() -> None:
    p = make_planner(num_slots=1, disk_enabled=True, disk_capacity_bytes=1 << 20)
    a, b, c = _req(80, 1), _req(81, 1), _req(82, 1)
    stores = _store(p, "a", *a)
    ka = a[1][BPC - 1]
    assert stores[0].disk_header is not None  # the worker writes straight from the slot
    _confirm(p, stores)  # in RAM; its disk write is still pending
    assert _store(p, "b", *b) == []  # a evicted, but its slot is still being read
    assert p.slots.num_free == 0
    p.on_reports([Report(STORED, ka, Tier.STORAGE)])  # the write finished: slot free again
    assert p.slots.num_free == 1
    assert len(_store(p, "c", *c)) == 1


def test_hit_split_by_tier_for_vllm_metrics() -> None:
    p = make_planner(num_slots=8, disk_enabled=True, disk_capacity_bytes=1 << 20)
    tokens, hashes = _req(90, 3)
    from kvroute.connector.keys import chunk_info

    _confirm(p, _store(p, "a", tokens[: CHUNK + 1], hashes[:BPC]))  # chunk 0 in RAM
    infos = [chunk_info(hashes, tokens, BLOCK, BPC, c) for c in (1, 2)]
    p.add_disk_entries([(i, 1000) for i in infos])  # chunks 1-2 on disk only
    res = p.lookup("x", hashes, tokens, len(tokens), BLOCK)
    assert [h.tier for h in res.hits] == [Tier.CPU, Tier.STORAGE, Tier.STORAGE] and res.is_async
    assert p.hit_split("x", res.num_tokens) == {Tier.CPU: CHUNK - BLOCK, Tier.STORAGE: 2 * CHUNK}
