"""Two routers over one fleet agree where new prefixes go (an HA deployment): real router
apps on 127.0.0.1, simulated vLLM replicas with real ZMQ KV-event feeds, no mocks."""

from __future__ import annotations

from typing import Any

import httpx

from kvroute.router.app import create_app
from kvroute.router.http_protocol import header_deadline_protocol
from tests.router.fleet import make_fleet
from tests.router.servers import ServerThread, wait_until

SYSTEM = "You are a careful assistant for distributed caches; answer in one line. " * 12


def _chat(tag: str, question: str = "Where does this prefix live?") -> dict[str, Any]:
    # The tag opens the prompt: every tag is a prefix no replica holds yet.
    return {
        "model": "tiny",
        "messages": [
            {"role": "system", "content": f"Tenant {tag}. {SYSTEM}"},
            {"role": "user", "content": question},
        ],
        "max_tokens": 2,
    }


def _route(url: str, body: dict[str, Any]) -> dict[str, Any]:
    resp = httpx.post(f"{url}/debug/route", json=body, timeout=10)
    assert resp.status_code == 200, resp.text
    return resp.json()


def _stored(url: str) -> dict[str, int]:
    replicas = httpx.get(f"{url}/index/stats", timeout=5).json()["replicas"]
    return {name: r["feed"]["blocks_stored"] for name, r in replicas.items()}


def test_two_routers_place_new_prefixes_on_the_same_replicas(local_tokenizer) -> None:
    """Router A serves three new prefixes (their blocks land on the replicas A chose, and
    both routers read them from the event feeds); then both routers are asked where 24
    further new prefixes go: the same replica for every one, never a replica whose recent
    stored blocks are above the mean, and both routers report the same stored rates. With
    the old router-private count of placed homes, B (which placed nothing) ranked the
    replicas differently from A."""
    with make_fleet(local_tokenizer, n=4, hint_ttl_s=0.0) as fleet:
        b = ServerThread(
            create_app(fleet.settings, tokenizer=local_tokenizer),
            http=header_deadline_protocol(fleet.settings.header_timeout_s),
        ).start()
        try:
            service_b = b.app.state.service
            wait_until(lambda: len(service_b.registry.healthy()) == 4, timeout_s=10)
            urls = (fleet.url, b.url)
            for url in urls:  # both routers are up before traffic: both sample from zero
                assert _route(url, _chat("warm-up"))["reason"] == "load"
            for tag in ("alpha", "beta", "gamma"):
                resp = httpx.post(f"{fleet.url}/v1/chat/completions", json=_chat(tag), timeout=10)
                assert resp.status_code == 200, resp.text
            wait_until(lambda: _stored(fleet.url) == _stored(b.url), timeout_s=10)
            assert sum(_stored(b.url).values()) > 0
            wait_until(
                lambda: all(v["pending"] == 0 for v in _route(fleet.url, _chat("x"))["replicas"]),
                timeout_s=10,
            )
            for i in range(24):
                a_dec, b_dec = (_route(url, _chat(f"new-{i}")) for url in urls)
                assert a_dec["reason"] == b_dec["reason"] == "load", (a_dec, b_dec)
                assert a_dec["chosen"] == b_dec["chosen"], (a_dec, b_dec)
                rates = {v["name"]: v["stored_rate"] for v in a_dec["replicas"]}
                rates_b = {v["name"]: v["stored_rate"] for v in b_dec["replicas"]}
                for name, rate in rates.items():
                    assert abs(rate - rates_b[name]) <= 0.01 * max(rate, 1e-3), (rates, rates_b)
                assert rates[a_dec["chosen"]] <= sum(rates.values()) / len(rates) + 1e-9
        finally:
            b.stop()
