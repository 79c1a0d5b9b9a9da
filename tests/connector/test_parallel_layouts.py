"""Parallel layouts beyond one engine of equal parts: pipeline stages of different layer
counts, decode context parallelism, data-parallel engines on one directory.

* vLLM gives the scheduler PP stage 0's KV cache config and each worker its own stage's.
  With 61 layers at PP=4 (15/15/16/15) a RAM pool sized from one's own layers would give
  the 16-layer stage fewer slots than the scheduler plans: every process sizes it from
  the largest stage instead, and workers of every stage execute the same plans.
* DCP > 1 changes vLLM's hashing unit to block_size x DCP: refused at start.
* Each DP engine gets a private directory of its own (a storage domain stays shared).

Plain torch and stand-ins for vLLM's config objects; the two tests marked ``vllm``
check the stand-ins' assumptions against vLLM's own functions (no server)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvroute.connector.cpu_tier import num_slots_for
from kvroute.connector.disk_scan import scan_layout
from kvroute.connector.disk_tier import unlink_chunk_all_ranks
from kvroute.connector.identity import RankInfo
from kvroute.connector.layout import (
    LayoutError,
    check_dcp,
    check_stage_layers,
    dp_index,
    engine_layout_dir,
    pool_slots,
    stage_layer_counts,
    stage_layers,
)
from kvroute.connector.planner import Planner
from kvroute.connector.worker import WorkerExecutor
from tests.connector.helpers import (
    BPC,
    CHUNK,
    IDENTITY,
    block_data,
    block_hashes,
    make_paged,
    make_planner,
)


def _pp_indices(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """vLLM's default split (``vllm.distributed.utils.get_pp_indices``): the remainder
    goes to the stages before the last, from the second-to-last backwards."""
    parts = [num_layers // pp_size] * pp_size
    for i in range(2, num_layers % pp_size + 2):
        parts[-i] += 1
    start = sum(parts[:pp_rank])
    return start, start + parts[pp_rank]


class FakeModelConfig:
    """``ModelConfig.get_num_layers_by_block_type`` of a plain transformer: the layers
    of the stage that ``parallel_config.rank`` belongs to (layout DP x PP x TP)."""

    def __init__(self, num_layers: int, split: Any = _pp_indices) -> None:
        self.num_layers = num_layers
        self.split = split

    def get_num_layers_by_block_type(self, pc: Any, block_type: str = "attention") -> int:
        pp = pc.pipeline_parallel_size
        stage = (pc.rank // pc.tensor_parallel_size) % pp
        start, end = self.split(self.num_layers, stage, pp)
        return end - start


# ---------------------------------------------------------------- pipeline stages
def test_61_layers_at_pp4_give_every_stage_the_same_slots() -> None:
    counts = stage_layer_counts(FakeModelConfig(61), tp_size=2, pp_size=4)
    assert counts == [15, 15, 16, 15]
    page, cpu = 4096, 100 * 15 * BPC * 4096  # room for 100 chunks of a 15-layer stage
    # Sized from its own layers, the 16-layer stage would have fewer slots than the
    # scheduler (stage 0) plans.
    assert num_slots_for(cpu, 16 * BPC * page) < num_slots_for(cpu, 15 * BPC * page)
    slots = pool_slots(cpu, counts, BPC, page)
    assert slots == num_slots_for(cpu, 16 * BPC * page) == 93
    for stage, layers in enumerate(counts):
        assert layers * BPC * page * slots <= cpu  # no stage's pool exceeds cpu_gib
        check_stage_layers(counts, stage, layers)
    # PP=1: nothing to derive, the process's own layers.
    assert stage_layers(SimpleNamespace(model_config=None), 61, 1, 1) == [61]


def test_a_stage_whose_layers_do_not_match_the_split_is_refused() -> None:
    counts = [15, 15, 16, 15]
    with pytest.raises(LayoutError, match="VLLM_PP_LAYER_PARTITION"):
        check_stage_layers(counts, 2, 15)

    class Broken:
        def get_num_layers_by_block_type(self, pc: Any, block_type: str = "attention") -> int:
            raise AttributeError("no layers_block_type")

    with pytest.raises(LayoutError, match="--pipeline-parallel-size 1"):
        stage_layers(SimpleNamespace(model_config=Broken()), 15, 1, 4)


def test_workers_of_stages_with_different_layer_counts_execute_the_same_plans(
    tmp_path: Path,
) -> None:
    """A scheduler (stage 0, 15 layers) and four workers (15/15/16/15 layers): every
    slot the planner hands out exists in every pool, and each stage's RAM hit and disk
    hit give back its own bytes."""
    counts = [15, 15, 16, 15]
    pageds = [make_paged(layers=n) for n in counts]
    for i, pg in enumerate(pageds):
        for t in pg.layers:
            t.add_(10.0 * i)  # other layers, other values
    page = pageds[0].block_bytes()
    # RAM for exactly 4 chunks of a 15-layer stage: 3 of the 16-layer one.
    cpu = 4 * 15 * BPC * page + 10
    assert num_slots_for(cpu, 15 * BPC * page) == 4 and num_slots_for(cpu, 16 * BPC * page) == 3
    slots = pool_slots(cpu, counts, BPC, page)
    assert slots == 3
    ranks = [RankInfo(pp_rank=s, pp_size=4) for s in range(4)]
    layout = tmp_path / "layout"
    planner = make_planner(
        num_slots=slots,
        disk_enabled=True,
        disk_capacity_bytes=1 << 24,
        payload_bytes=max(counts) * BPC * page,
        num_workers=4,
        files_per_chunk=4,
        unlink=lambda k: unlink_chunk_all_ranks(layout, ranks, k),
    )
    workers = [
        WorkerExecutor(
            pg, blocks_per_chunk=BPC, num_slots=slots, identity=IDENTITY, disk_dir=layout, rank=r
        )
        for pg, r in zip(pageds, ranks, strict=True)
    ]

    def step() -> None:
        plan = planner.take_plan()
        reports = []
        for w in workers:
            w.before_forward(plan)
            w.after_forward(plan)
            w.wait_idle()
            reports += w.take_reports()
        planner.on_reports(reports)

    # More chunks than slots: every slot number is used, then reused.
    prompts = []
    for seed in range(5):
        tokens = [seed * 7919 + i for i in range(CHUNK + 1)]
        hashes = block_hashes(tokens)
        prompts.append((tokens, hashes))
        planner.on_scheduled(f"s{seed}", list(range(BPC)), hashes, tokens, len(tokens))
        step()
        step()  # disk write reports
    used = {planner.cpu.get(h[BPC - 1]).slot for _, h in prompts if planner.cpu.get(h[BPC - 1])}
    assert used == set(range(slots))
    want = [block_data(pg, list(range(BPC))) for pg in pageds]  # the last prompt's blocks
    # A RAM hit (the last prompt) and a disk hit (the first, evicted from RAM).
    for name, (tokens, hashes) in (("ram", prompts[-1]), ("disk", prompts[0])):
        res = planner.lookup(name, hashes, tokens, len(tokens), 0)
        assert res.num_tokens == CHUNK
        dst = list(range(40, 40 + BPC))
        planner.on_alloc(name, dst, res.num_tokens)
        step()
        for w in workers:
            w.wait_idle()
            assert w.take_load_errors() == set()
        if name == "ram":
            for pg, exp in zip(pageds, want, strict=True):
                for a, b in zip(exp, block_data(pg, dst), strict=True):
                    assert torch.equal(a, b)
    # Each stage's files hold its own layers: the start-up scan serves all five chunks.
    assert len(scan_layout(layout, IDENTITY, ranks)) == 5
    for w in workers:
        w.close()


# ---------------------------------------------------------------- decode context parallel
def test_decode_context_parallelism_is_refused_at_start() -> None:
    check_dcp(SimpleNamespace(decode_context_parallel_size=1), 32)
    check_dcp(SimpleNamespace(), 32)  # a vLLM without DCP
    with pytest.raises(LayoutError) as err:
        check_dcp(SimpleNamespace(decode_context_parallel_size=2), 32)
    msg = str(err.value)
    assert "block_size x DCP = 64" in msg and "--decode-context-parallel-size 1" in msg


# ---------------------------------------------------------------- data parallel
def test_each_dp_engine_has_its_own_private_directory(tmp_path: Path) -> None:
    base, digest = tmp_path / "kv", "0123456789abcdef"
    # vLLM resets data_parallel_rank to 0 in the independent engines of a dense model
    # and keeps the rank in data_parallel_index.
    assert dp_index(SimpleNamespace(data_parallel_rank=0, data_parallel_index=1)) == 1
    assert dp_index(SimpleNamespace(data_parallel_rank=3)) == 3
    assert dp_index(SimpleNamespace()) == 0
    dirs = [engine_layout_dir(base, digest, dp=r, shared=False) for r in range(3)]
    assert dirs == [base / digest, base / digest / "dp1", base / digest / "dp2"]
    # A storage domain stays one directory for every DP rank.
    assert {engine_layout_dir(base, digest, dp=r, shared=True) for r in range(3)} == {base / digest}


class DpEngine:
    """A DP engine's planner and worker on its private directory, as after a start."""

    def __init__(self, base: Path, dp: int) -> None:
        self.dir = engine_layout_dir(base, "0123456789abcdef", dp=dp, shared=False)
        self.paged = make_paged()
        self.p: Planner = make_planner(
            num_slots=1,  # RAM evicts at once: hits come from disk
            disk_enabled=True,
            disk_capacity_bytes=1 << 20,
            payload_bytes=self.paged.num_layers * BPC * self.paged.block_bytes(),
            unlink=lambda k: unlink_chunk_all_ranks(self.dir, [RankInfo()], k),
        )
        self.p.add_disk_entries(scan_layout(self.dir, IDENTITY, [RankInfo()]))
        self.ex = WorkerExecutor(
            self.paged, blocks_per_chunk=BPC, num_slots=1, identity=IDENTITY, disk_dir=self.dir
        )

    def step(self) -> None:
        plan = self.p.take_plan()
        self.ex.before_forward(plan)
        self.ex.after_forward(plan)
        self.ex.wait_idle()
        self.p.on_reports(self.ex.take_reports())

    def store(self, seed: int) -> tuple[list[int], list[bytes]]:
        tokens = [seed * 7919 + i for i in range(CHUNK + 1)]
        hashes = block_hashes(tokens)
        self.p.on_scheduled(f"s{seed}", list(range(BPC)), hashes, tokens, len(tokens))
        self.step()
        self.step()
        return tokens, hashes

    def load(self, tokens: list[int], hashes: list[bytes]) -> tuple[int, set[int]]:
        res = self.p.lookup("r", hashes, tokens, len(tokens), 0)
        if res.num_tokens:
            self.p.on_alloc("r", list(range(20, 20 + BPC)), res.num_tokens)
            self.step()
            self.ex.wait_idle()
        return res.num_tokens, self.ex.take_load_errors()

    def close(self) -> None:
        self.ex.close()


def test_dp_engines_never_delete_each_others_indexed_files(tmp_path: Path) -> None:
    base = tmp_path / "kv"
    e0, e1 = DpEngine(base, 0), DpEngine(base, 1)
    _, h0 = e0.store(1)
    t1, h1 = e1.store(2)
    # Both restart (each scans its own directory only, and removes nothing of the other's).
    e0.close()
    e1.close()
    e0, e1 = DpEngine(base, 0), DpEngine(base, 1)
    assert e0.p.disk.get(h0[BPC - 1]) is not None and e0.p.disk.get(h1[BPC - 1]) is None
    assert e1.p.disk.get(h1[BPC - 1]) is not None and e1.p.disk.get(h0[BPC - 1]) is None
    # Engine 0 resets its cache (deletes every file it indexes): engine 1's disk hit,
    # which a shared private directory would have turned into a load error (a failed
    # request under vLLM's default kv_load_failure_policy="fail"), still loads.
    e0.p.reset()
    e0.step()
    assert not list(e0.dir.glob("tp0-pp0/*.kvc"))
    assert e1.load(t1, h1) == (CHUNK, set())
    for e in (e0, e1):
        e.close()


# ---------------------------------------------------------------- against vLLM itself
@pytest.mark.vllm
def test_the_stand_in_split_is_vllms() -> None:
    from vllm.distributed.utils import get_pp_indices

    for n, pp in ((61, 4), (32, 4), (30, 4), (7, 3), (2, 2)):
        assert [_pp_indices(n, r, pp) for r in range(pp)] == [
            get_pp_indices(n, r, pp) for r in range(pp)
        ]
    counts = stage_layer_counts(FakeModelConfig(61, split=get_pp_indices), 1, 4)
    assert counts == [15, 15, 16, 15]


@pytest.mark.vllm
def test_vllm_hashes_block_size_x_dcp_tokens_per_block() -> None:
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    kv = KVCacheConfig(
        num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)]
    )

    def cfg(dcp: int) -> Any:
        return SimpleNamespace(
            cache_config=SimpleNamespace(
                block_size=32, prefix_match_unit=None, enable_prefix_caching=True
            ),
            parallel_config=SimpleNamespace(decode_context_parallel_size=dcp),
            kv_transfer_config=object(),
        )

    assert resolve_kv_cache_block_sizes(kv, cfg(1)) == (32, 32)
    assert resolve_kv_cache_block_sizes(kv, cfg(2)) == (64, 64)  # what check_dcp refuses
