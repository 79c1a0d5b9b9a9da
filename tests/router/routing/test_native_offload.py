"""The recommended CUDA setup, end to end: vLLM's native CPU offloading under kvroute's router.

vLLM's ``OffloadingConnector`` refuses the CPU platform (its worker needs CUDA), so its events
cannot come from a running vLLM here. They come from vLLM's own classes instead: the frames of
``tests/fixtures/vllm_events/native_offload_*.json`` are what vLLM 0.32's scheduler, block pool,
OffloadingConnector scheduler and event tracker published in a scripted run
(``test_vllm_fixtures_regenerate.py`` checks they still are). Here they are decoded with vLLM's
own ``KVEventBatch`` decoder and published again by vLLM's own ``ZmqEventPublisher`` on real
ipc:// sockets, to the real router app served over HTTP on 127.0.0.1. The replica's HTTP side
is a simulated replica (``tests.router.sim_replica``), standing in for the vLLM server that cannot
run with that connector here; it only answers health and load checks in this test.

The vLLM flags the docs recommend are also parsed by vLLM's own ``EngineArgs``.
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvroute.router.app import create_app
from kvroute.router.config import ReplicaConfig, RouterSettings
from tests.paths import REPO_ROOT
from tests.router.servers import ServerThread, wait_until
from tests.router.sim_replica import SimServer

pytestmark = pytest.mark.vllm

FIXTURES = REPO_ROOT / "tests" / "fixtures" / "vllm_events"


def _republish(publisher: Any, payload: bytes) -> None:
    import msgspec
    from vllm.distributed.kv_events import KVEventBatch

    publisher.publish(msgspec.msgpack.Decoder(KVEventBatch).decode(payload))


@contextmanager
def _router_on_vllms_publisher(
    local_tokenizer: Any, tmp_path: Path, topic: str
) -> Iterator[tuple[Any, SimServer, ServerThread]]:
    """vLLM's own ``ZmqEventPublisher`` on ipc:// sockets, a simulated replica's HTTP side,
    and the router's app over HTTP subscribed to the publisher, once it is healthy and its
    subscriber has joined."""
    from vllm.distributed.kv_events import ZmqEventPublisher

    events, replay = f"ipc://{tmp_path}/events", f"ipc://{tmp_path}/replay"
    publisher = ZmqEventPublisher(
        data_parallel_rank=0, endpoint=events, replay_endpoint=replay, topic=topic
    )
    server = SimServer("native", local_tokenizer.name).start()
    settings = RouterSettings(
        replicas=[ReplicaConfig(url=server.url, events=events, replay=replay, name="native")],
        health_interval_s=0.2,
        tokenizer_check_on_start=False,
    )
    router = ServerThread(create_app(settings, tokenizer=local_tokenizer)).start()
    try:
        service = router.app.state.service
        wait_until(lambda: len(service.registry.healthy()) == 1, timeout_s=10)
        time.sleep(0.5)  # the router's subscriber joins before the first batch goes out
        yield publisher, server, router
    finally:
        router.stop()
        server.close()
        publisher.shutdown()


@pytest.mark.parametrize(
    "scenario", ["native_offload_bpc4_placeholder", "native_offload_bpc4_selfdescribing"]
)
def test_router_predicts_the_cpu_tier_of_vllms_native_offloading(
    scenario: str, local_tokenizer: Any, tmp_path: Path
) -> None:
    fx = json.loads((FIXTURES / f"{scenario}.json").read_text())
    probe = next(p for p in fx["probes"] if p["label"] == "after filler F3: X")
    assert probe["truth"]["gpu_hit_tokens"] == 0 and probe["truth"]["offload_hit_tokens"] == 64

    topic = fx["config"]["topic"]
    with _router_on_vllms_publisher(local_tokenizer, tmp_path, topic) as (publisher, _, router):
        upto = probe["after_batch"]
        for batch in fx["batches"][: upto + 1]:
            _republish(publisher, base64.b64decode(batch["payload_b64"]))

        def stats() -> dict[str, Any]:
            return httpx.get(f"{router.url}/index/stats", timeout=5).json()["replicas"]["native"]

        wait_until(lambda: stats()["feed"]["batches"] == upto + 1, timeout_s=10)
        entry = stats()
        assert entry["feed"]["events_rejected"] == 0, entry["feed"]
        assert entry["chunk_blocks"] == {"CPU": 4}
        body = {"model": "tiny", "prompt": probe["token_ids"], "max_tokens": 1}
        decision = httpx.post(f"{router.url}/debug/route", json=body, timeout=10).json()
        view = decision["replicas"][0]
        # X left the device; its four blocks are one chunk in vLLM's CPU tier: 64 tokens.
        assert view["tokens_by_tier"] == {"CPU": 64}, view
        assert view["predicted_cached_tokens"] == 64


def test_an_answer_that_proves_the_cpu_tier_reset_drops_its_chunks(
    local_tokenizer: Any, tmp_path: Path
) -> None:
    """A connector reset sent to the replica directly, whose device reset failed, publishes
    nothing: vLLM's OffloadingConnector empties its CPU tier without a word. The replica's
    next answer on those chunks tells: its cached tokens (``usage.prompt_tokens_details``)
    stop where the device's part ends, and the router drops the chunks it predicted from CPU.
    The events are vLLM's own classes, published by vLLM's own publisher as its scheduler
    orders them (a prompt computed, offloaded as one self-describing chunk of four blocks,
    then evicted from the device); the replica answering is the simulated one, whose empty
    cache is what the reset replica holds (mock: vLLM's OffloadingConnector cannot run on
    CPU). The official ``openai`` client sends the requests."""
    import openai
    from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch

    prompt = list(range(10, 80))  # 70 tokens: one chunk of four 16-token blocks, and more
    hashes = [0x5EED0 + i for i in range(4)]
    topic = "kv@native@tiny"
    with _router_on_vllms_publisher(local_tokenizer, tmp_path, topic) as (
        publisher,
        server,
        router,
    ):
        stored = {"parent_block_hash": None, "token_ids": prompt[:64], "block_size": 16}
        for batch in (
            [
                BlockStored(
                    hashes,
                    **stored,
                    lora_id=None,
                    medium="GPU",
                    lora_name=None,
                    extra_keys=[None] * 4,
                )
            ],
            [BlockStored(hashes, **stored, lora_id=None, medium="CPU", lora_name=None)],
            [BlockRemoved(hashes, medium="GPU")],
        ):
            publisher.publish(KVEventBatch(ts=time.time(), events=batch))

        def stats() -> dict[str, Any]:
            return httpx.get(f"{router.url}/index/stats", timeout=5).json()

        wait_until(lambda: stats()["replicas"]["native"]["feed"]["batches"] == 3)
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 1}

        def route() -> dict[str, Any]:
            decision = httpx.post(f"{router.url}/debug/route", json=body, timeout=10).json()
            return decision["replicas"][0]

        assert route()["tokens_by_tier"] == {"CPU": 64}
        assert stats()["fleet"]["refuted_cpu_blocks"] == 0
        client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0)
        # prompt logprobs make vLLM skip the prefix cache: its zero proves nothing
        client.completions.create(
            model="tiny", prompt=prompt, max_tokens=1, extra_body={"prompt_logprobs": 0}
        )
        assert route()["tokens_by_tier"] == {"CPU": 64}
        # ... and cached the prompt on the simulated device: the reset, sent to it directly
        reset = httpx.post(f"{server.url}/reset_prefix_cache", timeout=5)
        assert reset.json() == {"success": True}
        answer = client.completions.create(model="tiny", prompt=prompt, max_tokens=1)
        assert answer.usage is not None and answer.usage.prompt_tokens_details is not None
        assert answer.usage.prompt_tokens_details.cached_tokens == 0
        assert stats()["fleet"]["refuted_cpu_blocks"] == 4  # the one chunk of four blocks
        view = route()
        assert "CPU" not in view["tokens_by_tier"], view


def test_the_documented_native_offloading_flags_parse_in_vllm() -> None:
    """docs/deploy.md's flags, through vLLM's own argument parser and EngineArgs."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    extra = {"cpu_bytes_to_use": 8 << 30, "block_size": 256, "self_describing_kv_events": True}
    args = parser.parse_args(
        [
            "--kv-transfer-config",
            json.dumps(
                {
                    "kv_connector": "OffloadingConnector",
                    "kv_role": "kv_both",
                    "kv_connector_extra_config": extra,
                }
            ),
            "--kv-events-config",
            json.dumps(
                {
                    "enable_kv_cache_events": True,
                    "publisher": "zmq",
                    "endpoint": "tcp://*:5557",
                    "replay_endpoint": "tcp://*:5558",
                }
            ),
        ]
    )
    engine = EngineArgs.from_cli_args(args)
    assert engine.kv_transfer_config.kv_connector == "OffloadingConnector"
    assert engine.kv_transfer_config.kv_connector_extra_config == extra
    assert engine.kv_events_config.enable_kv_cache_events
    short = parser.parse_args(["--kv-offloading-size", "8", "--kv-offloading-backend", "native"])
    engine = EngineArgs.from_cli_args(short)
    assert engine.kv_offloading_size == 8 and engine.kv_offloading_backend == "native"
