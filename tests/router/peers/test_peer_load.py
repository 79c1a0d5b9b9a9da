"""Shared load between peer routers (router/peers/load.py): the answer's decoder, the sum over
fresh peers, and two real routers on 127.0.0.1 in front of simulated vLLM replicas, where the
second router sees (and routes around) the requests the first one is holding."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import json
import math
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from kvroute.bench.sim.faults import ReplicaFaults
from kvroute.router.app import create_app
from kvroute.router.config import ConfigError, ReplicaConfig, RouterSettings
from kvroute.router.fleet.replicas import Replica, ReplicaRegistry
from kvroute.router.peers.load import (
    MAX_WAIT_S,
    MIN_ASK_INTERVAL_S,
    PeerAnswer,
    PeerLoad,
    PeerLoadError,
    PeerReport,
    load_body,
    load_version,
    parse_load,
)
from kvroute.router.tokens.tokenization import LocalTokenizer
from tests.router.manual_clock import ManualClock
from tests.router.servers import ServerThread, wait_until
from tests.router.sim_fleet import Fleet, make_fleet

KEY = "sk-peer-load-test"
AUTH = {"authorization": f"Bearer {KEY}"}
# How long the slow replicas hold a request before its first token: every check on the held
# requests must fit in it, on a loaded CI machine too.
HOLD_S = 8.0


# --- the answer ---------------------------------------------------------------------------


def test_a_peers_answer_round_trips() -> None:
    replicas = [
        Replica(ReplicaConfig(url=f"http://127.0.0.1:{9000 + i}", name=f"r{i}")) for i in range(2)
    ]
    replicas[1].in_flight = 7
    body = load_body("router-a", replicas)
    version = load_version(replicas)
    assert parse_load(body) == PeerAnswer("router-a", {"r0": 0, "r1": 7}, {}, version, 0)
    body = load_body("router-a", replicas, {"r0": 0, "r1": 125})
    assert body["unstored_blocks"] == {"r1": 125}  # zeros are left out
    assert parse_load(body) == PeerAnswer("router-a", {"r0": 0, "r1": 7}, {"r1": 125}, version, 0)
    # Queue and rate samples, numbered in one log, in their own lists.
    log = [("r0", 0.25, None), ("r1", None, (100.0, 0.0, 50.0, 0.5, 1.0)), ("r1", 0.125, None)]
    body = load_body("router-a", replicas, next_sample=3, samples=log)
    assert body["samples"] == {
        "next": 3,
        "values": [["r0", 0.25], ["r1", 0.125]],
        "rates": [["r1", 100.0, 0.0, 50.0, 0.5, 1.0]],
    }
    answer = parse_load(body)
    assert answer.samples == [("r0", 0.25), ("r1", 0.125)]
    assert answer.rate_samples == [("r1", (100.0, 0.0, 50.0, 0.5, 1.0))]
    # This version's samples carry the queue delay priced for the request, in their own key
    # (an older router, which refuses rows of another length, ignores it).
    row = (100.0, 0, 50.0, 0.5, 1.0, 0.25)
    current = load_body("router-a", replicas, next_sample=1, samples=[("r1", None, row)])
    assert current["samples"]["rates_q"] == [["r1", 100.0, 0, 50.0, 0.5, 1.0, 0.25]]
    assert "rates" not in current["samples"]
    assert parse_load(current).rate_samples == [("r1", (100.0, 0.0, 50.0, 0.5, 1.0, 0.25))]
    current["samples"]["rates_q"][0][6] = -1.0
    with pytest.raises(PeerLoadError):
        parse_load(current)
    # The device blocks its requests hold on each replica (router/routing/kv_room.py); an
    # older router omits them.
    held = load_body("router-a", replicas, kv_held={"r0": 40, "r1": 0})
    assert held["kv_held_blocks"] == {"r0": 40}
    assert parse_load(held).kv_held_blocks == {"r0": 40}
    assert parse_load(load_body("router-a", replicas)).kv_held_blocks == {}
    # ... and when they should free them, soonest first (an older router omits it)
    frees = load_body("router-a", replicas, kv_frees={"r0": [(30, 0.25), (10, 1.5)], "r1": []})
    assert frees["kv_frees"] == {"r0": [[30, 0.25], [10, 1.5]]}
    assert parse_load(frees).kv_frees == {"r0": [(30, 0.25), (10, 1.5)]}
    assert parse_load(held).kv_frees == {}
    # ... and the homes it gave new prefixes, numbered with the samples
    homes = load_body("router-a", replicas, next_sample=2, samples=[("r1", None, b"\xab\x01")])
    assert homes["samples"]["homes"] == [["r1", "ab01"]]
    assert "rates" not in homes["samples"] and homes["samples"]["values"] == []
    assert parse_load(homes).homes == [("r1", b"\xab\x01")]
    assert parse_load(held).homes == []
    # An older router's answer has no version: its follower polls it.
    del body["version"]
    assert parse_load(body).version is None


def test_the_version_changes_with_the_in_flight_counts() -> None:
    replicas = [
        Replica(ReplicaConfig(url=f"http://127.0.0.1:{9000 + i}", name=f"r{i}")) for i in range(2)
    ]
    seen = {load_version(replicas)}
    for r0, r1 in [(1, 0), (0, 1), (1, 1), (0, 0)]:
        replicas[0].in_flight, replicas[1].in_flight = r0, r1
        seen.add(load_version(replicas))
    assert len(seen) == 4  # (0, 0) came back to the first version
    assert load_version(replicas[:1]) != load_version(replicas)  # a replica gone


@pytest.mark.parametrize(
    "body",
    [
        [],
        "text",
        {"router": "a"},
        {"replicas": {"r0": 1}},
        {"router": "", "replicas": {}},
        {"router": 5, "replicas": {}},
        {"router": "a", "replicas": []},
        {"router": "a", "replicas": {"r0": -1}},
        {"router": "a", "replicas": {"r0": True}},
        {"router": "a", "replicas": {"r0": "3"}},
        {"router": "a", "replicas": {"r0": math.nan}},
        {"router": "a", "replicas": {"r0": math.inf}},
        {"router": "a", "replicas": {"r0": 10**9}},
        {"router": "a", "replicas": {}, "unstored_blocks": []},
        {"router": "a", "replicas": {}, "unstored_blocks": {"r0": -5}},
        {"router": "a", "replicas": {}, "unstored_blocks": {"r0": "125"}},
        {"router": "a", "replicas": {}, "unstored_blocks": {"r0": math.inf}},
        {"router": "a", "replicas": {}, "unstored_blocks": {"r0": 10**12}},
        {"router": "a", "replicas": {}, "kv_held_blocks": {"r0": -1}},
        {"router": "a", "replicas": {}, "kv_held_blocks": {"r0": "40"}},
        {"router": "a", "replicas": {}, "kv_held_blocks": [40]},
        {"router": "a", "replicas": {}, "kv_frees": [[1, 0.5]]},
        {"router": "a", "replicas": {}, "kv_frees": {"r0": [[1, -0.5]]}},
        {"router": "a", "replicas": {}, "kv_frees": {"r0": [[-1, 0.5]]}},
        {"router": "a", "replicas": {}, "kv_frees": {"r0": [[1, 1e9]]}},
        {"router": "a", "replicas": {}, "kv_frees": {"r0": [[1, math.nan]]}},
        {"router": "a", "replicas": {}, "kv_frees": {"r0": [[True, 0.5]]}},
        {"router": "a", "replicas": {}, "kv_frees": {"r0": [[1, "0.5"]]}},
        {"router": "a", "replicas": {}, "kv_frees": {"r0": [[1, 0.5, 2]]}},
        {"router": "a", "replicas": {}, "kv_frees": {"r0": [[1, 0.5]] * 65}},
        {"router": "a", "replicas": {}, "kv_frees": {"r0": {"1": 0.5}}},
        {"router": "a", "replicas": {}, "samples": {"next": 1, "homes": {"r0": "ab"}}},
        {"router": "a", "replicas": {}, "samples": {"next": 1, "homes": [["r0", "xyz"]]}},
        {"router": "a", "replicas": {}, "samples": {"next": 1, "homes": [["r0", ""]]}},
        {"router": "a", "replicas": {}, "samples": {"next": 1, "homes": [["r0", "ab" * 65]]}},
        {"router": "a", "replicas": {}, "samples": {"next": 1, "homes": [[1, "ab"]]}},
        {"router": "a", "replicas": {}, "samples": {"next": 1, "homes": [["r0"]]}},
        {"router": "a", "replicas": {}, "version": 5},
        {"router": "a", "replicas": {}, "version": ""},
        {"router": "a", "replicas": {}, "version": "v" * 65},
        {"router": "a", "replicas": {}, "samples": []},
        {"router": "a", "replicas": {}, "samples": {"values": []}},
        {"router": "a", "replicas": {}, "samples": {"next": -1}},
        {"router": "a", "replicas": {}, "samples": {"next": True}},
        {"router": "a", "replicas": {}, "samples": {"next": 1.5}},
        {"router": "a", "replicas": {}, "samples": {"next": 1, "values": {"r0": 0.1}}},
        {"router": "a", "replicas": {}, "samples": {"next": 1, "values": [["r0"]]}},
        {"router": "a", "replicas": {}, "samples": {"next": 1, "values": [["r0", -0.1]]}},
        {"router": "a", "replicas": {}, "samples": {"next": 1, "values": [["r0", math.nan]]}},
        {"router": "a", "replicas": {}, "samples": {"next": 1, "values": [["r0", "0.1"]]}},
        {"router": "a", "replicas": {}, "samples": {"next": 1, "values": [[0, 0.1]]}},
        {"router": "a", "replicas": {}, "samples": {"next": 1, "values": [["r0", 0.1]] * 4097}},
        {"router": "a", "replicas": {}, "samples": {"next": 1, "rates": {"r0": 1}}},
        {"router": "a", "replicas": {}, "samples": {"next": 1, "rates": [["r0", 1, 2, 3, 0.5]]}},
        {"router": "a", "replicas": {}, "samples": {"next": 1, "rates": [["r0", -1, 0, 0, 1, 1]]}},
        {"router": "a", "replicas": {}, "samples": {"next": 1, "rates": [["r0", 1, 0, 0, 1, 0]]}},
        {"router": "a", "replicas": {}, "samples": {"next": 1, "rates": [["r0", 1, 0, 0, 1, 2]]}},
        {
            "router": "a",
            "replicas": {},
            "samples": {"next": 1, "rates": [["r0", 1, 0, 0, math.inf, 1]]},
        },
        {"router": "a", "replicas": {}, "samples": {"next": 1, "rates": [[0, 1, 0, 0, 1, 1]]}},
    ],
)
def test_a_malformed_or_forged_answer_is_refused(body: Any) -> None:
    with pytest.raises(PeerLoadError):
        parse_load(body)


def test_only_fresh_answers_of_other_routers_count() -> None:
    clock = ManualClock()
    load = PeerLoad(interval_s=0.1, timeout_s=0.5, router_id="me", clock=clock)
    replicas = [
        Replica(ReplicaConfig(url=f"http://127.0.0.1:{9000 + i}", name=f"r{i}")) for i in range(2)
    ]
    for url, router, counts in [
        ("http://a", "router-a", {"r0": 2, "r1": 1}),
        ("http://b", "router-b", {"r0": 3, "unknown": 50}),
        ("http://self", "me", {"r0": 100}),  # a discovery list that includes this router
    ]:
        load.peers[url] = PeerReport(
            router=router,
            in_flight=counts,
            unstored_blocks={name: 10 * n for name, n in counts.items()},
            kv_held_blocks={name: 100 * n for name, n in counts.items()},
            kv_frees={name: [(100 * n, 0.1 * n)] for name, n in counts.items()},
            received_at=clock(),
        )
    load.apply(replicas)
    assert [r.peer_in_flight for r in replicas] == [5, 1]
    assert [r.peer_unstored_blocks for r in replicas] == [50, 10]
    assert [r.peer_kv_held for r in replicas] == [500, 100]
    # when the fresh peers' holdings free, in this router's clock, soonest first
    assert replicas[0].peer_kv_frees == [
        (pytest.approx(clock() + 0.2), 200),
        (pytest.approx(clock() + 0.3), 300),
    ]
    assert replicas[1].peer_kv_frees == [(pytest.approx(clock() + 0.1), 100)]
    replicas[0].in_flight = 1
    assert replicas[0].pending == 6  # ours plus the peers'
    clock.t += 0.5
    load.peers["http://a"].received_at = clock()
    clock.t += 0.6  # b answered 1.1 s ago: past stale_after_s (1 s)
    load.apply(replicas)
    assert [r.peer_in_flight for r in replicas] == [2, 1]
    clock.t += 1.0
    load.apply(replicas)
    assert [r.peer_in_flight for r in replicas] == [0, 0]
    assert [r.peer_unstored_blocks for r in replicas] == [0, 0]
    assert [r.peer_kv_held for r in replicas] == [0, 0]
    assert [r.peer_kv_frees for r in replicas] == [[], []]
    # what they held when, for the moment of a scrape
    assert replicas[0].peer_kv_held_at(time.monotonic()) == 0
    assert [b for _, b in replicas[0].peer_kv_history] == [500, 200, 0]
    # a page read over a window (asked, answered): the most the peers held in it
    (first, _), (second, _), (last, _) = replicas[0].peer_kv_history
    assert replicas[0].peer_kv_held_at(second, last) == 200
    assert replicas[0].peer_kv_held_at(first, last) == 500
    assert replicas[0].peer_kv_held_at(first - 1.0, first - 0.5) == 0
    stats = load.to_dict()["peers"]
    assert stats["http://self"]["self"] is True
    assert stats["http://a"]["fresh"] is False


def test_the_interval_is_checked() -> None:
    with pytest.raises(ConfigError):
        RouterSettings(peer_load_interval_s=-1)
    with pytest.raises(ConfigError):
        RouterSettings(peer_load_interval_s=600)


# --- two routers over real HTTP -----------------------------------------------------------


@contextlib.contextmanager
def _peer(fleet: Fleet, tokenizer: LocalTokenizer, **changes: Any) -> Iterator[ServerThread]:
    """A second router over the same replicas. It scrapes their metrics only at start
    (health every 60 s): the replicas' gauges cannot tell it what the first router sent."""
    settings = fleet.settings.replace(health_interval_s=60.0, **changes)
    with ServerThread(create_app(settings, tokenizer=tokenizer)) as router:
        wait_until(lambda: len(router.app.state.service.registry.healthy()) == len(fleet.fakes))
        yield router


@contextlib.contextmanager
def _slow_pair(
    tokenizer: LocalTokenizer, *, peer_load_interval_s: float, peer_load_mode: str = "follow"
) -> Iterator[tuple[Fleet, ServerThread]]:
    """Two replicas that take HOLD_S to prefill behind router A (least loaded), and router B,
    A's peer, following (or polling) A's load (``peer_load_interval_s`` 0: off)."""
    slow = ReplicaFaults(prefill_delay_s=HOLD_S)
    with (
        make_fleet(
            tokenizer, n=2, faults=[slow, slow], api_keys=[KEY], policy="least_loaded"
        ) as fleet,
        _peer(
            fleet,
            tokenizer,
            peers=[fleet.url],
            peer_load_interval_s=peer_load_interval_s,
            peer_load_mode=peer_load_mode,
        ) as b,
    ):
        yield fleet, b


def _stats(url: str) -> dict[str, Any]:
    return httpx.get(f"{url}/index/stats", headers=AUTH, timeout=5).json()


def _hold(fleet: Fleet, n: int) -> list[concurrent.futures.Future[int]]:
    """``n`` streamed completions through the first router, each held HOLD_S by its replica's
    slow prefill; returns their futures (status codes)."""
    pool = concurrent.futures.ThreadPoolExecutor(n)

    def one(i: int) -> int:
        body = {
            "model": "tiny",
            "prompt": f"held request {i} " * 20,
            "max_tokens": 2,
            "stream": True,
        }
        with httpx.stream(
            "POST", f"{fleet.url}/v1/completions", json=body, headers=AUTH, timeout=30
        ) as resp:
            resp.read()
            return resp.status_code

    futures = [pool.submit(one, i) for i in range(n)]
    pool.shutdown(wait=False)
    return futures


@pytest.mark.parametrize("mode", ["follow", "poll"])
def test_a_peer_sees_and_routes_around_what_the_first_router_holds(
    local_tokenizer: LocalTokenizer, mode: str
) -> None:
    with _slow_pair(local_tokenizer, peer_load_interval_s=0.05, peer_load_mode=mode) as (
        fleet,
        b,
    ):
        futures = _hold(fleet, 3)
        in_flight = {}

        def held() -> bool:
            in_flight.update(
                {n: r["load"]["in_flight"] for n, r in _stats(fleet.url)["replicas"].items()}
            )
            return sum(in_flight.values()) == 3

        wait_until(held, timeout_s=5)
        busy = max(in_flight, key=lambda n: in_flight[n])
        idle = min(in_flight, key=lambda n: in_flight[n])
        assert in_flight[busy] > in_flight[idle]

        def peer_sees() -> bool:
            load = {n: r["load"] for n, r in _stats(b.url)["replicas"].items()}
            return all(load[n]["peer_in_flight"] == in_flight[n] for n in in_flight)

        wait_until(peer_sees, timeout_s=3)
        replicas = _stats(b.url)["replicas"]
        assert {n: r["load"]["pending"] for n, r in replicas.items()} == in_flight
        peer_load = _stats(b.url)["peer_load"]
        assert peer_load["peers"][fleet.url]["fresh"] is True
        assert peer_load["peers"][fleet.url]["in_flight"] == 3
        # Followed: A streams B a line each time its counts change.
        assert peer_load["peers"][fleet.url]["followed"] is (mode == "follow")
        assert peer_load["peers"][fleet.url]["streamed"] is (mode == "follow")
        # B's dashboard names the router it shares load with, fresh.
        peers = httpx.get(f"{b.url}/dashboard/data", headers=AUTH, timeout=5).json()["peers"]
        assert peers == [
            {
                "url": fleet.url,
                "router": peer_load["peers"][fleet.url]["router"],
                "fresh": True,
                "error": None,
            }
        ]
        # B has sent nothing, yet it puts a new request where A's queue is shorter.
        decision = httpx.post(
            f"{b.url}/debug/route",
            json={"model": "tiny", "prompt": "a new question"},
            headers=AUTH,
            timeout=5,
        ).json()
        assert decision["chosen"] == idle, decision
        assert [f.result(timeout=30) for f in futures] == [200, 200, 200]
        wait_until(
            lambda: all(
                r["load"]["peer_in_flight"] == 0 for r in _stats(b.url)["replicas"].values()
            ),
            timeout_s=3,
        )
        # The third request waited HOLD_S behind another: a queue sample A took from its first
        # byte, which B learns as well, so both price that replica's queue alike.
        taken = _stats(fleet.url)["queue_samples"]["taken"]
        assert taken >= 1
        wait_until(lambda: _stats(b.url)["queue_samples"]["from_peers"] == taken, timeout_s=3)
        assert _stats(b.url)["peer_load"]["peers"][fleet.url]["queue_samples_received"] == taken
        a_queue = {
            n: r["load"]["queue_s_per_request"] for n, r in _stats(fleet.url)["replicas"].items()
        }
        b_queue = {
            n: r["load"]["queue_s_per_request"] for n, r in _stats(b.url)["replicas"].items()
        }
        assert a_queue[busy] > 5 * a_queue[idle]  # learned from the held one; idle: the prior
        assert b_queue == pytest.approx(a_queue, rel=0.01)


def test_a_peer_learns_the_rates_the_first_router_learned(local_tokenizer: LocalTokenizer) -> None:
    """Router A (kvroute's cost model) prices each answered stream into a sample of the
    replica's prefill and load rates; B, following A's load, learns each of them too, so both
    price the replicas alike."""
    with (
        make_fleet(local_tokenizer, n=2, api_keys=[KEY]) as fleet,
        _peer(fleet, local_tokenizer, peers=[fleet.url], peer_load_interval_s=0.05) as b,
    ):
        # B follows A first: a follower skips what its peer took before the first answer.
        wait_until(
            lambda: (_stats(b.url)["peer_load"]["peers"].get(fleet.url) or {}).get("fresh"),
            timeout_s=5,
        )
        for i in range(4):
            body = {"model": "tiny", "prompt": f"question {i} " * (10 + 20 * i), "stream": True}
            with httpx.stream(
                "POST", f"{fleet.url}/v1/completions", json=body, headers=AUTH, timeout=30
            ) as resp:
                resp.read()
                assert resp.status_code == 200

        def rates(url: str) -> dict[str, Any]:
            return {n: r["cost_rates"] for n, r in _stats(url)["replicas"].items()}

        a = rates(fleet.url)
        assert sum(r["samples"] for r in a.values()) == 4
        wait_until(lambda: _stats(b.url)["queue_samples"]["from_peers"] >= 4, timeout_s=3)
        got = rates(b.url)
        for name, r in a.items():  # the same samples, decayed to a slightly different now
            assert got[name]["samples"] == r["samples"], (got, a)
            for key in ("prefill_s_per_token", "load_s_per_token_cpu"):
                assert got[name][key] == pytest.approx(r[key], rel=0.01), (got, a)


def test_without_shared_load_the_peer_is_blind_to_them(local_tokenizer: LocalTokenizer) -> None:
    """The same setup with polling off: what the test above asserts is the peer load's doing."""
    with _slow_pair(local_tokenizer, peer_load_interval_s=0) as (fleet, b):
        futures = _hold(fleet, 3)
        wait_until(
            lambda: (
                sum(r["load"]["in_flight"] for r in _stats(fleet.url)["replicas"].values()) == 3
            ),
            timeout_s=5,
        )
        stats = _stats(b.url)
        assert stats["peer_load"] is None
        assert all(r["load"]["pending"] == 0 for r in stats["replicas"].values())
        assert [f.result(timeout=30) for f in futures] == [200, 200, 200]
        assert _stats(fleet.url)["queue_samples"]["taken"] >= 1
        assert _stats(b.url)["queue_samples"] == {
            "taken": 0,
            "from_peers": 0,
            "homes_from_peers": 0,
        }


def test_peer_load_needs_the_key_and_a_wrong_key_is_reported(
    local_tokenizer: LocalTokenizer,
) -> None:
    with make_fleet(local_tokenizer, n=1, api_keys=[KEY]) as fleet:
        assert httpx.get(f"{fleet.url}/peer/load", timeout=5).status_code == 401
        ok = httpx.get(f"{fleet.url}/peer/load", headers=AUTH, timeout=5)
        assert ok.status_code == 200
        answer = parse_load(ok.json())
        assert answer.in_flight == {"r0": 0} and answer.unstored_blocks == {}
        assert answer.router == fleet.service.peer_load.router_id
        # A peer holding another key: its polls are refused, counted and shown, never used.
        with _peer(
            fleet,
            local_tokenizer,
            api_keys=["sk-another-key"],
            peers=[fleet.url],
            peer_load_interval_s=0.05,
        ) as b:
            headers = {"authorization": "Bearer sk-another-key"}

            def refused() -> dict[str, Any] | None:
                stats = httpx.get(f"{b.url}/index/stats", headers=headers, timeout=5).json()
                peer = stats["peer_load"]["peers"].get(fleet.url)
                return peer if peer and peer["failures"] >= 2 else None

            wait_until(lambda: refused() is not None, timeout_s=5)
            peer = refused()
            assert peer is not None and "401" in peer["error"] and peer["fresh"] is False


def test_a_router_listed_among_its_own_peers_ignores_itself(
    local_tokenizer: LocalTokenizer,
) -> None:
    slow = ReplicaFaults(prefill_delay_s=HOLD_S)
    with make_fleet(local_tokenizer, n=1, faults=[slow], api_keys=[KEY]) as fleet:
        service = fleet.service
        service.peer_urls = lambda: [fleet.url]
        futures = _hold(fleet, 2)
        wait_until(lambda: service.registry.get("r0").in_flight == 2, timeout_s=5)
        wait_until(lambda: fleet.url in _stats(fleet.url)["peer_load"]["peers"], timeout_s=3)
        wait_until(lambda: _stats(fleet.url)["peer_load"]["peers"][fleet.url]["fresh"])
        stats = _stats(fleet.url)
        assert stats["peer_load"]["peers"][fleet.url]["self"] is True
        assert stats["peer_load"]["peers"][fleet.url]["streamed"] is True
        assert stats["replicas"]["r0"]["load"]["peer_in_flight"] == 0
        assert stats["replicas"]["r0"]["load"]["pending"] == 2  # not 4
        assert [f.result(timeout=30) for f in futures] == [200, 200]


def test_a_held_answer_comes_when_the_counts_change(local_tokenizer: LocalTokenizer) -> None:
    """``GET /peer/load?wait_s=W&seen=V`` on a real router: answered at once when V is not
    its version, held W when nothing changes, and answered as soon as a request starts."""
    slow = ReplicaFaults(prefill_delay_s=HOLD_S)
    with make_fleet(local_tokenizer, n=1, faults=[slow], api_keys=[KEY]) as fleet:
        url = f"{fleet.url}/peer/load"

        def ask(**params: Any) -> tuple[dict[str, Any], float]:
            t0 = time.monotonic()
            resp = httpx.get(url, params=params, headers=AUTH, timeout=15)
            assert resp.status_code == 200, resp.text
            return resp.json(), time.monotonic() - t0

        first, _ = ask()
        assert first["replicas"] == {"r0": 0} and first["version"] == load_version(
            fleet.service.registry
        )
        _, took = ask(wait_s=MAX_WAIT_S, seen="an older version")
        assert took < MAX_WAIT_S - 1
        same, took = ask(wait_s=0.5, seen=first["version"])
        assert took >= 0.45 and same["version"] == first["version"]
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            held = pool.submit(ask, wait_s=MAX_WAIT_S, seen=first["version"])
            time.sleep(0.3)
            futures = _hold(fleet, 1)
            changed, took = held.result(timeout=15)
        assert changed["replicas"] == {"r0": 1} and changed["version"] != first["version"]
        assert took < MAX_WAIT_S - 0.5
        assert [f.result(timeout=30) for f in futures] == [200]
        # Bad parameters: an OpenAI-style 400, nothing held.
        bad = httpx.get(url, params={"wait_s": "soon"}, headers=AUTH, timeout=5)
        assert bad.status_code in (400, 422) and "error" in bad.json()


def test_a_streamed_answer_comes_at_each_change_and_at_each_heartbeat(
    local_tokenizer: LocalTokenizer,
) -> None:
    """``GET /peer/load?stream=1`` on a real router: a line at once, one within moments of
    a request starting, heartbeat lines while nothing changes; a queue sample taken meanwhile
    comes on a line of its own; and the router stops at once with the stream still open."""
    slow = ReplicaFaults(prefill_delay_s=2.0)
    with make_fleet(local_tokenizer, n=1, faults=[slow], api_keys=[KEY]) as fleet:
        lines: list[tuple[float, dict[str, Any]]] = []

        def read(params: dict[str, Any]) -> None:
            with httpx.stream(
                "GET", f"{fleet.url}/peer/load", params=params, headers=AUTH, timeout=15
            ) as resp:
                assert resp.status_code == 200
                assert resp.headers["content-type"].startswith("application/x-ndjson")
                for line in resp.iter_lines():
                    lines.append((time.monotonic(), json.loads(line)))

        pool = concurrent.futures.ThreadPoolExecutor(1)
        opened = time.monotonic()
        reader = pool.submit(read, {"stream": 1, "wait_s": 0.3, "samples_from": 0})
        wait_until(lambda: len(lines) >= 3, timeout_s=5)  # the first, then two heartbeats
        assert lines[0][0] - opened < 1.0
        assert all(body["replicas"] == {"r0": 0} for _, body in lines[:3])
        assert 0.2 < lines[2][0] - lines[1][0] < 1.0
        seen = len(lines)
        started = time.monotonic()
        futures = _hold(fleet, 2)  # the second waits behind the first: a queue sample
        wait_until(lambda: any(b["replicas"] == {"r0": 2} for _, b in lines[seen:]), timeout_s=3)
        at = next(t for t, b in lines[seen:] if b["replicas"] == {"r0": 2})
        assert at - started < 1.0  # at the change, not at the next heartbeat
        assert [f.result(timeout=30) for f in futures] == [200, 200]
        # Each answer's rate sample is logged when the router closes its stream, which may
        # be just after the client has its last byte: wait for both, and for the stream to
        # have carried every sample the router has numbered by then.
        log = fleet.service.router.queue_delay

        def streamed_all() -> bool:
            rates = sum(len(b["samples"].get("rates_q", [])) for _, b in lines)
            return rates == 2 and lines[-1][1]["samples"]["next"] == log.next_sample

        wait_until(streamed_all, timeout_s=5)
        taken = log.next_sample
        assert taken >= 3  # the queue sample of the second request, and two answers' rates
        # Each sample on exactly one line: those since the line before (queue samples, and
        # the rate samples of each answer, numbered in one log).
        values = [v for _, b in lines for v in b["samples"]["values"]]
        rates = [v for _, b in lines for v in b["samples"].get("rates_q", [])]
        homes = [v for _, b in lines for v in b["samples"].get("homes", [])]
        assert len(values) + len(rates) + len(homes) == taken
        assert {name for name, _ in values} == {"r0"}
        assert len(rates) == 2 and {row[0] for row in rates} == {"r0"}
        assert len(homes) <= 2 and {name for name, _ in homes} <= {"r0"}
        stopping = time.monotonic()
        fleet.router.stop()
        assert time.monotonic() - stopping < 1.5  # the graceful timeout (2 s) not waited out
        with contextlib.suppress(httpx.HTTPError):
            reader.result(timeout=10)  # the stream ended with the router
        pool.shutdown()


def _follow_for(
    load: PeerLoad,
    peer: Callable[[Request], Awaitable[JSONResponse]],
    seconds: float,
    on_answer: Callable[[], None],
    sent: list[float] | None = None,
    until: Callable[[], bool] | None = None,
) -> PeerReport:
    """Follow a peer served by ``peer`` (GET /peer/load, a real HTTP server) for
    ``seconds``; returns the follower's report of it. ``sent`` gets the time the follower
    sent each question (on its own side: the server's arrival times jitter). ``until``: go on
    past ``seconds`` until it holds (a loaded machine is slower), for at most 10 s more."""
    app = Starlette(routes=[Route("/peer/load", peer)])

    async def on_request(request: httpx.Request) -> None:
        if sent is not None:
            sent.append(time.monotonic())

    async def follow(url: str) -> None:
        async with httpx.AsyncClient(event_hooks={"request": [on_request]}) as client:
            task = asyncio.create_task(load.follow(client, url, on_answer))
            await asyncio.sleep(seconds)
            deadline = time.monotonic() + 10.0
            while until is not None and not until() and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    with ServerThread(app) as server:
        asyncio.run(follow(server.url))
        return load.peers[server.url]


def test_a_peer_without_versions_is_polled_not_hammered() -> None:
    """An older router ignores ``wait_s`` and answers at once, without a version: its
    follower waits the interval between questions instead of asking in a loop."""
    asked: list[float] = []

    async def old_router(request: Request) -> JSONResponse:
        asked.append(time.monotonic())
        return JSONResponse({"router": "old", "replicas": {"r0": 2}})

    load = PeerLoad(interval_s=0.1, timeout_s=1.0, router_id="me")
    answers: list[int] = []
    report = _follow_for(load, old_router, 1.0, lambda: answers.append(1))
    assert 3 <= len(asked) <= 12  # every 0.1 s for a second, not hundreds
    # (the last question may have been cut short by the cancel)
    assert len(asked) - 1 <= len(answers) <= len(asked) and report.followed is False
    assert report.in_flight == {"r0": 2} and report.error is None


def test_a_peer_whose_counts_always_change_is_asked_at_most_every_check() -> None:
    """Under heavy traffic a peer's counts differ at every answer, so every question is
    answered at once: its follower still asks at most once per MIN_ASK_INTERVAL_S."""
    asked: list[float] = []

    async def busy_router(request: Request) -> JSONResponse:
        asked.append(time.monotonic())
        return JSONResponse(
            {"router": "busy", "version": f"v{len(asked)}", "replicas": {"r0": len(asked)}}
        )

    load = PeerLoad(interval_s=0.1, timeout_s=1.0, router_id="me")
    sent: list[float] = []
    report = _follow_for(load, busy_router, 1.0, lambda: None, sent)
    assert 5 <= len(asked) <= 1.0 / MIN_ASK_INTERVAL_S + 5, len(asked)
    gaps = sorted(b - a for a, b in itertools.pairwise(sent))
    assert len(sent) >= len(asked)
    # A hammering follower asks once per round trip (~1 ms here); a preemption between
    # the follower's clock reading and its request being sent may shorten one gap a little.
    assert gaps[len(gaps) // 10] >= MIN_ASK_INTERVAL_S * 0.95, gaps[:5]
    assert gaps[0] >= MIN_ASK_INTERVAL_S * 0.5, gaps[:5]
    # (the last question may have been cut short by the cancel)
    assert report.followed is True and report.in_flight["r0"] >= len(asked) - 1


def test_a_followed_peers_queue_samples_are_fetched_once_each() -> None:
    """The follower passes back the ``next`` of the peer's last answer and applies what comes
    with it; a peer that restarted (a new id, numbering from 0 again) is not mistaken for
    the old one, and a first answer's samples are never asked for."""
    asked: list[int | None] = []
    log = [("r0", 0.1 * i) for i in range(1, 8)]

    async def peer(request: Request) -> JSONResponse:
        raw = request.query_params.get("samples_from")
        asked.append(None if raw is None else int(raw))
        n = len(asked)
        router, taken = ("old", min(n, 4)) if n <= 5 else ("new", 2)  # restarts after 5
        values = [] if raw is None else [list(s) for s in log[int(raw) : taken]]
        if n == 6:  # the new peer's first answer, to a cursor of the old one's numbering
            values = [["r0", 9.9]]
        return JSONResponse(
            {
                "router": router,
                "version": f"v{n}",
                "replicas": {"r0": 0},
                "samples": {"next": taken, "values": values},
            }
        )

    got: list[tuple[str, float]] = []
    load = PeerLoad(interval_s=0.1, timeout_s=1.0, router_id="me", on_samples=got.extend)
    report = _follow_for(load, peer, 0.3, lambda: None, until=lambda: len(asked) >= 7)
    # Asked from 1, 2, 3, 4, 4 (the old peer), then the new one answered from its 2.
    assert asked[:7] == [None, 1, 2, 3, 4, 4, 2], asked
    assert got[:3] == log[1:4]  # samples 1-3: each once, none from before the first answer
    assert report.samples_received == len(got)
    # The new peer's answer to the old peer's cursor is not applied (its numbers mean other
    # samples); asked from its own 2 since, it has had nothing new.
    assert ("r0", 9.9) not in got and len(got) == 3


def test_the_load_signal_wakes_a_waiter_where_counts_change() -> None:
    """What holds a ``GET /peer/load``: woken by a request beginning or ending and by a
    replica coming or going, never by time alone (but for the waiter's own timeout)."""
    registry = ReplicaRegistry()

    async def scenario() -> list[str]:
        woken: list[str] = []

        async def waiter(name: str, timeout_s: float) -> None:
            t0 = time.monotonic()
            await registry.load_signal.wait(timeout_s)
            woken.append(f"{name}:{'change' if time.monotonic() - t0 < timeout_s else 'timeout'}")

        replica = registry.add(ReplicaConfig(url="http://127.0.0.1:9000", name="r0"))
        for step in (
            replica.begin_request,
            lambda: replica.end_request(0),
            lambda: registry.add(ReplicaConfig(url="http://127.0.0.1:9001", name="r1")),
            lambda: registry.remove("r1"),
        ):
            task = asyncio.create_task(waiter("w", 5.0))
            await asyncio.sleep(0.05)
            step()
            await asyncio.wait_for(task, 2.0)
        await waiter("idle", 0.05)
        return woken

    assert asyncio.run(scenario()) == ["w:change"] * 4 + ["idle:timeout"]
