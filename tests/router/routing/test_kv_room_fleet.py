"""The wait for device room, end to end: a router process (as ``kvroute serve`` runs it) in
front of two simulated replicas (bench/sim: vLLM's API, metrics and KV events; its scheduler
admits a request only when the device cache has blocks for its prompt and output).

One replica holds a prefix and is decoding a long answer on it that leaves too little of its
small device cache for a second request on the same prefix: that one would wait for the
first to finish (seconds) to save recomputing 21 blocks (milliseconds). With the room
counted (``cost.kv_room``, the default) the router sends it to the other replica; with it
off, the cache hit wins and the request waits: the same fleet and requests, both ways. A
second router, a peer of the first (shared load), knows what the first one's requests hold
(router/peers/load.py) and places the request the same way.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from kvroute.bench.sim.fleet import SimFleet, SimFleetConfig
from kvroute.bench.sim.latency import LatencyModel
from kvroute.deploy.router_process import RouterProcess

MODEL = "kvroute-sim"
BS = 16
PREFIX = [100 + i for i in range(20 * BS)]  # 20 blocks


@pytest.fixture(scope="module")
def fleet() -> Iterator[SimFleet]:
    config = SimFleetConfig(
        replicas=2,
        block_size=BS,
        # 40 blocks: the long answer holds 34 (its 21 prompt blocks and 200 output tokens),
        # 85% of the cache (under the 90% where the pressure term starts), and leaves 6 for
        # a second request that needs 8 beyond the shared prefix.
        gpu_blocks=40,
        cpu_blocks=200,
        max_num_seqs=8,
        max_model_len=2048,
        latency=LatencyModel(prefill_s_per_token=1e-4, decode_s_per_step=0.01),
        stream_interval_s=0.002,
    )
    with SimFleet(config) as f:
        yield f


def _complete(client: httpx.Client, prompt: list[int], max_tokens: int) -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
    resp = client.post("/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    return resp


@pytest.mark.parametrize(("kv_room", "via_peer"), [(True, False), (False, False), (True, True)])
def test_a_request_that_would_wait_for_room_goes_where_there_is_room(
    fleet: SimFleet, kv_room: bool, via_peer: bool
) -> None:
    fleet.reset_caches()
    settings = fleet.router_settings(health_interval_s=0.2, cost={"kv_room": kv_room})
    with contextlib.ExitStack() as stack:
        proc = stack.enter_context(RouterProcess(settings))
        assert proc.wait_feeds_settled(30)
        second = proc
        if via_peer:
            second = stack.enter_context(RouterProcess({**settings, "peers": [proc.url]}))
            assert second.wait_feeds_settled(30)
        with (
            httpx.Client(base_url=proc.url, timeout=30) as client,
            httpx.Client(base_url=second.url, timeout=30) as other_client,
        ):
            holder = _complete(client, PREFIX + [7] * BS, 2).headers["x-kvroute-replica"]
            other = next(r.name for r in fleet.replicas if r.name != holder)
            # the router knows the prefix is there (the holder's events), from both routers
            deadline = time.monotonic() + 10
            while True:
                stats = other_client.get("/index/stats").json()["replicas"]
                if sum((stats[holder].get("entries_by_tier") or {}).values()) >= 20:
                    break
                assert time.monotonic() < deadline, stats
                time.sleep(0.1)
            # the router learns each cache's size from the replicas' metrics pages
            deadline = time.monotonic() + 10
            while True:
                stats = other_client.get("/index/stats").json()["replicas"]
                if all(e["load"]["kv_cache_blocks"] == 40 for e in stats.values()):
                    break
                assert time.monotonic() < deadline, stats
                time.sleep(0.1)

            # the long answer on the prefix: 200 tokens at 10 ms, about 2 s of decoding
            first_byte = threading.Event()
            long_done: list[str] = []

            def long_answer() -> None:
                body = {
                    "model": MODEL,
                    "prompt": PREFIX + [8] * BS,
                    "max_tokens": 200,
                    "ignore_eos": True,
                    "stream": True,
                }
                with client.stream("POST", "/v1/completions", json=body) as resp:
                    long_done.append(resp.headers["x-kvroute-replica"])
                    for _ in resp.iter_bytes():
                        first_byte.set()

            thread = threading.Thread(target=long_answer)
            thread.start()
            try:
                assert first_byte.wait(10)
                assert long_done == [holder]  # its prefix is there
                time.sleep(0.3)  # a scrape sees it decoding
                if via_peer:  # the first router's holdings, as its peer heard them
                    load = other_client.get("/index/stats").json()["replicas"][holder]["load"]
                    assert load["peer_kv_held_blocks"] >= 30, load
                sent = time.monotonic()
                resp = _complete(other_client, PREFIX + [9] * BS, 100)
                took = time.monotonic() - sent
                chosen = resp.headers["x-kvroute-replica"]
            finally:
                thread.join(30)
    if kv_room:
        assert chosen == other, f"sent to the full holder, waited {took:.2f} s"
        assert took < 1.5
    else:  # the cache hit wins, and the request waits for the long answer's blocks
        assert chosen == holder
        assert took > 1.0
