"""The tiny model build: tokenizer-only builds (what a base install can do) and the stamp."""

from __future__ import annotations

import json
from pathlib import Path

from kvroute.deploy.tiny_model import BUILD_STAMP, build_tiny_model

SMALL = {"max_model_len": 512, "num_layers": 1, "hidden_size": 64}


def test_a_tokenizer_only_build_writes_no_weights(tmp_path: Path) -> None:
    out = build_tiny_model(tmp_path / "tok", weights=False, **SMALL)
    assert not (out / "model.safetensors").exists()
    assert {"tokenizer.json", "tokenizer_config.json", "config.json"} <= {
        p.name for p in out.iterdir()
    }
    assert json.loads((out / BUILD_STAMP).read_text())["weights"] is False


def test_a_full_build_serves_a_tokenizer_only_ask_but_not_the_reverse(tmp_path: Path) -> None:
    full = build_tiny_model(tmp_path / "m", **SMALL)
    stamp = (full / BUILD_STAMP).stat().st_mtime_ns
    assert build_tiny_model(full, weights=False, **SMALL) == full
    assert (full / BUILD_STAMP).stat().st_mtime_ns == stamp  # left untouched

    tok = build_tiny_model(tmp_path / "t", weights=False, **SMALL)
    build_tiny_model(tok, **SMALL)
    assert (tok / "model.safetensors").is_file()  # rebuilt with weights


def test_a_stamp_from_before_the_weights_knob_still_counts_as_a_full_build(
    tmp_path: Path,
) -> None:
    full = build_tiny_model(tmp_path / "m", **SMALL)
    stamp_path = full / BUILD_STAMP
    old = json.loads(stamp_path.read_text())
    del old["weights"]
    stamp_path.write_text(json.dumps(old))
    mtime = stamp_path.stat().st_mtime_ns
    assert build_tiny_model(full, **SMALL) == full
    assert stamp_path.stat().st_mtime_ns == mtime
