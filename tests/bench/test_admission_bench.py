"""The admission benchmark's arithmetic (bench/admission_bench.py): the arrivals it offers,
the capacity it divides by, and how it judges issue 38's targets. The fleet runs are the
benchmark itself (docs/benchmarks.md), not a test."""

from __future__ import annotations

import argparse

from kvroute.bench.admission_bench import add_arguments, capacity_per_s, plan, targets
from kvroute.bench.sim.latency import LatencyModel
from kvroute.bench.workloads import TextSource


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_capacity_is_replicas_over_the_mixes_mean_prefill() -> None:
    args = _args("--replicas", "2", "--cold-tokens", "1000", "--suffix-tokens", "99")
    lat = LatencyModel(prefill_s_per_token=1e-3)
    # half cold (1.0 s), half cached (100 uncached tokens: 0.1 s): mean 0.55 s
    assert abs(capacity_per_s(args, lat) - 2 / 0.55) < 1e-9


def test_the_plan_is_seeded_and_mixes_classes_and_kinds() -> None:
    args = _args("--duration-s", "20", "--prefix-tokens", "20", "--cold-tokens", "20")
    first = plan(args, 10.0, TextSource(0))
    again = plan(args, 10.0, TextSource(0))
    assert [(p.at_s, p.priority, p.kind, p.prompt) for p in first] == [
        (p.at_s, p.priority, p.kind, p.prompt) for p in again
    ]
    assert 120 < len(first) < 280  # Poisson at 10/s over 20 s
    assert all(0 <= p.at_s < 20 for p in first)
    assert {p.priority for p in first} == {-1, 0} and {p.kind for p in first} == {"cached", "cold"}
    high = sum(1 for p in first if p.priority == -1) / len(first)
    assert 0.1 < high < 0.4


def _row(arm: str, goodput: int, high_p90: float) -> dict:
    return {"arm": arm, "goodput": goodput, "by_class": {"high": {"ttft_p90_s": high_p90}}}


def test_targets_compare_arms_of_the_same_run() -> None:
    rows = [
        _row("unloaded", 20, 0.4),
        _row("refuse", 90, 0.5),
        _row("fcfs", 80, 1.5),
        _row("kvroute", 120, 0.55),
    ]
    out = targets(rows)
    assert out["high_ttft_p90_ratio_vs_unloaded"] == 1.375
    assert out["met_high_p90_within_1_5x"]
    assert out["met_goodput_above_fcfs"] and out["met_goodput_above_refuse"]
    assert out["goodput_ratio_vs_fcfs"] == 1.5
    rows[3] = _row("kvroute", 85, 0.7)
    out = targets(rows)
    assert not out["met_high_p90_within_1_5x"] and not out["met_goodput_above_refuse"]
