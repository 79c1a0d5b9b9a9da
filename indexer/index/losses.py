"""Batches lost at their source: what the index stops vouching for when a replica's stream
numbered a batch that nobody will ever deliver.

vLLM's publisher consumes a sequence number for a batch it fails to encode (LMCache's events
on its tensor path carry a ``torch.device`` medium) and buffers nothing, so no replay holds it
(indexer/subscriber/recovery.py counts it, ``lost_batches``). The batch held the step's device
events and its connector's: a removal in it leaves a block believed that the replica no longer
has, and nothing says which. Clearing the replica at each such loss would empty it for good on
LMCache's tensor path (every batch carrying an LMCache event is lost); keeping everything
would believe a removed block forever.

So a loss opens a window of ``unconfirmed_ttl_s``. Whatever the replica's later events prove
held meanwhile is kept: a store of the block (any confirmed tier; a chunk named by its last
hash keeps its members), and on the device every ancestor of a stored block's parent (vLLM
stores a block only while its request holds the whole chain before it, ``KVCacheManager``'s
full-attention blocks). When the window ends, every other block of the replica's confirmed
tiers is dropped, as a removal would drop it (reference counts and all), and what is kept is
held once: the lost batch may have removed one of a block's copies, so while a window is open
a store of a block the index holds is not counted as another copy (confirmed.py), and the
copies counted before it are forgotten when it ends (a prediction below vLLM's hit at worst,
after the remaining copy's removal). A loss while a window
is open opens the next one, which keeps only what is proved after the latest loss and ends
``unconfirmed_ttl_s`` after the first loss it stands for. So a block a lost batch removed is
believed at most ``unconfirmed_ttl_s`` after the index hears of the loss (the stream's next
batch shows it), plus the router's expiry period; a block stored after the latest loss is
never dropped by it. What this costs: a block held all along but not stored again, nor below
a new store, within the window (an idle replica's prefix, a CPU chunk loaded but never
offloaded again) is dropped too: a prediction below vLLM's hit until it is stored again. A
replica that never loses a batch never opens a window. A storage domain's own stream has no
replay and loses nothing at the source (its gaps clear it, domains.py); its layouts are not
swept.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from kvroute.indexer.index.state import (
    _CONFIRMED,
    _CPU,
    _GPU,
    _STORAGE,
    _W,
    IndexStore,
    _LossWindow,
    _ReplicaState,
)
from kvroute.indexer.wire import BlockStored, Event

__all__ = ["SourceLosses"]

_KEYED = -1  # the keyed (full-attention) group's blocks, in ``_LossWindow.kept``


class SourceLosses(IndexStore):
    """``note_lost``, what later stores prove held, and the sweep at the window's end."""

    if TYPE_CHECKING:  # confirmed holdings (confirmed.py), hybrid groups (hybrid.py)

        def _release(self, state: _ReplicaState, h: int, key: int, cls: int) -> int: ...

        def _keyed(self, state: _ReplicaState, group: int | None) -> bool: ...

    def note_lost(self, replica: str, source: str = "", batches: int = 1) -> None:
        """``batches`` of ``source``'s stream of ``replica`` were lost at their source."""
        if batches <= 0:
            return
        with self._lock:
            state = self._replicas.get(replica)
            if state is None or source not in state.confirmed_sources:
                return  # nothing the stream published is vouched for: a loss changes nothing
            window = state.loss
            if window is None:
                state.loss = _LossWindow(self._clock())
            elif window.next is None:
                window.next = _LossWindow(self._clock())
            else:  # the next window keeps only what is proved after the latest loss
                window.next.kept = {}
                window.next.parents = {}

    def _note_kept(self, state: _ReplicaState, events: Iterable[Event]) -> None:
        """Record what ``events`` (about to be applied) prove held, while a window is open."""
        windows = [w for w in (state.loss, state.loss.next if state.loss else None) if w]
        for e in events:
            if type(e) is not BlockStored or not e.confirmed:
                continue
            cls = int(e.medium)
            group = _KEYED if self._keyed(state, e.group_idx) else (e.group_idx or 0)
            parent = e.parent_block_hash if cls == _GPU and group == _KEYED else None
            for window in windows:
                kept = window.kept.get((cls, group))
                if kept is None:
                    kept = window.kept[(cls, group)] = set()
                kept.update(e.block_hashes)
                if parent is not None:
                    window.parents.setdefault(group, set()).add(parent)

    def _sweep_losses(self, state: _ReplicaState, now: float) -> int:
        """At each ended window, drop what it did not prove held; returns the entries dropped."""
        gone = 0
        while state.loss is not None and now >= state.loss.opened + self.unconfirmed_ttl_s:
            window = state.loss
            state.loss = window.next
            gone += self._sweep(state, window)
        return gone

    def _sweep(self, state: _ReplicaState, window: _LossWindow) -> int:
        keep = {
            _GPU: self._with_ancestors(state, window, _KEYED),
            _CPU: self._with_members(state, window, _CPU),
            _STORAGE: self._with_members(state, window, _STORAGE),
        }
        # what is kept is held once (a copy counted before the loss may be the one it removed),
        # and what goes goes whole
        state.refs = {k: n for k, n in state.refs.items() if k[1] >= 3}
        shift = _W * state.slot
        masks = self._masks
        gone = 0
        for h, key in list(state.engine_to_key.items()):
            bits = (masks.get(key, 0) >> shift) & _CONFIRMED
            for c in (_GPU, _CPU, _STORAGE):
                if bits >> c & 1 and h not in keep[c]:
                    gone += self._release(state, h, key, c)
        if state.chunks:
            for rec in state.chunks.values():
                rec[1] = 1
            engine_to_key = state.engine_to_key
            state.chunks = {
                (c, h): rec
                for (c, h), rec in state.chunks.items()
                if (k := engine_to_key.get(h)) is not None and masks.get(k, 0) >> (shift + c) & 1
            }
        for group, (by_hash, by_key) in state.groups.items():
            held = self._with_ancestors(state, window, group)
            for h in [h for h in by_hash if h not in held]:
                key = by_hash.pop(h)[0]
                left = by_key.get(key, 0) - 1
                if left > 0:
                    by_key[key] = left
                else:
                    by_key.pop(key, None)
                gone += 1
        return gone

    @staticmethod
    def _with_ancestors(state: _ReplicaState, window: _LossWindow, group: int) -> set[int]:
        """The device blocks of ``group`` stored in the window, with every ancestor of a
        stored block's parent the replica's parent links name (keyed group only: the other
        groups' links are not kept, and a sliding window frees the blocks behind it)."""
        held = set(window.kept.get((_GPU, group), ()))
        if group != _KEYED:
            return held
        chain = state.chain
        for h in window.parents.get(group, ()):
            while h is not None and h not in held:
                held.add(h)
                h = chain.get(h)
        return held

    @staticmethod
    def _with_members(state: _ReplicaState, window: _LossWindow, cls: int) -> set[int]:
        """The blocks stored in ``cls`` in the window, a chunk named by its last hash whole."""
        held = set(window.kept.get((cls, _KEYED), ()))
        chunks = state.chunks
        if chunks:
            for h in list(held):
                rec = chunks.get((cls, h))
                if rec is not None:
                    held.update(rec[0])
        return held
