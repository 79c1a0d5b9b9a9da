"""The asynchronous copy path on a real CUDA device (skipped without one).

The bookkeeping is covered on CPU by ``test_async_copies``; these check what only a
GPU can: exact bytes through streams, pinned memory and ``index_select``/``index_copy_``
kernels, and that the host does not wait for a store while the device is busy.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from kvroute.connector.block_kernels import TorchBlockMover, TritonBlockMover
from kvroute.connector.copiers import AsyncCopier, make_copier
from kvroute.connector.disk_scan import scan_layout
from kvroute.connector.disk_tier import unlink_chunk_all_ranks
from kvroute.connector.identity import RankInfo
from kvroute.connector.plan import STORED
from kvroute.connector.transfer import PagedKV
from kvroute.indexer.tiers import Tier
from tests.connector.helpers import BPC, CHUNK, IDENTITY, block_hashes, make_executor, make_planner

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA device (none on this machine or in CI); the same bookkeeping "
    "runs on CPU with a fake device in test_async_copies.py",
)


def _cuda_paged(block_dim: int, num_blocks: int = 64) -> PagedKV:
    g = torch.Generator(device="cuda").manual_seed(3)
    shape = (num_blocks, 2, 16, 64) if block_dim == 0 else (2, num_blocks, 16, 2, 32)
    layers = [torch.randn(shape, generator=g, device="cuda").to(torch.bfloat16) for _ in range(3)]
    return PagedKV(layers, num_blocks)


def _blocks(paged: PagedKV, ids: list[int]) -> list[torch.Tensor]:
    idx = torch.tensor(ids, device="cuda")
    return [t.index_select(paged.block_dim, idx).cpu() for t in paged.layers]


def _chunk_bytes(paged: PagedKV) -> int:
    return paged.num_layers * BPC * paged.block_bytes()


KERNELS = ["triton", "per_layer"]
MOVER = {"triton": TritonBlockMover, "per_layer": TorchBlockMover}


def test_auto_picks_the_one_launch_kernel_on_cuda() -> None:
    copier = make_copier(_cuda_paged(1), BPC)
    assert isinstance(copier, AsyncCopier) and isinstance(copier.mover, TritonBlockMover)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("block_dim", [0, 1])
def test_cuda_round_trip_through_a_pinned_slot_is_exact(block_dim: int, kernel: str) -> None:
    paged = _cuda_paged(block_dim)
    copier = make_copier(paged, BPC, block_kernel=kernel)
    assert isinstance(copier, AsyncCopier) and isinstance(copier.mover, MOVER[kernel])
    slot = torch.empty(paged.chunk_shape(BPC), dtype=paged.dtype, pin_memory=True)
    want = _blocks(paged, [7, 2])
    done = copier.store([7, 2], 0, slot)
    done.synchronize()
    copier.load(0, slot, 0, [30, 31])
    copier.loads_issued()
    torch.cuda.current_stream().synchronize()
    for w, g in zip(want, _blocks(paged, [30, 31]), strict=True):
        assert torch.equal(w, g)
    # from a pinned host chunk (disk path), on this thread's own stream
    copier.load_host_chunk(slot, 1, [40], after=copier.compute_marker())
    for w, g in zip(want, _blocks(paged, [40]), strict=True):
        assert torch.equal(w.narrow(block_dim, 1, 1), g)


def test_the_host_does_not_wait_for_a_store_while_the_device_is_busy() -> None:
    if not hasattr(torch.cuda, "_sleep"):
        pytest.skip("torch.cuda._sleep is not available in this torch build")
    paged = _cuda_paged(0)
    p = make_planner(num_slots=4, payload_bytes=_chunk_bytes(paged))
    ex = make_executor(paged, num_slots=4, pin_memory=True)
    tokens = [9000 + i for i in range(CHUNK + 1)]
    hashes = block_hashes(tokens)
    p.on_scheduled("a", [0, 1], hashes, tokens, len(tokens))
    plan = p.take_plan()
    torch.cuda._sleep(2_000_000_000)  # a long "forward" on the compute stream
    t0 = time.perf_counter()
    ex.after_forward(plan)
    issued = time.perf_counter() - t0
    assert ex.take_reports() == []  # the copy waits for the forward: not STORED yet
    ex.wait_idle()
    assert [(r.kind, r.tier) for r in ex.take_reports()] == [(STORED, Tier.CPU)]
    assert issued < 0.5  # after_forward only enqueued work
    ex.close()


@pytest.mark.parametrize(
    ("store_kernel", "load_kernel"), [("triton", "per_layer"), ("per_layer", "triton")]
)
def test_cuda_store_then_disk_restart_is_exact(
    tmp_path: Path, store_kernel: str, load_kernel: str
) -> None:
    """A chunk stored with one kernel loads exactly with the other: the bytes on disk
    do not depend on the kernel (replicas of a storage domain may differ)."""
    paged = _cuda_paged(1)
    nbytes = _chunk_bytes(paged)
    kw = dict(
        disk_enabled=True,
        disk_capacity_bytes=1 << 24,
        payload_bytes=nbytes,
        unlink=lambda k: unlink_chunk_all_ranks(tmp_path, [RankInfo()], k),
    )
    p = make_planner(num_slots=4, **kw)
    ex = make_executor(
        paged, num_slots=4, disk_dir=tmp_path, pin_memory=True, block_kernel=store_kernel
    )
    tokens = [9100 + i for i in range(2 * CHUNK + 1)]
    hashes = block_hashes(tokens)
    want = _blocks(paged, list(range(2 * BPC)))
    p.on_scheduled("a", list(range(2 * BPC)), hashes, tokens, len(tokens))
    plan = p.take_plan()
    ex.before_forward(plan)
    ex.after_forward(plan)
    ex.wait_idle()
    p.on_reports(ex.take_reports())
    ex.close()
    p2 = make_planner(num_slots=4, **kw)
    p2.add_disk_entries(scan_layout(tmp_path, IDENTITY, [RankInfo()]))
    ex2 = make_executor(
        paged, num_slots=4, disk_dir=tmp_path, pin_memory=True, block_kernel=load_kernel
    )
    res = p2.lookup("b", hashes, tokens, len(tokens), 0)
    assert res.num_tokens == 2 * CHUNK and res.is_async
    dst = list(range(40, 40 + 2 * BPC + 1))
    p2.on_alloc("b", dst, res.num_tokens)
    ex2.before_forward(p2.take_plan())
    ex2.wait_idle()
    assert ex2.take_finished_loads() == {"b"} and ex2.take_load_errors() == set()
    torch.cuda.synchronize()
    for w, g in zip(want, _blocks(paged, dst[: 2 * BPC]), strict=True):
        assert torch.equal(w, g)
    ex2.close()
