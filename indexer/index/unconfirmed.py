"""Unconfirmed holdings: what publishers that never announce a removal hold, kept apart from the
confirmed classes, per source, until they expire.

- Media whose publisher never removes anything (LMCache's, llm-d's FS backend) are held as
  *unconfirmed*: apart from the confirmed tiers, counted separately by lookups, and dropped
  after ``unconfirmed_ttl_s`` or beyond ``unconfirmed_max_blocks`` per replica. Chunks larger
  than the replica's block size (LMCache's 256 tokens) are re-chunked through their tokens.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

from kvroute.indexer.index.api import ApplyResult
from kvroute.indexer.index.state import _W, IndexStore, _cls, _Held, _ReplicaState
from kvroute.indexer.keys import block_keys, event_extra_keys, pack_tokens
from kvroute.indexer.wire import BlockRemoved, BlockStored

__all__ = ["UnconfirmedHoldings"]


class UnconfirmedHoldings(IndexStore):
    """Unconfirmed stores and removals, the per-replica limit, and expiry."""

    if TYPE_CHECKING:  # offloaded chunks (chunks.py)

        def _chunk_members(
            self, state: _ReplicaState, h: int, cls: int, result: ApplyResult | None = None
        ) -> tuple[int, ...]: ...

        @staticmethod
        def _chunk_seen(state: _ReplicaState, cls: int, blocks: int) -> None: ...

    def _store_unconfirmed(
        self, state: _ReplicaState, event: BlockStored, source: str, result: ApplyResult
    ) -> None:
        cls = _cls(event.medium, confirmed=False)
        held = state.held.setdefault(source, OrderedDict())
        expires = self._clock() + self.unconfirmed_ttl_s
        if not event.token_ids:
            # Tier-only (llm-d's FS backend): chunks named by their last block hash.
            state.warm_chain = False
            state.whole_loads.add(cls)
            for h in event.block_hashes:
                rec = held.get((cls, h))
                if rec is not None:
                    rec.expires = expires
                    held.move_to_end((cls, h))
                    continue
                members = self._chunk_members(state, h, cls, result)
                if not members:
                    result.unresolved += 1
                    continue
                keys = tuple(state.engine_to_key[m] for m in members)
                self._hold_unconfirmed(state, held, (cls, h), keys, cls, expires, result)
            return
        # Self-describing chunks with the publisher's own hashes (LMCache): re-keyed through
        # their tokens at the replica's block size, chained through the parent chunk.
        bs = state.block_size
        if bs is None:
            raise ValueError("unconfirmed store before the replica's block size is known")
        n_hashes = len(event.block_hashes)
        size = event.block_size
        if size % bs and n_hashes > 1:
            raise ValueError(f"chunks of {size} tokens are not whole {bs}-token blocks")
        parent_hash = event.parent_block_hash
        parent: int | None = None
        if parent_hash is not None:
            prec = held.get((cls, parent_hash))
            if prec is None or not prec.keys:
                result.unresolved += n_hashes
                return
            parent = prec.keys[-1]
        # LMCache's chunks: their blocks are keyed at the replica's size, where its events say
        # nothing of extra keys but the LoRA name.
        extra = event_extra_keys(None, event.lora_name, size // bs)
        if size % bs == 0:
            self._chunk_seen(state, cls, size // bs)
        for i, h in enumerate(event.block_hashes):
            chunk = event.token_ids[i * size : (i + 1) * size]
            keys = tuple(block_keys(pack_tokens(chunk), bs, parent=parent, extra_keys=extra))
            if not keys:
                result.ignored += 1
                break
            rec = held.get((cls, h))
            if rec is not None:
                rec.expires = expires
                held.move_to_end((cls, h))
            else:
                self._hold_unconfirmed(state, held, (cls, h), keys, cls, expires, result)
            if size % bs:
                break  # a final partial chunk: nothing can chain from it
            parent = keys[-1]

    def _hold_unconfirmed(
        self,
        state: _ReplicaState,
        held: OrderedDict[tuple[int, int], _Held],
        chunk_id: tuple[int, int],
        keys: tuple[int, ...],
        cls: int,
        expires: float,
        result: ApplyResult,
    ) -> None:
        bit = 1 << (_W * state.slot + cls)
        masks, refs = self._masks, state.refs
        for key in keys:
            mask = masks.get(key, 0)
            if mask & bit:
                refs[(key, cls)] = refs.get((key, cls), 0) + 1
            else:
                self._set_mask(key, mask | bit)
                state.tier_counts[cls] += 1
        held[chunk_id] = _Held(cls, keys, expires)
        state.unconfirmed_blocks += len(keys)
        self._entries += len(keys)
        result.unconfirmed_blocks += len(keys)
        over = state.unconfirmed_blocks - self.unconfirmed_max_blocks
        while over > 0 and state.held:
            over -= self._drop_oldest_holding(state)

    def _remove_unconfirmed(
        self, state: _ReplicaState, event: BlockRemoved, source: str, result: ApplyResult
    ) -> None:
        """Publishers of unconfirmed media (as of vLLM 0.32) send no removals; honour one if
        they do."""
        cls = _cls(event.medium, confirmed=False)
        held = state.held.get(source)
        for h in event.block_hashes:
            rec = held.pop((cls, h), None) if held else None
            if rec is None:
                result.unresolved += 1
                continue
            result.blocks_removed += self._unhold(state, rec)

    def _unhold(self, state: _ReplicaState, rec: _Held) -> int:
        bit = 1 << (_W * state.slot + rec.cls)
        masks, refs = self._masks, state.refs
        gone = 0
        for key in rec.keys:
            extra = refs.get((key, rec.cls)) if refs else None
            if extra:
                if extra == 1:
                    del refs[(key, rec.cls)]
                else:
                    refs[(key, rec.cls)] = extra - 1
                continue
            mask = masks.get(key, 0)
            if mask & bit:
                self._set_mask(key, mask & ~bit)
                state.tier_counts[rec.cls] -= 1
                gone += 1
        state.unconfirmed_blocks -= len(rec.keys)
        self._entries -= len(rec.keys)
        return gone

    def _drop_oldest_holding(self, state: _ReplicaState) -> int:
        """Drop the replica's oldest unconfirmed holding (any source); returns its blocks."""
        oldest: tuple[float, str] | None = None
        for source, held in state.held.items():
            if held:
                first = next(iter(held.values()))
                if oldest is None or first.expires < oldest[0]:
                    oldest = (first.expires, source)
        if oldest is None:
            return 0
        held = state.held[oldest[1]]
        _, rec = held.popitem(last=False)
        self._unhold(state, rec)
        self.expired_blocks += len(rec.keys)
        return len(rec.keys)

    def _drop_source_holdings(self, state: _ReplicaState, source: str) -> None:
        held = state.held.pop(source, None)
        for rec in (held or {}).values():
            self._unhold(state, rec)

    def _expire_state(self, state: _ReplicaState, now: float) -> int:
        gone = 0
        for held in state.held.values():
            while held:
                rec = next(iter(held.values()))
                if rec.expires > now:
                    break
                held.popitem(last=False)
                self._unhold(state, rec)
                gone += len(rec.keys)
        self.expired_blocks += gone
        return gone

    def expire(self, replica: str | None = None) -> int:
        with self._lock:
            now = self._clock()
            states = (
                list(self._replicas.values())
                if replica is None
                else [s for s in (self._replicas.get(replica),) if s is not None]
            )
            return sum(self._expire_state(s, now) for s in states if s.held)
