"""A data-parallel server behind the router: the simulator with two engines (real ZMQ event
sockets per rank, real HTTP), the router in process, the official ``openai`` client.

The router must find both ranks (from ``/kv_event_sources`` with ``dp=auto``, or from
``dp=2``), index them apart, send a repeated prefix back to the rank that holds it (pinned
with ``X-data-parallel-rank``: the simulator names the engine that ran each request), and
clear only the restarted rank when one engine's event stream starts over.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from kvroute.bench.sim.fleet import SimFleet
from kvroute.router.app import create_app
from kvroute.router.config import RouterSettings
from kvroute.router.serving.http_protocol import header_deadline_protocol
from kvroute.router.specs import parse_replica_flag
from kvroute.router.tokens.tokenization import LocalTokenizer
from tests.router.servers import ServerThread, wait_until
from tests.sim_configs import dp_fleet_config

SERVER = "dpsrv"  # the router's name for the server
SIM = "sim-0"  # the simulator's
RANKS = [f"{SERVER}#dp0", f"{SERVER}#dp1"]


@pytest.fixture(scope="module")
def sim() -> Iterator[SimFleet]:
    with SimFleet(dp_fleet_config()) as fleet:
        yield fleet


@pytest.fixture(scope="module")
def tokenizer(sim: SimFleet) -> LocalTokenizer:
    return LocalTokenizer(sim.model_dir)


@contextlib.contextmanager
def router(sim: SimFleet, tokenizer: LocalTokenizer, flag: str) -> Iterator[ServerThread]:
    settings = RouterSettings(
        replicas=[parse_replica_flag(flag)],
        health_interval_s=0.2,
        health_timeout_s=1.0,
        tokenizer_check_on_start=False,
    )
    server = ServerThread(
        create_app(settings, tokenizer=tokenizer),
        http=header_deadline_protocol(settings.header_timeout_s),
    ).start()
    try:
        service = server.app.state.service
        wait_until(lambda: sorted(r.name for r in service.registry.healthy()) == RANKS, 15)
        yield server
    finally:
        server.stop()


def stats(server: ServerThread) -> dict[str, Any]:
    return httpx.get(f"{server.url}/index/stats", timeout=5).json()


def chat(server: ServerThread, system: str, question: str) -> tuple[str, str, int]:
    """Returns (x-kvroute-replica, the rank the simulator ran it on, cached tokens)."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model="kvroute-sim",
        messages=[
            {"role": "system", "content": f"{system}: " + "answer briefly and precisely. " * 40},
            {"role": "user", "content": question},
        ],
        max_tokens=4,
    )
    body = raw.parse()
    cached = body.usage.prompt_tokens_details.cached_tokens if body.usage else 0
    return raw.headers["x-kvroute-replica"], raw.headers["x-sim-data-parallel-rank"], cached or 0


def engine_blocks(sim: SimFleet) -> list[int]:
    return [len(sim.cache_contents(f"{SIM}#dp{r}")["GPU"]) for r in range(2)]


def entries(server: ServerThread) -> dict[str, int]:
    return {name: stats(server)["replicas"][name]["entries"] for name in RANKS}


def test_discovered_ranks_are_indexed_apart_and_a_prefix_returns_to_its_rank(
    sim: SimFleet, tokenizer: LocalTokenizer
) -> None:
    url = sim.replicas[0].url
    with router(sim, tokenizer, f"{url},dp=auto,name={SERVER}") as server:
        st = stats(server)
        assert sorted(st["replicas"]) == RANKS
        # Each rank's feed is the simulator's rank socket: event port + r.
        ports = [st["replicas"][n]["health"]["events"].rsplit(":", 1)[1] for n in RANKS]
        base = int(sim.replicas[0].events.rsplit(":", 1)[1])
        assert ports == [str(base), str(base + 1)]

        target, rank, _ = chat(server, "alpha", "q0")
        assert target == f"{SERVER}#dp{rank}"
        home, other = target, next(n for n in RANKS if n != target)
        wait_until(lambda: entries(server)[home] > 0, 10)
        assert entries(server)[other] == 0  # rank-apart: the other engine never saw alpha
        for i in range(1, 5):
            again, again_rank, cached = chat(server, "alpha", f"q{i}")
            assert (again, again_rank) == (home, rank)
            assert cached > 0  # and the engine did have it cached
        # A new prefix goes to the rank that took no new home yet.
        target_b, rank_b, _ = chat(server, "beta", "q0")
        assert target_b == other and target_b == f"{SERVER}#dp{rank_b}"
        wait_until(lambda: entries(server)[other] > 0, 10)


def test_one_ranks_restart_clears_only_that_rank(sim: SimFleet, tokenizer: LocalTokenizer) -> None:
    r = sim.replicas[0]
    flag = f"{r.url},events={r.events},replay={r.replay},topic={r.topic},dp=2,name={SERVER}"
    with router(sim, tokenizer, flag) as server:
        # Both ranks hold something (placement spreads new prefixes over the ranks).
        for name in ("gamma", "delta", "epsilon", "zeta"):
            chat(server, name, "q")
        # Each rank's index entries are that engine's cache, block for block.
        wait_until(lambda: list(entries(server).values()) == engine_blocks(sim), 10)
        assert all(n > 0 for n in engine_blocks(sim))
        before = entries(server)
        resets = {n: stats(server)["replicas"][n]["feed"]["resets"] for n in RANKS}
        sim.restart(f"{SIM}#dp1")
        wait_until(
            lambda: stats(server)["replicas"][RANKS[1]]["feed"]["resets"] > resets[RANKS[1]], 15
        )
        wait_until(lambda: entries(server)[RANKS[1]] == 0, 10)
        after = stats(server)["replicas"]
        assert after[RANKS[0]]["entries"] == before[RANKS[0]]
        assert after[RANKS[0]]["feed"]["resets"] == resets[RANKS[0]]
        # The restarted engine's cache is empty too: the index agrees with it.
        assert sim.cache_contents(f"{SIM}#dp1")["GPU"] == []
