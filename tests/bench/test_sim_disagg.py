"""The simulator's P/D (bench/sim/disagg.py), two replicas in-process over HTTP: a prefill
leg answers vLLM's transfer parameters and holds its blocks until the decode pulls them or
the lease ends; the decode leg pulls at the transfer rate, caches and announces the pulled
blocks and reports the prefill's cached tokens; a pull that cannot happen is recomputed."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvroute.bench.sim.disagg import BOARD
from kvroute.bench.sim.dp import make_server
from kvroute.bench.sim.latency import LatencyModel
from kvroute.bench.sim.replica import SimReplica, SimReplicaConfig
from kvroute.bench.sim.tokenizer import SimTokenizer
from kvroute.deploy.tiny_model import build_tiny_model
from kvroute.indexer.wire import BlockStored, Medium

PROMPT = "The prefill replica computes this prompt and the decode replica pulls it. " * 6
# Prefill costs 10x the pull per token; the clock is 100x fast, and nothing else costs.
LATENCY = LatencyModel(
    prefill_s_per_token=5e-2,
    load_cpu_s_per_token=0.0,
    load_storage_s_per_token=0.0,
    decode_s_per_step=0.0,
    decode_s_per_seq=0.0,
    transfer_s_per_token=5e-3,
    time_scale=0.01,
)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> SimTokenizer:
    model_dir = build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", weights=False)
    return SimTokenizer(Path(model_dir))


Scenario = Callable[[SimReplica, SimReplica, httpx.AsyncClient], Awaitable[None]]


def _serve(tokenizer: SimTokenizer, scenario: Scenario, **config: Any) -> None:
    """Run ``scenario`` on a prefill and a decode replica (both with the NIXL-like
    connector), started fresh."""

    async def go() -> None:
        replicas = []
        for name in ("p", "d"):
            replica = make_server(
                SimReplicaConfig(
                    name=name,
                    latency=LATENCY,
                    stream_interval_s=0.0,
                    default_max_tokens=3,
                    **config,
                ),
                tokenizer,
            )
            assert isinstance(replica, SimReplica)
            await replica.start()
            replicas.append(replica)
        try:
            async with httpx.AsyncClient(timeout=10) as client:
                await scenario(replicas[0], replicas[1], client)
        finally:
            for replica in replicas:
                await replica.stop()

    asyncio.run(go())


async def _prefill(client: httpx.AsyncClient, p: SimReplica) -> dict[str, Any]:
    body = {
        "model": "kvroute-sim",
        "prompt": PROMPT,
        "max_tokens": 1,
        "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False},
    }
    answer = (await client.post(f"{p.url}/v1/completions", json=body)).json()
    return answer


async def _decode(
    client: httpx.AsyncClient, d: SimReplica, params: dict[str, Any] | None, prompt: str = PROMPT
) -> tuple[dict[str, Any], float]:
    body: dict[str, Any] = {"model": "kvroute-sim", "prompt": prompt, "max_tokens": 3}
    if params is not None:
        body["kv_transfer_params"] = params
    loop = asyncio.get_running_loop()
    started = loop.time()
    answer = (await client.post(f"{d.url}/v1/completions", json=body)).json()
    return answer, (loop.time() - started) / LATENCY.time_scale


@pytest.mark.solo  # the pull's time against a recompute's: with nothing else on the cores
def test_the_decode_pulls_the_prefills_blocks_caches_and_announces_them(
    tokenizer: SimTokenizer,
) -> None:
    async def scenario(p: SimReplica, d: SimReplica, client: httpx.AsyncClient) -> None:
        answer = await _prefill(client, p)
        params = answer["kv_transfer_params"]
        assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
        assert params["remote_engine_id"] == p.engine_id and params["remote_host"] == "localhost"
        assert {"remote_request_id", "remote_block_ids", "remote_port", "tp_size"} <= set(params)
        held = p.scheduler._held  # the prefill keeps its blocks for the pull
        assert len(held) == 1
        prompt_tokens = answer["usage"]["prompt_tokens"]
        stored: list[BlockStored] = []
        publish = d.scheduler._publish  # what the engine publishes on its KV event stream
        d.scheduler._publish = lambda events: (stored.extend(events), publish(events))
        pulls = BOARD.pulls
        pulled, seconds = await _decode(client, d, params)
        assert BOARD.pulls == pulls + 1
        assert not held  # pulled: the prefill let its blocks go
        # The prefill's cached tokens (none: a new prompt) are what the decode reports.
        assert pulled["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        # Pulled at the transfer rate, 10x cheaper than computing a prompt as long.
        _, computed = await _decode(client, d, None, PROMPT.replace("The", "A", 1))
        assert seconds < 0.6 * computed
        full = (prompt_tokens // 16) * 16
        gpu_stored = sum(
            len(e.block_hashes)
            for e in stored
            if isinstance(e, BlockStored) and e.medium is Medium.GPU
        )
        assert gpu_stored >= full // 16
        again, _ = await _decode(client, d, None)  # the pulled blocks are the decode's own now
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == (
            (prompt_tokens - 1) // 16 * 16
        )

    _serve(tokenizer, scenario)


def test_a_pull_that_cannot_happen_is_recomputed_and_counted(tokenizer: SimTokenizer) -> None:
    async def scenario(p: SimReplica, d: SimReplica, client: httpx.AsyncClient) -> None:
        params = (await _prefill(client, p))["kv_transfer_params"]
        await _decode(client, d, params)
        failures = BOARD.failures
        answer, _ = await _decode(client, d, params)  # the lease was used up
        assert answer["choices"][0]["text"] and BOARD.failures == failures + 1
        params = (await _prefill(client, p))["kv_transfer_params"]
        await p.kill()  # the prefill process died: its side channel is gone
        answer, _ = await _decode(client, d, {**params})
        assert answer["choices"][0]["text"] and BOARD.failures == failures + 2

    _serve(tokenizer, scenario)


def test_an_unpulled_lease_ends_and_frees_the_blocks(tokenizer: SimTokenizer) -> None:
    async def scenario(p: SimReplica, d: SimReplica, client: httpx.AsyncClient) -> None:
        expired = BOARD.expired
        params = (await _prefill(client, p))["kv_transfer_params"]
        assert len(p.scheduler._held) == 1
        await asyncio.sleep(3 * LATENCY.time_scale)  # the lease: 1 simulated second
        assert not p.scheduler._held and BOARD.expired == expired + 1
        failures = BOARD.failures
        await _decode(client, d, params)
        assert BOARD.failures == failures + 1

    _serve(tokenizer, scenario, pd_lease_s=1.0)


def test_a_replica_without_the_connector_answers_no_transfer_params(
    tokenizer: SimTokenizer,
) -> None:
    async def scenario(p: SimReplica, d: SimReplica, client: httpx.AsyncClient) -> None:
        answer = await _prefill(client, p)
        assert answer["kv_transfer_params"] is None and not p.scheduler._held

    _serve(tokenizer, scenario, nixl=False)
