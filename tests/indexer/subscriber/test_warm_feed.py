"""A feed seeded from a peer's snapshot, over real ZMQ sockets on 127.0.0.1: it replays only
the batches after the snapshot, and drops the snapshot (clear, replay from 0) when the replica
is not the process the snapshot saw or its replay cannot confirm it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import msgspec
import pytest
import xxhash

from kvroute.bench.publisher import EventPublisher
from kvroute.indexer.index import InMemoryPrefixIndex
from kvroute.indexer.keys import RequestKeys
from kvroute.indexer.subscriber import (
    EventSource,
    EventSubscriber,
    Freshness,
    ReplicaFeed,
    ReplicaSnapshot,
)
from kvroute.indexer.wire import Frame, Medium, decode_batch, encode_batch
from tests.indexer.builders import DOC, OTHER, removed, stored
from tests.waiting import wait_until

TOPIC = "kv@127.0.0.1:8000@tiny"


def publisher() -> EventPublisher:
    return EventPublisher(
        "tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0", topic=TOPIC, bind=True
    )


def source(pub: EventPublisher) -> EventSource:
    return EventSource("r1", pub.endpoint, pub.replay_endpoint, TOPIC)


Make = Callable[[], tuple[InMemoryPrefixIndex, EventSubscriber]]


@pytest.fixture
def subscribers() -> Iterator[Make]:
    made: list[EventSubscriber] = []

    def make() -> tuple[InMemoryPrefixIndex, EventSubscriber]:
        index = InMemoryPrefixIndex()
        sub = EventSubscriber(index, replay_timeout_s=1.0, stale_clear_after_s=5.0)
        made.append(sub)
        return index, sub

    yield make
    for sub in made:
        sub.close()


def blocks(index: InMemoryPrefixIndex, tokens: list[int] = DOC) -> int:
    match = index.lookup(RequestKeys(tokens)).get("r1")
    return 0 if match is None else match.blocks


def live_snapshot(sub: EventSubscriber) -> ReplicaSnapshot:
    wait_until(lambda: sub.freshness("r1")[0] is Freshness.LIVE)
    snap = sub.export_replica("r1")
    assert snap is not None
    # As a peer receives it: through msgpack.
    state = msgspec.msgpack.decode(msgspec.msgpack.encode(snap.state), type=type(snap.state))
    return dataclasses.replace(snap, state=state)


def test_a_seeded_feed_replays_only_the_gap(subscribers: Make) -> None:
    with publisher() as pub:
        first_index, first = subscribers()
        for b in range(4):
            pub.publish([stored(DOC, 2 * b, 2)])  # seqs 0..3
        first.add_source(source(pub))
        wait_until(lambda: blocks(first_index) == 8)
        snap = live_snapshot(first)
        assert snap.last_seq == 3 and snap.state.entries == 8
        pub.publish([removed(DOC, [7])])  # seqs 4, 5: the gap
        pub.publish([stored(DOC, 7, 1, Medium.CPU)])
        wait_until(lambda: first.feed_stats()["r1"].last_seq == 5)

        index, sub = subscribers()
        assert sub.seed_replica("r1", source(pub), snap)
        assert blocks(index) == 8  # imported before the feed even connects
        wait_until(lambda: sub.freshness("r1")[0] is Freshness.LIVE)
        warm = sub.warm_outcomes()["r1"]
        assert (warm.outcome, warm.snapshot_seq, warm.gap_batches) == ("verified", 3, 2)
        stats = sub.feed_stats()["r1"]
        assert stats.batches == 2 and stats.last_seq == 5 and stats.resets == 0
        for tokens in (DOC, OTHER):
            assert index.lookup(RequestKeys(tokens)) == first_index.lookup(RequestKeys(tokens))
        assert index.block_tiers("r1", DOC)[7] == {"CPU"}
        pub.publish([removed(DOC, [6, 7], Medium.GPU)])  # seq 6: live, for both
        wait_until(lambda: index.block_tiers("r1", DOC)[6] == set())
        wait_until(lambda: index.lookup(RequestKeys(DOC)) == first_index.lookup(RequestKeys(DOC)))
        assert sub.feed_stats()["r1"].duplicates == 0


def test_a_replica_that_restarted_since_the_snapshot_is_replayed_from_zero(
    subscribers: Make,
) -> None:
    """The new process has published as many batches as the old one had, so its sequence
    never went backwards: only the digest of the snapshot's last batch tells them apart."""
    with publisher() as old, publisher() as new:
        _, first = subscribers()
        for b in range(3):
            old.publish([stored(DOC, 2 * b, 2)])
        first.add_source(source(old))
        snap = live_snapshot(first)
        for b in range(5):
            new.publish([stored(OTHER, b, 1)])  # seqs 0..4, another history
        # The same replica, its endpoints now served by the new process.
        restarted = dataclasses.replace(snap, source=source(new))
        index, sub = subscribers()
        assert sub.seed_replica("r1", source(new), restarted)
        wait_until(lambda: sub.warm_outcomes()["r1"].outcome != "pending")
        assert sub.warm_outcomes()["r1"].outcome.startswith("replica restarted")
        wait_until(lambda: sub.freshness("r1")[0] is Freshness.LIVE)
        assert blocks(index, OTHER) == 5
        assert index.block_tiers("r1", DOC)[2:] == [set()] * 6  # the old process's blocks
        assert sub.feed_stats()["r1"].resets == 1


def test_a_snapshot_the_replay_cannot_confirm_is_dropped(subscribers: Make) -> None:
    with publisher() as pub:
        _, first = subscribers()
        pub.publish([stored(DOC, 0, 8)])
        first.add_source(source(pub))
        snap = live_snapshot(first)
        # A replay endpoint nobody answers on: the snapshot cannot be checked.
        silent = EventSource("r1", pub.endpoint, "tcp://127.0.0.1:9", TOPIC)
        index, sub = subscribers()
        assert sub.seed_replica("r1", silent, dataclasses.replace(snap, source=silent))
        wait_until(lambda: sub.warm_outcomes()["r1"].outcome != "pending")
        assert sub.warm_outcomes()["r1"].outcome == "replay unavailable: snapshot dropped"
        assert blocks(index) == 0  # nothing unconfirmed is believed
        pub.publish([stored(OTHER, 0, 8)])  # live events rebuild it the normal way
        wait_until(lambda: blocks(index, OTHER) == 8)
        assert sub.freshness("r1")[0] is Freshness.REBUILDING


def test_a_forged_snapshot_is_refused_and_the_feed_starts_by_replay(subscribers: Make) -> None:
    with publisher() as pub:
        _, first = subscribers()
        pub.publish([stored(DOC, 0, 8)])
        first.add_source(source(pub))
        snap = live_snapshot(first)
        forged = dataclasses.replace(
            snap, state=msgspec.structs.replace(snap.state, tier_counts=[999, 0, 0, 0, 0, 0])
        )
        index, sub = subscribers()
        assert not sub.seed_replica("r1", source(pub), forged)
        assert index.replicas() == []
        sub.add_source(source(pub))  # what the router does next
        wait_until(lambda: blocks(index) == 8)
        assert "r1" not in sub.warm_outcomes()
        assert sub.feed_stats()["r1"].replays == 1


def test_a_seeded_feed_cleared_before_its_check_keeps_nothing_of_the_snapshot() -> None:
    """The router saw the replica die before the feed connected: the check must not then
    bless an index that no longer holds the snapshot. (The state machine alone, its replay
    hook answering from a list: no socket needed to order these two events.)"""
    frames = [Frame(TOPIC, seq, encode_batch([stored(DOC, seq, 1)], ts=0.0)) for seq in range(4)]
    first = InMemoryPrefixIndex()
    for frame in frames[:3]:
        first.apply("r1", decode_batch(frame.payload).events)
    state = first.export_replica("r1")
    assert state is not None
    index = InMemoryPrefixIndex()
    index.import_replica("r1", state)
    src = EventSource("r1", "tcp://127.0.0.1:1", "tcp://127.0.0.1:2", TOPIC)
    feed = ReplicaFeed(src, index, replay=lambda start: [f for f in frames if f.seq >= start])
    feed.seed(2, xxhash.xxh3_64_intdigest(frames[2].payload))
    feed.on_replica_down("health check failed")
    assert feed.warm is not None and feed.warm.outcome == "cleared before it was checked"
    feed.on_connected()
    assert blocks(index) == 0  # not the snapshot's 3 blocks plus the gap's 1
    assert feed.stats.freshness is Freshness.REBUILDING


def test_the_check_applies_the_gap_through_the_replay_hook() -> None:
    frames = [Frame(TOPIC, seq, encode_batch([stored(DOC, seq, 1)], ts=0.0)) for seq in range(5)]
    first = InMemoryPrefixIndex()
    for frame in frames[:3]:
        first.apply("r1", decode_batch(frame.payload).events)
    state = first.export_replica("r1")
    assert state is not None
    index = InMemoryPrefixIndex()
    index.import_replica("r1", state)
    asked: list[int] = []

    def replay(start: int) -> list[Frame]:
        asked.append(start)
        return [f for f in frames if f.seq >= start]

    src = EventSource("r1", "tcp://127.0.0.1:1", "tcp://127.0.0.1:2", TOPIC)
    feed = ReplicaFeed(src, index, replay=replay)
    feed.seed(2, xxhash.xxh3_64_intdigest(frames[2].payload))
    feed.handle(frames[4])  # a live batch before the connection's event: checked first
    assert asked == [2]
    assert blocks(index) == 5 and feed.stats.batches == 2 and feed.stats.duplicates == 1
    assert feed.warm is not None and feed.warm.gap_batches == 2
