"""An event of a type the decoder does not know, through a replica's feed: applied in its place
(the replica's lower tiers that stream could have changed are dropped), counted per type, and
visible in ``/index/stats`` (kvroute.indexer.stats)."""

from __future__ import annotations

from types import SimpleNamespace

import msgspec

from kvroute.indexer.index import InMemoryPrefixIndex
from kvroute.indexer.stats import collect_stats
from kvroute.indexer.subscriber import EventSource, Freshness
from kvroute.indexer.subscriber.replica_feed import ReplicaFeed
from kvroute.indexer.wire import Frame, Medium, encode_batch
from tests.indexer.builders import BS, DOC, removed, stored

TOPIC = "kv@r@tiny"
N = len(DOC) // BS


def test_an_unknown_event_is_counted_and_distrusted_and_shown_in_stats() -> None:
    index = InMemoryPrefixIndex()
    feed = ReplicaFeed(EventSource("r", "tcp://unused"), index)
    feed.handle(Frame(TOPIC, 0, encode_batch([stored(DOC, 0, N)], ts=0.0)))
    feed.handle(Frame(TOPIC, 1, encode_batch([stored(DOC, 0, N, Medium.CPU)], ts=0.0)))
    later = msgspec.msgpack.encode(
        [1.0, [{"type": "TierBlocksCleared", "medium": "CPU"}, {"type": "BlockPinned"}]]
    )
    feed.handle(Frame(TOPIC, 2, later))
    assert feed.stats.freshness is Freshness.LIVE
    assert feed.stats.unknown_event_types == {"TierBlocksCleared": 1, "BlockPinned": 1}
    assert feed.stats.distrust_clears == 2 and feed.stats.events_rejected == 0
    feed.handle(Frame(TOPIC, 3, encode_batch([removed(DOC, list(range(N)))], ts=0.0)))
    assert index.lookup(DOC)["r"].blocks == 0  # the CPU copy was dropped, not kept stale

    subscriber = SimpleNamespace(feed_stats=lambda: {"r": feed.stats}, stream_stats=lambda: {})
    stats = collect_stats(index, subscriber).to_dict()  # type: ignore[arg-type]
    assert stats["fleet"]["unknown_event_types"] == {"TierBlocksCleared": 1, "BlockPinned": 1}
    assert stats["fleet"]["distrust_clears"] == 2
    feed_view = stats["replicas"]["r"]["feed"]
    assert feed_view["unknown_event_types"] == {"TierBlocksCleared": 1, "BlockPinned": 1}
