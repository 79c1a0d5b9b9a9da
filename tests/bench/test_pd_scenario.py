"""The P/D routing scenario's mechanics (bench/pd_scenario.py), on a small preset: a real
router process over a real simulated fleet with P/D pools, a prefill replica killed mid-run,
and every request still answered; the mix's kinds; the targets' arithmetic. The performance
targets are benchmark figures (docs/benchmarks.md), never asserted here."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from kvroute.bench import routing_bench
from kvroute.bench.pd_scenario import ARMS, PD_PRESETS, pd_targets, run_pd_arm
from kvroute.bench.workloads import TextSource, pd_mix

SMALL = {
    **PD_PRESETS["quick"],
    "kill_at_s": 2.0,
    "deadline_s": 60.0,
    "sizes": {
        **PD_PRESETS["quick"]["sizes"],
        "long_requests": 5,
        "long_rate": 1.0,
        "users": 2,
        "rounds": 2,
        "short_requests": 6,
        "short_rate": 2.0,
    },
}


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    routing_bench.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_the_mix_has_long_new_prompts_returning_users_and_short_prompts() -> None:
    w = pd_mix.build(TextSource(1), seed=1, long_requests=3, users=2, rounds=3, short_requests=4)
    kinds = {s.id.split("-")[0]: 0 for s in w.sessions}
    for s in w.sessions:
        kinds[s.id.split("-")[0]] += len(s.turns)
    assert kinds == {"long": 3, "user": 6, "short": 4}
    assert [s.start_s for s in w.sessions] == sorted(s.start_s for s in w.sessions)
    again = pd_mix.build(
        TextSource(1), seed=1, long_requests=3, users=2, rounds=3, short_requests=4
    )
    assert [s.turns for s in again.sessions] == [s.turns for s in w.sessions]


@pytest.mark.timeout(180)
def test_a_prefill_replica_killed_mid_run_costs_no_request(tmp_path: Any) -> None:
    args = _args("--preset", "quick", "--out-dir", str(tmp_path))
    arm = next(a for a in ARMS if a[0] == "kvroute_pd_prefill_killed")
    row = run_pd_arm(args, SMALL, arm)
    assert row["killed"]["replica"] == "sim-0" and row["killed"]["at_s"] is not None
    assert row["roles"] == {
        "sim-0": "prefill",
        "sim-1": "prefill",
        "sim-2": "decode",
        "sim-3": "decode",
    }
    assert row["failed"] == 0 and row["completed"] == row["requests"] == 5 + 4 + 6
    # Prefill replicas answer clients only for what the decider served whole there; the
    # decider skipped the prefill leg for some requests.
    by = row["requests_by_replica"]
    pd = row["pd"]
    assert by.get("sim-0", 0) + by.get("sim-1", 0) <= pd["on_prefill"]
    assert sum(pd["decisions"].values()) == row["requests"]
    assert pd["decisions"]["small_uncached"] > 0
    assert pd["resume_failures"] == 0


def _row(policy: str, p90: float, failed: int = 0) -> dict[str, Any]:
    return {"policy": policy, "ttft_p90_s": p90, "failed": failed}


def test_the_targets_compare_the_decider_with_both_baselines() -> None:
    met = pd_targets([_row("kvroute_pd", 0.7), _row("always_split", 1.0), _row("aggregated", 0.8)])
    assert met["met_no_worse_than_best"] and met["met_0_8x_always_split"]
    assert met["met_zero_failures"] and met["ratio_vs_always_split"] == pytest.approx(0.7)
    missed = pd_targets(
        [_row("kvroute_pd", 0.9), _row("always_split", 1.0), _row("aggregated", 0.8, failed=1)]
    )
    assert not missed["met_no_worse_than_best"] and not missed["met_0_8x_always_split"]
    assert not missed["met_zero_failures"] and missed["failed"]["aggregated"] == 1
