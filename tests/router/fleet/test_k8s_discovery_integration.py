"""Three real ``kvroute serve --discover k8s`` processes in front of a simulated fleet
(kvroute.bench.sim, real HTTP and ZMQ), discovering it through the kube-apiserver stand-in
(tests/router/k8s_apiserver.py: no API server can run here; the routers' client is the real
lightkube, pointed at it by a kubeconfig file). Pods come, go, change IP, are deleted while
the watches are broken, and the history is compacted (410); every router's replica set
follows. Then a router is killed mid-traffic and restarted: it warm-starts from a peer found
by --peer-selector, its index matches its peers', and no request that did not start on it
fails."""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from kvroute.bench.sim.fleet import FleetReplica, SimFleet, SimFleetConfig
from kvroute.bench.sim.latency import LatencyModel
from kvroute.deploy.processes import free_port
from kvroute.deploy.router_process import RouterProcess
from tests.router.k8s_apiserver import FakeApiServer, make_pod

SYSTEM = "You are a careful assistant for a cache-aware router test. " * 12


def _port(endpoint: str) -> str:
    return endpoint.rsplit(":", 1)[1]


def _vllm_pod(name: str, ip: str, replica: FleetReplica, uid: str) -> dict[str, Any]:
    return make_pod(
        name,
        ip,
        uid=uid,
        annotations={
            "kvroute.io/http-port": replica.url.rsplit(":", 1)[1],
            "kvroute.io/events-port": _port(replica.events),
            "kvroute.io/replay-port": _port(replica.replay),
            "kvroute.io/topic": replica.topic,
        },
    )


def _until(check: Callable[[], bool], timeout_s: float, what: str) -> float:
    """Seconds until ``check()`` held (printed: the figures docs/router.md quotes)."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        with contextlib.suppress(httpx.HTTPError, KeyError, ValueError):
            if check():
                took = time.monotonic() - start
                print(f"{what}: {took:.2f}s")
                return took
        time.sleep(0.05)
    raise AssertionError(f"not within {timeout_s}s: {what}")


def _stats(router: RouterProcess) -> dict[str, Any]:
    return httpx.get(router.url + "/index/stats", timeout=5).json()


def _urls(router: RouterProcess) -> dict[str, str]:
    replicas = _stats(router)["replicas"]
    return {name: r["health"]["url"] for name, r in replicas.items()}


def _complete(router: RouterProcess, i: int) -> None:
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0)
    out = client.completions.create(
        model="kvroute-sim", prompt=f"{SYSTEM} question {i}", max_tokens=2, timeout=20
    )
    assert out.choices and out.usage is not None


def _entries(router: RouterProcess) -> int:
    return sum(r["entries"] for r in _stats(router)["replicas"].values())


@pytest.mark.timeout(180)
def test_three_routers_follow_pods_and_a_restarted_router_catches_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fast = LatencyModel(time_scale=0.02)
    with contextlib.ExitStack() as stack:
        api = stack.enter_context(FakeApiServer(bookmark_interval_s=0.5))
        kubeconfig = api.kubeconfig(tmp_path / "kubeconfig")
        fleet_a = SimFleet(SimFleetConfig(replicas=3, latency=fast, stream_interval_s=0.0))
        fleet_b = SimFleet(
            SimFleetConfig(replicas=1, latency=fast, stream_interval_s=0.0, host="127.0.0.2")
        )
        for fleet in (fleet_a, fleet_b):
            stack.callback(fleet.stop)
            fleet.start()
        a, b = fleet_a.replicas, fleet_b.replicas[0]
        api.add_pod(_vllm_pod("vllm-0", "127.0.0.1", a[0], "u0"))
        api.add_pod(_vllm_pod("vllm-1", "127.0.0.1", a[1], "u1"))

        ports = [free_port() for _ in range(3)]
        routers = []
        for i, port in enumerate(ports):
            api.add_pod(
                make_pod(
                    f"router-{i}",
                    "127.0.0.1",
                    labels={"app": "kvroute"},
                    annotations={"kvroute.io/router-port": str(port)},
                )
            )
            routers.append(
                RouterProcess(
                    name=f"router-{i}",
                    port=port,
                    tokenizer=fleet_a.model_dir,
                    log_path=tmp_path / f"router-{i}.log",
                    extra_args=[
                        *("--discover", "k8s", "--selector", "app=vllm"),
                        *("--kubeconfig", str(kubeconfig), "--relist-interval-s", "3"),
                        *("--peer-selector", "app=kvroute", "--health-interval-s", "0.2"),
                        "--no-tokenizer-check",
                    ],
                )
            )
        for i, router in enumerate(routers):
            monkeypatch.setenv("POD_NAME", f"router-{i}")  # what the pod's downward API sets
            stack.callback(router.stop)
            router.start(wait=False)
        for router in routers:
            router.wait_ready()

        def all_follow(want: dict[str, str], what: str) -> None:
            _until(lambda: all(_urls(r) == want for r in routers), 15, what)

        url = {n: r.url for n, r in zip(("s0", "s1", "s2"), a, strict=True)}
        all_follow({"vllm-0": url["s0"], "vllm-1": url["s1"]}, "the first list")
        rr = itertools.count()
        for router in routers:
            _complete(router, next(rr))

        api.add_pod(_vllm_pod("vllm-2", "127.0.0.1", a[2], "u2"))
        all_follow({"vllm-0": url["s0"], "vllm-1": url["s1"], "vllm-2": url["s2"]}, "added")
        api.delete_pod("vllm-0")
        all_follow({"vllm-1": url["s1"], "vllm-2": url["s2"]}, "deleted")
        api.update_pod(_vllm_pod("vllm-1", "127.0.0.2", b, "u1"))  # a new IP: a new incarnation
        all_follow({"vllm-1": b.url, "vllm-2": url["s2"]}, "IP changed")
        # A delete while every watch is broken, never sent to any watcher: found by re-list.
        _until(lambda: api.live_watches >= len(routers), 10, "every router watching")
        api.break_watches()
        api.delete_pod("vllm-2", silent=True)
        all_follow({"vllm-1": b.url}, "missed delete")
        # History compacted under the watches, then the streams end: resuming is 410 Gone.
        api.compact()
        api.add_pod(_vllm_pod("vllm-0", "127.0.0.1", a[0], "u0b"))
        api.compact()
        api.end_watches()
        final = {"vllm-0": url["s0"], "vllm-1": b.url}
        all_follow(final, "after 410")
        for router in routers:
            disc = _stats(router)["discovery"]
            assert disc["relists_410"] >= 1 and disc["watch_restarts"] >= 1, disc
            assert disc["peers"] == sorted(
                f"http://127.0.0.1:{p}" for p in ports if p != router.port
            )
            # The discovered peers are the ones whose in-flight counts it polls (shared load).
            peer_load = _stats(router)["peer_load"]
            assert sorted(peer_load["peers"]) == disc["peers"], peer_load
            assert all(p["fresh"] and not p["self"] for p in peer_load["peers"].values())
            for _ in range(3):
                _complete(router, next(rr))

        # Bounded traffic while router-1 is killed and restarted; the client picks a live
        # router per request, as a Service does with readiness.
        live = set(range(3))
        phase = [0]  # 0: all up; 1: router-1 killed; 2: router-1 back in the pick
        failures: list[tuple[int, int, str]] = []  # (router, phase at start, error)
        stop = threading.Event()
        sent = itertools.count()

        def traffic() -> None:
            while not stop.is_set() and next(sent) < 400:
                pick, started = sorted(live)[next(rr) % len(live)], phase[0]
                try:
                    _complete(routers[pick], next(rr))
                except Exception as exc:
                    failures.append((pick, started, repr(exc)))

        worker = threading.Thread(target=traffic)
        worker.start()
        try:
            time.sleep(1.0)
            routers[1].process.kill()
            live.discard(1)
            phase[0] = 1
            monkeypatch.setenv("POD_NAME", "router-1")
            routers[1].start()
            # ready as a readiness probe would see it: both discovered replicas healthy
            _until(
                lambda: httpx.get(routers[1].url + "/health").json()["healthy_replicas"] == 2,
                15,
                "restarted router: both discovered replicas healthy",
            )
            live.add(1)
            phase[0] = 2
            time.sleep(1.5)
        finally:
            stop.set()
            worker.join(timeout=30)
        total = next(sent)
        print(f"traffic: {total} requests, {len(failures)} failed (all on the killed router)")
        assert total > 20, "too little traffic to mean anything"
        # only requests sent to router-1 before it was back may fail
        assert [f for f in failures if f[0] != 1 or f[1] == 2] == []

        def close_to_peers() -> bool:
            counts = [_entries(r) for r in routers]
            return counts[0] > 0 and all(abs(c - counts[0]) <= counts[0] * 0.01 for c in counts)

        _until(close_to_peers, 10, "restarted router's index within 1% of its peers'")
        start = _stats(routers[1])["start"]
        print(f"restarted router's start: {start}")
        assert start["mode"] == "peer_snapshot", start
        assert start["peer"] in {routers[0].url, routers[2].url}
        # at least one discovered replica was seeded from it (a replica whose snapshot the
        # peer could not vouch for replays instead: router/peers/warm_start.py decides that)
        assert start["replicas_from_snapshot"] >= 1, start
