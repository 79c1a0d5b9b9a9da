"""Feeds the index from every replica's KV-event stream.

One thread per replica (``ReplicaFeed``): a ZMQ SUB socket on the replica's publisher, applied
in sequence order, so one replica's events are never reordered while replicas proceed in
parallel and a slow replay of one never holds up another. Nothing here runs on the router's
asyncio loop; the only shared state is the index, which has its own lock.

What each module does, and the rules it keeps, is in README.md beside this file.
"""

from __future__ import annotations

from kvroute.indexer.subscriber.manager import MAX_BYTES_PER_S, EventSubscriber
from kvroute.indexer.subscriber.recovery import moot_prefix
from kvroute.indexer.subscriber.replica_feed import ReplicaFeed
from kvroute.indexer.subscriber.sockets import MAX_MESSAGE_BYTES, MAX_REPLAY_FRAMES
from kvroute.indexer.subscriber.types import (
    EventSource,
    FeedHealth,
    FeedStats,
    Freshness,
    ReplicaSnapshot,
    WarmOutcome,
)

__all__ = [
    "MAX_BYTES_PER_S",
    "MAX_MESSAGE_BYTES",
    "MAX_REPLAY_FRAMES",
    "EventSource",
    "EventSubscriber",
    "FeedHealth",
    "FeedStats",
    "Freshness",
    "ReplicaFeed",
    "ReplicaSnapshot",
    "WarmOutcome",
    "moot_prefix",
]
