"""Scale-in that keeps the cache (router/fleet/discovery/deletion_cost.py): each replica pod's
``controller.kubernetes.io/pod-deletion-cost`` is the recompute time of what it alone holds.

The costs from a real index; the patches through the router's real discovery (lightkube) to
the kube-apiserver stand-in (tests/router/k8s_apiserver.py), which applies merge patches
as the API server does; a bounded number of patches per round, none for a small move."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvroute.indexer.index import InMemoryPrefixIndex
from kvroute.indexer.wire import Medium
from kvroute.router.app import create_app
from kvroute.router.config import (
    ConfigError,
    CostSettings,
    K8sDiscoverySettings,
    RouterSettings,
)
from kvroute.router.fleet.discovery.deletion_cost import (
    ANNOTATION,
    DeletionCosts,
    costs_from_index,
    deletion_costs,
    pod_of,
)
from kvroute.router.fleet.discovery.k8s import KubernetesDiscovery
from kvroute.router.serving.http_protocol import header_deadline_protocol
from kvroute.router.tokens.tokenization import LocalTokenizer
from tests.indexer.builders import BS, DOCS, stored
from tests.router.fleet.test_drain import sim_pod
from tests.router.k8s_apiserver import FakeApiServer, make_pod
from tests.router.servers import ServerThread, wait_until
from tests.router.sim_replica import SimServer

COST = CostSettings(prefill_s_per_token=1e-3, load_s_per_token_cpu=4e-4)


def test_a_pods_cost_is_the_recompute_of_what_it_alone_holds_by_tier() -> None:
    sole = {
        "a": {Medium.GPU: 2},  # 2 blocks x 16 tokens x 1 ms
        "b": {Medium.CPU: 2},  # the same blocks from CPU memory: prefill less the load
        "c#dp0": {Medium.GPU: 1},  # a data-parallel rank and a port: the same pod, summed
        "c:8001": {Medium.GPU: 1},
    }
    sizes = {"a": 16, "b": 16, "c#dp0": 16, "c:8001": 16}
    costs = deletion_costs(sole, sizes, COST, ["a", "b", "c", "d"])
    assert costs == {"a": 32, "b": 19, "c": 32, "d": 0}
    huge = deletion_costs({"a": {Medium.GPU: 10**9}}, {"a": 10**4}, COST, ["a"])
    assert huge == {"a": 2**31 - 1}  # the API's int32
    assert deletion_costs({"a": {Medium.GPU: 5}}, {"a": None}, COST, ["a"]) == {"a": 0}
    assert [pod_of(n) for n in ("vllm-0", "vllm-0#dp3", "vllm-0:8001")] == ["vllm-0"] * 3


def test_rounds_patch_new_and_moved_pods_only_and_at_most_max_patches() -> None:
    written: list[tuple[str, int]] = []

    async def patch(pod: str, value: int) -> None:
        written.append((pod, value))

    costs = {"a": 100, "b": 1000, "c": 0}
    rounds = DeletionCosts(lambda pods: {p: costs[p] for p in pods}, patch, max_patches=2)

    async def run() -> None:
        await rounds.round(["a", "b", "c"])
        assert len(written) == 2  # bounded
        await rounds.round(["a", "b", "c"])
        assert len(written) == 3 and rounds.written == costs
        costs.update(a=105, b=2000)  # a moved 5 %: not worth a write; b doubled
        await rounds.round(["a", "b", "c"])
        assert written[-1] == ("b", 2000) and len(written) == 4
        await rounds.round(["a", "b"])  # c left the fleet: forgotten
        assert set(rounds.written) == {"a", "b"}

    asyncio.run(run())


def test_the_setting_is_off_by_default_and_checked() -> None:
    assert K8sDiscoverySettings(selector={"app": "vllm"}).deletion_cost_interval_s is None
    with pytest.raises(ConfigError, match="deletion_cost_interval_s"):
        K8sDiscoverySettings(selector={"app": "vllm"}, deletion_cost_interval_s=0.1)


def test_three_pods_with_different_sole_holdings_get_costs_in_that_order(tmp_path: Path) -> None:
    """vllm-a holds only what the others hold too, vllm-b a little alone, vllm-c a lot
    alone: their annotations order them a < b < c, so a scale-down deletes vllm-a. A pod
    already being deleted is left alone."""
    index = InMemoryPrefixIndex()
    shared, own = DOCS
    for name in ("vllm-a", "vllm-b", "vllm-c"):
        index.apply(name, [stored(shared, 0, 2)])
    index.apply("vllm-b", [stored(own, 0, 3)])  # blocks 0-1 are shared's too: 1 alone
    index.apply("vllm-c", [stored(shared, 0, len(shared) // BS)])  # 4 more, alone
    with FakeApiServer() as api:
        for name, ip in (("vllm-a", "10.0.0.1"), ("vllm-b", "10.0.0.2"), ("vllm-c", "10.0.0.3")):
            api.add_pod(make_pod(name, ip))
        leaving = make_pod("vllm-d", "10.0.0.4")
        leaving["metadata"]["deletionTimestamp"] = "2026-11-27T21:00:00Z"
        api.add_pod(leaving)
        settings = K8sDiscoverySettings(
            selector={"app": "vllm"},
            kubeconfig=str(api.kubeconfig(tmp_path / "kubeconfig")),
            deletion_cost_interval_s=60,
        )

        async def scenario() -> dict[str, object]:
            discovery = KubernetesDiscovery(
                settings,
                lambda _: None,
                costs=lambda pods: costs_from_index(index, COST, pods),
            )
            await discovery.load_now()
            try:
                await discovery.cost_round()
                await discovery.cost_round()  # nothing moved: no second write
                return discovery.status()
            finally:
                await discovery.stop()

        status = asyncio.run(scenario())
        pods = api.pods()
    costs = {
        n: int(p["metadata"]["annotations"][ANNOTATION]) for n, p in pods.items() if n != "vllm-d"
    }
    assert costs["vllm-a"] == 0 < costs["vllm-b"] < costs["vllm-c"]
    assert costs["vllm-c"] == 4 * costs["vllm-b"]  # 4 blocks alone against 1
    assert ANNOTATION not in pods["vllm-d"]["metadata"]["annotations"]
    assert sorted(name for name, _ in api.patches) == ["vllm-a", "vllm-b", "vllm-c"]
    assert all(
        patch == {"metadata": {"annotations": {ANNOTATION: str(costs[name])}}}
        for name, patch in api.patches
    )
    assert status["deletion_costs"] == {
        "annotation": ANNOTATION,
        "costs_ms": costs,
        "patches": 3,
        "failures": 0,
        "last_error": None,
        "writer": True,  # no peer routers: this one writes
    }


def test_one_router_of_several_writes_the_costs(tmp_path: Path) -> None:
    """Routers agree on the caches, so they compute the same costs: the first by pod name
    among the Ready peers (--peer-selector) writes them, the others do not; when it leaves,
    the next one takes over."""
    index = InMemoryPrefixIndex()
    index.apply("vllm-a", [stored(DOCS[0], 0, 2)])
    with FakeApiServer() as api:
        api.add_pod(make_pod("vllm-a", "10.0.0.1"))
        for name, ip in (("router-a", "10.0.1.1"), ("router-b", "10.0.1.2")):
            api.add_pod(make_pod(name, ip, labels={"app": "kvroute-router"}))
        settings = K8sDiscoverySettings(
            selector={"app": "vllm"},
            peer_selector={"app": "kvroute-router"},
            kubeconfig=str(api.kubeconfig(tmp_path / "kubeconfig")),
            deletion_cost_interval_s=60,
        )

        async def scenario() -> list[bool]:
            routers = []
            for name in ("router-b", "router-a"):
                d = KubernetesDiscovery(
                    settings, lambda _: None, costs=lambda pods: costs_from_index(index, COST, pods)
                )
                d.self_name = name
                await d.load_now()
                routers.append(d)
            try:
                for d in routers:
                    await d.cost_round()
                writers = [d.cost_writer for d in routers]
                assert len(api.patches) == 1  # router-a's
                api.delete_pod("router-a")
                await routers[0].relist()
                await routers[0].cost_round()
                writers.append(routers[0].cost_writer)
                return writers
            finally:
                for d in routers:
                    await d.stop()

        writers = asyncio.run(scenario())
        assert writers == [False, True, True]
        # router-b took over, and wrote: it had written nothing before.
        assert [name for name, _ in api.patches] == ["vllm-a", "vllm-a"]


def test_a_running_routers_discovered_fleet_gets_costs_in_the_order_of_its_sole_holdings(
    local_tokenizer: LocalTokenizer, tmp_path: Path
) -> None:
    """End to end: a router (``--discover k8s``, ``--deletion-cost-interval-s 1``) in front of
    three simulated vLLM replicas whose pods the API stand-in serves. Each replica computes
    what its clients send it (requests sent to it directly), and its KV events reach the
    router's index: all three hold a shared prompt, vllm-b also a prompt of its own, vllm-c
    one four times as long. The annotations the router writes order the pods a < b < c (a
    holds nothing alone: 0), so a scale-down deletes vllm-a, whose loss recomputes nothing."""
    shared = "Shared system prompt, sentence {}. "
    own = {"vllm-b": "Bee asks, part {}. ", "vllm-c": "Sea asks, part {}. "}
    with (
        SimServer("vllm-a", local_tokenizer.name) as a,
        SimServer("vllm-b", local_tokenizer.name) as b,
        SimServer("vllm-c", local_tokenizer.name) as c,
        FakeApiServer() as api,
    ):
        sims = {"vllm-a": a, "vllm-b": b, "vllm-c": c}
        for name, sim in sims.items():
            api.add_pod(sim_pod(name, sim))
        settings = RouterSettings(
            k8s_discovery=K8sDiscoverySettings(
                selector={"app": "vllm"},
                kubeconfig=str(api.kubeconfig(tmp_path / "kube")),
                deletion_cost_interval_s=1,
            ),
            health_interval_s=0.2,
            tokenizer_check_on_start=False,
        )
        router = ServerThread(
            create_app(settings, tokenizer=local_tokenizer),
            http=header_deadline_protocol(settings.header_timeout_s),
        ).start()
        try:
            service = router.app.state.service
            wait_until(lambda: len(service.registry.healthy()) == 3, 10)

            def compute(sim: SimServer, prompt: str) -> None:
                body = {"model": "tiny", "prompt": prompt, "max_tokens": 1}
                httpx.post(f"{sim.url}/v1/completions", json=body, timeout=30).raise_for_status()

            for sim in sims.values():
                compute(sim, "".join(shared.format(i) for i in range(20)))
            compute(b, "".join(own["vllm-b"].format(i) for i in range(8)))
            compute(c, "".join(own["vllm-c"].format(i) for i in range(32)))

            def costs() -> dict[str, int]:
                pods = api.pods()
                return {
                    name: int(pods[name]["metadata"]["annotations"].get(ANNOTATION, -1))
                    for name in sims
                }

            def status() -> dict[str, Any]:
                stats = httpx.get(f"{router.url}/index/stats", timeout=5).json()
                return stats["discovery"]["deletion_costs"]

            def ordered() -> bool:
                now = costs()
                # ... and the router has heard the last patch's answer (its record).
                written = now == status()["costs_ms"]
                return written and now["vllm-a"] == 0 < now["vllm-b"] < now["vllm-c"]

            wait_until(ordered, 20)
            final, record = costs(), status()
        finally:
            router.stop()
    assert final["vllm-c"] > 2 * final["vllm-b"], final  # four times the text, alone
    assert record["writer"] is True and record["failures"] == 0
    assert {name for name, _ in api.patches} == set(sims)
