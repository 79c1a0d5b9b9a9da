"""The values the subscriber hands out: where a replica publishes (``EventSource``), a feed's
freshness and counters, the position a snapshot was taken at, what came of a warm start, and
``FeedHealth``, the read-only view of the feeds the router needs."""

from __future__ import annotations

import enum
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from kvroute.indexer.snapshot import ReplicaState

__all__ = [
    "EventSource",
    "FeedHealth",
    "FeedStats",
    "Freshness",
    "ReplicaSnapshot",
    "WarmOutcome",
]


class Freshness(enum.StrEnum):
    CONNECTING = "connecting"  # no publisher seen yet
    SYNCING = "syncing"  # replaying missed batches
    LIVE = "live"  # every batch since the replica started is applied
    REBUILDING = "rebuilding"  # history was lost and cleared; live events are refilling it
    STALE = "stale"  # publisher gone: entries kept but may no longer be true
    THROTTLED = "throttled"  # publisher over its event budget: cleared, its batches dropped


@dataclass(frozen=True, slots=True)
class EventSource:
    """Where a replica publishes: ``endpoint`` is what the SUB socket connects to."""

    replica: str
    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""
    # Which of the replica's streams: "" is vLLM's own; others (llm-d's FS backend) are named
    # by their endpoint.
    stream: str = ""


@dataclass(slots=True)
class FeedStats:
    """Counters of one replica's feed (what /index/stats shows per replica)."""

    freshness: Freshness = Freshness.CONNECTING
    reason: str = "waiting for the first event batch"
    batches: int = 0
    events_applied: int = 0
    events_rejected: int = 0
    blocks_stored: int = 0
    blocks_removed: int = 0
    unresolved_blocks: int = 0
    partial_blocks: int = 0
    unconfirmed_blocks: int = 0
    ignored_events: int = 0
    malformed_messages: int = 0
    foreign_topic: int = 0
    duplicates: int = 0
    gaps: int = 0
    missed_batches: int = 0
    # Batches the publisher numbered but never buffered (vLLM's publisher drops a batch it
    # cannot encode, such as LMCache's tensor-path events): proven lost at the source by a
    # replay that holds the batches on both sides of the hole.
    lost_batches: int = 0
    replays: int = 0
    replay_failures: int = 0
    resets: int = 0
    clears: int = 0
    device_clears: int = 0  # AllBlocksCleared of the device tier (vLLM's prefix cache reset)
    moot_batches: int = 0
    throttles: int = 0
    throttled_messages: int = 0
    throttled_bytes: int = 0
    last_seq: int | None = None
    last_event_wall: float | None = None
    last_event_ts: float | None = None
    rejected_reasons: Counter[str] = field(default_factory=Counter)
    unknown_media: Counter[str] = field(default_factory=Counter)
    # events of a type no wire definition has, by type; and the lower-tier clears they caused
    unknown_event_types: Counter[str] = field(default_factory=Counter)
    distrust_clears: int = 0

    def snapshot(self) -> dict[str, object]:
        now = time.time()
        return {
            "freshness": self.freshness.value,
            "reason": self.reason,
            "batches": self.batches,
            "events_applied": self.events_applied,
            "events_rejected": self.events_rejected,
            "blocks_stored": self.blocks_stored,
            "blocks_removed": self.blocks_removed,
            "unresolved_blocks": self.unresolved_blocks,
            "partial_blocks": self.partial_blocks,
            "unconfirmed_blocks": self.unconfirmed_blocks,
            "ignored_events": self.ignored_events,
            "malformed_messages": self.malformed_messages,
            "foreign_topic": self.foreign_topic,
            "duplicates": self.duplicates,
            "gaps": self.gaps,
            "missed_batches": self.missed_batches,
            "lost_batches": self.lost_batches,
            "replays": self.replays,
            "replay_failures": self.replay_failures,
            "resets": self.resets,
            "clears": self.clears,
            "device_clears": self.device_clears,
            "moot_batches": self.moot_batches,
            "throttles": self.throttles,
            "throttled_messages": self.throttled_messages,
            "throttled_bytes": self.throttled_bytes,
            "last_seq": self.last_seq,
            "last_event_age_s": None
            if self.last_event_wall is None
            else round(now - self.last_event_wall, 3),
            "rejected_reasons": dict(self.rejected_reasons.most_common(10)),
            "unknown_media": dict(self.unknown_media.most_common(10)),
            "unknown_event_types": dict(self.unknown_event_types.most_common(10)),
            "distrust_clears": self.distrust_clears,
        }


@dataclass(frozen=True, slots=True)
class ReplicaSnapshot:
    """A replica's index state and where its feed stood when it was taken."""

    source: EventSource
    last_seq: int
    digest: int
    state: ReplicaState


@dataclass(slots=True)
class WarmOutcome:
    """What came of seeding a feed from a peer's snapshot (``/index/stats``' ``start``)."""

    outcome: str  # "pending", "verified", or why the snapshot was dropped
    snapshot_seq: int
    gap_batches: int = 0
    settled_at: float | None = None  # time.monotonic() when the outcome was known


@runtime_checkable
class FeedHealth(Protocol):
    """What the router reads of the feeds (``EventSubscriber`` has it): each replica's
    freshness, and every feed's counters. Read-only: nothing through it starts, stops or
    clears a feed."""

    def freshness(self, replica: str) -> tuple[Freshness, str]:
        """The replica's freshness and why: that of vLLM's own stream (``stream=""``)."""
        ...

    def all_feed_stats(self) -> dict[tuple[str, str], FeedStats]:
        """Every feed's stats by (replica, stream)."""
        ...
