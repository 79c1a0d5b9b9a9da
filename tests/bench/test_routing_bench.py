"""The routing benchmark end to end: quick preset, real router processes, simulated fleet.

Runs two policies on the shared-prefix workload (about a minute) and checks the JSON's shape
and sanity, then the same workload behind two router processes sharing the traffic (the HA
deployment); the full comparison is ``kvroute bench routing`` (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

import pytest

from kvroute.bench import routing_bench
from kvroute.bench.workloads.runner import pick_router

CORES = sorted(os.sched_getaffinity(0))

KEYS = {
    "workload",
    "policy",
    "hit_rate",
    "ttft_p50_s",
    "ttft_p90_s",
    "ttft_p99_s",
    "throughput_rps",
    "upper_bound_hit_rate",
}


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    routing_bench.add_arguments(parser)
    return parser.parse_args(list(argv))


def _quick_shared_prefix(out: Path, *argv: str) -> dict:
    return routing_bench.run(
        _args("--preset", "quick", "--workloads", "shared_prefix", "--out", str(out), *argv)
    )


def test_unknown_policy_or_workload_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown"):
        routing_bench.run(
            _args("--preset", "quick", "--policies", "random", "--out-dir", str(tmp_path))
        )
    with pytest.raises(ValueError, match="unknown"):
        routing_bench.run(
            _args("--preset", "quick", "--workloads", "nope", "--out-dir", str(tmp_path))
        )


def test_cpu_lists_name_cores_this_process_may_use() -> None:
    assert routing_bench.cpu_list(str(CORES[0])) == [CORES[0]]
    assert routing_bench.cpu_list(f"{CORES[-1]},{CORES[0]}") == sorted({CORES[0], CORES[-1]})
    if list(range(CORES[0], CORES[-1] + 1)) == CORES:
        assert routing_bench.cpu_list(f"{CORES[0]}-{CORES[-1]}") == CORES
    for bad in ("", "a", "1-x", str(max(CORES) + 1)):
        with pytest.raises(argparse.ArgumentTypeError):
            routing_bench.cpu_list(bad)
    with pytest.raises(SystemExit):  # argparse: a clear usage error, nothing started
        _args("--router-cpus", "nope")


def test_router_count_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--routers"):
        routing_bench.run(_args("--preset", "quick", "--routers", "0", "--out-dir", str(tmp_path)))


def test_router_options_override_settings_and_cost_knobs() -> None:
    settings: dict = {"policy": "kvroute", "cost": {"prefill_s_per_token": 1e-4}}
    routing_bench._apply_router_options(
        settings,
        ["hint_ttl_s=0", "cost.delay_to_others_weight=2.5", "cost.learn_queue_delay=false"],
    )
    assert settings["hint_ttl_s"] == 0
    assert settings["cost"] == {
        "prefill_s_per_token": 1e-4,
        "delay_to_others_weight": 2.5,
        "learn_queue_delay": False,
    }
    routing_bench._apply_router_options(settings, ["tokenizer_mode=remote"])  # bare string
    assert settings["tokenizer_mode"] == "remote"
    with pytest.raises(ValueError, match="KEY=JSON"):
        routing_bench._apply_router_options(settings, ["hint_ttl_s"])


def test_size_overrides_are_checked_before_anything_runs() -> None:
    preset = routing_bench.PRESETS["quick"]
    sizes = routing_bench.workload_sizes(
        preset,
        ["shared_prefix", "agentic"],
        ["shared_prefix.groups=64", "agentic.tool_output_tokens=[10, 20]"],
    )
    assert sizes["shared_prefix"] == preset["sizes"]["shared_prefix"] | {"groups": 64}
    assert sizes["agentic"]["tool_output_tokens"] == (10, 20)
    assert preset["sizes"]["shared_prefix"]["groups"] == 16  # the preset is not modified
    for bad, why in [
        ("groups=64", "WORKLOAD.KEY=JSON"),
        ("shared_prefix.groups", "WORKLOAD.KEY=JSON"),
        ("chat.users=3", "not being run"),
        ("shared_prefix.grups=3", "no size 'grups'"),
        ("shared_prefix.groups=sixty", "not JSON"),
    ]:
        with pytest.raises(ValueError, match=why):
            routing_bench.workload_sizes(preset, ["shared_prefix"], [bad])


def test_small_device_preset_holds_about_two_long_conversations_per_device() -> None:
    """The preset's premise (bench/routing_presets.py): a device tier that holds two of the
    longest conversations and not three, a CPU tier that holds every history of a replica's
    share, and a chat prompt on the order of a tenth of a second of prefill."""
    preset = routing_bench.PRESETS["small_device"]
    chat = preset["sizes"]["chat"]
    longest = chat["system_tokens"] + chat["rounds"] * (
        chat["question_tokens"] + chat["answer_tokens"]
    )
    blocks = -(-longest // 16)
    assert 2 * blocks <= preset["gpu_blocks"] < 3 * blocks
    per_replica = -(-chat["users"] // preset["replicas"]) * blocks
    assert preset["cpu_blocks"] >= per_replica
    assert preset["workloads"] == ["chat"]


def test_requests_spread_over_routers_stably() -> None:
    urls = ["http://a", "http://b", "http://c"]
    picks = [pick_router(urls, f"user-{u}", t) for u in range(100) for t in range(6)]
    counts = {u: picks.count(u) for u in urls}
    assert all(150 <= n <= 250 for n in counts.values()), counts  # about 200 each
    # The same request goes to the same router in every run (every policy sees the same split),
    # and one conversation's turns reach several routers, as behind a per-request balancer.
    assert picks == [pick_router(urls, f"user-{u}", t) for u in range(100) for t in range(6)]
    assert len({pick_router(urls, "user-7", t) for t in range(6)}) > 1
    assert pick_router(["http://only"], "s", 3) == "http://only"


def test_percentile_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert routing_bench.percentile(values, 50) == 50.0
    assert routing_bench.percentile(values, 90) == 90.0
    assert routing_bench.percentile(values, 99) == 99.0
    assert math.isnan(routing_bench.percentile([], 50))


@pytest.mark.solo  # kvroute's TTFT against round robin's: with nothing else on the cores
@pytest.mark.timeout(240)
def test_quick_run_end_to_end(tmp_path: Path) -> None:
    result = _quick_shared_prefix(tmp_path, "--policies", "round_robin,kvroute")
    assert result["routers"] == 1
    rows = result["results"]
    assert [(r["workload"], r["policy"]) for r in rows] == [
        ("shared_prefix", "round_robin"),
        ("shared_prefix", "kvroute"),
    ]
    assert json.loads((tmp_path / "routing.json").read_text()) == rows
    for r in rows:
        assert r.keys() >= KEYS
        assert r["routers"] == 1
        assert r["completed"] == r["requests"] > 0, r["errors"]
        assert r["token_mismatches"] == 0  # router, replicas and client agree on token ids
        assert 0 <= r["hit_rate"] <= r["upper_bound_hit_rate"] + 0.02 <= 1.02
        assert 0 < r["ttft_p50_s"] <= r["ttft_p90_s"] <= r["ttft_p99_s"]
        assert r["throughput_rps"] > 0
        # The preset's premise: the working set does not fit the fleet's device cache.
        assert r["working_set_tokens"] > r["fleet_device_tokens"]
        # How punctual the fleet's clock and the load generator were during this run.
        for side in ("fleet", "client"):
            lag = r["loop_lag_ms"][side]
            assert lag["samples"] > 0
            assert 0 <= lag["p50_ms"] <= lag["p99_ms"] <= lag["max_ms"]
        timing = r["router_timing"]  # the routers' own histograms, this run only
        assert timing["decision_ms_mean"] > 0 and timing["upstream_ttft_ms_mean"] > 0
        assert timing["router_added_ms_mean"] is not None
        pick = r["queued_prefill_at_pick"]  # the queue behind each pick (bench/pick_quality.py)
        assert pick["requests"] == r["completed"]
        assert pick["mean_tokens"] >= 0 and 0 <= pick["over_2000"] <= 1
    rr, kv = rows
    # Each row says why the router placed its requests (its own /metrics, this run only).
    assert rr["route_reasons"] == {"round_robin": rr["requests"]}
    assert sum(kv["route_reasons"].values()) == kv["requests"]
    assert set(kv["route_reasons"]) <= {"prefix", "hint", "spill", "load", "home"}
    assert kv["upper_bound_hit_rate"] == pytest.approx(rr["upper_bound_hit_rate"], abs=0.05)
    assert kv["hit_rate"] > rr["hit_rate"] + 0.2
    assert kv["ttft_p90_s"] < rr["ttft_p90_s"]
    # The KV-event volume each run put on the index (this run only): every uncached block a
    # replica computed is stored once; removals follow once the device caches are full.
    for r in rows:
        volume = r["feed_volume"]
        uncached_blocks = (r["prompt_tokens"] - r["cached_tokens"]) // 16
        assert volume["blocks_stored"] >= 0.9 * uncached_blocks > 0, (volume, uncached_blocks)
        assert volume["batches"] > 0 and volume["blocks_removed"] > 0
    for path in result["plots"]:
        assert Path(path).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert {Path(p).name for p in result["plots"]} == {
        "routing_ttft_cdf.png",
        "routing_hit_rate.png",
    }
    target = result["targets"][0]
    assert target["workload"] == "shared_prefix" and target["ttft_p90_vs_round_robin"] > 1


@pytest.mark.timeout(240)
def test_two_routers_share_the_traffic(tmp_path: Path) -> None:
    """The HA path: two router processes, requests spread by session and turn, each router's
    decision counts read and summed. round_robin, because a 3-second quick run is too short
    to judge routing quality across routers (the full preset's four-router figures are in
    docs/benchmarks.md). One more router runs idle (--idle-routers): it follows the feeds and
    its peers but is sent nothing, and decides nothing."""
    result = _quick_shared_prefix(
        tmp_path,
        "--policies",
        "round_robin",
        "--routers",
        "2",
        "--idle-routers",
        "1",
        "--no-plots",
        "--size",
        "shared_prefix.groups=8",
        "--records",
        # The routers on cores of their own, as on separate machines (the last core; the
        # first for the fleet and the clients: the same core on a one-core machine).
        "--fleet-cpus",
        str(CORES[0]),
        "--router-cpus",
        str(CORES[-1]),
    )
    assert result["cpus"] == {
        "fleet": [CORES[0]],
        "clients": [CORES[0]],
        "routers": [[CORES[-1]]] * 3,
    }
    assert sorted(os.sched_getaffinity(0)) == CORES  # this process unpinned after the run
    assert result["routers"] == 2 and result["idle_routers"] == 1
    (row,) = result["results"]
    assert row["routers"] == 2 and row["idle_routers"] == 1
    assert row["idle_router_decisions"] == 0
    # CPU seconds per router process (the two taking traffic, then the idle one).
    assert len(row["router_cpu_s"]) == 3 and all(c >= 0 for c in row["router_cpu_s"])
    # --size: 8 groups of the preset's 4 questions each.
    assert row["sizes"]["groups"] == 8 and row["requests"] == 32
    assert result["workload_sizes"]["shared_prefix"]["groups"] == 8
    # Every answer names the replica that served it (the router's x-kvroute-replica header).
    fleet_names = {f"sim-{i}" for i in range(result["fleet"]["replicas"])}
    assert set(row["requests_by_replica"]) <= fleet_names
    assert sum(row["requests_by_replica"].values()) == row["completed"]
    lines = (tmp_path / "routing_requests.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert len(records) == row["requests"]
    assert {(r["workload"], r["policy"]) for r in records} == {("shared_prefix", "round_robin")}
    assert all(r["replica"] in fleet_names and r["error"] is None for r in records)
    assert sum(r["cached_tokens"] for r in records) == row["cached_tokens"]
    ttfts = sorted(r["ttft_s"] for r in records)
    assert routing_bench.percentile(ttfts, 90) == pytest.approx(row["ttft_p90_s"])
    assert row["completed"] == row["requests"] > 0, row["errors"]
    assert row["token_mismatches"] == 0
    # The routers' decision counts, summed: together they placed every request exactly once
    # (how requests spread over routers is test_requests_spread_over_routers_stably).
    assert row["route_reasons"] == {"round_robin": row["requests"]}


def test_router_timing_is_this_runs_share_of_the_histograms() -> None:
    before = {
        "kvroute_decision_seconds_sum": 1.0,
        "kvroute_decision_seconds_count": 100,
        "kvroute_upstream_ttft_seconds_sum": 50.0,
        "kvroute_upstream_ttft_seconds_count": 100,
    }
    after = {
        "kvroute_decision_seconds_sum": 1.5,
        "kvroute_decision_seconds_count": 200,
        "kvroute_upstream_ttft_seconds_sum": 70.0,
        "kvroute_upstream_ttft_seconds_count": 200,
    }
    # 100 decisions of 5 ms; 100 upstream first bytes after 0.2 s; clients saw 4 simulated
    # seconds at time_scale 0.05, 0.2 wall seconds plus 12 ms.
    # Cumulative decision-time buckets: 10 decisions under 1 ms, 95 under 10 ms, all 100.
    after.update({"decision_le_0.001": 10, "decision_le_0.01": 95, "decision_le_+Inf": 200})
    before.update({"decision_le_0.001": 0, "decision_le_0.01": 0, "decision_le_+Inf": 100})
    row = routing_bench.router_timing_row(before, after, 4.24, 0.05)
    assert row == {
        "decision_ms_mean": 5.0,
        "decision_ms_p90_bound": 10.0,
        "upstream_ttft_ms_mean": 200.0,
        "router_added_ms_mean": pytest.approx(12.0),
    }
    empty = routing_bench.router_timing_row(after, after, float("nan"), 1.0)
    assert empty == dict.fromkeys(row, None)


def test_warm_up_runs_each_workload_at_the_replicas_then_resets_their_caches(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``--warm-up``: every workload once, straight at the replicas (no router), before the
    first policy; the caches are reset after it, so no policy starts on what it left."""
    calls: list[tuple[str, list[str]]] = []
    events: list[str] = []

    async def fake_run(workload, urls, **kw):  # type: ignore[no-untyped-def]
        calls.append((workload, list(urls)))
        events.append("run")
        return [], 0.1

    class Fleet:
        replicas = [argparse.Namespace(url="http://r0"), argparse.Namespace(url="http://r1")]

        def reset_caches(self) -> None:
            events.append("reset")

    config = argparse.Namespace(model="m", latency=argparse.Namespace(time_scale=0.5))
    monkeypatch.setattr(routing_bench, "run_workload", fake_run)
    routing_bench._warm_up(Fleet(), {"chat": "chat-w", "doc_qa": "doc-w"}, config, 5.0)  # type: ignore[arg-type]
    assert calls == [("chat-w", ["http://r0", "http://r1"]), ("doc-w", ["http://r0", "http://r1"])]
    assert events == ["run", "run", "reset"]
    assert _args("--warm-up").warm_up and not _args().warm_up
