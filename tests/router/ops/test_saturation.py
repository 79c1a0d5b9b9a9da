"""The autoscaling signal: ``kvroute_replica_queued_prefill_tokens`` and
``kvroute_fleet_saturation`` (queued prefill tokens per healthy replica), on a real router
on 127.0.0.1 in front of simulated vLLM replicas, read from its real ``/metrics``.

The replicas' event feeds point at ports nobody publishes on, so no store is ever announced:
what a request sent to compute stays queued (for the test's long
``placement_unstored_max_age_s``), which makes the figures exact rather than racing the
simulator's prefill."""

from __future__ import annotations

import re

import httpx

from kvroute.deploy.processes import free_port
from kvroute.router.app import create_app
from kvroute.router.config import CostSettings, ReplicaConfig, RouterSettings
from kvroute.router.serving.http_protocol import header_deadline_protocol
from kvroute.router.tokens.tokenization import LocalTokenizer
from tests.router.servers import ServerThread, wait_until
from tests.router.sim_replica import SimServer


def _gauge(text: str, name: str, labels: str = "") -> float:
    match = re.search(rf"^{name}{re.escape(labels)} (\S+)$", text, re.MULTILINE)
    assert match, f"{name}{labels} not in /metrics"
    return float(match.group(1))


def _settings(*sims: SimServer) -> RouterSettings:
    """A router in front of ``sims``, health-checked every 0.2 s; a placement stays while
    the test runs (it is what turns the sent work into queued prefill)."""
    replicas = [
        ReplicaConfig(url=sim.url, events=f"tcp://127.0.0.1:{free_port()}", name=sim.name)
        for sim in sims
    ]
    return RouterSettings(
        replicas=replicas,
        health_interval_s=0.2,
        tokenizer_check_on_start=False,
        cost=CostSettings(placement_unstored_max_age_s=600),
    )


def test_queued_prefill_rises_with_work_sent_and_the_fleet_figure_is_per_replica(
    local_tokenizer: LocalTokenizer,
) -> None:
    with SimServer("r0", local_tokenizer.name) as r0, SimServer("r1", local_tokenizer.name) as r1:
        settings = _settings(r0, r1)
        router = ServerThread(
            create_app(settings, tokenizer=local_tokenizer),
            http=header_deadline_protocol(settings.header_timeout_s),
        ).start()
        try:
            service = router.app.state.service
            wait_until(lambda: len(service.registry.healthy()) == 2, timeout_s=10)
            before = httpx.get(f"{router.url}/metrics", timeout=5).text
            assert _gauge(before, "kvroute_fleet_saturation") == 0
            prompt = "Count the words of this sentence, please. " * 40
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 2}
            answer = httpx.post(f"{router.url}/v1/completions", json=body, timeout=30)
            assert answer.status_code == 200, answer.text
            picked = answer.headers["x-kvroute-replica"]
            tokens = answer.json()["usage"]["prompt_tokens"]  # the router reads it alike
            text = httpx.get(f"{router.url}/metrics", timeout=5).text
        finally:
            router.stop()
    queued = _gauge(text, "kvroute_replica_queued_prefill_tokens", f'{{replica="{picked}"}}')
    other = "r1" if picked == "r0" else "r0"
    assert queued == tokens // 16 * 16  # whole blocks of the uncached prompt
    assert _gauge(text, "kvroute_replica_queued_prefill_tokens", f'{{replica="{other}"}}') == 0
    assert _gauge(text, "kvroute_fleet_saturation") == queued / 2


def test_a_peer_router_reports_the_fleets_figure_with_the_work_it_did_not_send(
    local_tokenizer: LocalTokenizer,
) -> None:
    """Router B follows router A's load (``--peer``); a request sent through A alone shows in
    B's figures too (the blocks A sent to compute, shared in ``/peer/load``), so any router
    the autoscaler scrapes reports the fleet's saturation, not its own share."""
    with SimServer("r0", local_tokenizer.name) as r0, SimServer("r1", local_tokenizer.name) as r1:
        settings = _settings(r0, r1)
        a = ServerThread(
            create_app(settings, tokenizer=local_tokenizer),
            http=header_deadline_protocol(settings.header_timeout_s),
        ).start()
        b_settings = settings.replace(peers=[a.url])
        b = ServerThread(
            create_app(b_settings, tokenizer=local_tokenizer),
            http=header_deadline_protocol(settings.header_timeout_s),
        ).start()
        try:
            for router in (a, b):
                service = router.app.state.service
                wait_until(lambda s=service: len(s.registry.healthy()) == 2, timeout_s=10)
            body = {"model": "tiny", "prompt": "Name three rivers, please. " * 40, "max_tokens": 2}
            answer = httpx.post(f"{a.url}/v1/completions", json=body, timeout=30)
            assert answer.status_code == 200, answer.text
            picked = answer.headers["x-kvroute-replica"]
            queued = _gauge(
                httpx.get(f"{a.url}/metrics", timeout=5).text,
                "kvroute_replica_queued_prefill_tokens",
                f'{{replica="{picked}"}}',
            )
            assert queued > 0

            def b_sees_it() -> bool:
                text = httpx.get(f"{b.url}/metrics", timeout=5).text
                return _gauge(text, "kvroute_fleet_saturation") == queued / 2

            wait_until(b_sees_it, timeout_s=10)
            text_b = httpx.get(f"{b.url}/metrics", timeout=5).text
        finally:
            b.stop()
            a.stop()
    labels = f'{{replica="{picked}"}}'
    assert _gauge(text_b, "kvroute_replica_queued_prefill_tokens", labels) == queued
