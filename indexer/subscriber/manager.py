"""``EventSubscriber``: every replica's feeds into one index, added and removed at run time.

A replica may publish on several streams (llm-d's FS backend has a socket of its own): each has
its own feed, sequence and freshness; the first (``stream=""``, vLLM's own) is the replica's
freshness. A feed that loses history clears only what its stream can no longer vouch for
(``PrefixIndex.clear_source``).
"""

from __future__ import annotations

import logging
import threading

import zmq

from kvroute.indexer.index import PrefixIndex
from kvroute.indexer.snapshot import SnapshotError
from kvroute.indexer.subscriber.budget import ByteBudget
from kvroute.indexer.subscriber.sockets import MAX_MESSAGE_BYTES, _FeedThread
from kvroute.indexer.subscriber.types import (
    EventSource,
    FeedStats,
    Freshness,
    ReplicaSnapshot,
    WarmOutcome,
)

__all__ = ["MAX_BYTES_PER_S", "EventSubscriber"]

log = logging.getLogger(__name__)

# The most bytes per second one stream may make the indexer decode (budget.py); a real vLLM
# replica sends well under 1 MiB/s. Bursts up to max(2 s of it, one largest message) pass.
MAX_BYTES_PER_S = 8 * 1024 * 1024


class EventSubscriber:
    """All replicas' feeds into one index; add and remove replicas and streams at run time."""

    def __init__(
        self,
        index: PrefixIndex,
        *,
        context: zmq.Context | None = None,
        replay_timeout_s: float = 5.0,
        stale_clear_after_s: float = 30.0,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        max_bytes_per_s: float | None = MAX_BYTES_PER_S,
    ) -> None:
        self.index = index
        self.max_message_bytes = max_message_bytes
        self.max_bytes_per_s = max_bytes_per_s
        self.ctx = context or zmq.Context.instance()
        self.replay_timeout_s = replay_timeout_s
        self.stale_clear_after_s = stale_clear_after_s
        self._threads: dict[tuple[str, str], _FeedThread] = {}
        self._lock = threading.Lock()

    def add_source(self, source: EventSource, seed: tuple[int, int] | None = None) -> None:
        """Start (or re-point) the feed of one of a replica's streams; ``seed``: (seq,
        digest) of the last batch a peer's snapshot applied, already imported into the
        index (``ReplicaFeed.seed``). A feed already running ignores it."""
        key = (source.replica, source.stream)
        with self._lock:
            old = self._threads.get(key)
            if old is not None:
                if old.feed.source == source:
                    return
                self._stop(key)
            rate = self.max_bytes_per_s
            budget = None if not rate else ByteBudget(rate, max(2 * rate, self.max_message_bytes))
            thread = _FeedThread(
                source,
                self.index,
                self.ctx,
                budget=budget,
                replay_timeout_s=self.replay_timeout_s,
                max_message_bytes=self.max_message_bytes,
                stale_clear_after_s=self.stale_clear_after_s,
            )
            if seed is not None and old is None:
                thread.feed.seed(*seed)
            self._threads[key] = thread
            thread.start()

    def seed_replica(self, replica: str, source: EventSource, snapshot: ReplicaSnapshot) -> bool:
        """Start the replica's only stream, ``source``, from a peer's snapshot: import its
        index state whole, then start the feed at the snapshot's position (it first checks
        that position against the replay). False, and nothing done, when the replica already
        has a feed or its state is refused (the caller starts it the normal way)."""
        with self._lock:
            if any(k[0] == replica for k in self._threads):
                return False
        try:
            self.index.import_replica(replica, snapshot.state)
        except (SnapshotError, NotImplementedError) as exc:
            log.warning("replica %s: peer snapshot refused (%s): replaying instead", replica, exc)
            return False
        self.add_source(source, seed=(snapshot.last_seq, snapshot.digest))
        return True

    def export_replica(self, replica: str) -> ReplicaSnapshot | None:
        """A snapshot of the replica for a peer: its index state with the position of the
        feed that built it, taken under the feed's lock so the two agree. None unless the
        replica has exactly one stream, with a replay socket (the peer checks the snapshot
        with it), and that stream is live."""
        with self._lock:
            threads = [t for k, t in self._threads.items() if k[0] == replica]
        if len(threads) != 1 or threads[0].feed.source.stream or not threads[0].feed.replay:
            return None
        feed = threads[0].feed
        with feed.lock:
            position = feed.position()
            if position is None:
                return None
            try:
                state = self.index.export_replica(replica)
            except SnapshotError as exc:
                log.error("replica %s cannot be exported: %s", replica, exc)
                return None
        if state is None:
            return None
        return ReplicaSnapshot(feed.source, position[0], position[1], state)

    def warm_outcomes(self) -> dict[str, WarmOutcome]:
        """What came of every feed seeded from a peer's snapshot, by replica."""
        with self._lock:
            feeds = [(k[0], t.feed) for k, t in self._threads.items()]
        return {name: feed.warm for name, feed in feeds if feed.warm is not None}

    def set_sources(self, replica: str, sources: list[EventSource]) -> None:
        """The replica's streams are exactly ``sources``: start new ones, stop the others."""
        wanted = {(s.replica, s.stream) for s in sources}
        with self._lock:
            gone = [k for k in self._threads if k[0] == replica and k not in wanted]
            for key in gone:
                self._stop(key)
        for key in gone:
            self.index.clear_source(replica, key[1], restarted=True)
        for source in sources:
            self.add_source(source)

    def _stop(self, key: tuple[str, str]) -> None:
        thread = self._threads.pop(key, None)
        if thread is not None:
            thread.stop_event.set()
            thread.join(timeout=5)

    def remove_source(self, replica: str) -> None:
        """Stop every stream of the replica and forget it."""
        with self._lock:
            for key in [k for k in self._threads if k[0] == replica]:
                self._stop(key)
        self.index.remove_replica(replica)

    def clear_replica(self, replica: str, reason: str) -> None:
        """Drop a replica's entries from outside (e.g. the router saw it die)."""
        with self._lock:
            feeds = [t.feed for k, t in self._threads.items() if k[0] == replica]
        if not feeds:
            self.index.clear_replica(replica)
            return
        for feed in feeds:
            feed.on_replica_down(reason)

    def sources(self) -> list[EventSource]:
        with self._lock:
            return [t.feed.source for t in self._threads.values()]

    def freshness(self, replica: str) -> tuple[Freshness, str]:
        """The replica's freshness: that of vLLM's own stream."""
        thread = self._threads.get((replica, ""))
        if thread is None:
            return Freshness.STALE, "no event source configured"
        stats = thread.feed.stats
        return stats.freshness, stats.reason

    def feed_stats(self) -> dict[str, FeedStats]:
        """The main stream's feed of every replica."""
        with self._lock:
            return {k[0]: t.feed.stats for k, t in self._threads.items() if not k[1]}

    def all_feed_stats(self) -> dict[tuple[str, str], FeedStats]:
        """Every feed's stats by (replica, stream)."""
        with self._lock:
            return {k: t.feed.stats for k, t in self._threads.items()}

    def stream_stats(self) -> dict[str, dict[str, FeedStats]]:
        """Every other stream's feed, per replica (replica -> stream -> stats)."""
        out: dict[str, dict[str, FeedStats]] = {}
        with self._lock:
            for (replica, stream), t in self._threads.items():
                if stream:
                    out.setdefault(replica, {})[stream] = t.feed.stats
        return out

    def close(self) -> None:
        with self._lock:
            for key in list(self._threads):
                self._stop(key)

    def __enter__(self) -> EventSubscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
