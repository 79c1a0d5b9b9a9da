"""The simulator's data-parallel mode: one HTTP server, two engines, as vLLM 0.32 shows it.

Real sockets throughout: the fleet subprocess, HTTP on 127.0.0.1, each rank's ZMQ PUB socket
read by a plain SUB socket and decoded with the indexer's wire module.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import pytest
import zmq

from kvroute.bench.sim.fleet import SimFleet
from kvroute.indexer.wire import decode_batch, decode_frames
from kvroute.router.fleet.replicas import parse_vllm_metrics_by_engine
from tests.sim_configs import dp_fleet_config


@pytest.fixture(scope="module")
def dp_fleet() -> Iterator[SimFleet]:
    with SimFleet(dp_fleet_config()) as fleet:
        yield fleet


def _complete(url: str, prompt: str, rank: str | None = None, **kw: object) -> httpx.Response:
    headers = {} if rank is None else {"X-data-parallel-rank": rank}
    body = {"model": "kvroute-sim", "prompt": prompt, "max_tokens": 2, **kw}
    return httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=30)


def test_kv_event_sources_list_each_rank_on_its_port(dp_fleet: SimFleet) -> None:
    r = dp_fleet.replicas[0]
    assert r.dp == 2
    sources = httpx.get(f"{r.url}/kv_event_sources", timeout=5).json()
    base = int(r.events.rsplit(":", 1)[1])
    replay = int(r.replay.rsplit(":", 1)[1])
    assert sorted(sources) == ["0", "1"]
    for rank in (0, 1):
        s = sources[str(rank)]
        assert s["endpoint"] == f"tcp://*:{base + rank}"
        assert s["replay_endpoint"] == f"tcp://*:{replay + rank}"
        assert s["publisher"] == "zmq" and s["enable_kv_cache_events"] is True
        assert s["topic"] == r.topic


def test_the_rank_header_pins_and_each_rank_publishes_its_own_events(dp_fleet: SimFleet) -> None:
    r = dp_fleet.replicas[0]
    base = int(r.events.rsplit(":", 1)[1])
    ctx = zmq.Context.instance()
    subs = []
    for rank in (0, 1):
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"tcp://127.0.0.1:{base + rank}")
        subs.append(sub)
    try:
        time.sleep(0.3)  # let the SUB sockets join before publishing
        resp = _complete(r.url, "pinned to one " * 20, "1")
        assert resp.status_code == 200, resp.text
        assert resp.headers["x-sim-data-parallel-rank"] == "1"
        assert subs[1].poll(5000), "rank 1 published nothing"
        batch = decode_batch(decode_frames(subs[1].recv_multipart()).payload)
        assert batch.data_parallel_rank == 1 and batch.events
        assert not subs[0].poll(300), "rank 0 published for a request pinned to rank 1"
    finally:
        for sub in subs:
            sub.close()
    assert _complete(r.url, "again " * 20, "0").headers["x-sim-data-parallel-rank"] == "0"


def test_bad_rank_headers_as_vllm(dp_fleet: SimFleet) -> None:
    url = dp_fleet.replicas[0].url
    resp = _complete(url, "out of range", "2")
    assert resp.status_code == 400
    err = resp.json()["error"]
    assert err["message"] == "data_parallel_rank 2 is out of range [0, 2)."
    assert err["code"] == 400 and err["type"] == "BadRequestError"
    # Not an integer: vLLM ignores the header and balances.
    assert _complete(url, "not a rank", "one").status_code == 200


def test_without_header_the_least_loaded_engine_serves(dp_fleet: SimFleet) -> None:
    url = dp_fleet.replicas[0].url

    async def two_at_once() -> list[str]:
        async with httpx.AsyncClient(timeout=30) as client:
            body = {"model": "kvroute-sim", "max_tokens": 40}
            resps = await asyncio.gather(
                *(
                    client.post(f"{url}/v1/completions", json=body | {"prompt": f"load {i} " * 30})
                    for i in range(2)
                )
            )
        return sorted(r.headers["x-sim-data-parallel-rank"] for r in resps)

    assert asyncio.run(two_at_once()) == ["0", "1"]


def test_metrics_carry_each_engine_under_its_label(dp_fleet: SimFleet) -> None:
    page = httpx.get(f"{dp_fleet.replicas[0].url}/metrics", timeout=5).text
    assert page.count("# TYPE vllm:num_requests_running gauge") == 1
    assert set(parse_vllm_metrics_by_engine(page)) == {"0", "1"}
    assert 'vllm:prefix_cache_queries_total{engine="1",model_name="kvroute-sim"}' in page


def test_restarting_one_rank_starts_its_sequence_over(dp_fleet: SimFleet) -> None:
    r = dp_fleet.replicas[0]
    _complete(r.url, "before the restart " * 10, "1")
    assert dp_fleet.cache_contents(f"{r.name}#dp1")["batches_published"] > 0
    zero = dp_fleet.cache_contents(f"{r.name}#dp0")
    dp_fleet.restart(f"{r.name}#dp1")
    one = dp_fleet.cache_contents(f"{r.name}#dp1")
    assert one["batches_published"] == 0 and one["GPU"] == []
    assert dp_fleet.cache_contents(f"{r.name}#dp0")["GPU"] == zero["GPU"]
    # The server still answers on both ranks.
    assert _complete(r.url, "after the restart", "1").status_code == 200
