"""How a feed gets back what it did not see live: joining, warm starts, reconnects,
restarts and gaps, each answered from the replica's replay socket.

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

A gap in a live stream asks the replay from the batch applied last: when it still holds that
batch, unchanged, a seq missing after it was never buffered (vLLM's publisher consumes a seq for
a batch it cannot encode): lost at the source, counted (``lost_batches``), never cleared.

A replay may hold thousands of batches (vLLM buffers 10,000). ``AllBlocksCleared`` (vLLM's
block pool on ``/reset_prefix_cache``) clears the device tier; when no batch before the last one
touched another tier, that history cannot change what the index holds once the clear is
applied, so those batches only advance the sequence (``moot_batches``): a router joining a busy
fleet whose caches were reset does not re-key their history.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import xxhash

from kvroute.indexer.subscriber.budget import ByteBudget
from kvroute.indexer.subscriber.types import FeedStats, Freshness, WarmOutcome
from kvroute.indexer.wire import (
    Frame,
    WireError,
    decode_batch,
    is_device_clear,
    payload_hints,
    touches_lower_tier,
)

__all__ = ["FeedRecovery", "moot_prefix"]

_digest = xxhash.xxh3_64_intdigest


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


class FeedRecovery:
    """The recovery half of ``ReplicaFeed``: joining, warm starts, reconnects, restarts and
    gaps, each settled by asking the replica's replay socket (``_ask_replay``).

    A mixin: the feed's state (declared below, set in ``ReplicaFeed.__init__``) and its
    transitions (``_set``, ``_clear``, ``_forget``, ``_advance``, ``_apply``) are
    ``ReplicaFeed``'s. Every method here runs with the feed's ``lock`` held, except ``seed``
    and ``bootstrap``, which take it.
    """

    replay: Callable[[int], list[Frame] | None] | None
    budget: ByteBudget | None
    stats: FeedStats
    expected: int | None
    lock: threading.Lock
    warm: WarmOutcome | None
    _throttled: bool
    _replayed: tuple[int, int] | None
    _last_digest: int | None
    _seeded: bool

    if TYPE_CHECKING:

        def _set(self, freshness: Freshness, reason: str) -> None: ...

        def _clear(self, reason: str, *, restarted: bool = False) -> None: ...

        def _forget(self, *, restarted: bool) -> None: ...

        def _advance(self, frame: Frame) -> None: ...

        def _apply(self, frame: Frame, first_event: int = 0) -> None: ...

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

    # --- joining, reconnecting, restarting ------------------------------------------------

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

    # --- filling holes ------------------------------------------------------------------------

    def _catch_up(self, start: int, frame: Frame, why: str) -> None:
        """Fill [start, frame.seq) from the replay socket, then apply ``frame``.

        A gap in a live stream asks from the batch applied last (``start - 1``): when the
        replay still holds it, unchanged, it holds every batch the publisher buffered since
        (vLLM's buffer drops its oldest first), so a seq missing from it was never buffered:
        lost at the source (``_take_lost``), not a reason to clear."""
        self._set(Freshness.SYNCING, why)
        anchored = start > 0 and self._last_digest is not None and self.expected == start
        frames = self._ask_replay(start - 1 if anchored else start)
        if (
            anchored
            and frames
            and min(frames, key=lambda f: f.seq).seq == start - 1
            and _digest(min(frames, key=lambda f: f.seq).payload) == self._last_digest
        ):
            self.stats.replays += 1
            self._take_lost(start, frames, frame, why)
            return
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

    def _take_lost(self, start: int, frames: list[Frame], frame: Frame, why: str) -> None:
        """Apply a replay anchored on the last applied batch (see ``_catch_up``), and
        ``frame``, in order. Each seq missing among them was numbered but never buffered by
        the publisher: vLLM's publisher consumes a seq for a batch it fails to encode (LMCache's
        events on its tensor path carry a ``torch.device`` medium) and buffers nothing. No
        replay will ever hold it, and clearing would not bring it back: the stream keeps what
        it holds, counts the loss (``lost_batches``) and stays live. What the lost batch held
        is unknowable: its stores are missing (their successors are counted unresolved), and
        a removal in it may leave a block believed: the index is told where in the stream the
        loss fell (``note_lost``) and keeps, a window later, only what the batches after it
        prove held (indexer/index/losses.py; docs/indexer.md)."""
        by_seq = {f.seq: f for f in frames if f.seq >= start}
        by_seq[frame.seq] = frame
        seqs = sorted(by_seq)
        lost = 0
        expect = start
        for seq in seqs:
            if seq > expect:
                lost += seq - expect
                self.index.note_lost(self.source.replica, self.source.stream, seq - expect)
            self._apply(by_seq[seq])
            expect = seq + 1
        self.stats.lost_batches += lost
        self._replayed = (start, self.expected or 0)
        self._set(
            Freshness.LIVE,
            f"{why}: replayed {len(seqs)} batches; {lost} never buffered by the publisher "
            "(lost at the source, counted in lost_batches; nothing cleared)"
            if lost
            else f"{why}: in sync after replaying {len(seqs)} batches",
        )

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
