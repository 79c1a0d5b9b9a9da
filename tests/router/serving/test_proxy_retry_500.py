"""A replica's HTTP 500 before the first byte (router/serving/proxy.py, ``Forwarder.open``): retried
on the next replica only when the replica's own ``/health`` then fails (vLLM's dead engine:
``EngineDeadError`` -> 500, ``/health`` -> 503), at most once per request; relayed as is when
the replica is healthy (the request's own error). Real HTTP servers on 127.0.0.1: simulated
replicas behind a real router, and, where a test needs to count or slow ``/health``, a small
Starlette replica of its own.

The fleets run the health checker every 60 s, so that between the fleet start and the
request only the proxy's probe can see a replica's engine die; round robin sends the first
request to r0 first."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvroute.router.config import ReplicaConfig
from kvroute.router.errors import RouterError
from kvroute.router.fleet.replicas import Replica, ReplicaRegistry
from kvroute.router.serving.auth import ReplicaAuth
from kvroute.router.serving.proxy import Forwarder
from kvroute.router.serving.upstream import UpstreamClient
from tests.router.servers import ServerThread, wait_until
from tests.router.sim_fleet import Fleet, make_fleet
from tests.router.sim_replica import SimServer

BODY = {"model": "tiny", "prompt": "a prompt that crashes nothing", "max_tokens": 3}
ERROR_KEYS = {"message", "type", "param", "code"}


# --- helpers ------------------------------------------------------------------------------


def _quiet_fleet(local_tokenizer: Any, n: int = 2) -> Any:
    return make_fleet(local_tokenizer, n=n, policy="round_robin", health_interval_s=60.0)


def _engine_dies(fleet: Fleet, i: int) -> None:
    """Replica i's engine is dead: generation answers 500, /health 503 (as vLLM's)."""
    fleet.fakes[i].faults.fail_status = 500
    fleet.fakes[i].faults.healthy = False


def _completions(fleet: Fleet, i: int) -> list[dict[str, Any]]:
    return [s.body for s in fleet.fakes[i].seen if s.path == "/v1/completions"]


def _retries(fleet: Fleet) -> float:
    text = httpx.get(f"{fleet.url}/metrics", timeout=5).text
    match = re.search(r"^kvroute_retries_total (\S+)$", text, re.MULTILINE)
    assert match is not None, "kvroute_retries_total is not exported"
    return float(match.group(1))


def _balanced(fleet: Fleet) -> None:
    """Every begin_request had its end_request."""
    wait_until(lambda: all(r.in_flight == 0 for r in fleet.service.registry), timeout_s=5)
    assert all(r.sent_since_scrape >= 0 for r in fleet.service.registry)


# --- through the router -------------------------------------------------------------------


def test_500_from_a_dead_engine_is_retried_on_the_next_replica(local_tokenizer) -> None:
    with _quiet_fleet(local_tokenizer) as fleet:
        assert _retries(fleet) == 0.0
        _engine_dies(fleet, 0)
        resp = httpx.post(f"{fleet.url}/v1/completions", json=BODY, timeout=10)
        assert resp.status_code == 200, resp.text
        assert resp.headers["x-kvroute-replica"] == "r1"
        expected = "".join(fleet.fakes[1].generated_text(BODY))
        assert resp.json()["choices"][0]["text"] == expected
        assert _completions(fleet, 0) == [BODY]  # r0 was tried first and answered 500
        assert _completions(fleet, 1) == [BODY]
        assert _retries(fleet) == 1.0
        r0 = fleet.service.registry.get("r0")
        assert r0.healthy is False and r0.ejections == 1
        assert r0.last_error.startswith("proxy: HTTP 500 and /health answered 503")
        assert fleet.service.registry.get("r1").healthy is True
        assert fleet.stats()["replicas"]["r0"]["health"]["healthy"] is False
        _balanced(fleet)
        # Ejected: the next request goes straight to r1 (round robin would have chosen r0).
        again = httpx.post(f"{fleet.url}/v1/completions", json=BODY | {"prompt": "b"})
        assert again.status_code == 200 and again.headers["x-kvroute-replica"] == "r1"
        assert len(_completions(fleet, 0)) == 1
        assert _retries(fleet) == 1.0


def test_500_from_a_dead_engine_is_retried_when_streaming(local_tokenizer) -> None:
    with _quiet_fleet(local_tokenizer) as fleet:
        _engine_dies(fleet, 0)
        body = BODY | {"stream": True}
        with httpx.stream("POST", f"{fleet.url}/v1/completions", json=body, timeout=10) as resp:
            assert resp.status_code == 200
            assert resp.headers["content-type"].startswith("text/event-stream")
            assert resp.headers["x-kvroute-replica"] == "r1"
            text = resp.read().decode()
        events = [e for e in text.split("\n\n") if e]
        assert events[-1] == "data: [DONE]"
        chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
        assert all("error" not in c for c in chunks)
        streamed = "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))
        assert streamed == "".join(fleet.fakes[1].generated_text(body))
        assert _completions(fleet, 0) == [body] and _completions(fleet, 1) == [body]
        assert _retries(fleet) == 1.0
        assert fleet.service.registry.get("r0").healthy is False
        _balanced(fleet)


def test_500_from_a_healthy_replica_is_the_requests_own(local_tokenizer) -> None:
    """/health answers 200: the 500 is relayed (OpenAI's schema, the replica's own message)
    and no other replica sees the request: a request that fails engines is not spread."""
    with _quiet_fleet(local_tokenizer) as fleet:
        fleet.fakes[0].faults.fail_status = 500  # /health stays 200
        resp = httpx.post(f"{fleet.url}/v1/completions", json=BODY, timeout=10)
        assert resp.status_code == 500
        assert resp.headers["x-kvroute-replica"] == "r0"
        error = resp.json()["error"]
        assert set(error) == ERROR_KEYS
        assert error["message"] == "injected failure on r0"
        assert error["code"] == 500
        assert _completions(fleet, 0) == [BODY]
        assert _completions(fleet, 1) == []
        assert _retries(fleet) == 0.0
        r0 = fleet.service.registry.get("r0")
        assert r0.healthy is True and r0.ejections == 0 and r0.last_error is None
        _balanced(fleet)


def test_500s_from_two_dead_engines_relay_the_second(local_tokenizer) -> None:
    """Both engines dead: r0's 500 is retried (r0 ejected), r1's 500 is the client's answer.
    The replica's own 500, not a router 503: nothing else could serve the request, and a 503
    with Retry-After would invite the client to send a possibly engine-killing request
    again at once; the 500 keeps vLLM's message and names (x-kvroute-replica) the replica
    whose engine failed. r1 was the last candidate, so it is not probed by this request."""
    with _quiet_fleet(local_tokenizer) as fleet:
        _engine_dies(fleet, 0)
        _engine_dies(fleet, 1)
        resp = httpx.post(f"{fleet.url}/v1/completions", json=BODY, timeout=10)
        assert resp.status_code == 500
        assert resp.headers["x-kvroute-replica"] == "r1"
        error = resp.json()["error"]
        assert set(error) == ERROR_KEYS
        assert error["message"] == "injected failure on r1" and error["code"] == 500
        assert _completions(fleet, 0) == [BODY] and _completions(fleet, 1) == [BODY]
        assert _retries(fleet) == 1.0
        registry = fleet.service.registry
        assert registry.get("r0").healthy is False
        assert registry.get("r1").healthy is True  # the health checker's to eject
        _balanced(fleet)


def test_a_500_is_retried_at_most_once_per_request(local_tokenizer) -> None:
    """Three replicas, the first two with dead engines: r1's 500 is relayed, r2 (which would
    have served it) never sees the request: one request takes down two engines at most."""
    with _quiet_fleet(local_tokenizer, n=3) as fleet:
        _engine_dies(fleet, 0)
        _engine_dies(fleet, 1)
        resp = httpx.post(f"{fleet.url}/v1/completions", json=BODY, timeout=10)
        assert resp.status_code == 500
        assert resp.headers["x-kvroute-replica"] == "r1"
        assert resp.json()["error"]["message"] == "injected failure on r1"
        assert [len(_completions(fleet, i)) for i in range(3)] == [1, 1, 0]
        assert _retries(fleet) == 1.0
        registry = fleet.service.registry
        assert [registry.get(f"r{i}").healthy for i in range(3)] == [False, True, True]
        _balanced(fleet)


# --- the Forwarder alone, against real servers --------------------------------------------


class DeadEngine:
    """A replica whose engine is dead: 500 on generation (vLLM's schema), ``/health`` 503
    after ``health_delay_s``; counts both and keeps the probes' Authorization headers. With
    ``gate``, a generation answers once ``gate`` of them arrived (their 500s leave together)."""

    def __init__(
        self, health_delay_s: float = 0.0, health_status: int = 503, gate: int = 1
    ) -> None:
        self.health_delay_s = health_delay_s
        self.health_status = health_status
        self.gate = gate
        self.generations = 0
        self.health_calls = 0
        self.health_auth: list[str | None] = []
        self.app = Starlette(
            routes=[
                Route("/health", self.health, methods=["GET"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
            ]
        )

    async def health(self, request: Request) -> Response:
        self.health_calls += 1
        self.health_auth.append(request.headers.get("authorization"))
        await asyncio.sleep(self.health_delay_s)
        return Response(status_code=self.health_status)

    async def completions(self, request: Request) -> Response:
        self.generations += 1
        async with asyncio.timeout(10):
            while self.generations < self.gate:
                await asyncio.sleep(0.005)
        error = {"message": "EngineCore encountered an issue.", "type": "InternalServerError"}
        return JSONResponse({"error": error | {"param": None, "code": 500}}, status_code=500)


@pytest.fixture
def sim(local_tokenizer) -> Iterator[SimServer]:
    with SimServer("ok", local_tokenizer.name) as server:
        yield server


def _replica(registry: ReplicaRegistry, url: str, name: str, **kw: Any) -> Replica:
    replica = registry.add(ReplicaConfig(url=url, name=name, **kw))
    replica.healthy = True
    return replica


async def _complete(forwarder: Forwarder, ranked: list[Replica]) -> tuple[int, str, Any]:
    """One completion through ``forwarder``: (status, replica name, JSON body)."""
    body = json.dumps(BODY).encode()
    upstream = await forwarder.open(
        ranked, "/v1/completions", body, [(b"content-type", b"application/json")]
    )
    try:
        data = json.loads(await upstream.response.read())
    finally:
        forwarder.close(upstream, complete=True)
    return upstream.status, upstream.replica.name, data


def test_data_parallel_siblings_of_a_dead_engine_are_skipped(sim: SimServer) -> None:
    """Two ranks of one server whose engine died, then another server, with two attempts:
    the dead server's second rank is skipped (ejected with the first, and not an attempt),
    so the second attempt reaches the live server."""
    with ServerThread(DeadEngine().app) as dead:
        registry = ReplicaRegistry()
        ranks = [
            _replica(registry, dead.url, f"s0-{rank}", dp_rank=rank, server="s0") for rank in (0, 1)
        ]
        live = _replica(registry, sim.url, "s1")
        retries: list[int] = []

        async def go() -> tuple[int, str, Any]:
            client = UpstreamClient()
            forwarder = Forwarder(
                client, registry, max_attempts=2, on_retry=lambda: retries.append(1)
            )
            try:
                return await _complete(forwarder, [*ranks, live])
            finally:
                client.close()

        status, name, data = asyncio.run(go())
        assert (status, name) == (200, "s1")
        assert data["choices"][0]["text"] == "".join(sim.generated_text(BODY))
        assert len(retries) == 1
        assert [r.healthy for r in ranks] == [False, False] and live.healthy
        assert all(r.in_flight == 0 for r in registry)


def test_concurrent_500s_share_one_probe_carrying_the_replica_key(sim: SimServer) -> None:
    """Eight requests get 500s from one dead engine at once: one /health probe (with the
    router's replica key) answers them all, and each is served by the next replica."""
    engine = DeadEngine(health_delay_s=0.5, gate=8)
    with ServerThread(engine.app) as dead:
        registry = ReplicaRegistry()
        first = _replica(registry, dead.url, "dead")
        live = _replica(registry, sim.url, "live")
        retries: list[int] = []

        async def go() -> list[tuple[int, str, Any]]:
            client = UpstreamClient()
            forwarder = Forwarder(
                client,
                registry,
                on_retry=lambda: retries.append(1),
                auth=ReplicaAuth.of([], "replica-key"),
                probe_timeout_s=3.0,
            )
            try:
                return await asyncio.gather(
                    *(_complete(forwarder, [first, live]) for _ in range(8))
                )
            finally:
                client.close()

        results = asyncio.run(go())
        assert [(status, name) for status, name, _ in results] == [(200, "live")] * 8
        assert engine.generations == 8
        assert engine.health_calls == 1
        assert engine.health_auth == ["Bearer replica-key"]
        assert len(retries) == 8
        assert first.healthy is False and first.ejections == 1
        assert first.in_flight == 0 and live.in_flight == 0


def test_a_health_probe_without_answer_counts_as_a_dead_engine(sim: SimServer) -> None:
    engine = DeadEngine(health_delay_s=5.0, health_status=200)
    with ServerThread(engine.app) as dead:
        registry = ReplicaRegistry()
        first = _replica(registry, dead.url, "hung")
        live = _replica(registry, sim.url, "live")

        async def go() -> tuple[int, str, Any]:
            client = UpstreamClient()
            forwarder = Forwarder(client, registry, probe_timeout_s=0.3)
            try:
                return await _complete(forwarder, [first, live])
            finally:
                client.close()

        status, name, _ = asyncio.run(go())
        assert (status, name) == (200, "live")
        assert first.healthy is False
        assert first.last_error == "proxy: HTTP 500 and /health did not answer within 0.3 s"
        assert first.in_flight == 0 and live.in_flight == 0


def test_a_client_gone_during_the_probe_leaves_nothing_in_flight(sim: SimServer) -> None:
    engine = DeadEngine(health_delay_s=1.0)
    with ServerThread(engine.app) as dead:
        registry = ReplicaRegistry()
        first = _replica(registry, dead.url, "dead")
        live = _replica(registry, sim.url, "live")

        async def go() -> None:
            client = UpstreamClient()
            forwarder = Forwarder(client, registry, probe_timeout_s=3.0)
            try:
                task = asyncio.create_task(_complete(forwarder, [first, live]))
                while engine.health_calls == 0:
                    await asyncio.sleep(0.01)
                assert first.in_flight == 1  # still held while the probe runs
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                assert first.in_flight == 0 and live.in_flight == 0
                # The shared probe finishes on its own and is forgotten.
                while forwarder._probes:
                    await asyncio.sleep(0.05)
            finally:
                client.close()

        asyncio.run(go())
        assert engine.generations == 1 and not [s for s in sim.seen]
        assert first.healthy is True  # nobody was left to act on the verdict


def test_a_500_from_the_only_candidate_is_relayed_without_a_probe() -> None:
    engine = DeadEngine()
    with ServerThread(engine.app) as dead:
        registry = ReplicaRegistry()
        only = _replica(registry, dead.url, "only")

        async def go() -> tuple[int, str, Any]:
            client = UpstreamClient()
            try:
                return await _complete(Forwarder(client, registry), [only])
            finally:
                client.close()

        status, name, data = asyncio.run(go())
        assert (status, name) == (500, "only")
        assert data["error"]["message"] == "EngineCore encountered an issue."
        assert engine.health_calls == 0 and only.in_flight == 0


def test_a_500_then_a_refused_connection_is_a_503(sim: SimServer) -> None:
    """The retry after a dead engine finds the next replica gone: the router's 503 names
    both failures."""
    with ServerThread(DeadEngine().app) as dead:
        registry = ReplicaRegistry()
        first = _replica(registry, dead.url, "dead")
        gone = _replica(registry, sim.url, "gone")
        sim.stop()

        async def go() -> RouterError:
            client = UpstreamClient()
            try:
                with pytest.raises(RouterError) as caught:
                    await _complete(Forwarder(client, registry), [first, gone])
                return caught.value
            finally:
                client.close()

        error = asyncio.run(go())
        assert error.status == 503
        assert "dead: HTTP 500, engine down (/health answered 503)" in str(error)
        assert "gone: UpstreamUnreachable" in str(error)
        assert not first.healthy and not gone.healthy
        assert first.in_flight == 0 and gone.in_flight == 0
