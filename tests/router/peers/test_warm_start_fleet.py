"""Warm start end to end: router processes (as ``kvroute serve`` runs them) in front of a
simulated vLLM fleet (bench/sim: vLLM's HTTP API and ZMQ KV events, replay sockets included).

The first router takes traffic; a second starts with ``--peer`` the first while traffic goes
on: it copies the first one's index, replays only the batches published since, and agrees
with the first router's entry counts within 1% a few seconds later. A third router, started
alone, is the baseline: it replays every replica's whole history.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest

from kvroute.bench.sim.fleet import SimFleet, SimFleetConfig
from kvroute.bench.sim.latency import LatencyModel
from kvroute.deploy.router_process import RouterProcess

KEY = "sk-warm-fleet"
MODEL = "kvroute-sim"
REPLICAS = 3


@pytest.fixture(scope="module")
def fleet() -> Iterator[tuple[SimFleet, dict[str, Any]]]:
    config = SimFleetConfig(
        replicas=REPLICAS,
        gpu_blocks=160,  # small: blocks are evicted to the CPU tier and removed
        cpu_blocks=96,
        max_num_seqs=16,
        max_model_len=4096,
        default_max_tokens=2,
        latency=LatencyModel(time_scale=0.005),
        stream_interval_s=0.002,
    )
    with SimFleet(config) as sim:
        yield sim, sim.router_settings(health_interval_s=0.5)


def _chat(client: openai.OpenAI, i: int) -> None:
    system = f"You are the assistant of tenant {i % 17}. " + "Answer briefly and exactly. " * 12
    client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "system", "content": system},
            {"role": "user", "content": f"turn {i}?"},
        ],
        max_tokens=2,
    )


def _traffic(url: str, n: int, start: int = 0) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=30)
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda i: _chat(client, i), range(start, start + n)))


def _stats(router: RouterProcess) -> dict[str, Any]:
    return httpx.get(f"{router.url}/index/stats", headers=router.auth_headers(), timeout=10).json()


def _view(router: RouterProcess) -> dict[str, tuple[int, int]]:
    """Per replica: (entries, feed batches applied since the router started)."""
    return {
        n: (r["entries"], (r.get("feed") or {}).get("batches", 0))
        for n, r in _stats(router)["replicas"].items()
    }


def _agree(a: dict[str, int], b: dict[str, int]) -> bool:
    return a.keys() == b.keys() and all(abs(a[n] - b[n]) <= 0.01 * max(a[n], 1) for n in a)


def _wait_agree(first: RouterProcess, other: RouterProcess, timeout_s: float) -> float:
    """Seconds until both routers' entry counts agree within 1% for every replica."""
    started = time.monotonic()
    while True:
        a = {n: e for n, (e, _) in _view(first).items()}
        b = {n: e for n, (e, _) in _view(other).items()}
        if _agree(a, b) and all(a.values()):
            return time.monotonic() - started
        if time.monotonic() - started > timeout_s:
            pytest.fail(f"entries never agreed: first {a}, other {b}")
        time.sleep(0.2)


def test_a_router_started_beside_a_peer_replays_only_the_gap(
    fleet: tuple[SimFleet, dict[str, Any]],
) -> None:
    _sim, settings = fleet
    with RouterProcess(settings, api_key=KEY, name="router-1") as first:
        assert first.wait_feeds_settled(30)
        _traffic(first.url, 150)
        stop = threading.Event()

        def more() -> None:  # traffic goes on while the second router starts
            i = 1000
            while not stop.wait(0.05):
                _traffic(first.url, 1, i)
                i += 1

        background = threading.Thread(target=more, daemon=True)
        background.start()
        try:
            warm = RouterProcess({**settings, "peers": [first.url]}, api_key=KEY, name="router-2")
            with warm:
                deadline = time.monotonic() + 20
                while _stats(warm)["start"]["replicas_pending"]:
                    assert time.monotonic() < deadline, _stats(warm)["start"]
                    time.sleep(0.1)
                time.sleep(0.5)
                stop.set()
                background.join(timeout=30)
                agreed_s = _wait_agree(first, warm, timeout_s=10)
                start = _stats(warm)["start"]
                assert start["mode"] == "peer_snapshot", start
                assert start["peer"] == first.url and start["error"] is None
                assert start["replicas_from_snapshot"] == REPLICAS == start["replicas_verified"]
                assert start["entries_imported"] > 0
                full = sum(b for _, b in _view(first).values())
                warm_batches = sum(b for _, b in _view(warm).values())
                # Only the gap and the live batches since: far fewer than the whole history.
                assert start["gap_batches_replayed"] <= warm_batches < full / 2
                with RouterProcess(settings, api_key=KEY, name="router-3") as cold:
                    cold_agreed_s = _wait_agree(first, cold, timeout_s=20)
                    cold_start = _stats(cold)["start"]
                    assert cold_start["mode"] == "replay" and cold_start["peer"] is None
                    cold_batches = sum(b for _, b in _view(cold).values())
                    assert cold_batches >= full  # the whole history, replayed
                print(
                    f"\nwarm start: {start['entries_imported']} entries imported, "
                    f"{start['gap_batches_replayed']} gap batches replayed, took "
                    f"{start['took_s']}s, agreed {agreed_s:.2f}s after; cold start: "
                    f"{cold_batches} batches replayed, took {cold_start['took_s']}s, "
                    f"agreed {cold_agreed_s:.2f}s after start"
                )
        finally:
            stop.set()
            background.join(timeout=30)
