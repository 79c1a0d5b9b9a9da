"""GET /dashboard/data and its parts, in-process (the browser test is test_dashboard.py)."""

from __future__ import annotations

import httpx

from kvroute.router.config import ReplicaConfig, RouterSettings
from kvroute.router.ops.dashboard_data import DashboardData, HitRateSeries, Totals
from kvroute.router.routing.decision_log import DecisionLog
from kvroute.router.routing.router import Decision
from kvroute.router.service import RouterService
from tests.router.servers import wait_until
from tests.router.sim_fleet import Fleet


def test_data_agrees_with_index_stats_and_logs_decisions_newest_first(fleet: Fleet) -> None:
    served = []
    with httpx.Client(base_url=fleet.url, timeout=10) as client:
        for i in range(3):
            body = {"model": "tiny", "prompt": f"dashboard prompt {i} " * 20, "max_tokens": 2}
            resp = client.post("/v1/completions", json=body)
            assert resp.status_code == 200, resp.text
            served.append(resp.headers["x-kvroute-replica"])
        wait_until(lambda: fleet.service.accuracy.fleet.requests == 3)
        data = client.get("/dashboard/data").json()
        stats = client.get("/index/stats").json()
        page = client.get("/dashboard")
        script = client.get("/dashboard/dashboard.js")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert '<script src="dashboard/dashboard.js">' in page.text
    assert script.status_code == 200 and "dashboard/data" in script.text
    assert data["fleet"]["replicas"] == len(stats["replicas"]) == 2
    assert data["fleet"]["requests"] == 3
    for row in data["replicas"]:
        want = stats["replicas"][row["name"]]
        assert row["freshness"] == want["freshness"]
        assert row["healthy"] == want["health"]["healthy"]
        for tier in ("GPU", "CPU", "STORAGE"):
            assert row["entries_by_tier"][tier] == want["entries_by_tier"].get(tier, 0)
        assert row["role"] == want["role"] == "both"
        # the rates the cost model prices the replica with, and their samples
        rates = want["cost_rates"]
        assert row["prefill_s_per_token"] == rates["prefill_s_per_token"] > 0
        assert row["load_s_per_token_cpu"] == rates["load_s_per_token_cpu"]
        assert row["load_s_per_token_storage"] == rates["load_s_per_token_storage"]
        assert (row["rates_learned"], row["rates_samples"]) == (rates["learned"], rates["samples"])
        assert row["queue_s_per_request"] == want["load"]["queue_s_per_request"]
    assert [d["chosen"] for d in data["decisions"]] == served[::-1]
    newest = data["decisions"][0]
    assert {c["name"] for c in newest["candidates"]} == {"r0", "r1"}
    assert newest["reason"] and newest["prompt_tokens"] > 0
    assert data["peers"] == [] and data["router"]["policy"] == fleet.settings.policy
    assert data["disaggregation"] is None  # an aggregated fleet: no P/D panel


def test_a_pd_fleet_shows_its_pools_and_the_deciders_counts() -> None:
    """Prefill and decode replicas beside aggregated ones: the P/D data is /index/stats's
    ``disaggregation`` (pools with their load, the decider's counters), and every row names
    its replica's role."""
    roles = ["prefill", "prefill", "decode", "both"]
    configs = [
        ReplicaConfig(url=f"http://127.0.0.1:9/r{i}", name=f"r{i}", role=role)
        for i, role in enumerate(roles)
    ]
    service = RouterService(RouterSettings(replicas=configs))
    for i, config in enumerate(configs):
        replica = service.add_replica(config)
        replica.healthy = i != 1
    service.disagg.counters.decided("split")
    service.disagg.counters.prefill_failures += 1
    data = DashboardData(service).snapshot()
    assert {r["name"]: r["role"] for r in data["replicas"]} == {
        f"r{i}": role for i, role in enumerate(roles)
    }
    pd = data["disaggregation"]
    want = service.stats()["disaggregation"]
    assert pd["pools"] == want["pools"]
    assert {k: v["replicas"] for k, v in pd["pools"].items()} == {
        "prefill": 2,
        "decode": 1,
        "both": 1,
    }
    assert pd["pools"]["prefill"]["healthy"] == 1
    assert (pd["split"], pd["prefill_failures"]) == (1, 1)
    assert pd["split"] == want["split"] and pd["bypass_rate"] == want["bypass_rate"]


def _totals(at: float, requests: int, prompt: int, predicted: int, delivered: int) -> Totals:
    return Totals(at, requests, prompt, predicted, delivered, requests, 0.0, 0)


def test_series_rates_are_per_interval_and_sampled_at_most_once_a_second() -> None:
    series = HitRateSeries(points=3, min_interval_s=1.0)
    series.sample(_totals(100.0, 0, 0, 0, 0))
    series.sample(_totals(100.5, 5, 500, 400, 300))  # too soon: ignored
    series.sample(_totals(102.0, 10, 1000, 800, 600))
    series.sample(_totals(104.0, 10, 1000, 800, 600))  # an idle interval: no hit rate
    (busy, idle) = series.to_list()
    assert busy["requests_per_s"] == 5.0
    assert (busy["predicted_hit_rate"], busy["delivered_hit_rate"]) == (0.8, 0.6)
    assert idle["predicted_hit_rate"] is None and idle["requests_per_s"] == 0.0
    for t in (106.0, 108.0):
        series.sample(_totals(t, 10, 1000, 800, 600))
    assert len(series.to_list()) == 3  # bounded


def test_decision_log_is_a_bounded_ring() -> None:
    log = DecisionLog(size=2)
    for i in range(5):
        log.record(Decision("kvroute", "load", [], [], i), f"r{i}")
    assert len(log) == 2 and log.recorded == 5
    assert [(d["chosen"], d["prompt_tokens"]) for d in log.to_list()] == [("r4", 4), ("r3", 3)]


def test_a_decision_shows_the_prefix_this_router_just_sent_its_replica(fleet: Fleet) -> None:
    """Each candidate of a logged decision says how much of the prompt this router sent it
    moments ago (its burst hints): on the replica's device by now, whatever tier the index,
    its events maybe still in flight, puts those blocks in."""
    body = {"model": "tiny", "prompt": "a prompt sent twice in a row " * 30, "max_tokens": 1}
    with httpx.Client(base_url=fleet.url, timeout=10) as client:
        first = client.post("/v1/completions", json=body)
        second = client.post("/v1/completions", json=body)
        assert first.status_code == second.status_code == 200
        newest = client.get("/dashboard/data").json()["decisions"][0]
    chosen = next(c for c in newest["candidates"] if c["name"] == newest["chosen"])
    assert newest["chosen"] == first.headers["x-kvroute-replica"]
    assert chosen["hint_tokens"] >= 16 * (newest["prompt_tokens"] // 16 - 1) > 0, chosen
    others = [c for c in newest["candidates"] if c["name"] != newest["chosen"]]
    assert all(c["hint_tokens"] == 0 for c in others), others
