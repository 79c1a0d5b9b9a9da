"""``GET /ready`` against a real router on 127.0.0.1: simulated vLLM replicas (HTTP and their
ZMQ publishers) and, for a feed that comes up late, a real ZMQ publisher started by the test
(kvroute.bench.publisher, vLLM's wire format). The grace period is driven by a hand-moved
clock so the tests neither sleep for it nor race it."""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator
from typing import Any

import httpx

from kvroute.bench.publisher import EventPublisher
from kvroute.deploy.processes import free_port
from kvroute.router.app import create_app
from kvroute.router.cli import add_arguments, settings_from_args
from kvroute.router.config import ReplicaConfig, RouterSettings
from kvroute.router.serving.http_protocol import header_deadline_protocol
from kvroute.router.tokens.tokenization import LocalTokenizer
from tests.router.manual_clock import ManualClock
from tests.router.servers import ServerThread, wait_until
from tests.router.sim_fleet import make_fleet
from tests.router.sim_replica import SimServer


@contextlib.contextmanager
def _router(
    tokenizer: LocalTokenizer, replicas: list[ReplicaConfig], **settings_kw: Any
) -> Iterator[ServerThread]:
    settings = RouterSettings(
        replicas=replicas,
        health_interval_s=0.2,
        health_timeout_s=1.0,
        tokenizer_check_on_start=False,
        **settings_kw,
    )
    router = ServerThread(
        create_app(settings, tokenizer=tokenizer),
        http=header_deadline_protocol(settings.header_timeout_s),
    ).start()
    try:
        yield router
    finally:
        router.stop()


def _manual_clock(router: ServerThread) -> ManualClock:
    """Swap the readiness clock for one the test moves; the grace starts now."""
    readiness = router.app.state.readiness
    clock = ManualClock()
    readiness.clock = clock
    readiness.start()
    return clock


def _healthy(router: ServerThread, n: int) -> None:
    wait_until(lambda: len(router.app.state.service.registry.healthy()) == n, timeout_s=10)


def _ready(url: str) -> httpx.Response:
    return httpx.get(f"{url}/ready", timeout=5)


def test_ready_waits_for_a_late_feed_then_turns_ready(local_tokenizer: LocalTokenizer) -> None:
    """A replica whose publisher is not up yet keeps /ready at 503, naming its feed; once a
    real publisher binds that endpoint and sends its first batch, /ready is 200."""
    port = free_port()
    with SimServer("r0", local_tokenizer.name) as sim:
        config = ReplicaConfig(url=sim.url, events=f"tcp://127.0.0.1:{port}", name="r0")
        with _router(local_tokenizer, [config], ready_grace_s=3600) as router:
            _healthy(router, 1)
            resp = _ready(router.url)
            assert resp.status_code == 503
            body = resp.json()
            assert body["status"] == "not_ready"
            assert set(body["feeds_not_live"]) == {"r0"}
            assert body["feeds_not_live"]["r0"]["freshness"] == "connecting"
            assert resp.headers["retry-after"]
            assert body["error"]["code"] == 503 and "feeds" in body["error"]["message"]

            with EventPublisher(f"tcp://127.0.0.1:{port}", bind=True) as publisher:

                def live() -> bool:
                    publisher.publish([])  # PUB drops until the SUB has joined: keep sending
                    return _ready(router.url).status_code == 200

                wait_until(live, timeout_s=15, interval_s=0.1)
                body = _ready(router.url).json()
                assert body["status"] == "ready" and body["feeds_not_live"] == {}
                assert body["healthy_replicas"] == 1


def test_ready_serves_after_the_grace_with_a_broken_publisher(
    local_tokenizer: LocalTokenizer,
) -> None:
    """A publisher that never comes up blocks readiness only for ``ready_grace_s``."""
    dead = f"tcp://127.0.0.1:{free_port()}"
    with SimServer("r0", local_tokenizer.name) as sim:
        config = ReplicaConfig(url=sim.url, events=dead, name="r0")
        with _router(local_tokenizer, [config], ready_grace_s=60) as router:
            clock = _manual_clock(router)
            _healthy(router, 1)
            clock.t += 59
            assert _ready(router.url).status_code == 503
            clock.t += 1
            resp = _ready(router.url)
            assert resp.status_code == 200, resp.text
            body = resp.json()
            assert "grace" in body["reason"]
            assert set(body["feeds_not_live"]) == {"r0"}  # still said, not hidden


def test_ready_needs_a_healthy_replica_even_after_the_grace(
    local_tokenizer: LocalTokenizer,
) -> None:
    with make_fleet(local_tokenizer, n=1, ready_grace_s=0) as fleet:
        wait_until(lambda: _ready(fleet.url).status_code == 200, timeout_s=10)
        fleet.servers[0].stop()
        wait_until(lambda: not fleet.service.registry.healthy(), timeout_s=10)
        resp = _ready(fleet.url)
        assert resp.status_code == 503
        assert resp.json()["reason"] == "no healthy replica"
        fleet.servers[0].start()
        wait_until(lambda: _ready(fleet.url).status_code == 200, timeout_s=10)


def test_ready_with_every_simulated_feed_live(local_tokenizer: LocalTokenizer) -> None:
    """The simulated fleet's own publishers (with replay) take both routers' feeds live."""
    with make_fleet(local_tokenizer, n=2, ready_grace_s=3600) as fleet:
        wait_until(lambda: _ready(fleet.url).status_code == 200, timeout_s=15)
        stats = fleet.stats()
        assert {r["freshness"] for r in stats["replicas"].values()} == {"live"}
        assert _ready(fleet.url).json()["healthy_replicas"] == 2


def test_replicas_without_a_feed_are_not_waited_for(local_tokenizer: LocalTokenizer) -> None:
    with make_fleet(local_tokenizer, n=1, events=False, ready_grace_s=3600) as fleet:
        resp = _ready(fleet.url)
        assert resp.status_code == 200, resp.text
        assert resp.json()["feeds_not_live"] == {}


def test_ready_is_open_like_health_under_api_keys(local_tokenizer: LocalTokenizer) -> None:
    with make_fleet(local_tokenizer, n=1, api_keys=["k-1"], ready_grace_s=0) as fleet:
        assert _ready(fleet.url).status_code == 200
        assert httpx.get(f"{fleet.url}/index/stats", timeout=5).status_code == 401
    guarded = {"api_keys": ["k-1"], "api_key_protects_metrics": True, "ready_grace_s": 0}
    with make_fleet(local_tokenizer, n=1, **guarded) as fleet:
        assert _ready(fleet.url).status_code == 401
        resp = httpx.get(f"{fleet.url}/ready", headers={"Authorization": "Bearer k-1"})
        assert resp.status_code == 200


def test_ready_is_in_the_openapi_document_and_the_flag_parses(
    local_tokenizer: LocalTokenizer,
) -> None:
    with make_fleet(local_tokenizer, n=1) as fleet:
        paths = httpx.get(f"{fleet.url}/openapi.json", timeout=5).json()["paths"]
        assert set(paths["/ready"]["get"]["responses"]) >= {"200", "503"}
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--replica", "http://h:8000", "--ready-grace-s", "7.5"])
    assert settings_from_args(args).ready_grace_s == 7.5
    assert RouterSettings().ready_grace_s == 60.0
