"""The subscriber over real ZMQ sockets on 127.0.0.1: ordering, gaps, replay, resets, garbage."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator

import msgspec
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.bench.publisher import EventPublisher
from kvroute.indexer.cpu_priority import BACKGROUND_NICE
from kvroute.indexer.index import InMemoryPrefixIndex
from kvroute.indexer.stats import collect_stats
from kvroute.indexer.subscriber import (
    EventSource,
    EventSubscriber,
    Freshness,
    ReplicaFeed,
    moot_prefix,
)
from kvroute.indexer.subscriber.budget import ByteBudget
from kvroute.indexer.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    Frame,
    Medium,
    decode_batch,
    encode_batch,
    encode_frames,
)
from tests.indexer.builders import BS, DOC, DOCS, ehash, operation, removed, stored, tier_only
from tests.waiting import wait_until

TOPIC = "kv@127.0.0.1:8000@tiny"


def publisher(replay: bool = True, buffer_steps: int = 10_000) -> EventPublisher:
    return EventPublisher(
        "tcp://127.0.0.1:0",
        replay_endpoint="tcp://127.0.0.1:0" if replay else None,
        topic=TOPIC,
        buffer_steps=buffer_steps,
        bind=True,
    )


@pytest.fixture
def index() -> InMemoryPrefixIndex:
    return InMemoryPrefixIndex()


@pytest.fixture
def subscriber(index: InMemoryPrefixIndex) -> Iterator[EventSubscriber]:
    sub = EventSubscriber(index, replay_timeout_s=2.0, stale_clear_after_s=1.0)
    yield sub
    sub.close()


def connect(sub: EventSubscriber, pub: EventPublisher, name: str = "r1") -> None:
    sub.add_source(EventSource(name, pub.endpoint, pub.replay_endpoint, TOPIC))


def blocks(index: InMemoryPrefixIndex, replica: str = "r1") -> int:
    match = index.lookup(DOC).get(replica)
    return 0 if match is None else match.blocks


def test_live_events_are_indexed_in_order_and_late_join_replays(
    index: InMemoryPrefixIndex, subscriber: EventSubscriber
) -> None:
    with publisher() as pub:
        # Published before anyone listens: only the replay socket can deliver these.
        pub.publish([stored(DOC, 0, 2)])
        pub.publish([stored(DOC, 2, 2)])
        connect(subscriber, pub)
        time.sleep(0.3)
        pub.publish([stored(DOC, 4, 1, Medium.CPU)])
        wait_until(lambda: blocks(index) == 5)
        state, reason = subscriber.freshness("r1")
        assert state is Freshness.LIVE, reason
        stats = subscriber.feed_stats()["r1"]
        assert stats.replays == 1 and stats.missed_batches == 0
        pub.publish([removed(DOC, [4], Medium.CPU)])
        wait_until(lambda: blocks(index) == 4)


def test_joining_an_idle_replica_takes_its_history_without_waiting_for_a_batch(
    index: InMemoryPrefixIndex, subscriber: EventSubscriber
) -> None:
    """A router started while the fleet is idle knows the replica's cache at once."""
    with publisher() as pub:
        pub.publish([stored(DOC, 0, 2)])
        pub.publish([stored(DOC, 2, 1, Medium.CPU), stored(DOC, 3, 1, Medium.CPU)])
        connect(subscriber, pub)  # and nothing is published from here on
        wait_until(lambda: blocks(index) == 4)
        state, reason = subscriber.freshness("r1")
        assert state is Freshness.LIVE, reason
        stats = subscriber.feed_stats()["r1"]
        assert stats.replays == 1 and stats.batches == 2 and stats.missed_batches == 0
        pub.publish([removed(DOC, [3], Medium.CPU)])  # seq 2: the next one, applied live
        wait_until(lambda: blocks(index) == 3)
        assert subscriber.feed_stats()["r1"].duplicates == 0


def test_joining_a_replica_that_published_nothing_is_live(
    index: InMemoryPrefixIndex, subscriber: EventSubscriber
) -> None:
    with publisher() as pub:
        connect(subscriber, pub)
        wait_until(lambda: subscriber.freshness("r1")[0] is Freshness.LIVE)
        assert "published nothing" in subscriber.freshness("r1")[1]
        pub.publish([stored(DOC, 0, 2)])  # seq 0
        wait_until(lambda: blocks(index) == 2)
        assert subscriber.feed_stats()["r1"].gaps == 0


def test_gap_is_filled_from_replay(index: InMemoryPrefixIndex, subscriber: EventSubscriber) -> None:
    with publisher() as pub:
        connect(subscriber, pub)
        time.sleep(0.3)
        pub.publish([stored(DOC, 0, 2)])
        wait_until(lambda: blocks(index) == 2)
        pub.publish([stored(DOC, 2, 2)], drop=True)  # lost on the wire, kept for replay
        pub.publish([stored(DOC, 4, 2)])
        wait_until(lambda: blocks(index) == 6)
        stats = subscriber.feed_stats()["r1"]
        # Two replays: the join's (nothing published yet) and the gap's.
        assert stats.gaps == 1 and stats.replays == 2 and stats.events_rejected == 0
        assert subscriber.freshness("r1")[0] is Freshness.LIVE


def test_gap_without_replay_clears_and_rebuilds(
    index: InMemoryPrefixIndex, subscriber: EventSubscriber
) -> None:
    other = list(range(900, 916))
    with publisher(replay=False) as pub:
        connect(subscriber, pub)
        time.sleep(0.3)
        pub.publish([stored(DOC, 0, 4)])
        wait_until(lambda: blocks(index) == 4)
        pub.publish([removed(DOC, [3, 2, 1, 0])], drop=True)  # lost: the index would lie
        pub.publish([stored(other, 0, 2)])
        wait_until(lambda: subscriber.feed_stats()["r1"].replay_failures == 1)
        state, reason = subscriber.freshness("r1")
        assert state is Freshness.REBUILDING and "no replay endpoint" in reason
        assert blocks(index) == 0  # cleared rather than trusting the stale view
        assert index.lookup(other)["r1"].blocks == 2  # rebuilding from live events


def test_replay_that_no_longer_holds_the_gap_clears(
    index: InMemoryPrefixIndex, subscriber: EventSubscriber
) -> None:
    with publisher(buffer_steps=2) as pub:
        connect(subscriber, pub)
        time.sleep(0.3)
        pub.publish([stored(DOC, 0, 2)])
        wait_until(lambda: blocks(index) == 2)
        for _ in range(3):
            pub.publish([removed(DOC, [1])], drop=True)
        pub.publish([BlockStored([1], None, [1, 2, 3, 4], 4)])
        wait_until(lambda: subscriber.freshness("r1")[0] is Freshness.REBUILDING)
        assert "no longer holds" in subscriber.freshness("r1")[1]
        assert blocks(index) == 0


def test_sequence_reset_clears_and_rebuilds(
    index: InMemoryPrefixIndex, subscriber: EventSubscriber
) -> None:
    pub = publisher()
    port_pub, port_replay = pub.endpoint, pub.replay_endpoint
    connect(subscriber, pub)
    time.sleep(0.3)
    for i in range(4):
        pub.publish([stored(DOC, 2 * i, 2)])
    wait_until(lambda: blocks(index) == 8)
    pub.close()
    wait_until(lambda: subscriber.freshness("r1")[0] is Freshness.STALE)
    assert blocks(index) == 8  # kept while stale (and discounted by the router)
    # The replica restarts on the same ports: a new process, seq from 0, an empty cache.
    pub = EventPublisher(port_pub, replay_endpoint=port_replay, topic=TOPIC, bind=True)
    try:
        # Found on reconnect (the replay no longer holds our last batch) or by the first
        # live batch, whichever comes first: either way exactly one reset.
        time.sleep(0.3)
        pub.publish([stored(DOC, 0, 1)])
        wait_until(lambda: subscriber.feed_stats()["r1"].resets == 1)
        wait_until(lambda: blocks(index) == 1)
        assert subscriber.feed_stats()["r1"].resets == 1
        assert subscriber.freshness("r1")[0] is Freshness.LIVE
    finally:
        pub.close()


def test_stale_publisher_is_cleared_after_the_grace_period(
    index: InMemoryPrefixIndex, subscriber: EventSubscriber
) -> None:
    pub = publisher()
    connect(subscriber, pub)
    time.sleep(0.3)
    pub.publish([stored(DOC, 0, 2)])
    wait_until(lambda: blocks(index) == 2)
    pub.close()
    wait_until(lambda: blocks(index) == 0, timeout_s=10)  # stale_clear_after_s=1 in the fixture
    assert subscriber.freshness("r1")[0] is Freshness.STALE


def test_garbage_frames_and_foreign_topics_are_counted_never_fatal(
    index: InMemoryPrefixIndex, subscriber: EventSubscriber
) -> None:
    with publisher() as pub:
        connect(subscriber, pub)
        time.sleep(0.3)
        pub.send_raw([TOPIC.encode(), b"short"])
        pub.send_raw([TOPIC.encode(), b"\x00" * 7, b"x"])
        pub.publish_payload(b"\xc1 not msgpack")  # seq 0: counted and skipped
        pub.publish_payload(msgspec.msgpack.encode([1.0]))  # seq 1: not a batch
        pub.publish([stored(DOC, 0, 1), BlockRemoved([1], Medium.GPU)])  # seq 2
        wait_until(lambda: blocks(index) == 1)
        stats = subscriber.feed_stats()["r1"]
        assert stats.malformed_messages == 4
        assert stats.gaps == 0 and stats.events_applied == 2
        assert subscriber.freshness("r1")[0] is Freshness.LIVE
        snapshot = collect_stats(index, subscriber).to_dict()
        assert snapshot["fleet"]["malformed_messages"] == stats.malformed_messages
        assert snapshot["replicas"]["r1"]["entries_by_tier"]["GPU"] == 1


def test_replicas_are_independent_and_removable(
    index: InMemoryPrefixIndex, subscriber: EventSubscriber
) -> None:
    with publisher() as a, publisher() as b:
        connect(subscriber, a, "a")
        connect(subscriber, b, "b")
        time.sleep(0.3)
        a.publish([stored(DOC, 0, 3)])
        b.publish([stored(DOC, 0, 1)])
        wait_until(lambda: blocks(index, "a") == 3 and blocks(index, "b") == 1)
        subscriber.remove_source("a")
        assert "a" not in index.lookup(DOC)
        assert [s.replica for s in subscriber.sources()] == ["b"]


def test_duplicates_after_replay_are_skipped() -> None:
    """Driven without sockets: a replay that already delivered later batches."""
    index = InMemoryPrefixIndex()
    payloads = [encode_batch([stored(DOC, i, 1)], ts=0.0) for i in range(4)]
    frames = [Frame(TOPIC, i, p) for i, p in enumerate(payloads)]
    feed = ReplicaFeed(EventSource("r", "tcp://unused"), index, replay=lambda start: frames[start:])
    feed.handle(frames[2])  # joined late: replays 0..3
    feed.handle(frames[3])  # arrives live too: a duplicate
    assert feed.stats.duplicates == 1 and feed.expected == 4
    assert index.lookup(DOC)["r"].blocks == 4
    feed.handle(Frame(TOPIC, 1, payloads[1]))  # behind but inside the replayed range
    assert feed.stats.duplicates == 2 and feed.stats.resets == 0


def test_subscriber_never_blocks_on_a_dead_replay_socket(index: InMemoryPrefixIndex) -> None:
    ctx = zmq.Context.instance()
    silent = ctx.socket(zmq.ROUTER)  # accepts the request and never answers
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    sub = EventSubscriber(index, replay_timeout_s=0.5)
    try:
        with EventPublisher("tcp://127.0.0.1:0", topic=TOPIC, bind=True) as pub:
            sub.add_source(EventSource("r1", pub.endpoint, f"tcp://127.0.0.1:{port}", TOPIC))
            # The join's replay is not answered: still connecting, the feed thread alive.
            wait_until(lambda: sub.feed_stats()["r1"].replay_failures == 1)
            assert sub.freshness("r1")[0] is Freshness.CONNECTING
            pub.publish([stored(DOC, 0, 1)], drop=True)
            pub.publish([stored(DOC, 1, 1)])
            wait_until(lambda: sub.feed_stats()["r1"].replay_failures == 2)
            assert sub.freshness("r1")[0] is Freshness.REBUILDING
    finally:
        sub.close()
        silent.close(linger=0)


def test_restart_after_a_replay_is_a_reset_not_duplicates() -> None:
    """Regression: seqs of a restarted replica fell in an old replayed range and were skipped."""
    index = InMemoryPrefixIndex()
    payloads = [encode_batch([stored(DOC, i, 1)], ts=0.0) for i in range(4)]
    frames = [Frame(TOPIC, i, p) for i, p in enumerate(payloads)]
    feed = ReplicaFeed(
        EventSource("r", "tcp://unused"), index, replay=lambda start: frames[start:3]
    )
    feed.handle(frames[2])  # joined late: replays 0..2
    feed.handle(frames[3])  # live again
    assert index.lookup(DOC)["r"].blocks == 4
    # The replica restarts: a new process publishes seq 0 with an empty cache.
    feed.handle(Frame(TOPIC, 0, encode_batch([stored(DOC, 0, 1)], ts=0.0)))
    assert feed.stats.resets == 1 and feed.stats.duplicates == 0
    assert index.lookup(DOC)["r"].blocks == 1


def test_restart_that_goes_idle_before_we_reconnect_is_found_by_replay(
    index: InMemoryPrefixIndex, subscriber: EventSubscriber
) -> None:
    """A restarted replica publishes its first batches before our SUB reconnects, then idles:
    the reconnect itself must find the restart through the replay socket."""
    pub = publisher()
    endpoints = pub.endpoint, pub.replay_endpoint
    connect(subscriber, pub)
    time.sleep(0.3)
    for i in range(4):
        pub.publish([stored(DOC, 2 * i, 2)])
    wait_until(lambda: blocks(index) == 8)
    pub.close()
    wait_until(lambda: subscriber.freshness("r1")[0] is Freshness.STALE)
    pub = EventPublisher(endpoints[0], replay_endpoint=endpoints[1], topic=TOPIC, bind=True)
    try:
        pub.publish([stored(DOC, 0, 1)])  # published at once, then nothing more
        wait_until(lambda: subscriber.feed_stats()["r1"].resets == 1)
        wait_until(lambda: blocks(index) == 1)
        assert subscriber.freshness("r1")[0] is Freshness.LIVE
    finally:
        pub.close()


def test_reconnect_to_the_same_process_catches_up_without_reset() -> None:
    index = InMemoryPrefixIndex()
    payloads = [encode_batch([stored(DOC, i, 1)], ts=0.0) for i in range(4)]
    frames = [Frame(TOPIC, i, p) for i, p in enumerate(payloads)]
    feed = ReplicaFeed(EventSource("r", "tcp://unused"), index, replay=lambda s: frames[s:])
    feed.handle(frames[0])
    feed.handle(frames[1])
    feed.on_disconnected()
    assert feed.stats.freshness is Freshness.STALE
    feed.on_connected()  # a reconnect: batches 2 and 3 went out while we were away
    assert feed.stats.freshness is Freshness.LIVE and "reconnected" in feed.stats.reason
    assert feed.stats.resets == 0 and feed.expected == 4
    assert index.lookup(DOC)["r"].blocks == 4
    feed.handle(frames[3])  # the same batch again, live: a duplicate
    assert feed.stats.duplicates == 1 and index.lookup(DOC)["r"].blocks == 4


def test_a_restart_found_on_reconnect_past_the_replay_buffer_is_rebuilding() -> None:
    """The new process published more than its buffer holds before we reconnected: what the
    buffer holds is applied, and the feed does not claim to be live."""
    old = [Frame(TOPIC, i, encode_batch([stored(DOC, i, 1)], ts=0.0)) for i in range(2)]
    new = [Frame(TOPIC, i, encode_batch([stored(OTHER, i, 1)], ts=1.0)) for i in range(4)]
    replays = [new[1:], new[2:]]  # lacks the batch we applied last, and batch 0
    index = InMemoryPrefixIndex()
    feed = ReplicaFeed(EventSource("r", "tcp://unused"), index, replay=lambda s: replays.pop(0))
    feed.handle(old[0])
    feed.handle(old[1])
    feed.on_disconnected()
    assert feed.stats.freshness is Freshness.STALE
    feed.on_connected()  # a reconnect, to a new process
    assert feed.stats.resets == 1 and feed.expected == 4
    assert feed.stats.freshness is Freshness.REBUILDING, feed.stats.reason
    assert index.lookup(DOC)["r"].blocks == 0
    assert index.lookup(OTHER)["r"].blocks == 0  # OTHER 2 and 3: their parents were lost
    assert feed.stats.missed_batches == 2


OTHER = list(range(900, 932))  # 8 blocks, unrelated to DOC


def _frames(batches: list[list[Event]], positional: bool = False) -> list[Frame]:
    return [
        Frame(TOPIC, i, encode_batch(events, ts=0.0, positional=positional))
        for i, events in enumerate(batches)
    ]


@pytest.mark.parametrize("positional", [False, True])
def test_join_skips_history_before_the_moot_prefix(positional: bool) -> None:
    """A router joining a replica whose cache was reset does not re-key the history the
    reset made moot: those batches only advance the sequence."""
    batches: list[list[Event]] = [[stored(DOC, i, 1)] for i in range(6)]
    batches.append([stored(DOC, 6, 1), AllBlocksCleared(), stored(OTHER, 0, 1)])
    batches += [[stored(OTHER, 1, 1)], [stored(OTHER, 2, 1)]]
    frames = _frames(batches, positional)
    assert moot_prefix(frames) == (6, 1)
    index = InMemoryPrefixIndex()
    feed = ReplicaFeed(EventSource("r", "tcp://unused"), index, replay=lambda s: frames[s:])
    feed.handle(frames[-1])  # joined late: replays 0..7, then applies 8
    assert feed.stats.freshness is Freshness.LIVE
    assert feed.expected == 9 and feed.stats.batches == 9
    assert feed.stats.moot_batches == 6
    assert feed.stats.blocks_stored == 3  # OTHER 0..2; nothing before the clear
    assert feed.stats.events_rejected == 0  # DOC block 6's parent was moot, not missed
    assert "r" not in index.lookup(DOC) or index.lookup(DOC)["r"].blocks == 0
    assert index.lookup(OTHER)["r"].blocks == 3
    feed.handle(frames[8])  # the live copy of a replayed batch: a duplicate, not a restart
    assert feed.stats.duplicates == 1 and feed.stats.resets == 0


def test_a_join_past_the_replay_buffer_rebuilds_from_what_it_holds() -> None:
    """vLLM buffers the last 10,000 batches: a router joining a replica with a longer history
    applies the batches still buffered (their blocks are true; chains begun in the lost part
    stay unresolved) and says it is rebuilding."""
    batches: list[list[Event]] = [[stored(DOC, i, 1)] for i in range(5)]
    batches += [[stored(OTHER, 0, 2)], [stored(OTHER, 2, 1)]]
    frames = _frames(batches)
    index = InMemoryPrefixIndex()
    feed = ReplicaFeed(EventSource("r", "tcp://unused"), index, replay=lambda s: frames[3:])
    feed.bootstrap()
    assert feed.stats.freshness is Freshness.REBUILDING, feed.stats.reason
    assert "no longer holds batch 0" in feed.stats.reason
    assert feed.stats.missed_batches == 3 and feed.expected == 7
    assert index.lookup(OTHER)["r"].blocks == 3
    assert index.lookup(DOC)["r"].blocks == 0  # DOC 3 and 4: parents the buffer lost
    assert feed.stats.rejected_reasons == {
        "BlockStored whose parent block is unknown (missed events?)": 2
    }
    feed.handle(frames[6])  # queued on the SUB socket meanwhile: a duplicate
    assert feed.stats.duplicates == 1 and feed.stats.resets == 0
    feed.handle(Frame(TOPIC, 7, encode_batch([stored(OTHER, 3, 1)], ts=0.0)))
    assert index.lookup(OTHER)["r"].blocks == 4


def test_a_join_past_the_replay_buffer_is_rebuilding_even_after_a_device_clear() -> None:
    """vLLM's AllBlocksCleared clears the device tier only: the batches the buffer lost may
    have stored blocks in a lower tier that are still held, so nothing makes them moot."""
    batches: list[list[Event]] = [[stored(DOC, i, 1)] for i in range(5)]
    batches += [[AllBlocksCleared()], [stored(OTHER, 0, 2)]]
    frames = _frames(batches)
    index = InMemoryPrefixIndex()
    feed = ReplicaFeed(EventSource("r", "tcp://unused"), index, replay=lambda s: frames[4:])
    feed.bootstrap()
    assert feed.stats.freshness is Freshness.REBUILDING, feed.stats.reason
    assert feed.stats.missed_batches == 4 and feed.stats.moot_batches == 1
    assert index.lookup(OTHER)["r"].blocks == 2


def test_a_gap_past_the_replay_buffer_keeps_what_the_buffer_holds() -> None:
    frames = _frames(
        [[stored(DOC, 0, 1)], [stored(DOC, 1, 1)], [stored(DOC, 2, 1)], [stored(OTHER, 0, 1)]]
    )
    index = InMemoryPrefixIndex()
    feed = ReplicaFeed(EventSource("r", "tcp://unused"), index, replay=lambda s: frames[2:])
    feed.handle(frames[0])
    feed.handle(frames[3])  # batches 1 and 2 lost; the replay holds only 2 and 3
    assert feed.stats.freshness is Freshness.REBUILDING
    assert feed.stats.gaps == 1 and feed.stats.missed_batches == 1
    assert index.lookup(DOC)["r"].blocks == 0  # cleared; DOC 2 lost its parent with 1
    assert index.lookup(OTHER)["r"].blocks == 1
    assert feed.expected == 4


def test_a_join_replay_that_does_not_answer_leaves_the_feed_connecting() -> None:
    frames = _frames([[stored(DOC, 0, 1)], [stored(DOC, 1, 1)]])
    answers: list[list[Frame] | None] = [None, frames[0:]]
    index = InMemoryPrefixIndex()
    feed = ReplicaFeed(EventSource("r", "tcp://unused"), index, replay=lambda s: answers.pop(0))
    feed.bootstrap()
    assert feed.stats.freshness is Freshness.CONNECTING and feed.stats.replay_failures == 1
    feed.handle(frames[1])  # the first live batch: joined late, replays 0
    assert feed.stats.freshness is Freshness.LIVE
    assert index.lookup(DOC)["r"].blocks == 2


def test_a_crashed_socket_loop_leaves_the_feed_stale_and_cleared() -> None:
    index = InMemoryPrefixIndex()
    feed = ReplicaFeed(EventSource("r", "tcp://unused"), index)
    feed.handle(_frames([[stored(DOC, 0, 2)]])[0])
    assert index.lookup(DOC)["r"].blocks == 2
    feed.on_crash()
    assert feed.stats.freshness is Freshness.STALE and "crashed" in feed.stats.reason
    assert index.lookup(DOC)["r"].blocks == 0


def test_a_replay_the_feed_asked_for_is_charged_to_its_budget() -> None:
    """A replay is taken whole, and its bytes count against the stream's budget, so a
    publisher cannot flood through replays."""
    frames = _frames([[stored(DOC, 0, 1)], [stored(DOC, 1, 1)]])
    budget = ByteBudget(1000, 100_000, clock=lambda: 0.0)
    feed = ReplicaFeed(
        EventSource("r", "tcp://unused"),
        InMemoryPrefixIndex(),
        replay=lambda s: frames[s:],
        budget=budget,
    )
    feed.bootstrap()
    assert feed.stats.freshness is Freshness.LIVE
    assert budget.level == 100_000 - sum(len(f.payload) for f in frames)


def test_a_clear_of_one_tier_does_not_make_history_moot() -> None:
    batches: list[list[Event]] = [
        [stored(DOC, 0, 2)],
        [stored(DOC, 0, 2, Medium.CPU)],
        [AllBlocksCleared(Medium.GPU)],
        [stored(OTHER, 0, 1)],
    ]
    frames = _frames(batches)
    assert moot_prefix(frames) is None
    index = InMemoryPrefixIndex()
    feed = ReplicaFeed(EventSource("r", "tcp://unused"), index, replay=lambda s: frames[s:])
    feed.handle(frames[-1])
    assert feed.stats.moot_batches == 0
    match = index.lookup(DOC)["r"]
    assert match.blocks == 2 and match.blocks_by_tier == {Medium.CPU: 2}


def test_a_malformed_batch_is_never_taken_for_a_clear() -> None:
    frames = _frames([[stored(DOC, 0, 1)], [stored(DOC, 1, 1)]])
    frames.append(Frame(TOPIC, 2, b"\xc1AllBlocksCleared"))  # the tag's bytes, not msgpack
    assert moot_prefix(frames) is None


event_batches = st.lists(
    st.lists(operation().map(lambda op: op[1]), min_size=1, max_size=4), min_size=1, max_size=12
)


@st.composite
def one_publisher_batches(draw: st.DrawFn) -> tuple[int, Medium, list[list[Event]]]:
    """A stream as one replica's publishers write it: tier-only stores come from one
    offloading connector with one chunk size, in a tier of its own, and sized lower stores
    from one publisher, with extra keys or without (``operation``). Returns
    (that chunk size in blocks, its tier, the batches)."""
    grid = draw(st.sampled_from([1, 2, 3]))
    medium = draw(st.sampled_from([Medium.CPU, Medium.STORAGE]))
    sized = draw(st.sampled_from(["lower", "lower_by_hash"]))
    op = operation(chunk_grid=grid, tier_only_medium=medium, sized_kind=sized).map(lambda o: o[1])
    batches = draw(st.lists(st.lists(op, min_size=1, max_size=4), min_size=1, max_size=12))
    return grid, medium, batches


def _stream_truth(
    batches: list[list[Event]],
    grid: int,
    medium: Medium,
    want: list[frozenset[str]],
    doc: list[int],
) -> list[set[str]]:
    """What the replica may hold, per block of ``doc``: the full history's index (``want``),
    and every (tier, block) the stream stored since that tier's last clear and the block's
    last removal there, a tier-only chunk counted whole. The full history's index is below the
    replica where it took a store for something else (a chunk named while only another tier
    held its block resolves by that block alone, before the device's chain names the rest:
    ``test_a_join_may_learn_a_chunk_before_the_full_history``; a self-describing store of a
    chunk whose last block it holds is taken as a re-store, confirmed.py; a STORAGE store
    without extra keys, vLLM's FS tier, held apart and unconfirmed, is refreshed by its chunk's
    last block, not resolved again)."""
    held: set[tuple[str, int]] = set()
    for batch in batches:
        for e in batch:
            if isinstance(e, AllBlocksCleared):
                gone = e.medium.name if e.medium is not None else Medium.GPU.name
                held = {x for x in held if x[0] != gone}
            elif isinstance(e, BlockRemoved):
                held -= {(e.medium.name, h) for h in e.block_hashes}
            elif isinstance(e, BlockStored):
                held |= {(e.medium.name, h) for h in e.block_hashes}
    out = [set(t) for t in want]
    hashes = [ehash(tuple(doc[: (i + 1) * BS])) for i in range(len(out))]
    for i, tiers in enumerate(out):
        for t in ("GPU", "CPU", "STORAGE"):
            if (t, hashes[i]) in held:  # confirmed, or held apart (vLLM's FS tier's stores)
                tiers.update((t, f"{t}_UNCONFIRMED"))
        last = (i // grid + 1) * grid - 1
        if last < len(out) and (medium.name in want[last] or (medium.name, hashes[last]) in held):
            tiers.add(medium.name)
    return out


def _agree(direct: InMemoryPrefixIndex, joined: InMemoryPrefixIndex) -> None:
    for doc in DOCS:
        for length in (len(doc), 9, 4):
            want, got = direct.lookup(doc[:length]), joined.lookup(doc[:length])
            assert got["r"].blocks == want["r"].blocks
            assert got["r"].blocks_by_tier == want["r"].blocks_by_tier
    assert [(s.entries, s.entries_by_tier) for s in joined.summary()] == [
        (s.entries, s.entries_by_tier) for s in direct.summary()
    ]


def _applied(frames: list[Frame]) -> InMemoryPrefixIndex:
    index = InMemoryPrefixIndex()
    index.add_replica("r")
    for frame in frames:
        index.apply("r", decode_batch(frame.payload).events)
    return index


@settings(max_examples=200, deadline=None)
@given(event_batches, st.booleans(), st.booleans())
def test_joining_with_moot_history_skipped_equals_applying_everything(
    batches: list[list[Event]], positional: bool, at_connect: bool
) -> None:
    """Whatever the history (stores, removals, one-tier and full clears), a feed that joins
    (on connecting, or at the last batch) ends with the index that applying every batch in
    order gives."""
    frames = _frames(batches, positional)
    joined = InMemoryPrefixIndex()
    joined.add_replica("r")
    feed = ReplicaFeed(EventSource("r", "tcp://unused"), joined, replay=lambda s: frames[s:])
    if at_connect:
        feed.bootstrap()
    else:
        feed.handle(frames[-1])
    assert feed.stats.freshness is Freshness.LIVE
    assert feed.expected == len(frames)
    assert feed.stats.moot_batches == (moot_prefix(frames) or (0, 0))[0]
    _agree(_applied(frames), joined)


@settings(max_examples=200, deadline=None)
@given(one_publisher_batches(), st.data())
def test_a_join_past_the_replay_buffer_never_predicts_more_than_the_replica_holds(
    stream: tuple[int, Medium, list[list[Event]]], data: st.DataObject
) -> None:
    """Whatever the replay lost, the index holds no block the replica does not: its matches
    are at most the full history's, tier by tier, a tier-only chunk counted whole.

    The stream is one real set of publishers (``one_publisher_batches``). A chunk that a
    tier-only store names by its last block gets its length from the chain walks the index
    has seen; a stream that mixes chunk sizes in one tier, or names chunks out of a prompt's
    order, lets a join that saw fewer walks learn a longer chunk than the full history did,
    which no single offloading connector produces. The full history may learn a chunk's
    length later than a join does (``test_a_join_may_learn_a_chunk_before_the_full_history``):
    its index is then below the replica's holdings, so the truth counts its chunks whole."""
    grid, medium, batches = stream
    frames = _frames(batches)
    lost = data.draw(st.integers(0, len(frames) - 1))
    joined = InMemoryPrefixIndex()
    joined.add_replica("r")
    feed = ReplicaFeed(
        EventSource("r", "tcp://unused"), joined, replay=lambda s: frames[max(s, lost) :]
    )
    feed.bootstrap()
    assert feed.expected == len(frames)
    direct = _applied(frames)
    if feed.stats.freshness is Freshness.LIVE:
        _agree(direct, joined)
        return
    assert feed.stats.freshness is Freshness.REBUILDING
    for doc in DOCS:
        want, got = direct.block_tiers("r", doc), joined.block_tiers("r", doc)
        truth = _stream_truth(batches, grid, medium, want, doc)
        for i, tiers in enumerate(got):
            assert tiers <= (truth[i] if i < len(truth) else set()), (i, tiers, want)


def test_a_join_may_learn_a_chunk_before_the_full_history() -> None:
    """Found by the property above (hypothesis seed 75): an offloading connector's chunks of
    two blocks, the first named (tier-only, by its last block) while only the disk tier held
    that block. The full history resolves it at once by that block alone, which is no walk,
    and learns nothing of the length from it; a join past the buffer never saw the disk
    store, holds the name as unsized, and with the device's chain learns the length from two
    walks. The join is right: the connector holds both chunks whole."""
    cpu = Medium.CPU
    gpu_block0 = stored(DOC, 0, 1)
    batches = [
        [gpu_block0],
        [gpu_block0, stored(DOC, 0, 2, Medium.STORAGE)],
        [gpu_block0, tier_only(DOC, [1], cpu)],
        [gpu_block0, stored(DOC, 0, 4)],
        [gpu_block0, tier_only(DOC, [1, 3], cpu)],
    ]
    frames = _frames(batches)
    joined = InMemoryPrefixIndex()
    joined.add_replica("r")
    feed = ReplicaFeed(EventSource("r", "tcp://unused"), joined, replay=lambda s: frames[2:])
    feed.bootstrap()
    assert feed.stats.freshness is Freshness.REBUILDING
    direct = _applied(frames)
    want, got = direct.block_tiers("r", DOC), joined.block_tiers("r", DOC)
    assert [cpu.name in t for t in want[:4]] == [False, True, False, True]
    assert [cpu.name in t for t in got[:4]] == [True, True, True, True]
    truth = _stream_truth(batches, 2, cpu, want, DOC)
    assert all(t <= truth[i] for i, t in enumerate(got))


class _FsBackendPublisher:
    """llm-d's FS backend publisher, as its event_publisher.py writes the wire: its own PUB
    socket, topic ``kv@SHARED_STORAGE@<model>``, sequence numbers from 1, each event packed
    into msgpack bytes of its own, positional, parent 0, no data-parallel rank, no replay."""

    def __init__(self) -> None:
        self.sock = zmq.Context.instance().socket(zmq.PUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind("tcp://127.0.0.1:0")
        self.endpoint = self.sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.seq = 0

    def stored(self, hashes: list[int], medium: str = "SHARED_STORAGE") -> None:
        event = msgspec.msgpack.encode(["BlockStored", hashes, 0, [], 0, None, medium])
        payload = msgspec.msgpack.encode([time.time(), [event]])
        self.seq += 1
        self.sock.send_multipart([b"kv@SHARED_STORAGE@tiny", self.seq.to_bytes(8, "big"), payload])

    def close(self) -> None:
        self.sock.close(linger=0)


def test_a_second_stream_of_the_replica_resolves_through_the_first(
    index: InMemoryPrefixIndex, subscriber: EventSubscriber
) -> None:
    """llm-d's FS backend publishes stores on a socket of its own: its chunks (named by their
    last block hash) resolve through the device events of vLLM's stream; a medium nobody
    uses is counted, and the stream's own state never changes the replica's freshness."""
    from tests.indexer.builders import ehash

    fs = _FsBackendPublisher()
    try:
        with publisher() as pub:
            source = EventSource("r1", pub.endpoint, pub.replay_endpoint, TOPIC)
            aux = EventSource("r1", fs.endpoint, None, "", stream=fs.endpoint)
            subscriber.set_sources("r1", [source, aux])
            time.sleep(0.4)
            learn = list(range(300, 332))
            pub.publish([stored(DOC, 0, 8), stored(learn, 0, 8)])
            wait_until(lambda: blocks(index) == 8)
            # Chunks of 2 blocks, named by their last block: blocks 1, 3, 5, 7.
            learn_last = [ehash(tuple(learn[: 4 * b])) for b in (2, 4, 6, 8)]
            doc_last = [ehash(tuple(DOC[: 4 * b])) for b in (2, 4, 6, 8)]
            fs.stored(learn_last[:1])  # one walk: the length is not known yet
            time.sleep(0.3)
            # Both prompts computed again: their device stores are tracked now.
            pub.publish([removed(learn, list(range(8))), removed(DOC, list(range(8)))])
            pub.publish([stored(learn, 0, 8), stored(DOC, 0, 8)])
            # The streams are read by two threads: wait for each batch before the next one of
            # the other stream (in a fleet the store lands well before its offload finishes).
            wait_until(lambda: subscriber.feed_stats()["r1"].last_seq == 2)
            fs.stored(learn_last[1:2])  # two walks back to the previous chunk: 2 blocks
            fs.stored(learn_last[2:3])
            fs.stored([123], medium="TAPE")  # nobody's medium: counted, dropped
            fs.stored(doc_last)  # DOC's four chunks, resolved to 8 blocks
            wait_until(lambda: subscriber.stream_stats()["r1"][fs.endpoint].batches == 5)
            pub.publish([removed(DOC, list(range(8)))])
            wait_until(lambda: index.lookup(DOC)["r1"].blocks_by_tier == {})
            match = index.lookup(DOC)["r1"]
            assert match.blocks == 8 and match.unconfirmed_by_tier == {Medium.STORAGE: 8}
            assert subscriber.freshness("r1")[0] is Freshness.LIVE
            streams = subscriber.stream_stats()["r1"]
            assert streams[fs.endpoint].unknown_media == {"TAPE": 1}
            snapshot = collect_stats(index, subscriber).to_dict()
            assert snapshot["fleet"]["unknown_media"] == {"TAPE": 1}
            entry = snapshot["replicas"]["r1"]
            # learn's three chunks (the first claimed whole once the length was learned), DOC's 4
            assert entry["unconfirmed_entries_by_tier"]["STORAGE"] == 6 + 8
            assert entry["chunk_blocks"] == {"STORAGE_UNCONFIRMED": 2}
            # blocks stored by the stream, the first chunk's last block counted twice
            assert entry["streams"][fs.endpoint]["unconfirmed_blocks"] == 15
            # vLLM's stream restarting clears its tiers, not the FS backend's
            subscriber.clear_replica("r1", "test: restart")
            assert index.lookup(DOC)["r1"].blocks == 0
    finally:
        fs.close()


def test_an_oversized_message_costs_its_publisher_only(index: InMemoryPrefixIndex) -> None:
    """A frame past ``max_message_bytes`` makes ZMQ drop that publisher's connection; the
    frame is never decoded, the other replica's feed goes on, and the publisher's next
    batches arrive after it reconnects (the lost ones through the sequence gap's replay)."""
    sub = EventSubscriber(index, replay_timeout_s=0.5, max_message_bytes=64 * 1024)
    try:
        with publisher() as big, publisher() as fine:
            connect(sub, big, "r1")
            connect(sub, fine, "r2")
            time.sleep(0.4)
            huge = list(range(100_000, 100_000 + 40_000))  # ~160 KiB of token ids
            # Never decoded, so its hashes need not chain (builders.stored would hash each
            # block's whole prefix: minutes of the test's own time for 10,000 blocks).
            n = len(huge) // BS
            big.publish([BlockStored(list(range(1, n + 1)), None, huge, BS, medium=Medium.GPU)])
            fine.publish([stored(DOC, 0, 4)])
            wait_until(lambda: blocks(index, "r2") == 4)
            assert index.lookup(huge).get("r1") is None or index.lookup(huge)["r1"].blocks == 0

            def back() -> bool:
                big.publish([stored(DOC, 0, 2)])
                time.sleep(0.1)
                return blocks(index, "r1") == 2

            wait_until(back, timeout_s=15)
            assert index.lookup(huge)["r1"].blocks == 0  # the oversized batch was never applied
            assert blocks(index, "r2") == 4
    finally:
        sub.close()


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_flooding_publisher_is_cleared_dropped_and_rebuilt_once_it_slows() -> None:
    """Driven without sockets, on a manual clock: the budget is 1,000 bytes/s (burst 2,000)."""
    index = InMemoryPrefixIndex()
    clock = _Clock()
    feed = ReplicaFeed(
        EventSource("r", "tcp://unused"), index, budget=ByteBudget(1000, 2000, clock=clock)
    )
    raw = [
        encode_frames(TOPIC, i, encode_batch([stored(DOC, i % 8, 1)], ts=0.0)) for i in range(200)
    ]
    within = 2000 // sum(len(f) for f in raw[0])
    for frames in raw[:within]:
        feed.handle_frames(frames)
    assert within >= 4 and feed.stats.freshness is Freshness.LIVE
    assert blocks(index, "r") == min(within, 8)
    # The flood: 20 messages in a tenth of a second, far past 1,000 bytes/s.
    for k, frames in enumerate(raw[within : within + 20]):
        clock.now += 0.005
        feed.handle_frames(frames)
        if k == 0:
            assert feed.stats.freshness is Freshness.THROTTLED
            assert blocks(index, "r") == 0  # cleared: dropped batches may have removed blocks
    assert feed.stats.throttles == 1 and feed.stats.throttled_messages == 20
    assert feed.stats.throttled_bytes == sum(
        len(f) for frames in raw[within : within + 20] for f in frames
    )
    # Still flooding a second later: a slice that fits is not let through (no flapping).
    clock.now += 1.0
    feed.handle_frames(raw[within + 20])
    assert feed.stats.freshness is Freshness.THROTTLED and feed.stats.throttles == 1
    # Quiet long enough: the next batch rebuilds from live events, without asking for the
    # dropped ones.
    clock.now += 5.0
    seq = within + 21
    feed.handle_frames(encode_frames(TOPIC, seq, encode_batch([stored(DOC, 0, 3)], ts=0.0)))
    assert feed.stats.freshness is Freshness.REBUILDING, feed.stats.reason
    assert blocks(index, "r") == 3 and feed.expected == seq + 1 and feed.stats.replays == 0


@pytest.mark.solo  # the flood must outpace the budget 10x: with nothing else on the cores
def test_a_flood_costs_its_own_feed_only(index: InMemoryPrefixIndex) -> None:
    """Real sockets: one publisher sends 10x its budget, the other is applied in full, and
    the flooder's feed comes back once it sends at a normal rate again."""
    rate = 64 * 1024
    sub = EventSubscriber(
        index, replay_timeout_s=0.5, max_message_bytes=16 * 1024, max_bytes_per_s=rate
    )
    try:
        with publisher() as flood, publisher() as fine:
            connect(sub, flood, "r1")
            connect(sub, fine, "r2")
            time.sleep(0.4)
            doc = list(range(5000, 5000 + 256))  # 64 blocks of 4 tokens
            started = time.monotonic()
            sent = 0
            step = 0
            while time.monotonic() - started < 1.5:  # ~10x the budget for 1.5 s
                flood.publish([stored(doc, 0, 64)])
                sent += 1
                if sent % 8 == 0:
                    fine.publish([stored(DOC, step % 8, 1)])
                    step += 1
                time.sleep(0.001)
            fine.publish([stored(DOC, 0, 8)])
            wait_until(lambda: blocks(index, "r2") == 8)
            stats = sub.feed_stats()
            assert stats["r2"].freshness is Freshness.LIVE and stats["r2"].throttles == 0
            assert stats["r2"].missed_batches == 0
            flooded = stats["r1"]
            assert flooded.throttles >= 1 and flooded.throttled_bytes > 2 * rate
            assert flooded.freshness is Freshness.THROTTLED, flooded.reason
            assert flooded.events_applied * 5 < sent  # most of the flood was never decoded

            def back() -> bool:
                flood.publish([stored(DOC, 0, 2)])
                time.sleep(0.2)
                return blocks(index, "r1") == 2

            wait_until(back, timeout_s=20)
            assert sub.freshness("r1")[0] is Freshness.REBUILDING
    finally:
        sub.close()


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="SCHED_BATCH is Linux's")
def test_feed_threads_run_as_batch_work_and_the_caller_is_untouched(
    index: InMemoryPrefixIndex, subscriber: EventSubscriber
) -> None:
    """A feed's thread does not preempt the thread serving requests when a batch wakes it;
    the thread that started it keeps its own class."""
    with publisher() as pub:
        connect(subscriber, pub)
        feeds = [t for t in threading.enumerate() if t.name == "kv-feed-r1"]
        assert len(feeds) == 1 and feeds[0].native_id is not None
        tid = feeds[0].native_id
        wait_until(lambda: os.sched_getscheduler(tid) == os.SCHED_BATCH)
        assert os.getpriority(os.PRIO_PROCESS, tid) >= BACKGROUND_NICE
        pub.publish([stored(DOC, 0, 2)])
        wait_until(lambda: blocks(index) == 2)  # and it still ingests
    assert os.sched_getscheduler(0) == os.SCHED_OTHER


def test_a_batch_lost_at_the_source_is_counted_not_cleared(
    index: InMemoryPrefixIndex, subscriber: EventSubscriber
) -> None:
    """vLLM's publisher consumes a seq for a batch it cannot encode and buffers nothing
    (LMCache's tensor path): the replay holds the batches on both sides of the hole, so the
    hole is proven lost at the source; the stream keeps what it holds and stays live."""
    other = list(range(900, 916))
    with publisher() as pub:
        connect(subscriber, pub)
        time.sleep(0.3)
        pub.publish([stored(DOC, 0, 4)])
        wait_until(lambda: blocks(index) == 4)
        pub.lose_at_source()
        pub.publish([stored(other, 0, 2)], drop=True)  # also missed live: the replay has it
        pub.lose_at_source()
        pub.publish([stored(DOC, 4, 2)])
        wait_until(lambda: blocks(index) == 6)
        stats = subscriber.feed_stats()["r1"]
        assert stats.lost_batches == 2 and stats.gaps == 1 and stats.clears == 0
        assert stats.missed_batches == 0 and stats.last_seq == 4
        assert index.lookup(other)["r1"].blocks == 2
        state, reason = subscriber.freshness("r1")
        assert state is Freshness.LIVE and "lost at the source" in reason
        assert collect_stats(index, subscriber).to_dict()["fleet"]["lost_batches"] == 2
        # The next batch is in sequence: nothing more is counted.
        pub.publish([stored(other, 2, 2)])
        wait_until(lambda: index.lookup(other)["r1"].blocks == 4)
        assert subscriber.feed_stats()["r1"].lost_batches == 2


def test_a_hole_behind_a_changed_anchor_is_not_taken_as_lost() -> None:
    """Driven without sockets: the replay's first batch is not the one applied last (another
    process, or a buffer that dropped it): no proof, so the usual rules apply (clear)."""
    index = InMemoryPrefixIndex()
    good = _frames([[stored(DOC, 0, 2)], [stored(DOC, 2, 2)], [stored(DOC, 4, 2)]])
    other = _frames([[stored(list(range(900, 916)), 0, 2)]])[0]
    asked: list[int] = []

    def replay(start: int) -> list[Frame]:
        asked.append(start)
        return [Frame(TOPIC, 0, other.payload), good[2]] if start == 0 else good[start:]

    feed = ReplicaFeed(EventSource("r", "tcp://unused"), index, replay=replay)
    feed.handle(good[0])
    feed.handle(good[2])  # gap: 1 missing; the anchor (batch 0) came back changed
    assert asked == [0]
    assert feed.stats.lost_batches == 0 and feed.stats.missed_batches == 1
    assert feed.stats.freshness is Freshness.REBUILDING


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(["sent", "sent", "lost", "dropped"]), min_size=1, max_size=30))
def test_losses_at_the_source_are_counted_and_nothing_true_is_cleared(fates: list[str]) -> None:
    """A publisher that numbers every batch, loses some before buffering them (``lost``: vLLM
    failing to encode) and some on the wire after buffering them (``dropped``: ZMQ). The
    feed ends live with every buffered batch applied, each lost one counted once, and never
    clears: no block a buffered batch stored is missing."""
    fates = ["sent", *fates]  # the stream's first batch arrives (a join is not anchored)
    index = InMemoryPrefixIndex()
    buffered: list[Frame] = []
    feed = ReplicaFeed(
        EventSource("r", "tcp://unused"),
        index,
        replay=lambda s: [f for f in buffered if f.seq >= s],
    )
    docs = [list(range(1000 * (i + 1), 1000 * (i + 1) + BS)) for i in range(len(fates))]
    for seq, fate in enumerate(fates):
        if fate == "lost":
            continue
        frame = Frame(TOPIC, seq, encode_batch([stored(docs[seq], 0, 1)], ts=0.0))
        buffered.append(frame)
        if fate == "sent":
            feed.handle(frame)
    # What the feed could notice: everything up to the last batch it received live.
    last_live = max(s for s, f in enumerate(fates) if f == "sent")
    noticed = fates[: last_live + 1]
    assert feed.stats.clears == 0 and feed.stats.freshness is Freshness.LIVE
    assert feed.stats.lost_batches == noticed.count("lost")
    for seq, fate in enumerate(noticed):
        held = index.lookup(docs[seq] + [1]).get("r")
        assert (held is not None and held.blocks == 1) == (fate != "lost"), (seq, fate)
