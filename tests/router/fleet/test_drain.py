"""Drain: a replica pod being deleted (``deletionTimestamp`` seen by discovery), or whose
readiness drops, gets no new request from that moment, and the requests it is serving
finish; no client sees an error.

A real router on 127.0.0.1 (``--discover k8s`` through the real lightkube client) in front
of two simulated vLLM replicas, the pods served by the kube-apiserver stand-in
(tests/router/k8s_apiserver.py). The first replica's prefill is slowed so that its request
is still being served when its pod is marked for deletion. The router's endpoint picker runs
too: a request a gateway asks it to place (ext_proc, as tests/router/epp/test_epp.py drives
it) is not placed on the leaving pod either."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from kvroute.bench.sim.faults import ReplicaFaults
from kvroute.deploy.processes import free_port
from kvroute.router.app import create_app
from kvroute.router.config import K8sDiscoverySettings, RouterSettings
from kvroute.router.serving.http_protocol import header_deadline_protocol
from kvroute.router.tokens.tokenization import LocalTokenizer
from tests.router.epp.test_epp import Stream, _body, _destination, header_map
from tests.router.k8s_apiserver import FakeApiServer, make_pod
from tests.router.servers import ServerThread, wait_until
from tests.router.sim_replica import SimServer


def _picked(epp: str, body: dict[str, Any]) -> str:
    """The endpoint the picker names for ``body`` (a duplex pick, as Envoy asks it)."""

    async def main() -> str:
        async with grpc.aio.insecure_channel(epp) as channel:
            call = pb_grpc.ExternalProcessorStub(channel).Process()
            try:
                stream = Stream(call)
                await stream.send(header_map("/v1/completions", authorization=None))
                await stream.send(_body(json.dumps(body).encode()))
                return _destination(await stream.read())[0]
            finally:
                call.cancel()

    return asyncio.run(main())


def sim_pod(name: str, sim: SimServer, *, ready: bool = True) -> dict[str, Any]:
    def port(endpoint: str) -> str:
        return endpoint.rsplit(":", 1)[1]

    return make_pod(
        name,
        "127.0.0.1",
        ready=ready,
        uid=f"uid-{name}",
        annotations={
            "kvroute.io/http-port": str(sim.port),
            "kvroute.io/events-port": port(sim.events),
            "kvroute.io/replay-port": port(sim.replay),
        },
    )


@pytest.mark.parametrize("leaves_by", ["deletion", "readiness"])
def test_a_pod_leaving_takes_no_new_request_and_finishes_its_own(
    local_tokenizer: LocalTokenizer, tmp_path: Path, leaves_by: str
) -> None:
    """``deletion``: the pod's ``deletionTimestamp`` is set (a scale-down, a rollout, an
    eviction). ``readiness``: its Ready condition turns False while it keeps running (a
    failing readiness probe; the phase stays Running)."""
    with (
        SimServer("r0", local_tokenizer.name) as r0,
        SimServer("r1", local_tokenizer.name) as r1,
        FakeApiServer() as api,
    ):
        r0.replica.faults = ReplicaFaults(prefill_delay_s=2.0)
        api.add_pod(sim_pod("pod-0", r0))
        api.add_pod(sim_pod("pod-1", r1, ready=False))  # not yet: the first request goes to pod-0
        settings = RouterSettings(
            k8s_discovery=K8sDiscoverySettings(
                selector={"app": "vllm"}, kubeconfig=str(api.kubeconfig(tmp_path / "kube"))
            ),
            health_interval_s=0.2,
            tokenizer_check_on_start=False,
            epp_port=free_port("127.0.0.1"),
            epp_plaintext=True,
        )
        router = ServerThread(
            create_app(settings, tokenizer=local_tokenizer),
            http=header_deadline_protocol(settings.header_timeout_s),
        ).start()
        try:
            service = router.app.state.service
            wait_until(lambda: [r.name for r in service.registry.healthy()] == ["pod-0"], 10)
            body = {"model": "tiny", "prompt": "Drain test: " * 20, "max_tokens": 3, "stream": True}
            in_flight: dict[str, Any] = {}

            def first() -> None:
                with httpx.stream(
                    "POST", f"{router.url}/v1/completions", json=body, timeout=30
                ) as answer:
                    in_flight["status"] = answer.status_code
                    in_flight["replica"] = answer.headers.get("x-kvroute-replica")
                    in_flight["text"] = answer.read().decode()

            thread = threading.Thread(target=first)
            thread.start()
            wait_until(lambda: len(r0.seen) == 1, 10)
            # pod-1 becomes Ready and pod-0 starts terminating (or turns unready), in that
            # order, while pod-0 is still computing the first request.
            api.update_pod(sim_pod("pod-1", r1))
            leaving = sim_pod("pod-0", r0)
            if leaves_by == "deletion":
                leaving["metadata"]["deletionTimestamp"] = "2026-11-27T21:00:00Z"
            else:
                leaving["status"]["conditions"] = [{"type": "Ready", "status": "False"}]
            api.update_pod(leaving)
            wait_until(lambda: [r.name for r in service.registry] == ["pod-1"], 10)
            # pod-1 serves once the router's own health check has seen it (a Ready pod is
            # probed first: kubelet's readiness is a scrape old).
            wait_until(lambda: [r.name for r in service.registry.healthy()] == ["pod-1"], 10)
            assert thread.is_alive(), "the first request should still be in flight"
            later = []
            for i in range(6):
                answer = httpx.post(
                    f"{router.url}/v1/completions",
                    json={"model": "tiny", "prompt": f"After the drain {i}", "max_tokens": 2},
                    timeout=30,
                )
                later.append((answer.status_code, answer.headers.get("x-kvroute-replica")))
            epp = f"127.0.0.1:{settings.epp_port}"
            picked = [_picked(epp, {"model": "tiny", "prompt": f"Picked {i}"}) for i in range(3)]
            thread.join(30)
        finally:
            router.stop()
    assert later == [(200, "pod-1")] * 6  # none to the terminating pod, none refused
    assert picked == [f"127.0.0.1:{r1.port}"] * 3  # nor placed there by the picker
    assert in_flight["status"] == 200 and in_flight["replica"] == "pod-0"
    assert in_flight["text"].rstrip().endswith("data: [DONE]")  # finished, not cut
    assert len(r0.seen) == 1  # pod-0 received nothing after its deletion began
