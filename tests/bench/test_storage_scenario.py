"""The shared-storage routing scenario's mechanics, on its quick preset (real router process,
real simulated fleet, real ZMQ; no mocks).

One arm, kvroute over a fleet whose replicas share one STORAGE domain smaller than the
working set, with a replica added and one restarted mid-run: the domain's blocks are loaded
by replicas that never computed them, the domain's evictor removals reach the router's
index, and the added replica hits within its first requests. The performance targets are
benchmark figures (docs/benchmarks.md), never asserted here.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvroute.bench import routing_bench
from kvroute.bench.sim.fleet import SimFleet
from kvroute.bench.storage_scenario import (
    QUESTION,
    SCENARIO_PRESETS,
    run_arm,
    scenario_targets,
    warmup_workload,
)
from kvroute.bench.workloads import BUILDERS, TextSource
from kvroute.bench.workloads.runner import RequestRecord
from kvroute.deploy.router_process import RouterProcess


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    routing_bench.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_hot_docs_is_skewed_and_sized_as_asked() -> None:
    w = BUILDERS["hot_docs"](TextSource(1), seed=1, documents=4, requests=400, skew=1.0)
    assert w.num_requests == 400 and all(len(s.turns) == 1 for s in w.sessions)
    counts = [sum(1 for s in w.sessions if s.id.startswith(f"hot-{d}-")) for d in range(4)]
    assert counts[0] > 1.5 * counts[3] > 0  # weights 1 : 1/4
    starts = [s.start_s for s in w.sessions]
    assert starts == sorted(starts) and 400 / starts[-1] == pytest.approx(8.0, rel=0.25)
    with pytest.raises(ValueError, match="rate"):
        BUILDERS["hot_docs"](TextSource(1), rate=0)


def test_the_warmup_reads_each_document_once_with_a_question_of_its_own() -> None:
    w = BUILDERS["hot_docs"](TextSource(1), seed=1, documents=5, requests=200, skew=1.0)
    warm = warmup_workload(w, rate=4.0)
    docs = [s.turns[0].content.split(QUESTION)[0] for s in w.sessions]
    first_use = list(dict.fromkeys(docs))
    assert len(first_use) == 5
    assert [s.turns[0].content.split(QUESTION)[0] for s in warm.sessions] == first_use
    measured_questions = {s.turns[0].content for s in w.sessions}
    assert not measured_questions & {s.turns[0].content for s in warm.sessions}
    assert [s.start_s for s in warm.sessions] == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert all(s.id.startswith("warmup-") for s in warm.sessions)
    assert SCENARIO_PRESETS["full"]["warmup"] is True
    assert _args("--scenario", "shared_storage", "--scenario-cold").scenario_cold is True


@pytest.mark.timeout(150)
def test_quick_shared_storage_arm_mechanics(tmp_path: Path) -> None:
    preset = SCENARIO_PRESETS["quick"]
    seen: dict[str, Any] = {}

    def inspect(fleet: SimFleet, router: RouterProcess, records: list[RequestRecord]) -> None:
        # The router's index converges on the domain's contents: stores from every attached
        # replica, removals from the evictor's own stream. The last requests' events may still
        # be on their way (two streams are not ordered with each other): wait until both agree.
        deadline = time.monotonic() + 15
        while True:
            domain = fleet.storage_contents()
            stats = httpx.get(router.url + "/index/stats", timeout=5.0).json()
            view = stats["storage_domains"].get(domain["name"], {})
            removed = (view.get("feed") or {}).get("blocks_removed", 0)
            unresolved = (view.get("feed") or {}).get("unresolved_blocks", 0)
            converged = (
                removed + unresolved == domain["removals_announced"]
                and abs(view.get("blocks", 0) - domain["blocks"]) <= 0.1 * domain["blocks"]
            )
            if converged or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        seen.update(domain=domain, view=view, fleet_stats=fleet.stats())

    row = run_arm(
        _args("--preset", "quick"),
        preset,
        ("kvroute_shared", "kvroute", True),
        tmp_path,
        inspect=inspect,
        log_dir=tmp_path,
    )
    domain, view, fleet_stats = seen["domain"], seen["view"], seen["fleet_stats"]
    assert row["completed"] >= 0.8 * row["requests"], row["errors"]

    # The evictor ran (the domain is smaller than the working set) and said so on its stream;
    # every removal it published reached the router's index (applied, or unresolved when it
    # overtook the store it undoes: two streams are not ordered with each other), and the
    # index holds what the domain holds, up to such races.
    assert domain["evictions"] > 0 and domain["batches_published"] > 0, domain
    # (an eviction is announced, or not because the block was written again before it was)
    assert 0 < domain["removals_announced"] <= domain["evictions"] - domain["rewritten"], domain
    feed = view["feed"]
    assert feed["blocks_removed"] > 0
    assert feed["blocks_removed"] + feed["unresolved_blocks"] == domain["removals_announced"], (
        feed,
        domain,
    )
    assert abs(view["blocks"] - domain["blocks"]) <= 0.1 * domain["blocks"], (view, domain)
    added = row["scale_up"]["replica"]
    assert added in view["attached"] and len(view["attached"]) == preset["replicas"] + 1

    # The added replica hits within its first requests (the domain is written through: a
    # document computed anywhere is a load for it; docs/benchmarks.md).
    assert row["scale_up"]["requests"] >= 2
    assert row["scale_up"]["first_hit_request"] is not None
    assert row["scale_up"]["first_hit_request"] <= 3
    # The domain's blocks are routed to and loaded: with no CPU tier on this preset, every
    # external hit is a load from the domain by a replica that had dropped or never held it.
    assert domain["reads"] > 0
    assert sum(s["external_hits"] for s in fleet_stats.values()) > 0, fleet_stats

    # The restarted replica lost device and CPU but not the domain: it hits again.
    restart = row["restart"]
    assert restart["requests_after"] >= 3, restart
    assert restart["first_hit_request_after"] is not None, restart

    # What the cost model learned of the rates, against the simulator's (issue 38's
    # calibration on this preset): answered streams were its samples.
    rates = row["cost_rates"]
    assert rates["learned"] is True and rates["samples"] > 0, rates
    assert rates["load_s_per_token_storage_vs_true"] > 0, rates


def test_scenario_targets_compare_shared_with_private() -> None:
    rows = [
        {"policy": "kvroute_shared", "hit_rate": 0.8, "ttft_p90_s": 1.0},
        {"policy": "kvroute_private", "hit_rate": 0.6, "ttft_p90_s": 2.0},
    ]
    t = scenario_targets(rows)
    assert t["hit_rate_gain_vs_private"] == pytest.approx(0.2)
    assert t["ttft_p90_ratio_vs_private"] == pytest.approx(0.5)
    assert t["met_hit_rate"] and t["met_ttft_p90"]
    rows[0]["hit_rate"] = 0.65
    assert not scenario_targets(rows)["met_hit_rate"]
    assert scenario_targets(rows[:1]) == {}
