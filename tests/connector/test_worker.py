"""Planner + worker executor on plain torch CPU tensors: exact KV round trips through
RAM and disk, restart from disk, and failures that must become recomputes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvroute.connector.disk_format import file_name
from kvroute.connector.disk_scan import scan_layout
from kvroute.connector.disk_tier import unlink_chunk_all_ranks
from kvroute.connector.identity import RankInfo
from kvroute.connector.transfer import PagedKV
from kvroute.indexer.tiers import Tier
from tests.connector.helpers import (
    BLOCK,
    BPC,
    CHUNK,
    block_data,
    block_hashes,
    make_executor,
    make_paged,
    make_planner,
    step,
)


def _prompt(seed: int, n_chunks: int) -> tuple[list[int], list[bytes]]:
    tokens = [seed * 7919 + i for i in range(n_chunks * CHUNK + 1)]
    return tokens, block_hashes(tokens)


def _chunk_bytes(paged: PagedKV) -> int:
    return paged.num_layers * BPC * paged.block_bytes()


@pytest.mark.parametrize("block_dim", [0, 1])
def test_store_then_load_from_ram_is_exact(block_dim: int) -> None:
    paged = make_paged(block_dim=block_dim)
    p = make_planner(num_slots=8, payload_bytes=_chunk_bytes(paged))
    ex = make_executor(paged, num_slots=8)
    tokens, hashes = _prompt(1, 3)
    src_blocks = list(range(0, 3 * BPC))
    want = block_data(paged, src_blocks)
    p.on_scheduled("a", src_blocks, hashes, tokens, len(tokens))
    step(p, ex)
    assert [e.kind for e in p.take_events()] == ["stored"] * 3
    # The request comes back after its device blocks were reused: load into new blocks.
    dst_blocks = list(range(20, 20 + 3 * BPC + 1))
    for t in paged.layers:  # wipe the destination first
        t.index_fill_(paged.block_dim, torch.tensor(dst_blocks), 0)
    res = p.lookup("b", hashes, tokens, len(tokens), 0)
    assert res.num_tokens == 3 * CHUNK
    p.on_alloc("b", dst_blocks, res.num_tokens)
    step(p, ex)
    got = block_data(paged, dst_blocks[: 3 * BPC])
    for w, g in zip(want, got, strict=True):
        assert torch.equal(w, g)
    assert ex.take_load_errors() == set()
    assert all(e.pins == 0 for e in p.cpu.entries())
    ex.close()


def test_restart_serves_from_disk_exactly(tmp_path: Path) -> None:
    paged = make_paged()
    nbytes = _chunk_bytes(paged)
    kw = dict(disk_enabled=True, disk_capacity_bytes=1 << 20, payload_bytes=nbytes)
    p = make_planner(
        num_slots=8, **kw, unlink=lambda k: unlink_chunk_all_ranks(tmp_path, [RankInfo()], k)
    )
    ex = make_executor(paged, num_slots=8, disk_dir=tmp_path)
    tokens, hashes = _prompt(2, 2)
    want = block_data(paged, list(range(2 * BPC)))
    p.on_scheduled("a", list(range(2 * BPC)), hashes, tokens, len(tokens))
    step(p, ex)  # write-through: RAM and disk
    step(p, ex)  # disk write reports arrive
    media = sorted((e.kind, e.tier) for e in p.take_events())
    assert media == [("stored", Tier.CPU)] * 2 + [("stored", Tier.STORAGE)] * 2
    ex.close()

    # "Restart": new planner from a directory scan, new executor, RAM empty.
    p2 = make_planner(
        num_slots=8, **kw, unlink=lambda k: unlink_chunk_all_ranks(tmp_path, [RankInfo()], k)
    )
    from tests.connector.helpers import IDENTITY

    p2.add_disk_entries(scan_layout(tmp_path, IDENTITY, [RankInfo()]))
    assert len(p2.disk) == 2
    paged2 = make_paged()
    for t in paged2.layers:
        t.zero_()
    ex2 = make_executor(paged2, num_slots=8, disk_dir=tmp_path)
    res = p2.lookup("b", hashes, tokens, len(tokens), 0)
    assert res.num_tokens == 2 * CHUNK and res.is_async
    dst = list(range(30, 30 + 2 * BPC + 1))
    p2.on_alloc("b", dst, res.num_tokens)
    step(p2, ex2)
    assert ex2.take_finished_loads() == {"b"}
    assert ex2.take_load_errors() == set()
    for w, g in zip(want, block_data(paged2, dst[: 2 * BPC]), strict=True):
        assert torch.equal(w, g)
    # promotion: the loaded request runs, its chunks are stored into RAM from its blocks
    p2.on_scheduled("b", dst, hashes, tokens, len(tokens))
    step(p2, ex2)
    res2 = p2.lookup("c", hashes, tokens, len(tokens), 0)
    assert res2.num_tokens == 2 * CHUNK and not res2.is_async
    assert {h.tier for h in res2.hits} == {Tier.CPU}
    ex2.close()


def test_corrupt_file_on_load_is_recomputed_and_removed(tmp_path: Path) -> None:
    paged = make_paged()
    nbytes = _chunk_bytes(paged)
    p = make_planner(
        num_slots=8, disk_enabled=True, disk_capacity_bytes=1 << 20, payload_bytes=nbytes
    )
    ex = make_executor(paged, num_slots=8, disk_dir=tmp_path)
    tokens, hashes = _prompt(3, 1)
    p.on_scheduled("a", list(range(BPC)), hashes, tokens, len(tokens))
    step(p, ex)
    step(p, ex)
    p.reset_cpu()  # only the disk copy is left
    p.take_events()
    path = tmp_path / RankInfo().dir_name / file_name(hashes[BPC - 1])
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x55
    path.write_bytes(bytes(data))
    res = p.lookup("b", hashes, tokens, len(tokens), 0)
    assert res.is_async
    dst = list(range(40, 40 + BPC + 1))
    p.on_alloc("b", dst, res.num_tokens)
    step(p, ex)
    assert ex.take_finished_loads() == {"b"}  # still released, so vLLM recomputes
    assert ex.take_load_errors() == set(dst[:BPC])
    assert not path.exists()
    assert [(e.kind, e.tier) for e in p.take_events()] == [("removed", Tier.STORAGE)]
    assert p.lookup("c", hashes, tokens, len(tokens), 0).num_tokens == 0
    ex.close()


@pytest.mark.parametrize("stacked", [True, False])
def test_disk_load_from_mid_chunk_local_hit(tmp_path: Path, stacked: bool) -> None:
    """A local device hit ending inside a chunk: only the rest of the chunk is loaded,
    straight from the file into the blocks (checksum still over the whole payload)."""
    if stacked:  # vLLM CPU style: layers are equally spaced slices of one buffer
        base = make_paged(layers=1).layers[0]
        buf = torch.stack([base, base + 1, base + 2])
        paged = PagedKV([buf[i] for i in range(3)], base.shape[0])
        assert paged.stacked is not None
    else:
        paged = make_paged(layers=3)
        assert paged.stacked is None
    nbytes = _chunk_bytes(paged)
    p = make_planner(
        num_slots=8, disk_enabled=True, disk_capacity_bytes=1 << 20, payload_bytes=nbytes
    )
    ex = make_executor(paged, num_slots=8, disk_dir=tmp_path)
    tokens, hashes = _prompt(6, 2)
    src = list(range(2 * BPC))
    want = block_data(paged, src)
    p.on_scheduled("a", src, hashes, tokens, len(tokens))
    step(p, ex)
    step(p, ex)
    p.reset_cpu()
    res = p.lookup("b", hashes, tokens, len(tokens), BLOCK)  # one block computed locally
    assert res.num_tokens == 2 * CHUNK - BLOCK and res.is_async
    dst = [60, *range(61, 61 + 2 * BPC)]
    p.on_alloc("b", dst, res.num_tokens)
    step(p, ex)
    assert ex.take_load_errors() == set()
    got = block_data(paged, dst[1 : 2 * BPC])
    for w, g in zip(want, got, strict=True):
        assert torch.equal(w[1:] if paged.block_dim == 0 else w[:, 1:], g)
    ex.close()


def test_ram_slot_holding_another_chunk_is_never_served() -> None:
    paged = make_paged()
    p = make_planner(num_slots=4, payload_bytes=_chunk_bytes(paged))
    ex = make_executor(paged, num_slots=4)
    tokens, hashes = _prompt(4, 1)
    p.on_scheduled("a", list(range(BPC)), hashes, tokens, len(tokens))
    step(p, ex)
    slot = p.cpu.get(hashes[BPC - 1]).slot
    ex.pool.mark(slot, b"someone else")  # simulate a bookkeeping bug / reuse race
    res = p.lookup("b", hashes, tokens, len(tokens), 0)
    dst = list(range(50, 50 + BPC + 1))
    p.on_alloc("b", dst, res.num_tokens)
    step(p, ex)
    assert ex.take_load_errors() == set(dst[:BPC])
    assert p.stats.load_failures == 1
    ex.close()


def test_disk_write_queue_bound_drops_instead_of_blocking(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    from kvroute.connector import disk_tier

    gate = threading.Event()
    real_write = disk_tier.write_chunk_file

    def slow_write(*args, **kwargs):  # a disk that is slower than the forward pass
        gate.wait(10)
        return real_write(*args, **kwargs)

    monkeypatch.setattr(disk_tier, "write_chunk_file", slow_write)
    paged = make_paged()
    nbytes = _chunk_bytes(paged)
    p = make_planner(
        num_slots=8, disk_enabled=True, disk_capacity_bytes=1 << 20, payload_bytes=nbytes
    )
    ex = make_executor(paged, num_slots=8, disk_dir=tmp_path, disk_max_pending_bytes=nbytes)
    tokens, hashes = _prompt(5, 3)
    p.on_scheduled("a", list(range(3 * BPC)), hashes, tokens, len(tokens))
    plan = p.take_plan()
    ex.before_forward(plan)
    ex.after_forward(plan)  # returns although the disk has not written anything yet
    p.on_reports(ex.take_reports())
    assert len(p.cpu) == 3 and all(e.state.value == "ready" for e in p.cpu.entries())
    gate.set()
    ex.wait_idle()
    p.on_reports(ex.take_reports())
    # one write was queued and landed; the two beyond the byte bound were dropped
    assert len(p.disk) == 1
    assert p.stats.disk_write_failures == 2
    ex.close()


def test_the_executor_uses_a_ram_pool_made_at_start_and_refuses_a_mismatched_one() -> None:
    from kvroute.connector.cpu_tier import CpuPool

    paged = make_paged()
    shape = paged.chunk_shape(BPC)
    pool = CpuPool(4, shape, paged.dtype)
    p = make_planner(num_slots=4, payload_bytes=_chunk_bytes(paged))
    ex = make_executor(paged, num_slots=4, pool=pool)
    assert ex.pool is pool
    tokens, hashes = _prompt(5, 1)
    want = block_data(paged, [0, 1])
    p.on_scheduled("a", [0, 1], hashes, tokens, len(tokens))
    step(p, ex)
    slot = next(i for i in range(4) if pool.key_of(i) is not None)
    for li, w in enumerate(want):
        assert torch.equal(pool.slot(slot)[li], w.movedim(paged.block_dim, 0))
    ex.close()
    with pytest.raises(ValueError, match="does not match"):
        make_executor(paged, num_slots=8, pool=pool)
