"""``kvroute bench tokenizer`` at a small size: both encode paths give the same ids, and the
ratios it reports are the ones its rows hold."""

from __future__ import annotations

import argparse

import pytest

from kvroute.bench import tokenizer_bench
from kvroute.bench.sim.tokenizer import ensure_model_dir


def _args(*extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    tokenizer_bench.add_arguments(parser)
    return parser.parse_args(["--model-dir", str(ensure_model_dir()), *extra])


def test_small_run_reports_both_paths_with_equal_ids() -> None:
    out = tokenizer_bench.run(_args("--users", "3", "--routers", "2", "--repeats", "2"))
    assert out["ids_identical"] is True
    assert out["requests"] == 3 * 12  # the full preset's rounds per user
    assert out["mean_prompt_tokens"] > 1000  # system prompt + history: a real chat's size
    rows = {(r["routers"], r["encode"]): r for r in out["rows"]}
    assert set(rows) == {(1, "direct"), (1, "transformers"), (2, "direct"), (2, "transformers")}
    for row in rows.values():
        assert len(row["encode_ms_runs"]) == 2
        assert row["encode_ms_per_request"] > 0
    assert out["direct_over_transformers"]["2"] == pytest.approx(
        rows[(2, "direct")]["encode_ms_per_request"]
        / rows[(2, "transformers")]["encode_ms_per_request"]
    )
    assert out["routers_2_over_1"]["direct"] == pytest.approx(
        rows[(2, "direct")]["encode_ms_per_request"] / rows[(1, "direct")]["encode_ms_per_request"]
    )


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(SystemExit, match="must be >= 1"):
        tokenizer_bench.run(_args("--routers", "0"))


def test_a_missing_model_dir_is_a_clear_error(tmp_path) -> None:
    parser = argparse.ArgumentParser()
    tokenizer_bench.add_arguments(parser)
    args = parser.parse_args(["--model-dir", str(tmp_path / "none")])
    with pytest.raises(SystemExit, match="cannot load"):
        tokenizer_bench.run(args)
