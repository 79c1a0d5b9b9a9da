"""The tiny model build: tokenizer-only builds (what a base install can do), the stamp, and
builders in several processes at once (the suite's xdist workers share the state dir)."""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

from kvroute.deploy.tiny_model import BUILD_STAMP, build_tiny_model, model_digest

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


def _build_tokenizer_only(out: str) -> tuple[int, str]:
    built = build_tiny_model(Path(out), weights=False, **SMALL)
    return built.stat().st_ino, model_digest(built)


def test_builders_in_several_processes_at_once_build_it_once(tmp_path: Path) -> None:
    """Each caller gets the same directory, built once: a later builder waited and found it
    built, it did not swap in its own copy under a process already reading the first."""
    out = tmp_path / "shared" / "tok"
    with multiprocessing.get_context("spawn").Pool(3) as pool:
        got = pool.map(_build_tokenizer_only, [str(out)] * 3)
    assert set(got) == {(out.stat().st_ino, model_digest(out))}, got
    assert {p.name for p in out.parent.iterdir()} == {"tok", ".tok.lock"}  # nothing half-built
