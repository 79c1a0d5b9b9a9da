"""Unconfirmed holdings: what publishers that never announce a removal hold, kept apart from the
confirmed classes, per source, until they expire.

- Media whose publisher never removes anything (LMCache's, llm-d's FS backend, vLLM's FS/OBJ
  tiers, Mooncake's store) are held as *unconfirmed*: apart from the confirmed tiers, counted
  separately by lookups, and dropped after ``unconfirmed_ttl_s`` or beyond
  ``unconfirmed_max_blocks`` per replica. Chunks larger than the replica's block size
  (LMCache's 256 tokens) are re-chunked through their tokens.
- A store that names vLLM's own block hashes without their extra keys (``engine_hashes``:
  vLLM's FS/OBJ tiers, Mooncake's store) is resolved through the replica's map of vLLM hashes
  to keys, never keyed from its tokens: a LoRA or salted request's blocks keyed as plain
  tokens would give its tier to the plain prefix.
- vLLM's FS tier with ``locality="REMOTE"`` writes to a directory other replicas read: on a
  replica attached to a storage domain its holdings are copied to the domain
  (``_share_unconfirmed``), held once however many replicas wrote them, so every replica of
  the domain sees them as its unconfirmed STORAGE tier (lookup.py).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

from kvroute.indexer.index.api import ApplyResult
from kvroute.indexer.index.state import _W, IndexStore, _cls, _Held, _ReplicaState
from kvroute.indexer.keys import block_keys, event_extra_keys, pack_tokens
from kvroute.indexer.wire import BlockRemoved, BlockStored, Medium

__all__ = ["UnconfirmedHoldings"]


class UnconfirmedHoldings(IndexStore):
    """Unconfirmed stores and removals, the per-replica limit, and expiry."""

    if TYPE_CHECKING:  # offloaded chunks (chunks.py)

        def _expire_doubted(self, state: _ReplicaState, now: float) -> int: ...  # resets.py

        def _sweep_losses(self, state: _ReplicaState, now: float) -> int: ...  # losses.py

        def _chunk_members(
            self, state: _ReplicaState, h: int, cls: int, result: ApplyResult | None = None
        ) -> tuple[int, ...]: ...

        @staticmethod
        def _chunk_seen(state: _ReplicaState, cls: int, blocks: int) -> None: ...

        def _want_ghost(self, state: _ReplicaState) -> None: ...

        def _layouts(self, key: str) -> list[_ReplicaState]: ...  # storage domains

    def _engine_key(self, state: _ReplicaState, h: int) -> int | None:
        """Our key for vLLM hash ``h`` on this replica (held, recently forgotten, or held by
        its storage domain), or None."""
        key = state.engine_to_key.get(h)
        if key is None and state.ghost is not None:
            key = state.ghost.get(h)
        if key is None and state.name in self._attached:
            domain = self._replicas.get(self._attached[state.name])
            if domain is not None:
                key = domain.engine_to_key.get(h)
        return key

    def _store_engine_blocks(
        self,
        state: _ReplicaState,
        event: BlockStored,
        cls: int,
        held: OrderedDict[tuple[int, int], _Held],
        expires: float,
        result: ApplyResult,
    ) -> None:
        """Blocks named by vLLM's hashes, each hash one block: held as one chunk (its last
        hash), with the keys the device events gave those hashes."""
        self._want_ghost(state)
        chunk = (cls, event.block_hashes[-1])
        keys: list[int] = []
        for h in event.block_hashes:
            key = self._engine_key(state, h)
            if key is None:
                result.unresolved += 1
                continue
            keys.append(key)
        if event.medium is Medium.STORAGE and event.token_ids:
            # vLLM's offloading connector: one chunk per event, loaded whole or not at all
            self._chunk_seen(state, cls, len(event.block_hashes))
            state.whole_loads.add(cls)
        rec = held.get(chunk)
        if rec is not None:
            held.move_to_end(chunk)
            if len(rec.keys) >= len(keys):
                rec.expires = expires
                return
            # stored again, now with more of its blocks known: the fuller holding replaces it
            del held[chunk]
            self._unhold(state, rec)
        if keys:
            self._hold_unconfirmed(state, held, chunk, tuple(keys), cls, expires, result)

    def _store_unconfirmed(
        self,
        state: _ReplicaState,
        event: BlockStored,
        source: str,
        result: ApplyResult,
        into: _ReplicaState | None = None,
    ) -> None:
        """``into``: the storage domain (its layout's holder) an attached replica's shared
        storage chunks go to, resolved through the writer's blocks, held for the domain
        (source ``""``: the domain's evictor stream removes them)."""
        cls = _cls(event.medium, confirmed=False)
        holder = state if into is None else into
        held = holder.held.setdefault(source if into is None else "", OrderedDict())
        expires = self._clock() + self.unconfirmed_ttl_s
        if event.engine_hashes and (event.token_ids or event.block_size):
            # vLLM's FS/OBJ tiers' self-describing chunks, Mooncake's blocks (one per event,
            # tokens or not): every hash is a block of vLLM's.
            self._store_engine_blocks(state, event, cls, held, expires, result)
            return
        if not event.token_ids:
            # Tier-only (llm-d's FS backend): chunks named by their last block hash.
            state.warm_chain = False
            state.whole_loads.add(cls)
            if into is not None:
                into.whole_loads.add(cls)
                if into.block_size is None:
                    into.block_size = state.block_size
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
                self._hold_unconfirmed(holder, held, (cls, h), keys, cls, expires, result)
            if into is not None:
                n = state.chunk_blocks.get(cls)
                if n is not None and n > into.chunk_blocks.get(cls, 0):
                    into.chunk_blocks[cls] = n
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
                self._hold_unconfirmed(holder, held, (cls, h), keys, cls, expires, result)
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

    def _share_unconfirmed(
        self, state: _ReplicaState, domain: _ReplicaState, event: BlockStored, source: str
    ) -> None:
        """``event``'s holdings (just applied to ``state``) copied to its storage domain: a
        file in a shared directory is one file, held once however many replicas wrote it."""
        cls = _cls(event.medium, confirmed=False)
        held = state.held.get(source)
        if not held:
            return
        if domain.block_size is None:
            domain.block_size = state.block_size
        elif state.block_size is not None and state.block_size != domain.block_size:
            return  # another model's files: not this domain's to serve
        n = state.chunk_blocks.get(cls)
        if n is not None and n > domain.chunk_blocks.get(cls, 0):
            domain.chunk_blocks[cls] = n
        if cls in state.whole_loads:
            domain.whole_loads.add(cls)
        shared = domain.held.setdefault("", OrderedDict())
        scratch = ApplyResult()
        for h in event.block_hashes:
            rec = held.get((cls, h))
            if rec is None:
                continue
            mine = shared.get((cls, h))
            if mine is not None:
                mine.expires = max(mine.expires, rec.expires)
                shared.move_to_end((cls, h))
                continue
            self._hold_unconfirmed(domain, shared, (cls, h), rec.keys, cls, rec.expires, scratch)

    def _drop_class_holdings(
        self, state: _ReplicaState, cls: int, source: str | None = None
    ) -> int:
        """Drop the replica's unconfirmed holdings in class ``cls`` (of ``source`` only, when
        given); returns how many blocks they held."""
        gone = 0
        for name, held in state.held.items():
            if source is not None and name != source:
                continue
            for chunk in [c for c, rec in held.items() if rec.cls == cls]:
                rec = held.pop(chunk)
                self._unhold(state, rec)
                gone += len(rec.keys)
        return gone

    def _release_engine_holdings(
        self, state: _ReplicaState, event: BlockRemoved, source: str, result: ApplyResult
    ) -> None:
        """A confirmed removal of blocks a pool tier stored without extra keys (the
        SimpleCPUOffloadConnector's disk tier looks like vLLM's FS tier on the wire, so its
        stores are held unconfirmed): its removals are honoured there too."""
        held = state.held.get(source)
        if not held:
            return
        cls = _cls(event.medium, confirmed=False)
        for h in event.block_hashes:
            rec = held.pop((cls, h), None)
            if rec is not None:
                result.blocks_removed += self._unhold(state, rec)

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
                + self._layouts(replica)
            )
            gone = sum(self._expire_doubted(s, now) for s in states if s.doubted)
            gone += sum(self._sweep_losses(s, now) for s in states if s.loss is not None)
            return gone + sum(self._expire_state(s, now) for s in states if s.held)
