"""The warm-start benchmark runs and measures what it says: the warm subscriber applies only
the gap and ends with the cold one's entries."""

from __future__ import annotations

from kvroute.bench.warm_start_bench import run


def test_the_warm_start_bench_applies_only_the_gap() -> None:
    result = run(batches=200, blocks=4, gap=8)
    assert result["warm_outcome"] == "verified"
    assert result["same_entries"] is True
    assert result["cold_batches_applied"] == result["history_batches"] == 250
    assert result["warm_batches_applied"] == result["gap_batches"] == 10
