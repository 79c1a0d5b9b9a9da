"""``--discover k8s`` against the kube-apiserver stand-in (tests/router/k8s_apiserver.py),
driven by the real lightkube client: list, watch, bookmarks, 410, broken and silently stale
watches, InferencePools, peers; then a real router (in-process, real HTTP and ZMQ) whose
replicas come from pods, with real ZMQ publishers for listed, foreign-topic and unlisted
pods."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvroute.bench.publisher import EventPublisher
from kvroute.indexer.wire import BlockStored
from kvroute.router.app import create_app
from kvroute.router.cli import add_arguments, settings_from_args
from kvroute.router.cli import main as serve_main
from kvroute.router.config import ConfigError, K8sDiscoverySettings, ReplicaConfig, RouterSettings
from kvroute.router.fleet.discovery.k8s import KubernetesDiscovery
from kvroute.router.serving.http_protocol import header_deadline_protocol
from tests.router.k8s_apiserver import FakeApiServer, make_pod
from tests.router.servers import ServerThread, wait_until
from tests.router.sim_replica import SimServer


@pytest.fixture
def api() -> Iterator[FakeApiServer]:
    with FakeApiServer(bookmark_interval_s=0.2) as server:
        yield server


async def _until(check: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


def _discovery(
    api: FakeApiServer, tmp_path: Path, applied: list[list[ReplicaConfig]], **kw: Any
) -> KubernetesDiscovery:
    settings = K8sDiscoverySettings(
        kubeconfig=str(api.kubeconfig(tmp_path / "kubeconfig")),
        **{"selector": {"app": "vllm"}, **kw},
    )
    return KubernetesDiscovery(settings, applied.append)


def test_list_then_watch_follows_pods_through_410_breaks_and_stale_watches(
    api: FakeApiServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    api.add_pod(make_pod("p0", "10.0.0.1"))
    api.add_pod(make_pod("other", "10.0.0.9", labels={"app": "web"}))
    applied: list[list[ReplicaConfig]] = []
    names = lambda: [r.key for r in applied[-1]]  # noqa: E731

    async def scenario() -> None:
        d = _discovery(api, tmp_path, applied, relist_interval_s=1.5)
        await d.load_now()
        d.start()
        try:
            assert names() == ["p0"]  # the label selector left "other" out
            # watch: added, not ready, IP changed (a new incarnation), deleted
            api.add_pod(make_pod("p1", "10.0.0.2", uid="u1"))
            await _until(lambda: names() == ["p0", "p1"])
            api.update_pod(make_pod("p0", "10.0.0.1", ready=False))
            await _until(lambda: names() == ["p1"])
            api.update_pod(make_pod("p1", "10.0.0.3", uid="u1"))
            await _until(lambda: applied[-1][0].url == "http://10.0.0.3:8000")
            api.delete_pod("p1")
            await _until(lambda: names() == [])
            assert d.events >= 4 and d.lists == 1
            # bookmarks advance the resourceVersion
            await _until(lambda: d.bookmarks >= 2)
            # 410: the history is compacted and the stream ends; lightkube resumes from the
            # old version, gets ERROR 410, and we re-list (and see the pod added meanwhile)
            api.compact()
            api.add_pod(make_pod("p2", "10.0.0.4"))
            api.compact()
            api.end_watches()
            await _until(lambda: d.relists_410 >= 1 and names() == ["p2"])
            assert api.watch_410s >= 1
            # a broken stream: re-listed, a delete made while it was broken is found
            await _until(lambda: api.live_watches >= 1)  # else nothing is there to break
            api.break_watches()
            api.delete_pod("p2", silent=True)
            await _until(lambda: names() == [] and d.watch_restarts >= 1)
            # a silently stale watch: the delete never arrives; the periodic re-list finds it
            api.add_pod(make_pod("p3", "10.0.0.5"))
            await _until(lambda: names() == ["p3"])
            api.delete_pod("p3", silent=True)
            periodic = d.relists_periodic
            await _until(lambda: names() == [] and d.relists_periodic > periodic, 5)
            # a bad annotation: that pod skipped, logged once, others kept
            with caplog.at_level(logging.ERROR):
                api.add_pod(make_pod("p4", "10.0.0.6"))
                api.add_pod(make_pod("bad", "10.0.0.7", annotations={"kvroute.io/dp": "x"}))
                await _until(lambda: names() == ["p4"] and "bad" in d.status()["bad_pods"])
            assert "pod bad: annotation kvroute.io/dp='x'" in caplog.text
            status = d.status()
            assert status["pods_seen"] == 3 and status["pods_ready"] == 2  # p0 is not Ready
            assert int(status["resource_version"]) > 100 and status["last_list_at"] > 0
        finally:
            await d.stop()

    asyncio.run(scenario())
    watches = [r for r in api.requests if "watch=true" in r]
    assert watches and all("allowWatchBookmarks=true" in r for r in watches)
    assert all("labelSelector=app%3Dvllm" in r for r in api.requests if "/pods" in r)


def test_inference_pool_gives_selector_and_ports(api: FakeApiServer, tmp_path: Path) -> None:
    group_version = "inference.networking.k8s.io/v1"
    spec = {"selector": {"matchLabels": {"pool": "a"}}, "targetPorts": [{"number": 8100}]}
    kind = {"apiVersion": group_version, "kind": "InferencePool"}
    api.set_pool(group_version, "my-pool", {**kind, "metadata": {"name": "my-pool"}, "spec": spec})
    api.add_pod(make_pod("in-pool", "10.0.0.1", labels={"pool": "a"}))
    api.add_pod(make_pod("not-in-pool", "10.0.0.2", labels={"app": "vllm"}))
    applied: list[list[ReplicaConfig]] = []

    async def scenario() -> None:
        d = _discovery(api, tmp_path, applied, selector={}, inference_pool="my-pool")
        await d.load_now()
        await d.stop()
        assert d.status()["selector"] == {"pool": "a"} and d.target_ports == [8100]

    asyncio.run(scenario())
    assert [(r.key, r.url) for r in applied[-1]] == [("in-pool", "http://10.0.0.1:8100")]


def test_an_llm_d_pool_two_ports_events_on_5556_no_replay(
    api: FakeApiServer, tmp_path: Path
) -> None:
    """An existing llm-d pool, as its pods are (no kvroute annotations; events on 5556, no
    replay socket), two vLLM servers per pod: --pod-events-port 5556 --pod-replay-port none.
    A pod's kvroute.io/http-port does not override the pool's ports (noted in the status)."""
    group_version = "inference.networking.k8s.io/v1"
    spec = {
        "selector": {"matchLabels": {"llm-d.ai/inferenceServing": "true"}},
        "targetPorts": [{"number": 8000}, {"number": 8001}],
    }
    pool = {"apiVersion": group_version, "kind": "InferencePool", "metadata": {"name": "llm-d"}}
    api.set_pool(group_version, "llm-d", {**pool, "spec": spec})
    labels = {"llm-d.ai/inferenceServing": "true"}
    api.add_pod(make_pod("decode-0", "10.0.0.1", labels=labels))
    api.add_pod(
        make_pod("decode-1", "10.0.0.2", labels=labels, annotations={"kvroute.io/http-port": "9"})
    )
    applied: list[list[ReplicaConfig]] = []

    async def scenario() -> dict[str, Any]:
        d = _discovery(
            api,
            tmp_path,
            applied,
            selector={},
            inference_pool="llm-d",
            pod_events_port=5556,
            pod_replay_port=None,
        )
        await d.load_now()
        await d.stop()
        return d.status()

    status = asyncio.run(scenario())
    assert [(r.key, r.url, r.events, r.replay) for r in applied[-1]] == [
        ("decode-0:8000", "http://10.0.0.1:8000", "tcp://10.0.0.1:5556", None),
        ("decode-0:8001", "http://10.0.0.1:8001", "tcp://10.0.0.1:5557", None),
        ("decode-1:8000", "http://10.0.0.2:8000", "tcp://10.0.0.2:5556", None),
        ("decode-1:8001", "http://10.0.0.2:8001", "tcp://10.0.0.2:5557", None),
    ]
    assert "ignored" in status["pod_notes"]["decode-1"]


def test_a_v1alpha2_pool_is_not_read(api: FakeApiServer, tmp_path: Path) -> None:
    """Only inference.networking.k8s.io/v1: a pool left in the retired alpha API is reported
    as missing from v1, with the reason, never read."""
    group_version = "inference.networking.x-k8s.io/v1alpha2"
    spec = {"selector": {"pool": "a"}, "targetPortNumber": 8100}
    api.set_pool(group_version, "old", {"metadata": {"name": "old"}, "spec": spec})
    api.add_pod(make_pod("in-pool", "10.0.0.1", labels={"pool": "a"}))
    applied: list[list[ReplicaConfig]] = []

    async def scenario() -> str | None:
        d = _discovery(api, tmp_path, applied, selector={}, inference_pool="old")
        await d.load_now()
        await d.stop()
        return d.last_error

    error = asyncio.run(scenario())
    assert error is not None and "not found in inference.networking.k8s.io/v1" in error
    assert "v1alpha2" in error
    assert applied == []


def test_missing_pool_and_unreachable_api_are_reported_not_fatal(tmp_path: Path) -> None:
    with FakeApiServer() as api:
        kubeconfig = api.kubeconfig(tmp_path / "kubeconfig")

        async def missing_pool() -> None:
            settings = K8sDiscoverySettings(inference_pool="nope", kubeconfig=str(kubeconfig))
            d = KubernetesDiscovery(settings, lambda _: None)
            assert await d.load_now() == []
            await d.stop()
            assert "InferencePool default/nope not found" in str(d.last_error)

        asyncio.run(missing_pool())

    async def unreachable() -> None:  # the stand-in is gone: connection refused
        settings = K8sDiscoverySettings(selector={"app": "vllm"}, kubeconfig=str(kubeconfig))
        d = KubernetesDiscovery(settings, lambda _: None)
        assert await d.load_now() == []
        assert "first list failed" in str(d.last_error)
        await d.stop()

    asyncio.run(unreachable())
    with pytest.raises(ConfigError, match="no Kubernetes config"):
        asyncio.run(
            KubernetesDiscovery(
                K8sDiscoverySettings(selector={"a": "b"}, kubeconfig=str(tmp_path / "none")),
                lambda _: None,
            ).load_now()
        )


def test_peer_selector_lists_other_router_pods(
    api: FakeApiServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("POD_NAME", "router-a")
    for name, ip in (("router-a", "10.0.1.1"), ("router-b", "10.0.1.2")):
        api.add_pod(make_pod(name, ip, labels={"app": "kvroute"}))
    peers: list[list[str]] = []

    async def scenario() -> None:
        settings = K8sDiscoverySettings(
            selector={"app": "vllm"},
            peer_selector={"app": "kvroute"},
            kubeconfig=str(api.kubeconfig(tmp_path / "kubeconfig")),
        )
        d = KubernetesDiscovery(settings, lambda _: None, router_port=8080, on_peers=peers.append)
        await d.load_now()
        await d.stop()

    asyncio.run(scenario())
    assert peers == [["http://10.0.1.2:8080"]]


def test_serve_flags_build_discovery_settings() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        [
            "--discover",
            "k8s",
            "--selector",
            "app=vllm",
            "--namespace",
            "llm",
            "--peer-selector",
            "app=kvroute",
        ]
    )
    k8s = settings_from_args(args).k8s_discovery
    assert k8s is not None and k8s.selector == {"app": "vllm"} and k8s.namespace == "llm"
    assert k8s.peer_selector == {"app": "kvroute"}
    with pytest.raises(ConfigError, match="--selector needs --discover k8s"):
        settings_from_args(parser.parse_args(["--selector", "app=vllm"]))
    with pytest.raises(ConfigError, match="exactly one of"):
        settings_from_args(parser.parse_args(["--discover", "k8s"]))
    both = ["--discover", "k8s", "--selector", "a=b", "--replicas-file", "f.yaml"]
    with pytest.raises(ConfigError, match="pick one"):
        settings_from_args(parser.parse_args(both))


def test_serve_without_a_kubernetes_config_exits_2_with_the_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    flags = ["--discover", "k8s", "--selector", "a=b", "--kubeconfig", str(tmp_path / "no")]
    assert serve_main(parser.parse_args(flags)) == 2
    assert "no Kubernetes config" in capsys.readouterr().err


def _stored(block: int) -> list[BlockStored]:
    return [BlockStored([block], None, list(range(16)), 16)]


def test_router_follows_pods_clears_new_incarnations_and_ignores_unlisted_publishers(
    api: FakeApiServer, tmp_path: Path, local_tokenizer
) -> None:
    """Pods "listed" (Ready, events on a real publisher, no replay: a new feed cannot
    re-learn old entries), "foreign" (listed, its endpoint publishes another topic) and
    "unready" (its publisher is never subscribed to)."""
    with contextlib.ExitStack() as stack:
        sim = stack.enter_context(SimServer("s0", local_tokenizer.name))
        pubs = {
            name: stack.enter_context(EventPublisher("tcp://127.0.0.1:0", bind=True, topic=topic))
            for name, topic in (("listed", "kv"), ("foreign", "other"), ("unready", "kv"))
        }

        def pod(name: str, *, ready: bool = True, uid: str | None = None) -> dict[str, Any]:
            port = pubs[name].endpoint.rsplit(":", 1)[1]
            annotations = {
                "kvroute.io/http-port": str(sim.port),
                "kvroute.io/events-port": port,
                "kvroute.io/replay-port": "none",
                "kvroute.io/topic": "kv",
            }
            return make_pod(name, "127.0.0.1", annotations=annotations, ready=ready, uid=uid)

        for name in pubs:
            api.add_pod(pod(name, ready=name != "unready", uid=f"{name}-1"))
        k8s = K8sDiscoverySettings(
            selector={"app": "vllm"}, kubeconfig=str(api.kubeconfig(tmp_path / "kc"))
        )
        settings = RouterSettings(
            k8s_discovery=k8s, health_interval_s=0.2, tokenizer_check_on_start=False
        )
        router = ServerThread(
            create_app(settings, tokenizer=local_tokenizer),
            http=header_deadline_protocol(settings.header_timeout_s),
        ).start()
        stack.callback(router.stop)
        stats = lambda: httpx.get(f"{router.url}/index/stats", timeout=5).json()  # noqa: E731
        wait_until(lambda: set(stats()["replicas"]) == {"listed", "foreign"})

        def entries(name: str) -> int:
            return stats()["replicas"][name]["entries"]

        def published() -> bool:
            for i, p in enumerate(pubs.values()):
                p.publish(_stored(1000 + i))  # PUB drops until the SUB joins: keep sending
            return entries("listed") > 0

        wait_until(published, timeout_s=15, interval_s=0.1)
        for _ in range(5):
            for i, p in enumerate(pubs.values()):
                p.publish(_stored(2000 + i))
        wait_until(lambda: entries("listed") == 2)
        body = stats()
        foreign = body["replicas"]["foreign"]
        assert foreign["entries"] == 0
        assert foreign["feed"]["batches"] == 0 and foreign["feed"]["events_applied"] == 0
        assert "unready" not in body["replicas"]
        service = router.app.state.service
        assert pubs["unready"].endpoint not in {s.endpoint for s in service.subscriber.sources()}
        disc = body["discovery"]
        assert disc["source"] == "k8s" and disc["pods_seen"] == 3 and disc["pods_ready"] == 2
        assert disc["replicas"] == ["foreign", "listed"] and disc["last_error"] is None

        # The same pod name, IP and ports, a new UID (recreated): its entries are cleared.
        api.update_pod(pod("listed", uid="listed-2"))
        wait_until(lambda: entries("listed") == 0)
        assert stats()["replicas"]["listed"]["feed"]["batches"] == 0

        # Requests still route to the discovered replicas.
        resp = httpx.post(
            f"{router.url}/v1/completions", json={"model": "tiny", "prompt": "hi"}, timeout=10
        )
        assert resp.status_code == 200 and resp.headers["x-kvroute-replica"] in pubs
