"""llm-d's shared PVC as a storage domain, end to end: a prompt writer pod r0 stored on the PVC
(llm-d's FS backend, on its own socket) is a hit for pod r1 of the same layout, which never
wrote it; a pod of another layout (r2, TP=2) sees none of it; llm-d's PVC evictor, on a stream
of its own, takes a chunk out again.

Real parts: simulated vLLM replicas over HTTP, the router as ``kvroute serve`` runs it, ZMQ
on 127.0.0.1. r0's vLLM stream is scripted in vLLM's wire format (its device stores of the
prompt); its FS stream and the evictor's stream send, byte for byte, the frames llm-d's own
``StorageEventPublisher`` and ``delete_file_batch`` sent (tests/fixtures/llmd_pvc).
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvroute.indexer.publisher import EventPublisher
from kvroute.indexer.wire import BlockStored, Medium
from kvroute.router.app import create_app
from kvroute.router.config import ReplicaConfig, RouterSettings, StorageDomainConfig
from kvroute.router.serving.http_protocol import header_deadline_protocol
from kvroute.router.tokens.tokenization import LocalTokenizer
from tests.router.servers import ServerThread, wait_until
from tests.router.sim_replica import SimServer

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "llmd_pvc" / "llmd_pvc.json"
DOC = json.loads(FIXTURE.read_text())
CASE = DOC["cases"]["short_hashes"]
BS = DOC["block_size"]  # 16, the simulated replicas' block size too
W = [7 + (i * 13) % 450 for i in range(8 * BS)]
P = [11 + (i * 7) % 470 for i in range(16 * BS)]


def _frames(frame: dict) -> list[bytes]:
    return [
        frame["topic"].encode(),
        frame["seq"].to_bytes(8, "big"),
        base64.b64decode(frame["payload_b64"]),
    ]


@pytest.fixture
def pvc_fleet(local_tokenizer: LocalTokenizer) -> Iterator[tuple[str, list[EventPublisher]]]:
    sims = [SimServer(f"r{i}", local_tokenizer.name) for i in range(3)]
    vllm = EventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0", bind=True)
    fs, evictor = (EventPublisher("tcp://127.0.0.1:0", bind=True) for _ in range(2))
    pubs = [vllm, fs, evictor]
    router = None
    layout = CASE["layout"]
    try:
        for s in sims:
            s.start()
        settings = RouterSettings(
            replicas=[
                ReplicaConfig(
                    sims[0].url,
                    events=vllm.endpoint,
                    replay=vllm.replay_endpoint,
                    aux=(fs.endpoint,),
                    name="r0",
                    storage_domain="pvc",
                    layout=layout,
                ),
                ReplicaConfig(sims[1].url, name="r1", storage_domain="pvc", layout=layout),
                ReplicaConfig(sims[2].url, name="r2", storage_domain="pvc", layout="tp2"),
            ],
            storage_domains=[
                StorageDomainConfig(
                    "pvc", evictor.endpoint, topic=CASE["evictor_frames"][0]["topic"]
                )
            ],
            health_interval_s=0.2,
            tokenizer_check_on_start=False,
            hint_ttl_s=0.0,
        )
        router = ServerThread(
            create_app(settings, tokenizer=local_tokenizer),
            http=header_deadline_protocol(settings.header_timeout_s),
        ).start()
        service = router.app.state.service
        wait_until(lambda: len(service.registry.healthy()) == 3)
        # llm-d's sockets have no replay: give the router's SUB sockets time to connect
        time.sleep(1.0)
        # r0 computed W and P (vLLM's stream), then llm-d's FS backend stored their chunks.
        for hashes, tokens in ((DOC["w_hashes"], W), (DOC["p_hashes"], P)):
            vllm.publish(
                [BlockStored(hashes, None, tokens, BS, Medium.GPU, extra_keys=[None] * len(hashes))]
            )
        wait_until(lambda: _stats(router.url)["replicas"]["r0"]["entries"] == 24)
        for frame in CASE["fs_frames"]:
            fs.send_raw(_frames(frame))
        yield router.url, pubs
    finally:
        if router is not None:
            router.stop()
        for p in pubs:
            p.close()
        for s in sims:
            s.close()


def _stats(url: str) -> dict:
    return httpx.get(f"{url}/index/stats", timeout=5).json()


def _views(url: str) -> dict[str, dict]:
    body = {"model": "tiny", "prompt": [*P, 3, 4, 5], "max_tokens": 1}  # P and a short tail
    decision = httpx.post(f"{url}/debug/route", json=body, timeout=10).json()
    return {v["name"]: v for v in decision["replicas"]}


def test_the_pvc_is_a_hit_for_its_layout_and_the_evictor_shrinks_it(
    pvc_fleet: tuple[str, list[EventPublisher]],
) -> None:
    url, (vllm, _, evictor) = pvc_fleet
    key = f"pvc#{CASE['layout']}"
    # W's first chunk came before the chunk length was known: its last block only (4 + 1), P's 16
    wait_until(lambda: _stats(url)["storage_domains"].get(key, {}).get("unconfirmed_blocks") == 21)
    views = _views(url)
    assert views["r1"]["tokens_by_tier"] == {"STORAGE_UNCONFIRMED": 16 * BS}, views["r1"]
    assert views["r2"]["tokens_by_tier"] == {} and views["r2"]["predicted_cached_tokens"] == 0
    stats = _stats(url)
    assert stats["storage_domains"][key]["attached"] == ["r0", "r1"]
    assert stats["storage_domains"][key]["layout"] == CASE["layout"]
    # llm-d's PVC evictor deletes P's last chunk and says so on its own stream
    for frame in CASE["evictor_frames"]:
        evictor.send_raw(_frames(frame))
    wait_until(lambda: _stats(url)["storage_domains"][key]["unconfirmed_blocks"] == 17)
    assert _views(url)["r1"]["tokens_by_tier"] == {"STORAGE_UNCONFIRMED": 12 * BS}
    # r0's vLLM publisher loses a batch at the source (LMCache's tensor path would): counted,
    # nothing cleared, the stream stays live.
    vllm.lose_at_source()
    tokens = list(range(1, 1 + BS))
    vllm.publish([BlockStored([0xC0_0000], None, tokens, BS, Medium.GPU, extra_keys=[None])])
    wait_until(lambda: _stats(url)["fleet"]["lost_batches"] == 1)
    r0 = _stats(url)["replicas"]["r0"]
    assert r0["feed"]["freshness"] == "live" and r0["feed"]["clears"] == 0
    assert r0["entries"] == 25
    metrics = httpx.get(f"{url}/metrics", timeout=5).text
    assert 'kvroute_event_lost_batches_total{replica="r0"} 1.0' in metrics
