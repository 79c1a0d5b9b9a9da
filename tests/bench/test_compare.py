"""``kvroute bench compare`` on record files written in the routing benchmark's format: equal
arms come out equal, a slower arm is caught, and bad input gets a clear error."""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import pytest

from kvroute.bench import compare


def _write_run(path: Path, ttfts: list[float], *, failed: int = 0, hit: float = 0.92) -> str:
    path.mkdir(parents=True)
    lines = [
        {
            "workload": "chat",
            "policy": "kvroute",
            "session": f"u{i}",
            "turn": 0,
            "ttft_s": t,
            "error": None,
        }
        for i, t in enumerate(ttfts)
    ]
    lines += [
        {
            "workload": "chat",
            "policy": "kvroute",
            "session": "x",
            "turn": 1,
            "ttft_s": None,
            "error": "ReadTimeout: upstream",
        }
    ] * failed
    # Another workload and policy in the same file are not counted.
    lines.append({"workload": "shared_prefix", "policy": "kvroute", "ttft_s": 99.0, "error": None})
    lines.append({"workload": "chat", "policy": "round_robin", "ttft_s": 99.0, "error": None})
    (path / "routing_requests.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    summary = [{"workload": "chat", "policy": "kvroute", "hit_rate": hit}]
    (path / "routing.json").write_text(json.dumps(summary))
    return str(path)


def _arm(tmp: Path, name: str, runs: int, scale: float, seed: int) -> list[str]:
    out = []
    for i in range(runs):
        rng = random.Random(seed * 1000 + i)
        machine = rng.uniform(0.9, 1.1)  # a run's own conditions, shared by its requests
        ttfts = [scale * machine * rng.lognormvariate(-1.5, 1.0) for _ in range(600)]
        out.append(_write_run(tmp / f"{name}{i}", ttfts))
    return out


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    compare.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_equal_arms_are_no_worse_and_a_slower_one_is_caught(tmp_path: Path) -> None:
    base = _arm(tmp_path, "b", 8, 1.0, seed=1)
    same = _arm(tmp_path, "s", 8, 1.0, seed=2)
    slow = _arm(tmp_path, "w", 8, 1.3, seed=3)
    equal = compare.run(_args("--a", *same, "--b", *base, "--margin", "0.05"))
    assert 0.85 < equal["pooled"]["p90"]["a_over_b"] < 1.15
    interval = equal["pooled_ratio_paired_bootstrap"]
    assert interval["low_95"] < 1 < interval["high_95"]
    assert equal["pair_ratios"]["median"] == pytest.approx(1, abs=0.2)
    assert len(equal["pairs"]) == 8 and equal["failed_requests"] == {"a": 0, "b": 0}
    assert equal["hit_rates"]["a"] == [0.92] * 8

    worse = compare.run(_args("--a", *slow, "--b", *base, "--margin", "0.05"))
    assert worse["pooled"]["p90"]["a_over_b"] > 1.15
    assert worse["pooled_ratio_paired_bootstrap"]["low_95"] > 1.05
    assert worse["no_worse"] is False
    # The pooled figure is every request of the arm together, not a mean of runs.
    assert worse["pooled"]["p50"]["a"] > worse["pooled"]["p50"]["b"]


def test_unequal_run_counts_are_compared_unpaired(tmp_path: Path) -> None:
    a = _arm(tmp_path, "a", 3, 1.0, seed=4)
    b = _arm(tmp_path, "b", 5, 1.0, seed=5)
    out = compare.run(_args("--a", *a, "--b", *b, "--margin", "0.5", "--resamples", "200"))
    assert "pairs" not in out and "pooled_ratio_paired_bootstrap" not in out
    assert out["runs"] == {"a": 3, "b": 5}
    assert "no_worse" in out


def test_failed_requests_are_counted_not_timed(tmp_path: Path) -> None:
    a = [_write_run(tmp_path / "a", [0.1] * 50, failed=3)]
    b = [_write_run(tmp_path / "b", [0.1] * 50)]
    out = compare.run(_args("--a", *a, "--b", *b, "--resamples", "100"))
    assert out["failed_requests"] == {"a": 3, "b": 0}
    assert out["pooled"]["p99"]["a_over_b"] == 1.0


def test_bad_input_gets_a_clear_error(tmp_path: Path) -> None:
    good = _write_run(tmp_path / "good", [0.1] * 10)
    with pytest.raises(SystemExit, match="not found \\(run with --records\\)"):
        compare.run(_args("--a", str(tmp_path / "none"), "--b", good))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "routing_requests.jsonl").write_text('{"workload": "chat"}\n{not json\n')
    with pytest.raises(SystemExit, match=r"routing_requests\.jsonl:2"):
        compare.run(_args("--a", str(broken), "--b", good))
    with pytest.raises(SystemExit, match="no doc_qa/kvroute requests"):
        compare.run(_args("--a", good, "--b", good, "--workload", "doc_qa"))
    with pytest.raises(SystemExit, match="--resamples"):
        compare.run(_args("--a", good, "--b", good, "--resamples", "5"))
