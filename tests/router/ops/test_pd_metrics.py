"""P/D for operators: the router's ``/metrics`` (``kvroute_pd_*``), ``/index/stats``
(``disaggregation``) and the dashboard's data show the legs, the bypass rate, each pool's
load, every failure kind, and a decode that could not pull, which only the replica knows
(NixlConnector's ``vllm:nixl_num_failed_transfers``, the storage-domain transport's
``vllm:kvroute_pd_timeouts``/``mismatches``): the router reads them from each replica's
metrics page at its scrape. Values are read back from the rendered metrics."""

from __future__ import annotations

import asyncio
import re

import httpx

from kvroute.router.config import ReplicaConfig, RouterSettings
from kvroute.router.ops.dashboard_data import DashboardData
from kvroute.router.service import RouterService

PREFILL_PAGE = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 1.0
# TYPE vllm:nixl_num_kv_expired_reqs counter
vllm:nixl_num_kv_expired_reqs_total{engine="0",model_name="tiny"} 2.0
"""
DECODE_PAGE = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 3.0
vllm:num_requests_waiting{engine="0",model_name="tiny"} 1.0
# TYPE vllm:nixl_num_failed_transfers counter
vllm:nixl_num_failed_transfers_total{engine="0",model_name="tiny"} 4.0
# TYPE vllm:kvroute_pd_timeouts counter
vllm:kvroute_pd_timeouts_total{engine="0",model_name="tiny"} 2.0
vllm:kvroute_pd_mismatches_total{engine="0",model_name="tiny"} 1.0
vllm:kvroute_pd_transfers_total{engine="0",model_name="tiny"} 9.0
vllm:kvroute_pd_waited_total{engine="0",model_name="tiny"} 5.0
"""


def _value(text: str, name: str, labels: str = "") -> float:
    match = re.search(rf"^{name}{re.escape(labels)} (\S+)$", text, re.MULTILINE)
    assert match, f"{name}{labels} not in /metrics"
    return float(match.group(1))


def _service() -> RouterService:
    roles = ["prefill", "decode", "decode"]
    configs = [
        ReplicaConfig(url=f"http://r{i}.test", name=f"r{i}", role=role)
        for i, role in enumerate(roles)
    ]
    service = RouterService(RouterSettings(replicas=configs))
    for i, config in enumerate(configs):
        service.add_replica(config).healthy = i != 2
    return service


def _scrape(service: RouterService) -> None:
    """One health scrape of every replica's /metrics (r2 has no P/D counters)."""
    pages = {"r0.test": PREFILL_PAGE, "r1.test": DECODE_PAGE, "r2.test": ""}

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, text=pages[request.url.host])

    async def scrape() -> None:
        service.health.client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
        for replica in service.registry:
            await service.health._scrape([replica])
        await service.health.client.aclose()

    asyncio.run(scrape())


def test_a_decode_that_could_not_pull_is_a_metric_a_stat_and_on_the_dashboard() -> None:
    service = _service()
    _scrape(service)
    text = service.metrics.render().decode()
    # Per replica, as its page had them.
    r1 = '{counter="nixl_failed_transfers",replica="r1"}'
    assert _value(text, "kvroute_pd_transport_total", r1) == 4
    assert (
        _value(text, "kvroute_pd_transport_total", '{counter="storage_timeouts",replica="r1"}') == 2
    )
    assert (
        _value(text, "kvroute_pd_transport_total", '{counter="storage_waited",replica="r1"}') == 5
    )
    assert (
        _value(text, "kvroute_pd_transport_total", '{counter="nixl_expired_leases",replica="r0"}')
        == 2
    )
    assert 'replica="r2"' not in "\n".join(
        line for line in text.splitlines() if line.startswith("kvroute_pd_transport")
    )
    # The fleet's decodes that could not pull: NIXL's failures + storage timeouts/mismatches.
    assert _value(text, "kvroute_pd_failures_total", '{kind="pull_failure"}') == 4 + 2 + 1
    stats = service.stats()
    pd = stats["disaggregation"]
    assert (pd["pull_failures"], pd["expired_leases"]) == (7, 2)
    assert stats["replicas"]["r1"]["pd_transport"]["storage_timeouts"] == 2
    assert stats["replicas"]["r2"]["pd_transport"] is None
    panel = DashboardData(service).snapshot()["disaggregation"]
    assert (panel["pull_failures"], panel["expired_leases"]) == (7, 2)


def test_pool_load_and_bypass_rate_are_metrics() -> None:
    service = _service()
    _scrape(service)
    counters = service.disagg.counters
    for reason in ("split", "small_uncached", "small_uncached", "cheaper_on_decode"):
        counters.decided(reason)
    counters.prefill_legs, counters.decode_legs = 2, 1
    service.registry.get("r1").in_flight = 2
    text = service.metrics.render().decode()
    assert _value(text, "kvroute_pd_bypass_ratio") == 0.75
    assert _value(text, "kvroute_pd_legs_total", '{leg="prefill"}') == 2
    assert _value(text, "kvroute_pd_decisions_total", '{reason="small_uncached"}') == 2
    assert _value(text, "kvroute_pd_pool_replicas", '{pool="decode"}') == 2
    assert _value(text, "kvroute_pd_pool_replicas", '{pool="prefill"}') == 1
    assert _value(text, "kvroute_pd_pool_healthy", '{pool="decode"}') == 1
    assert _value(text, "kvroute_pd_pool_in_flight", '{pool="decode"}') == 2
    # pending: max(router in flight, vLLM running + waiting), summed over the pool
    assert _value(text, "kvroute_pd_pool_pending", '{pool="decode"}') == 4 + 0
    assert _value(text, "kvroute_pd_pool_pending", '{pool="prefill"}') == 1
    pools = service.stats()["disaggregation"]["pools"]
    assert pools["decode"]["pending"] == 4 and pools["prefill"]["in_flight"] == 0


def test_no_decision_yet_no_bypass_ratio() -> None:
    text = _service().metrics.render().decode()
    assert "kvroute_pd_bypass_ratio" not in text
    assert _value(text, "kvroute_pd_failures_total", '{kind="pull_failure"}') == 0
