"""One replica stream's state machine: its freshness, and its messages applied in order.

Sequence handling (vLLM numbers batches from 0 in every process, +1 per batch):
- next expected: apply.
- ahead (a gap): ask the replica's replay socket for the missing batches; if that fails or the
  replica no longer buffers them, clear the replica and rebuild from live events (state
  ``rebuilding``), rather than trusting a view with holes in it.
- behind: a batch we already have from a replay (skipped), or the replica restarted (a reset:
  clear, then replay the new process's history from 0).
How each replay is asked for and taken is ``recovery.py``'s.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kvroute.indexer.index import PrefixIndex
from kvroute.indexer.subscriber.budget import ByteBudget
from kvroute.indexer.subscriber.recovery import FeedRecovery, _digest
from kvroute.indexer.subscriber.types import EventSource, FeedStats, Freshness, WarmOutcome
from kvroute.indexer.wire import EventBatch, Frame, WireError, decode_batch, decode_frames

__all__ = ["ReplicaFeed"]

log = logging.getLogger(__name__)


def _per_s(rate: float) -> str:
    return f"{rate / 2**20:.1f} MiB/s" if rate >= 2**20 else f"{rate / 1024:.1f} KiB/s"


class ReplicaFeed(FeedRecovery):
    """The state machine of one replica's stream; ``handle`` is pure given the replay hook.

    Kept separate from the socket loop so it can be driven directly in tests.
    """

    def __init__(
        self,
        source: EventSource,
        index: PrefixIndex,
        replay: Callable[[int], list[Frame] | None] | None = None,
        budget: ByteBudget | None = None,
    ) -> None:
        self.source = source
        self.index = index
        self.replay = replay
        self.budget = budget
        self._throttled = False
        self.stats = FeedStats()
        self.expected: int | None = None
        self._replayed: tuple[int, int] | None = None  # seqs [lo, hi) obtained by replay
        self._last_digest: int | None = None  # of the last applied payload (restart check)
        self.lock = threading.Lock()
        # Warm start: the position a peer's snapshot was taken at, until the replay confirms
        # it (``_verify_seed``); then what came of it.
        self._seeded = False
        self.warm: WarmOutcome | None = None

    # --- state transitions --------------------------------------------------------------------

    def _set(self, freshness: Freshness, reason: str) -> None:
        if freshness != self.stats.freshness or reason != self.stats.reason:
            log.info("replica %s: %s (%s)", self.source.replica, freshness.value, reason)
        self.stats.freshness = freshness
        self.stats.reason = reason

    def _clear(self, reason: str, *, restarted: bool = False) -> None:
        """Forget what this stream can no longer vouch for, and rebuild from live events."""
        self._forget(restarted=restarted)
        self._set(Freshness.REBUILDING, reason)

    def _forget(self, *, restarted: bool) -> None:
        self.index.clear_source(self.source.replica, self.source.stream, restarted=restarted)
        self.stats.clears += 1
        if self._seeded:  # cleared before it was checked: nothing of the snapshot is left
            self._seeded = False
            assert self.warm is not None
            self.warm.outcome = "cleared before it was checked"
            self.warm.settled_at = time.monotonic()

    def on_disconnected(self) -> None:
        """The publisher's connection went down."""
        with self.lock:
            if self.stats.freshness is not Freshness.CONNECTING:
                self._set(Freshness.STALE, "publisher disconnected; entries kept until it returns")

    def on_gone(self, after_s: float) -> None:
        """The publisher stayed away ``after_s``: what it published is no longer believed."""
        with self.lock:
            if self.stats.freshness is Freshness.STALE:
                self._forget(restarted=True)
                self.stats.reason = f"publisher gone for over {after_s:.0f}s: cleared"

    def on_connected(self) -> None:
        """The publisher's connection is up: a reconnect catches up (``_resync``), a first
        connection joins (``bootstrap``)."""
        with self.lock:
            if self.stats.freshness is Freshness.STALE:
                self._set(Freshness.SYNCING, "publisher reconnected; waiting for the next batch")
                self._resync()
            else:
                self._bootstrap()

    def on_replica_down(self, reason: str) -> None:
        """The replica was seen to die (from outside the stream): what it published is gone
        with it, and its next process rebuilds from live events."""
        with self.lock:
            self._clear(reason, restarted=True)

    def on_crash(self) -> None:
        """The socket loop died: nothing more will arrive, so nothing held is believed."""
        with self.lock:
            self._clear("feed thread crashed; see the log")
            self._set(Freshness.STALE, "feed thread crashed; see the log")

    def expire(self) -> None:
        """Drop the replica's unconfirmed holdings past their time."""
        self.index.expire(self.source.replica)

    def note_malformed(self, reason: str) -> None:
        """A message that could not be decoded at all (live, or a replay's reply)."""
        self.stats.malformed_messages += 1
        self.stats.rejected_reasons[f"malformed message: {reason}"] += 1

    # --- messages ---------------------------------------------------------------------------------

    def handle_frames(self, frames: list[bytes]) -> None:
        if self.budget is not None:
            size = sum(len(f) for f in frames)
            with self.lock:
                if not self._admit(self.budget, size):
                    self._throttle(size)
                    return
        try:
            frame = decode_frames(frames)
        except WireError as exc:
            self.note_malformed(str(exc))
            return
        self.handle(frame)

    def handle(self, frame: Frame) -> None:
        with self.lock:
            self._handle(frame)

    def _admit(self, budget: ByteBudget, size: int) -> bool:
        """Whether a live message of ``size`` bytes is within the stream's budget.

        A throttled stream stays so until its publisher has been under the rate long enough
        to half refill the bucket (what it sends meanwhile is counted against it, down to one
        bucket of debt): a steady flood is dropped whole rather than let through in slices,
        each of which would rebuild the stream only to clear it again.
        """
        if self._throttled and budget.level < budget.burst / 2:
            budget.charge(size, floor=-budget.burst)
            return False
        return budget.take(size)

    def _throttle(self, size: int) -> None:
        """Drop a message over the stream's budget; the first of a run clears the stream,
        since the index can no longer vouch for what the dropped batches changed."""
        self.stats.throttled_messages += 1
        self.stats.throttled_bytes += size
        if self._throttled:
            return
        self._throttled = True
        self.stats.throttles += 1
        assert self.budget is not None
        self._forget(restarted=False)
        self._set(
            Freshness.THROTTLED,
            f"publisher over its event budget ({_per_s(self.budget.rate)}): "
            "cleared, its batches dropped until it slows down",
        )

    def _handle(self, frame: Frame) -> None:
        if self.source.topic and not frame.topic.startswith(self.source.topic):
            self.stats.foreign_topic += 1
            return
        if self._seeded:
            self._verify_seed()  # the first live batch came before the connection's event
        if self._throttled:
            self._on_slowed_down(frame.seq)
        seq = frame.seq
        expected = self.expected
        if expected is None:
            if seq == 0:
                self._apply(frame)
                self._set(Freshness.LIVE, "in sync since the replica's first batch")
            else:
                self._catch_up(0, frame, f"joined at seq {seq}: replaying 0..{seq - 1}")
            return
        if seq == expected:
            # SUB delivers in order: once the next live batch is here, nothing a replay
            # already delivered can arrive again, and a later lower seq means a restart.
            self._replayed = None
            self._apply(frame)
            if self.stats.freshness in (Freshness.SYNCING, Freshness.STALE):
                self._set(Freshness.LIVE, "in sync")
            return
        if seq > expected:
            self.stats.gaps += 1
            self._catch_up(expected, frame, f"gap: batches {expected}..{seq - 1} missing")
            return
        replayed = self._replayed
        if replayed is not None and replayed[0] <= seq < replayed[1]:
            self.stats.duplicates += 1
            return
        # The replica's sequence went backwards: it restarted.
        self._on_restart()
        if seq == 0:
            self._apply(frame)
            self._set(Freshness.LIVE, f"replica restarted (seq {expected - 1} -> 0); index rebuilt")
        else:
            self._catch_up(0, frame, f"replica restarted (seq {expected - 1} -> {seq}); replaying")

    def _advance(self, frame: Frame) -> None:
        """Take ``frame`` as the latest batch in sequence (applied or moot)."""
        self.expected = frame.seq + 1
        self._last_digest = _digest(frame.payload)
        self.stats.last_seq = frame.seq
        self.stats.batches += 1

    def _apply(self, frame: Frame, first_event: int = 0) -> None:
        """Apply the batch's events from ``first_event`` on (earlier ones are moot)."""
        self._advance(frame)
        try:
            batch: EventBatch = decode_batch(frame.payload)
        except WireError as exc:
            self.stats.malformed_messages += 1
            self.stats.rejected_reasons[str(exc)] += 1
            return
        for reason in batch.rejected:
            self.stats.rejected_reasons[reason] += 1
        self.stats.events_rejected += len(batch.rejected)
        if batch.unknown_media:
            self.stats.unknown_media.update(batch.unknown_media)
        if batch.unknown_types:
            self.stats.unknown_event_types.update(batch.unknown_types)
        events = batch.events[first_event:] if first_event else batch.events
        result = self.index.apply(self.source.replica, events, source=self.source.stream)
        self.stats.events_applied += result.applied
        self.stats.events_rejected += len(result.rejected)
        for reason in result.rejected:
            self.stats.rejected_reasons[reason] += 1
        self.stats.blocks_stored += result.blocks_stored
        self.stats.blocks_removed += result.blocks_removed
        self.stats.device_clears += result.device_cleared
        self.stats.unresolved_blocks += result.unresolved
        self.stats.partial_blocks += result.partial_blocks
        self.stats.unconfirmed_blocks += result.unconfirmed_blocks
        self.stats.ignored_events += result.ignored
        self.stats.distrust_clears += result.distrusted
        self.stats.last_event_wall = time.time()
        self.stats.last_event_ts = batch.ts
