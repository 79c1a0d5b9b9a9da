"""Offloaded chunks: resolving the stores that name a chunk by its last block only, and learning
how many blocks a chunk of each tier has.

- A tier-only store (``token_ids=[]``) names the last block of each offloaded chunk. Its
  chunk's other blocks are found by walking the device events' parent links back; how many
  blocks a chunk has is learned per replica and tier from the chain (docs/indexer.md).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import TYPE_CHECKING

from kvroute.indexer.index.api import ApplyResult
from kvroute.indexer.index.state import (
    _MAX_CHUNK_BLOCKS,
    _MAX_UNSIZED,
    _MAX_WALK,
    _W,
    IndexStore,
    _cls,
    _Held,
    _ReplicaState,
)
from kvroute.indexer.wire import BlockStored, Event

__all__ = ["OffloadedChunks"]


class OffloadedChunks(IndexStore):
    """Tier-only stores, chunk walks, and the chunk length per class."""

    if TYPE_CHECKING:  # confirmed holdings (confirmed.py), unconfirmed ones (unconfirmed.py)

        def _hold(
            self,
            state: _ReplicaState,
            h: int,
            key: int,
            cls: int,
            result: ApplyResult,
            *,
            count_dup: bool,
        ) -> None: ...

        def _hold_unconfirmed(
            self,
            state: _ReplicaState,
            held: OrderedDict[tuple[int, int], _Held],
            chunk_id: tuple[int, int],
            keys: tuple[int, ...],
            cls: int,
            expires: float,
            result: ApplyResult,
        ) -> None: ...

        def _unhold(self, state: _ReplicaState, rec: _Held) -> int: ...

        def _held_in(self, state: _ReplicaState, h: int, cls: int) -> bool: ...

    @staticmethod
    def _chunk_seen(state: _ReplicaState, cls: int, blocks: int) -> None:
        if blocks > state.chunk_blocks.get(cls, 0):
            state.chunk_blocks[cls] = min(blocks, _MAX_CHUNK_BLOCKS)

    @staticmethod
    def _landing(events: list[Event]) -> dict[int, set[int]]:
        """Per class, the hashes a batch's tier-only stores name (see ``_chunk_members``)."""
        out: dict[int, set[int]] = {}
        for e in events:
            if isinstance(e, BlockStored) and not e.token_ids and not e.group_idx:
                out.setdefault(_cls(e.medium, e.confirmed), set()).update(e.block_hashes)
        return out

    def _store_tier_only(
        self, state: _ReplicaState, hashes: list[int], cls: int, result: ApplyResult
    ) -> None:
        state.warm_chain = False  # from now on every parent link is kept
        state.whole_loads.add(cls)
        for h in hashes:
            if (cls, h) in state.chunks or self._held_in(state, h, cls):
                # vLLM's offloading connector never stores a chunk it holds: a re-store after
                # a reset that published nothing, taken once (confirmed.py); held now
                if state.doubted:
                    rec = state.chunks.get((cls, h))
                    for m in rec[0] if rec is not None else (h,):
                        state.doubted.pop(m, None)
                continue
            members = self._chunk_members(state, h, cls, result)
            if not members:
                result.unresolved += 1
                continue
            self._hold_chunk(state, h, members, cls, result)

    def _hold_chunk(
        self,
        state: _ReplicaState,
        h: int,
        members: tuple[int, ...],
        cls: int,
        result: ApplyResult,
    ) -> None:
        if len(members) > 1:
            rec = state.chunks.get((cls, h))
            if rec is None:
                state.chunks[(cls, h)] = [members, 1]
            else:
                members = rec[0]
                rec[1] += 1
        for m in members:
            key = state.engine_to_key.get(m)
            if key is None:
                result.unresolved += 1
                continue
            self._hold(state, m, key, cls, result, count_dup=True)

    def _chunk_members(
        self, state: _ReplicaState, h: int, cls: int, result: ApplyResult | None = None
    ) -> tuple[int, ...]:
        """The block hashes of the offloaded chunk whose last block is ``h``.

        Offloading stores a prompt's chunks in order, skipping those already held, so when a
        chunk lands the one before it is held in the same class, or lands in the same batch
        (vLLM announces one step's chunks in set order): the chunk is ``h`` and the blocks
        before it back to that one, at most a chunk's length. The length is learned per
        class: until two walks (back to the previous chunk, or to the prompt's start) agree
        on a gcd, only ``h`` is claimed, and the chunk is resolved again once the length is
        known. Claiming less than the replica holds only loses a prediction; the walk never
        claims a block past the previous chunk.
        """
        if h not in state.engine_to_key:
            return ()
        n = state.chunk_blocks.get(cls)
        if n is None:
            self._observe_chunk(state, h, cls)
            n = state.chunk_blocks.get(cls)
            if n is None or result is None:
                if n is None:
                    pending = state.unsized.setdefault(cls, [])
                    if len(pending) < _MAX_UNSIZED:
                        pending.append(h)
                return (h,)
            self._resolve_unsized(state, cls, n, result)
        return self._walk_chunk(state, h, cls, n)

    def _walk_chunk(self, state: _ReplicaState, h: int, cls: int, n: int) -> tuple[int, ...]:
        chain, engine_to_key = state.chain, state.engine_to_key
        landing = state.landing.get(cls, ())
        bit = 1 << (_W * state.slot + cls)
        masks = self._masks
        members = [h]
        cur = h
        while len(members) < n:
            parent = chain.get(cur)
            if parent is None or parent in landing:
                break
            key = engine_to_key.get(parent)
            if key is None or masks.get(key, 0) & bit:
                break
            members.append(parent)
            cur = parent
        return tuple(members)

    def _resolve_unsized(self, state: _ReplicaState, cls: int, n: int, result: ApplyResult) -> None:
        """The chunk length was just learned: claim the rest of the chunks stored before,
        which only their last block held so far."""
        bit = 1 << (_W * state.slot + cls)
        if cls >= 3:
            for h in state.unsized.pop(cls, ()):
                for held in state.held.values():
                    rec = held.get((cls, h))
                    if rec is None or len(rec.keys) != 1:
                        continue
                    members = self._walk_chunk(state, h, cls, n)
                    # ``h`` itself may have left the hash map since (its device copy was
                    # evicted); its key is the one its record holds. The walk checked the rest.
                    keys = (
                        *(state.engine_to_key[m] for m in reversed(members[1:])),
                        rec.keys[0],
                    )
                    if len(keys) > 1:
                        self._unhold(state, rec)
                        self._hold_unconfirmed(
                            state, held, (cls, h), keys, cls, rec.expires, result
                        )
            return
        for h in state.unsized.pop(cls, ()):
            key = state.engine_to_key.get(h)
            if key is None or not self._masks.get(key, 0) & bit or (cls, h) in state.chunks:
                continue
            members = self._walk_chunk(state, h, cls, n)
            if len(members) > 1:
                state.chunks[(cls, h)] = [members, 1]
                for m in members[1:]:
                    self._hold(state, m, state.engine_to_key[m], cls, result, count_dup=True)

    def _observe_chunk(self, state: _ReplicaState, h: int, cls: int) -> None:
        gcd, seen, last = state.chunk_obs.get(cls, (0, 0, -1))
        if h == last:
            return  # a re-store of the chunk just walked says nothing new about the length
        chain, engine_to_key = state.chain, state.engine_to_key
        landing = state.landing.get(cls, ())
        bit = 1 << (_W * state.slot + cls)
        masks = self._masks
        cur, steps = h, 0
        while steps < _MAX_WALK:
            if cur not in chain:
                return  # the chain was not tracked that far back
            parent = chain[cur]
            steps += 1
            if parent is None:
                break  # the start of the prompt
            if parent in landing:
                break  # the previous chunk, landing in the same batch
            key = engine_to_key.get(parent)
            if key is None:
                return
            if masks.get(key, 0) & bit:
                break  # the previous chunk, held in this class
            cur = parent
        else:
            return
        # Keep the gcd so far and how many observations made it.
        gcd, seen = math.gcd(gcd, steps), seen + 1
        state.chunk_obs[cls] = (gcd, seen, h)
        if seen >= 2 and gcd <= _MAX_CHUNK_BLOCKS:
            state.chunk_blocks[cls] = gcd
