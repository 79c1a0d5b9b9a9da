"""``IndexStats``: one snapshot of the index and its feeds, the body of ``/index/stats``.

Built from outside the index (it only reads the index's summary and the feeds' counters), so
the index stays a plain data structure and the stats can grow without touching it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from indexer.index import InMemoryPrefixIndex, PrefixIndex
from indexer.subscriber import EventSubscriber

__all__ = ["IndexStats", "ReplicaStats", "collect_stats"]


@dataclass(slots=True)
class ReplicaStats:
    replica: str
    block_size: int | None
    entries: int
    entries_by_tier: dict[str, int]
    feed: dict[str, Any] | None


@dataclass(slots=True)
class IndexStats:
    taken_at: float
    replicas: list[ReplicaStats]
    entries: int
    entries_by_tier: dict[str, int]
    distinct_blocks: int | None
    max_entries: int | None
    evicted_entries: int | None
    estimated_bytes: int
    bytes_per_entry: float | None
    events_applied: int
    events_rejected: int
    malformed_messages: int
    gaps: int
    replays: int
    replay_failures: int
    resets: int
    freshness: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "taken_at": self.taken_at,
            "fleet": {
                "replicas": len(self.replicas),
                "entries": self.entries,
                "entries_by_tier": self.entries_by_tier,
                "distinct_blocks": self.distinct_blocks,
                "max_entries": self.max_entries,
                "evicted_entries": self.evicted_entries,
                "estimated_bytes": self.estimated_bytes,
                "bytes_per_entry": self.bytes_per_entry,
                "events_applied": self.events_applied,
                "events_rejected": self.events_rejected,
                "malformed_messages": self.malformed_messages,
                "gaps": self.gaps,
                "replays": self.replays,
                "replay_failures": self.replay_failures,
                "resets": self.resets,
                "freshness": self.freshness,
            },
            "replicas": {
                r.replica: {
                    "block_size": r.block_size,
                    "entries": r.entries,
                    "entries_by_tier": r.entries_by_tier,
                    "feed": r.feed,
                }
                for r in self.replicas
            },
        }


def collect_stats(index: PrefixIndex, subscriber: EventSubscriber | None = None) -> IndexStats:
    feeds = subscriber.feed_stats() if subscriber is not None else {}
    replicas: list[ReplicaStats] = []
    by_tier: dict[str, int] = {"GPU": 0, "CPU": 0, "STORAGE": 0}
    seen = set()
    for summary in index.summary():
        seen.add(summary.replica)
        feed = feeds.get(summary.replica)
        replicas.append(
            ReplicaStats(
                replica=summary.replica,
                block_size=summary.block_size,
                entries=summary.entries,
                entries_by_tier=summary.entries_by_tier,
                feed=None if feed is None else feed.snapshot(),
            )
        )
        for tier, n in summary.entries_by_tier.items():
            by_tier[tier] = by_tier.get(tier, 0) + n
    for name, feed in feeds.items():
        if name not in seen:
            replicas.append(ReplicaStats(name, None, 0, dict.fromkeys(by_tier, 0), feed.snapshot()))
    entries = sum(r.entries for r in replicas)
    estimated = index.estimated_bytes()
    freshness: dict[str, int] = {}
    for feed in feeds.values():
        freshness[feed.freshness.value] = freshness.get(feed.freshness.value, 0) + 1
    mem = index if isinstance(index, InMemoryPrefixIndex) else None
    return IndexStats(
        taken_at=time.time(),
        replicas=replicas,
        entries=entries,
        entries_by_tier=by_tier,
        distinct_blocks=mem.distinct_blocks if mem else None,
        max_entries=mem.max_entries if mem else None,
        evicted_entries=mem.evicted_entries if mem else None,
        estimated_bytes=estimated,
        bytes_per_entry=round(estimated / entries, 1) if entries else None,
        events_applied=sum(f.events_applied for f in feeds.values()),
        events_rejected=sum(f.events_rejected for f in feeds.values()),
        malformed_messages=sum(f.malformed_messages for f in feeds.values()),
        gaps=sum(f.gaps for f in feeds.values()),
        replays=sum(f.replays for f in feeds.values()),
        replay_failures=sum(f.replay_failures for f in feeds.values()),
        resets=sum(f.resets for f in feeds.values()),
        freshness=freshness,
    )
