"""The runs of events the native core applies in one call (docs/indexer.md, "Native core"):
a device store's holdings (``hold_run``) and a batch's run of device removals
(``remove_device``), on the index's own tables and with confirmed.py's rules, which stay their
specification (``_hold_run``'s Python loop, ``_remove`` + ``_release`` + ``_forget_if_unheld``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvroute.indexer.index.api import ApplyResult
from kvroute.indexer.index.state import _GHOST_MAX, _GPU, _W, IndexStore, _ReplicaState
from kvroute.indexer.wire import BlockRemoved, Medium

__all__ = ["NativeRuns"]


class NativeRuns(IndexStore):
    """``_hold_run_native`` and ``_remove_device_run``."""

    if TYPE_CHECKING:  # confirmed holdings (confirmed.py), hybrid models (hybrid.py)

        def _forget_key(self, state: _ReplicaState, key: int) -> None: ...

        @staticmethod
        def _keyed_group(state: _ReplicaState) -> int | None: ...

    def _hold_run_native(
        self,
        state: _ReplicaState,
        hashes: list[int],
        keys: list[int],
        cls: int,
        result: ApplyResult,
        count_dup: bool,
    ) -> None:
        """``_hold_run``'s loop in the native core; a hash vLLM reused for another block (the
        native loop stops before it) is taken here, as the Python loop takes it."""
        engine_to_key, masks, interned = state.engine_to_key, self._masks, self._interned
        i, n, added = 0, len(hashes), 0
        while True:
            i, run_added, entries = self._native.hold_run(
                hashes,
                keys,
                i,
                state.slot,
                cls,
                count_dup,
                engine_to_key,
                masks,
                interned,
                state.refs,
            )
            added += run_added
            self._entries += entries
            if i >= n:
                break
            h, key = hashes[i], keys[i]
            # vLLM reused a hash for other content: the old block is gone from here.
            self._forget_key(state, engine_to_key.pop(h))
            engine_to_key[h] = key
            mask, bit = masks.get(key, 0), 1 << (_W * state.slot + cls)
            if not mask & bit:
                masks[key] = interned.setdefault(mask | bit, mask | bit)
                added += 1
            i += 1
        state.tier_counts[cls] += added
        result.blocks_stored += added

    def _remove_device_run(
        self, state: _ReplicaState, events: list[Any], i: int, source: str, result: ApplyResult
    ) -> int:
        """The native core's ``_remove`` for the run of device removals from ``events[i]``:
        vLLM's most common event (one per evicted block), applied in one call on the same
        tables. Returns how many events it applied: 0 when ``events[i]`` is not one (or the
        Python core runs), and the caller applies it in Python. A run qualifies while each
        event is a confirmed GPU ``BlockRemoved`` of the keyed group, and the replica has no
        tier-only chunk records (whose removals name a chunk's last hash only)."""
        native = self._native
        if native is None or state.chunks:
            return 0
        end, n = i, len(events)
        keyed, gpu = self._keyed_group(state), Medium.GPU  # _keyed(state, g): g == keyed
        while end < n:
            event = events[end]
            if (
                type(event) is not BlockRemoved
                or event.medium is not gpu
                or not event.confirmed
                or event.group_idx != keyed
            ):
                break
            end += 1
        if end == i:
            return 0
        state.confirmed_sources.add(source)
        removed, unresolved, forgotten = native.remove_device(
            [e.block_hashes for e in events[i:end]],
            state.slot,
            state.engine_to_key,
            self._masks,
            self._interned,
            state.refs,
            state.chain,
            state.ghost,
            _GHOST_MAX,
        )
        state.tier_counts[_GPU] -= removed
        self._entries -= forgotten
        result.blocks_removed += removed
        result.unresolved += unresolved
        result.applied += end - i
        return end - i
