"""``IndexStats``: one snapshot of the index and its feeds, the body of ``/index/stats``.

Built from outside the index (it only reads the index's summary and the feeds' counters), so
the index stays a plain data structure and the stats can grow without touching it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from kvroute.indexer.index import DOMAIN_PREFIX, PrefixIndex, domain_key
from kvroute.indexer.subscriber import EventSubscriber
from kvroute.indexer.tiers import Tier

__all__ = ["IndexStats", "ReplicaStats", "collect_stats"]


@dataclass(slots=True)
class ReplicaStats:
    replica: str
    block_size: int | None
    entries: int
    entries_by_tier: dict[str, int]
    feed: dict[str, Any] | None
    unconfirmed_by_tier: dict[str, int] = field(default_factory=dict)
    partial_unit: int | None = None
    chunk_blocks: dict[str, int] = field(default_factory=dict)
    streams: dict[str, dict[str, Any]] = field(default_factory=dict)


@dataclass(slots=True)
class IndexStats:
    taken_at: float
    replicas: list[ReplicaStats]
    entries: int
    entries_by_tier: dict[str, int]
    distinct_blocks: int
    max_entries: int
    evicted_entries: int
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
    unconfirmed_by_tier: dict[str, int] = field(default_factory=dict)
    unconfirmed_ttl_s: float = 0.0
    unconfirmed_max_blocks: int = 0
    expired_unconfirmed_blocks: int = 0
    unknown_media: dict[str, int] = field(default_factory=dict)
    unknown_event_types: dict[str, int] = field(default_factory=dict)
    distrust_clears: int = 0
    unresolved_blocks: int = 0
    # batches publishers numbered but never sent or buffered (see FeedStats.lost_batches)
    lost_batches: int = 0
    # CPU blocks a replica's answer proved gone (a connector reset nothing announced)
    refuted_cpu_blocks: int = 0
    # storage domain -> blocks held, replicas attached, its evictor feed
    storage_domains: dict[str, dict[str, Any]] = field(default_factory=dict)
    # "native" (C++) or "python": which index core runs (docs/indexer.md, "Native core")
    index_core: str = "python"

    def to_dict(self) -> dict[str, Any]:
        return {
            "taken_at": self.taken_at,
            "fleet": {
                "index_core": self.index_core,
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
                # Gaps no replay can fill, because the publisher never buffered the batch:
                # kept, not cleared (docs/indexer.md, "Batches lost at the source").
                "lost_batches": self.lost_batches,
                # CPU blocks a replica's answer proved its connector no longer holds (a
                # reset sent to it directly: docs/indexer.md, "How wrong the index may be")
                "refuted_cpu_blocks": self.refuted_cpu_blocks,
                "replays": self.replays,
                "replay_failures": self.replay_failures,
                "resets": self.resets,
                "freshness": self.freshness,
                "unresolved_blocks": self.unresolved_blocks,
                "unknown_media": self.unknown_media,
                # Events of a type the decoder does not know, and the clears of lower tiers
                # they caused (such an event may have changed what the index held)
                "unknown_event_types": self.unknown_event_types,
                "distrust_clears": self.distrust_clears,
                # Tiers whose publishers never announce removals: believed until they age out.
                "unconfirmed": {
                    "entries_by_tier": self.unconfirmed_by_tier,
                    "ttl_s": self.unconfirmed_ttl_s,
                    "max_blocks_per_replica": self.unconfirmed_max_blocks,
                    "expired_blocks": self.expired_unconfirmed_blocks,
                },
            },
            "replicas": {
                r.replica: {
                    "block_size": r.block_size,
                    "partial_unit": r.partial_unit,
                    "entries": r.entries,
                    "entries_by_tier": r.entries_by_tier,
                    "unconfirmed_entries_by_tier": r.unconfirmed_by_tier,
                    "chunk_blocks": r.chunk_blocks,
                    "feed": r.feed,
                    "streams": r.streams,
                }
                for r in self.replicas
            },
            "storage_domains": self.storage_domains,
        }


def collect_stats(index: PrefixIndex, subscriber: EventSubscriber | None = None) -> IndexStats:
    feeds = subscriber.feed_stats() if subscriber is not None else {}
    streams = subscriber.stream_stats() if subscriber is not None else {}
    replicas: list[ReplicaStats] = []
    by_tier: dict[str, int] = {t.label(): 0 for t in Tier}
    unconfirmed: dict[str, int] = {t.label(): 0 for t in Tier}
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
                unconfirmed_by_tier=summary.unconfirmed_by_tier,
                partial_unit=summary.partial_unit,
                chunk_blocks=summary.chunk_blocks,
                streams={
                    name: s.snapshot() for name, s in streams.get(summary.replica, {}).items()
                },
            )
        )
        for tier, n in summary.entries_by_tier.items():
            by_tier[tier] = by_tier.get(tier, 0) + n
        for tier, n in summary.unconfirmed_by_tier.items():
            unconfirmed[tier] = unconfirmed.get(tier, 0) + n
    for name, feed in feeds.items():
        if name not in seen and not name.startswith(DOMAIN_PREFIX):
            replicas.append(ReplicaStats(name, None, 0, dict.fromkeys(by_tier, 0), feed.snapshot()))
    every_feed = list(feeds.values()) + [f for s in streams.values() for f in s.values()]
    unknown_media: dict[str, int] = {}
    for f in every_feed:
        for medium, n in f.unknown_media.items():
            unknown_media[medium] = unknown_media.get(medium, 0) + n
    unknown_types: dict[str, int] = {}
    for f in every_feed:
        for tag, n in f.unknown_event_types.items():
            unknown_types[tag] = unknown_types.get(tag, 0) + n
    entries = sum(r.entries for r in replicas)
    figures = index.stats()
    estimated = figures.estimated_bytes
    domains: dict[str, dict[str, Any]] = {}
    for d in index.domains():
        feed = feeds.get(domain_key(d.domain))
        # One entry per layout a domain holds chunks of: "NAME", "NAME#LAYOUT".
        domains[domain_key(d.domain, d.layout)[len(DOMAIN_PREFIX) :]] = {
            "block_size": d.block_size,
            "blocks": d.blocks,
            "unconfirmed_blocks": d.unconfirmed_blocks,
            "chunk_blocks": d.chunk_blocks,
            "layout": d.layout,
            "attached": d.attached,
            # None: no evictor feed configured (nothing removes what the index cannot see);
            # one evictor feed serves every layout of its domain.
            "feed": None if feed is None else feed.snapshot(),
        }
    for name, feed in feeds.items():
        if name.startswith(DOMAIN_PREFIX) and name[len(DOMAIN_PREFIX) :] not in domains:
            domains[name[len(DOMAIN_PREFIX) :]] = {
                "block_size": None,
                "blocks": 0,
                "unconfirmed_blocks": 0,
                "chunk_blocks": None,
                "layout": None,
                "attached": [],
                "feed": feed.snapshot(),
            }
    freshness: dict[str, int] = {}
    for feed in feeds.values():
        freshness[feed.freshness.value] = freshness.get(feed.freshness.value, 0) + 1
    return IndexStats(
        taken_at=time.time(),
        replicas=replicas,
        entries=entries,
        entries_by_tier=by_tier,
        distinct_blocks=figures.distinct_blocks,
        max_entries=figures.max_entries,
        evicted_entries=figures.evicted_entries,
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
        unconfirmed_by_tier=unconfirmed,
        unconfirmed_ttl_s=figures.unconfirmed_ttl_s,
        unconfirmed_max_blocks=figures.unconfirmed_max_blocks,
        expired_unconfirmed_blocks=figures.expired_unconfirmed_blocks,
        unknown_media=unknown_media,
        unknown_event_types=unknown_types,
        distrust_clears=sum(f.distrust_clears for f in every_feed),
        unresolved_blocks=sum(f.unresolved_blocks for f in every_feed),
        lost_batches=sum(f.lost_batches for f in every_feed),
        refuted_cpu_blocks=figures.refuted_cpu_blocks,
        storage_domains=domains,
        index_core=figures.index_core,
    )
