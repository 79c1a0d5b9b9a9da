"""Two routers over one fleet agree where new prefixes go (an HA deployment): real router
apps on 127.0.0.1, simulated vLLM replicas with real ZMQ KV-event feeds, no mocks."""

from __future__ import annotations

import concurrent.futures
import contextlib
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from kvroute.bench.sim.faults import ReplicaFaults
from kvroute.router.app import create_app
from kvroute.router.serving.http_protocol import header_deadline_protocol
from tests.router.servers import ServerThread, wait_until
from tests.router.sim_fleet import make_fleet

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


@contextlib.contextmanager
def _peer_router(fleet: Any, local_tokenizer: Any) -> Iterator[ServerThread]:
    """A second router B over ``fleet``'s replicas that follows router A's load (its peer),
    once B sees every replica healthy."""
    b = ServerThread(
        create_app(
            fleet.settings.replace(peers=[fleet.url], peer_load_interval_s=0.05),
            tokenizer=local_tokenizer,
        ),
        http=header_deadline_protocol(fleet.settings.header_timeout_s),
    ).start()
    try:
        service_b = b.app.state.service
        wait_until(lambda: len(service_b.registry.healthy()) == 4, timeout_s=10)
        yield b
    finally:
        b.stop()


@pytest.mark.solo  # both routers' time-decayed stored rates agree to 1%: nothing else running
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


# A prefix whose prefill dominates the cost (2,000+ tokens): every replica is a near-equal,
# so placement alone (not the queue term) decides where each new prefix goes.
LONG = "Shared documents of this tenant, to be read before any answer. " * 90
ADMIT_DELAY_S = 4.0


def _long_chat(tag: str) -> dict[str, Any]:
    return {
        "model": "tiny",
        "messages": [
            {"role": "system", "content": f"Tenant {tag}. {LONG}"},
            {"role": "user", "content": "Summarise."},
        ],
        "max_tokens": 2,
    }


def _send_spaced(urls: list[str], n: int, gap_s: float) -> list[str]:
    """``n`` new prefixes, one every ``gap_s``, each to ``urls[i % len(urls)]``, all sent
    before any replica admits one (``ADMIT_DELAY_S``); returns where each went."""
    pool = concurrent.futures.ThreadPoolExecutor(n)

    def one(i: int) -> str:
        resp = httpx.post(
            f"{urls[i % len(urls)]}/v1/chat/completions", json=_long_chat(f"t{i}"), timeout=30
        )
        assert resp.status_code == 200, resp.text
        return resp.headers["x-kvroute-replica"]

    futures = []
    for i in range(n):
        futures.append(pool.submit(one, i))
        time.sleep(gap_s)
    pool.shutdown(wait=True)
    return [f.result() for f in futures]


def test_new_prefixes_are_balanced_before_their_blocks_are_announced(local_tokenizer) -> None:
    """12 new prefixes reach 4 replicas within 1.2 s, and no replica stores (announces) a
    block for 4 s. From the fifth on every replica is busy prefilling, so all stay
    near-equals and the stored rates decide. The router counts the blocks it sent as in
    progress (UnstoredBlocks): 3 homes per replica. On the announced blocks alone (all zero
    until the first prefill ends) these tags ended 2, 2, 4, 4."""
    slow = [ReplicaFaults(admit_delay_s=ADMIT_DELAY_S) for _ in range(4)]
    with make_fleet(local_tokenizer, n=4, faults=slow, hint_ttl_s=0.0) as fleet:
        chosen = _send_spaced([fleet.url], 12, gap_s=0.1)
        assert sorted(Counter(chosen).values()) == [3, 3, 3, 3], chosen
        load = httpx.get(f"{fleet.url}/index/stats", timeout=5).json()["replicas"]
        # All announced by now: nothing is left in progress.
        assert all(r["load"]["unstored_blocks"] == 0 for r in load.values()), load


def test_two_routers_balance_new_prefixes_sent_through_either(local_tokenizer) -> None:
    """The same with the prefixes sent alternately through two routers that poll each other's
    load (GET /peer/load): each counts the other's blocks in progress (2, 2, 4, 4 without)."""
    slow = [ReplicaFaults(admit_delay_s=ADMIT_DELAY_S) for _ in range(4)]
    with (
        make_fleet(
            local_tokenizer, n=4, faults=slow, hint_ttl_s=0.0, peer_load_interval_s=0.05
        ) as fleet,
        _peer_router(fleet, local_tokenizer) as b,
    ):
        fleet.service.peer_urls = lambda: [b.url]  # B's URL is known only now
        wait_until(lambda: fleet.service.peer_load.peers.get(b.url, None) is not None)
        chosen = _send_spaced([fleet.url, b.url], 12, gap_s=0.25)
        assert sorted(Counter(chosen).values()) == [3, 3, 3, 3], chosen


def test_a_home_one_router_gives_is_honoured_by_its_peer(local_tokenizer) -> None:
    """Homes ride the peer stream (``samples.homes`` of GET /peer/load): a conversation's
    first turn through router A gets a home, and router B, asked where the same prompt
    goes, knows that home. Router-local homes sent one conversation's turns back and forth
    between two replicas when its turns came through two routers (docs/benchmarks.md)."""
    with (
        make_fleet(local_tokenizer, n=4, peer_load_interval_s=0.05) as fleet,
        _peer_router(fleet, local_tokenizer) as b,
    ):
        service_b = b.app.state.service
        # B follows A and has A's sample cursor: what A logs next reaches B
        wait_until(
            lambda: (
                (p := service_b.peer_load.peers.get(fleet.url)) is not None
                and p.next_sample is not None
            ),
            timeout_s=10,
        )
        assert _route(b.url, _chat("homes"))["home"] is None  # nothing placed yet
        resp = httpx.post(f"{fleet.url}/v1/chat/completions", json=_chat("homes"), timeout=30)
        assert resp.status_code == 200, resp.text
        placed = resp.headers["x-kvroute-replica"]
        wait_until(lambda: service_b.router.homes_from_peers >= 1, timeout_s=5)
        stats = httpx.get(f"{b.url}/index/stats", timeout=5).json()
        assert stats["queue_samples"]["homes_from_peers"] >= 1
        assert _route(b.url, _chat("homes"))["home"] == placed
        # A peer never moves a home this router gave: B keeps its own
        own = _chat("own")
        resp = httpx.post(f"{b.url}/v1/chat/completions", json=own, timeout=30)
        assert resp.status_code == 200, resp.text
        mine = resp.headers["x-kvroute-replica"]
        affinity = next(k for k, v in service_b.router.homes._data.items() if v[0] == mine)
        other = next(r.name for r in service_b.registry.healthy() if r.name != mine)
        service_b.router.observe_shared_home(other, affinity)
        assert service_b.router.homes.get(affinity) == mine
