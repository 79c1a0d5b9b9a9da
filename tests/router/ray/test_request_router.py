"""``KVRouteRequestRouter`` without a Ray cluster: fake ``RunningReplica``s advertising event
endpoints, kvroute's own publisher (vLLM's wire format) on real ZMQ sockets on 127.0.0.1, and
the router's hooks called as Serve calls them."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("ray.serve")

from ray.serve._private.common import (
    DeploymentHandleSource,
    DeploymentID,
    ReplicaID,
    RequestMetadata,
)
from ray.serve.request_router import PendingRequest

from kvroute.indexer.publisher import EventPublisher
from kvroute.indexer.wire import Medium
from kvroute.router.ray.endpoints import METADATA_KEY, RAY_METADATA_KEY
from kvroute.router.ray.request_router import KVRouteRequestRouter
from kvroute.router.tokens.requests import parse_body
from tests.indexer.builders import BS, stored
from tests.waiting import wait_until

DEPLOYMENT = DeploymentID(name="LLMServer:tiny", app_name="llm")
SYSTEM = "You are a careful assistant who answers in one short sentence. " * 12


@dataclass
class FakeReplica:
    """What the router reads of Serve's ``RunningReplica``."""

    name: str
    replica_metadata: dict[str, Any] = field(default_factory=dict)
    routing_stats: dict[str, Any] = field(default_factory=dict)
    max_ongoing_requests: int = 64
    node_id: str = "node-1"
    availability_zone: str | None = None
    multiplexed_model_ids: set[str] = field(default_factory=set)

    @property
    def replica_id(self) -> ReplicaID:
        return ReplicaID(self.name, DEPLOYMENT)

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return 0


def _advertise(pub: EventPublisher, *, ray_style: bool = False) -> dict[str, Any]:
    entry = {"endpoint": pub.endpoint, "replay_endpoint": pub.replay_endpoint, "block_size": BS}
    if ray_style:
        return {RAY_METADATA_KEY: {**entry, "dp_rank": 0, "max_num_batched_tokens": 2048}}
    return {METADATA_KEY: {**entry, "topic": pub.topic}}


def _chat(question: str) -> dict[str, Any]:
    return {
        "model": "tiny",
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        "max_tokens": 4,
    }


def _pending(body: Any, request_id: str) -> PendingRequest:
    meta = RequestMetadata(request_id=request_id, internal_request_id=request_id)
    return PendingRequest(args=[body, None], kwargs={}, metadata=meta)


@pytest.fixture
def publishers() -> Iterator[list[EventPublisher]]:
    pubs = [
        EventPublisher(
            "tcp://127.0.0.1:0",
            replay_endpoint="tcp://127.0.0.1:0",
            topic=f"kv@r{i}@tiny",
            bind=True,
        )
        for i in range(3)
    ]
    yield pubs
    for p in pubs:
        p.close()


def _router(tiny_model_dir: Path, log: Path | None = None) -> KVRouteRequestRouter:
    router = KVRouteRequestRouter(
        deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.REPLICA
    )
    router.initialize_state(
        tokenizer=str(tiny_model_dir),
        decision_log=None if log is None else str(log),
        settings={"hint_ttl_s": 0.0},
    )
    return router


async def _tokens(router: KVRouteRequestRouter, body: dict[str, Any]) -> list[int]:
    await router.fleet._tokenizer()
    parsed = parse_body(json.dumps(body).encode(), "chat")
    tokens = await router.fleet.router.tokens(parsed)
    assert tokens is not None
    return tokens


def test_follow_ups_go_to_the_replica_whose_events_hold_the_prefix(
    tiny_model_dir: Path, publishers: list[EventPublisher], tmp_path: Path
) -> None:
    async def main() -> None:
        router = _router(tiny_model_dir, tmp_path / "decisions.jsonl")
        # r2 speaks Ray's own advertisement (routing stats), the others kvroute's.
        replicas = [
            FakeReplica("r0", replica_metadata=_advertise(publishers[0])),
            FakeReplica("r1", replica_metadata=_advertise(publishers[1])),
            FakeReplica("r2", routing_stats=_advertise(publishers[2], ray_style=True)),
        ]
        router.update_replicas(replicas)  # type: ignore[arg-type]
        try:
            first = _chat("What is a KV cache?")
            tokens = await _tokens(router, first)
            blocks = (len(tokens) - 1) // BS
            # The conversation was computed on r1 (its events say so), r2 holds a CPU copy
            # of its first half (Ray-style stream: no topic).
            publishers[1].publish([stored(tokens, 0, blocks)])
            publishers[2].publish([stored(tokens, 0, blocks // 2, Medium.CPU)])
            wait_until(lambda: router.stats()["fleet"]["entries"] >= blocks + blocks // 2)
            stats = router.stats()
            assert stats["replicas"]["r2"]["events"]["from"] == RAY_METADATA_KEY
            assert stats["replicas"]["r1"]["events"]["topic"] == "kv@r1@tiny"

            follow = _chat("What is a KV cache?")  # the same turn again: a full-prefix hit
            pending = _pending(follow, "req-1")
            groups = await router.choose_replicas(replicas, pending)  # type: ignore[arg-type]
            assert [r.name for r in groups[0]] == ["r1"]
            assert [r.name for g in groups for r in g] == ["r1", "r2", "r0"]
            router.on_request_routed(pending, replicas[1].replica_id, None)  # type: ignore[arg-type]
            assert router.fleet.replicas["r1"].in_flight == 1
            router.on_request_completed(replicas[1].replica_id, "req-1")
            assert router.fleet.replicas["r1"].in_flight == 0
            # A rejected send completes without having been routed: nothing to give back.
            router.on_request_completed(replicas[1].replica_id, "never-routed")
            assert router.fleet.replicas["r1"].in_flight == 0

            entry = router.stats()["recent"][-1]
            assert entry["chosen"] == "r1" and entry["reason"] == "prefix"
            assert entry["predicted_cached_tokens"] == blocks * BS
            assert entry["candidates"]["r2"]["predicted_cached_tokens"] == (blocks // 2) * BS
            assert entry["tokens_by_tier"] == {"GPU": blocks * BS}
            logged = [json.loads(line) for line in (tmp_path / "decisions.jsonl").open()]
            assert logged[-1]["request_id"] == "req-1" and logged[-1]["chosen"] == "r1"
        finally:
            router.fleet.close()

    asyncio.run(main())


def test_replica_set_changes_subscribe_and_forget(
    tiny_model_dir: Path, publishers: list[EventPublisher]
) -> None:
    async def main() -> None:
        router = _router(tiny_model_dir)
        a = FakeReplica("a", replica_metadata=_advertise(publishers[0]))
        b = FakeReplica("b", replica_metadata=_advertise(publishers[1]))
        router.update_replicas([a, b])  # type: ignore[list-item]
        try:
            tokens = await _tokens(router, _chat("hello"))
            publishers[0].publish([stored(tokens, 0, 4)])
            publishers[1].publish([stored(tokens, 0, 2)])
            wait_until(lambda: router.stats()["fleet"]["entries"] == 6)
            assert router.fleet.subscriber.freshness("a")[0] == "live"

            # b leaves the deployment: its feed stops, its entries go.
            router.update_replicas([a])  # type: ignore[list-item]
            wait_until(lambda: router.stats()["fleet"]["entries"] == 4)
            assert set(router.stats()["replicas"]) == {"a"}
            assert {s.replica for s in router.fleet.subscriber.sources()} == {"a"}

            # a dies: forgotten at once, though Serve has not sent a new replica set yet.
            router.on_replica_actor_died(a.replica_id)
            wait_until(lambda: router.stats()["fleet"]["entries"] == 0)
            assert router.stats()["replicas"] == {}

            # A replacement that advertises no events yet is routed by load, then subscribed
            # to once its routing stats show its stream (polled by Serve, no new replica set).
            c = FakeReplica("c")
            router.update_replicas([c])  # type: ignore[list-item]
            assert router.stats()["replicas"]["c"]["events"] is None
            c.routing_stats = _advertise(publishers[2])
            groups = await router.choose_replicas([c], _pending(_chat("hi"), "x"))  # type: ignore[list-item]
            assert [[r.name for r in g] for g in groups] == [["c"]]
            assert router.stats()["replicas"]["c"]["events"]["endpoint"] == publishers[2].endpoint
        finally:
            router.fleet.close()

    asyncio.run(main())


def test_what_it_cannot_parse_is_routed_by_load(tiny_model_dir: Path) -> None:
    async def main() -> None:
        router = _router(tiny_model_dir)
        replicas = [FakeReplica("a"), FakeReplica("b")]
        router.update_replicas(replicas)  # type: ignore[arg-type]
        try:
            for body in ({"model": "tiny"}, "not a request", {"messages": "x"}):
                groups = await router.choose_replicas(replicas, _pending(body, "q"))  # type: ignore[arg-type]
                assert groups == [replicas]
            assert await router.choose_replicas(replicas, None) == [replicas]  # type: ignore[arg-type]
            assert router.stats()["routed_by_load"] == 3
        finally:
            router.fleet.close()

    asyncio.run(main())


def test_the_direct_streaming_path_namespace_and_token_ids(
    tiny_model_dir: Path, publishers: list[EventPublisher]
) -> None:
    """Ray's ``LLMRouter`` (direct streaming) hands the body as a namespace of its fields,
    and the prompt's ids as ``request_token_ids`` when its tokenizer ran."""

    async def main() -> None:
        router = _router(tiny_model_dir)
        replicas = [
            FakeReplica(f"r{i}", replica_metadata=_advertise(publishers[i])) for i in range(2)
        ]
        router.update_replicas(replicas)  # type: ignore[arg-type]
        try:
            body = _chat("Where does the prefix live?")
            tokens = await _tokens(router, body)
            publishers[1].publish([stored(tokens, 0, (len(tokens) - 1) // BS)])
            wait_until(lambda: router.stats()["fleet"]["entries"] > 0)
            groups = await router.choose_replicas(replicas, _pending(SimpleNamespace(**body), "a"))  # type: ignore[arg-type]
            assert groups[0][0].name == "r1"
            ids = {"model": "tiny", "messages": [{"role": "user", "content": "unrelated"}]}
            pending = _pending(SimpleNamespace(**ids), "b")
            pending.kwargs["request_token_ids"] = tokens  # the ids win over the text
            groups = await router.choose_replicas(replicas, pending)  # type: ignore[arg-type]
            assert groups[0][0].name == "r1"
            assert router.stats()["recent"] == []  # nothing routed yet: decisions only
        finally:
            router.fleet.close()

    asyncio.run(main())
