"""Feeds the index from every replica's KV-event stream.

One thread per replica (``ReplicaFeed``): a ZMQ SUB socket on the replica's publisher, applied
in sequence order, so one replica's events are never reordered while replicas proceed in
parallel and a slow replay of one never holds up another. Nothing here runs on the router's
asyncio loop; the only shared state is the index, which has its own lock.

Sequence handling (vLLM numbers batches from 0 in every process, +1 per batch):
- next expected: apply.
- ahead (a gap): ask the replica's replay socket for the missing batches; if that fails or the
  replica no longer buffers them, clear the replica and rebuild from live events (state
  ``rebuilding``), rather than trusting a view with holes in it.
- behind: a batch we already have from a replay (skipped), or the replica restarted (a reset:
  clear, then replay the new process's history from 0).
Joining: on first connecting, the feed asks the replay socket for everything from 0 at once
(``bootstrap``) rather than waiting for the replica's next batch, so a router started while the
fleet is idle knows its caches before the first request. A first live message with seq > 0 (the
join replay was not answered) is a gap from 0. A feed seeded from a peer router's snapshot
(warm start, ``seed``) joins instead by asking the replay for the snapshot's last batch: the
same payload proves the same process, and only the batches after it are applied.

When the replay no longer holds the start of a hole, the batches it still holds up to the live
one are applied to the cleared replica (their blocks are true; chains that began in the lost
part stay unresolved), and the feed is ``rebuilding``, unless those batches include a full
clear, after which nothing was lost.

A replay may hold thousands of batches (vLLM buffers 10,000). ``AllBlocksCleared`` (vLLM's
block pool on ``/reset_prefix_cache``) clears the device tier; when no batch before the last one
touched another tier, that history cannot change what the index holds once the clear is
applied, so those batches only advance the sequence (``moot_batches``): a router joining a busy
fleet whose caches were reset does not re-key their history.

A replica may publish on several streams (llm-d's FS backend has a socket of its own): each has
its own feed, sequence and freshness; the first (``stream=""``, vLLM's own) is the replica's
freshness. A feed that loses history clears only what its stream can no longer vouch for
(``PrefixIndex.clear_source``).
"""

from __future__ import annotations

import contextlib
import enum
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import xxhash
import zmq
from zmq.utils.monitor import recv_monitor_message

from kvroute.indexer.budget import ByteBudget
from kvroute.indexer.cpu_priority import as_background_work
from kvroute.indexer.index import PrefixIndex
from kvroute.indexer.snapshot import ReplicaState, SnapshotError
from kvroute.indexer.wire import (
    EventBatch,
    Frame,
    WireError,
    decode_batch,
    decode_frames,
    decode_replay_reply,
    is_device_clear,
    payload_hints,
    touches_lower_tier,
)
from kvroute.indexer.wire import encode_replay_request as _replay_request

__all__ = [
    "EventSource",
    "EventSubscriber",
    "FeedStats",
    "Freshness",
    "ReplicaFeed",
    "ReplicaSnapshot",
    "WarmOutcome",
    "moot_prefix",
]

log = logging.getLogger(__name__)
_digest = xxhash.xxh3_64_intdigest
# How often a feed's thread drops the replica's unconfirmed holdings past their time.
_EXPIRE_EVERY_S = 1.0
# The largest event message accepted from a publisher. vLLM sends one batch per engine step;
# even a 128k-token prefill's batch is well under 2 MiB.
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
# libzmq reconnects a peer that went away by itself, but never one it dropped for a protocol
# error (a frame past MAXMSGSIZE): a connection down this long is re-made by hand.
_RECONNECT_AFTER_S = 3.0
# The most bytes per second one stream may make the indexer decode (indexer/budget.py); a
# real vLLM replica sends well under 1 MiB/s. Bursts up to max(2 s of it, one largest
# message) pass.
MAX_BYTES_PER_S = 8 * 1024 * 1024
# A replay is vLLM's buffer of past batches (10,000 by default): a reply longer than this is
# not a replay but a publisher that never stops answering.
MAX_REPLAY_FRAMES = 65_536
# Live messages ZMQ may queue per feed (see _FeedThread.run).
_RCVHWM = 1_000


def moot_prefix(frames: Sequence[Frame]) -> tuple[int, int] | None:
    """Where the history of ``frames`` (consecutive, oldest first) stops mattering: (position
    of the batch holding the last device clear, position of that event in it), when no event
    before it touched a tier other than the device; else None. Every event before that point
    is moot once the clear is applied."""
    for i in range(len(frames) - 1, -1, -1):
        has_clear, _ = payload_hints(frames[i].payload)
        if not has_clear:
            continue
        try:
            events = decode_batch(frames[i].payload).events
        except WireError:
            continue  # applied in turn, and counted as malformed there
        for j in range(len(events) - 1, -1, -1):
            if is_device_clear(events[j]):
                if any(touches_lower_tier(e) for e in events[:j]) or any(
                    payload_hints(f.payload)[1] for f in frames[:i]
                ):
                    return None
                return i, j
    return None


def _run_to(by_seq: dict[int, Frame], start: int, end: int) -> list[Frame]:
    """The batches of ``by_seq`` that run without a hole up to ``end`` (inclusive), no
    further back than ``start``: the part of a replay that can be applied in order."""
    lo = end
    while lo > start and lo - 1 in by_seq:
        lo -= 1
    return [by_seq[s] for s in range(lo, end + 1)]


class Freshness(enum.StrEnum):
    CONNECTING = "connecting"  # no publisher seen yet
    SYNCING = "syncing"  # replaying missed batches
    LIVE = "live"  # every batch since the replica started is applied
    REBUILDING = "rebuilding"  # history was lost and cleared; live events are refilling it
    STALE = "stale"  # publisher gone: entries kept but may no longer be true
    THROTTLED = "throttled"  # publisher over its event budget: cleared, its batches dropped


def _per_s(rate: float) -> str:
    return f"{rate / 2**20:.1f} MiB/s" if rate >= 2**20 else f"{rate / 1024:.1f} KiB/s"


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


class ReplicaFeed:
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

    # --- warm start -----------------------------------------------------------------------------

    def seed(self, last_seq: int, digest: int) -> None:
        """Start from a peer's snapshot (already imported into the index): batch ``last_seq``
        (whose payload digest is ``digest``) was the last applied. Call before the feed's
        thread starts; the first thing the feed does is ``_verify_seed``."""
        with self.lock:
            self.expected = last_seq + 1
            self._last_digest = digest
            self.stats.last_seq = last_seq
            self._seeded = True
            self.warm = WarmOutcome("pending", last_seq)
            self.stats.reason = f"seeded from a peer's snapshot at seq {last_seq}; not yet checked"

    def _verify_seed(self) -> None:
        self._check_seed()
        assert self.warm is not None
        self.warm.settled_at = time.monotonic()

    def _check_seed(self) -> None:
        """Check the snapshot against the replica, then replay only what it lacks.

        The replay from the snapshot's last batch tells: if it starts with that batch,
        unchanged, the publisher is the process the snapshot saw (apply the batches after it:
        the gap); if not, the replica restarted since, or the snapshot lied (clear, replay its
        history from 0). A replay that does not answer proves nothing: clear, and join the
        normal way.
        """
        self._seeded = False
        assert self.expected is not None and self.warm is not None
        last = self.expected - 1
        self._set(Freshness.SYNCING, f"warm start: checking the snapshot's batch {last}")
        frames = self._ask_replay(last)
        if frames is None:
            self.stats.replay_failures += 1
            self.warm.outcome = "replay unavailable: snapshot dropped"
            self._forget(restarted=True)
            self.expected = None
            self._last_digest = None
            self.stats.last_seq = None
            self._set(
                Freshness.CONNECTING,
                "warm start: the replay did not answer, snapshot dropped; waiting for the "
                "first event batch",
            )
            return
        self.stats.replays += 1
        frames = sorted(frames, key=lambda f: f.seq)
        if frames and frames[0].seq == last and _digest(frames[0].payload) == self._last_digest:
            gap = [f for f in frames[1:] if f.seq >= self.expected]
            run = _run_to({f.seq: f for f in gap}, self.expected, gap[-1].seq) if gap else []
            if run and run[0].seq != self.expected:
                run = []  # a hole in the replay: the next live batch asks for it again
            if run:
                self._apply_history(run, moot_prefix(run))
            self.warm.outcome = "verified"
            self.warm.gap_batches = len(run)
            self._replayed = (last, self.expected)
            self._set(
                Freshness.LIVE,
                f"warm start from a peer's snapshot at seq {last}: replayed {len(run)} batches",
            )
            return
        self.warm.outcome = "replica restarted since the snapshot: full replay"
        self._on_restart()
        history = self._ask_replay(0)
        if history is None:
            self._set(Freshness.REBUILDING, "replica restarted; its new history is not replayable")
            return
        self.stats.replays += 1
        self._take_whole_history(history, "replica restarted since the peer's snapshot")

    def position(self) -> tuple[int, int] | None:
        """(last applied seq, its payload's digest) when the stream is live: where a
        snapshot of what it applied stands. Call with ``lock`` held."""
        if (
            self.stats.freshness is not Freshness.LIVE
            or self._seeded
            or self.expected is None
            or self._last_digest is None
        ):
            return None
        return self.expected - 1, self._last_digest

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

    def _resync(self) -> None:
        """After a reconnect, ask the replay socket what happened while we were away.

        A restarted replica may publish its first batches before our SUB socket reconnects
        and then stay idle: waiting for the next live batch would keep the dead process's
        entries indefinitely. The batch we applied last tells: if the replay still holds it
        unchanged, the publisher is the same process (apply what we missed); if not, it is a
        new process (reset, then replay its history from 0).
        """
        if self.expected is None or self.replay is None:
            return
        last = self.expected - 1
        frames = self._ask_replay(last)
        if frames is None:
            return  # cannot tell now: the next live batch decides
        self.stats.replays += 1
        frames = sorted(frames, key=lambda f: f.seq)
        if frames and frames[0].seq == last and _digest(frames[0].payload) == self._last_digest:
            for frame in frames[1:]:
                if frame.seq == self.expected:
                    self._apply(frame)
            self._replayed = (last, self.expected)
            self._set(Freshness.LIVE, "publisher reconnected; caught up from replay")
            return
        self._on_restart()
        history = self._ask_replay(0)
        if history is None:
            self._set(Freshness.REBUILDING, "replica restarted; its new history is not replayable")
            return
        self.stats.replays += 1
        self._take_whole_history(history, "replica restarted (found on reconnect)")

    def bootstrap(self) -> None:
        """Join: take the replica's history now (what ``on_connected`` does first time)."""
        with self.lock:
            self._bootstrap()

    def _bootstrap(self) -> None:
        """On first connecting, take the replica's history from the replay socket now.

        Waiting for the replica's next batch instead would leave a router that starts while
        the fleet is idle (a restart at night, one more router in an HA set) knowing no
        replica's cache, every feed ``connecting``, until each replica next stores or evicts.
        """
        if self._seeded:
            self._verify_seed()
            return
        if (
            self.replay is None
            or self.expected is not None
            or self.stats.freshness is not Freshness.CONNECTING
        ):
            return
        self._set(Freshness.SYNCING, "joining: replaying the replica's history")
        frames = self._ask_replay(0)
        if frames is None:
            self.stats.replay_failures += 1
            self._set(
                Freshness.CONNECTING,
                "the join replay was not answered; waiting for the first event batch",
            )
            return
        self.stats.replays += 1
        self._take_whole_history(frames, "joined")

    def _ask_replay(self, start: int) -> list[Frame] | None:
        """Every buffered batch from ``start`` (None: no answer). What was asked for is taken
        whole, so its bytes are charged to the stream's budget (see ``_admit``)."""
        if self.replay is None:
            return None
        frames = self.replay(start)
        if frames is not None and self.budget is not None:
            self.budget.charge(sum(len(f.payload) for f in frames))
        return frames

    def _on_restart(self) -> None:
        """The replica's process restarted: its cache is new and its batches count from 0."""
        self.stats.resets += 1
        self._forget(restarted=True)
        self.expected = None
        self._replayed = None

    def _on_slowed_down(self, seq: int) -> None:
        """A throttled publisher is under its budget again: rebuild from batch ``seq`` on. A
        replay of the dropped batches would be the flood again, and the stream was cleared,
        so nothing before it is owed."""
        self._throttled = False
        self.expected = seq
        self._replayed = None
        self._set(Freshness.REBUILDING, "publisher slowed down: rebuilding from live events")

    def _take_whole_history(self, history: list[Frame], why: str) -> None:
        """Take a replay from batch 0 as everything the replica process published."""
        by_seq = {f.seq: f for f in history if f.seq >= 0}
        if not by_seq:
            self._set(Freshness.LIVE, f"{why}: in sync, the replica has published nothing yet")
            return
        newest = max(by_seq)
        self._take_history(0, _run_to(by_seq, 0, newest), f"{why} at seq {newest}")

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

    def _catch_up(self, start: int, frame: Frame, why: str) -> None:
        """Fill [start, frame.seq) from the replay socket, then apply ``frame``."""
        self._set(Freshness.SYNCING, why)
        frames = self._ask_replay(start)
        if frames is None:
            self.stats.replay_failures += 1
            why = f"{why}; " + (
                "no replay endpoint" if self.replay is None else "replay failed or timed out"
            )
            self.stats.missed_batches += frame.seq - start
            self._clear(f"{why}: cleared, rebuilding from live events")
            self._apply(frame)
            return
        self.stats.replays += 1
        by_seq = {f.seq: f for f in frames if start <= f.seq}
        by_seq[frame.seq] = frame
        newest = frame.seq
        while newest + 1 in by_seq:  # later batches the replay already delivered
            newest += 1
        self._take_history(start, _run_to(by_seq, start, newest), why)

    def _take_history(self, start: int, run: list[Frame], why: str) -> None:
        """Apply ``run``, consecutive replayed batches up to the newest, as everything since
        ``start``. If the replay lost batches before it, what the stream vouches for is
        cleared and ``run`` refills it (``rebuilding``): even a device clear in ``run`` does
        not make the lost part moot, since it may have touched the lower tiers."""
        first = run[0].seq
        full_clear = moot_prefix(run)
        complete = first == start
        if not complete:
            self.stats.missed_batches += first - start
            self._clear(
                f"{why}; replay no longer holds batch {start}: cleared, rebuilding from "
                f"batches {first}..{run[-1].seq} and live events"
            )
        self._apply_history(run, full_clear)
        # Those batches arrive again live (SUB queued them meanwhile): skip them then.
        self._replayed = (first, self.expected or 0)
        if complete:
            self._set(Freshness.LIVE, f"{why}: in sync after replaying {len(run)} batches")

    def _apply_history(self, frames: Sequence[Frame], full_clear: tuple[int, int] | None) -> None:
        """Apply consecutive batches, skipping what the last device clear among them made
        moot (``full_clear``: ``moot_prefix(frames)``)."""
        cut, first_event = full_clear or (0, 0)
        for frame in frames[:cut]:
            self._advance(frame)
            self.stats.moot_batches += 1
        for k, frame in enumerate(frames[cut:]):
            self._apply(frame, first_event if k == 0 else 0)

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
        self.stats.last_event_wall = time.time()
        self.stats.last_event_ts = batch.ts


class _FeedThread(threading.Thread):
    """Socket loop of one replica: SUB + connection monitor + on-demand replay DEALER."""

    def __init__(
        self,
        source: EventSource,
        index: PrefixIndex,
        ctx: zmq.Context,
        *,
        budget: ByteBudget | None,
        replay_timeout_s: float,
        stale_clear_after_s: float,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
    ) -> None:
        name = source.replica + (f"-{source.stream}" if source.stream else "")
        super().__init__(name=f"kv-feed-{name}", daemon=True)
        self.ctx = ctx
        self.replay_timeout_s = replay_timeout_s
        self.stale_clear_after_s = stale_clear_after_s
        self.max_message_bytes = max_message_bytes
        self.stop_event = threading.Event()
        replay = self._replay if source.replay_endpoint else None
        self.feed = ReplicaFeed(source, index, replay=replay, budget=budget)

    def _replay(self, start: int) -> list[Frame] | None:
        """Ask the replay socket for every batch from ``start``; None when it does not answer."""
        endpoint = self.feed.source.replay_endpoint
        assert endpoint is not None
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
        frames: list[Frame] = []
        deadline = time.monotonic() + self.replay_timeout_s
        try:
            sock.connect(endpoint)
            sock.send_multipart(_replay_request(start))
            while not self.stop_event.is_set():
                left = deadline - time.monotonic()
                if left <= 0 or not sock.poll(int(left * 1000)):
                    return None
                try:
                    frame = decode_replay_reply(sock.recv_multipart())
                except WireError as exc:
                    self.feed.note_malformed(str(exc))
                    continue
                if frame is None:
                    return frames
                frames.append(frame)
                if len(frames) > MAX_REPLAY_FRAMES:
                    log.warning(
                        "replay from %s sent over %d batches: ignored", endpoint, MAX_REPLAY_FRAMES
                    )
                    return None
            return None
        except zmq.ZMQError as exc:
            log.warning("replay from %s failed: %s", endpoint, exc)
            return None
        finally:
            sock.close(linger=0)

    def run(self) -> None:
        as_background_work()
        source = self.feed.source
        sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        # Messages ZMQ queues for this feed while its thread is busy (a replay, a burst). vLLM
        # sends at most one batch per engine step, so 1,000 outlasts a replay's timeout on a
        # busy replica; past it ZMQ drops, which the sequence gap's replay repairs. It is also
        # what a flooding publisher can make this process hold: at 10,000 a soak's flood of
        # 5 KB batches queued 60 MB that the allocator did not always give back.
        sub.setsockopt(zmq.RCVHWM, _RCVHWM)
        # A frame past this makes ZMQ drop the publisher's connection unread (re-made below;
        # the sequence gap then asks for a replay): one oversized publisher costs its own feed.
        sub.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
        sub.setsockopt(zmq.RECONNECT_IVL, 100)
        sub.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        sub.setsockopt(zmq.SUBSCRIBE, source.topic.encode())
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        poller = zmq.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        stale_since: float | None = None
        down_since: float | None = None
        next_expiry = time.monotonic() + _EXPIRE_EVERY_S
        try:
            sub.connect(source.endpoint)
            while not self.stop_event.is_set():
                ready = dict(poller.poll(100))
                if monitor in ready:
                    event = recv_monitor_message(monitor)
                    if event["event"] == zmq.EVENT_DISCONNECTED:
                        self.feed.on_disconnected()
                        stale_since = down_since = time.monotonic()
                    elif event["event"] == zmq.EVENT_CONNECTED:
                        down_since = None
                        self.feed.on_connected()
                        stale_since = None
                if sub in ready:
                    # Drain what is queued before polling again: bursts arrive together.
                    for _ in range(1000):
                        try:
                            frames = sub.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self.feed.handle_frames(frames)
                now = time.monotonic()
                if down_since is not None and now - down_since > _RECONNECT_AFTER_S:
                    with contextlib.suppress(zmq.ZMQError):
                        sub.disconnect(source.endpoint)
                    sub.connect(source.endpoint)
                    down_since = now
                if stale_since is not None and now - stale_since > self.stale_clear_after_s:
                    self.feed.on_gone(self.stale_clear_after_s)
                    stale_since = None
                if now >= next_expiry:
                    self.feed.expire()
                    next_expiry = now + _EXPIRE_EVERY_S
        except Exception:  # the feed must never die silently
            log.exception("event feed of %s%s crashed", source.replica, source.stream)
            self.feed.on_crash()
        finally:
            sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)


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
