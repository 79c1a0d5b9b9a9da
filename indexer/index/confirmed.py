"""Confirmed holdings: stores and removals in the classes whose publisher announces every
removal (vLLM's block pool, kvroute's and vLLM's offloading connectors), and each replica's map
from vLLM's block hash to our key, with the parent links, reference counts and forgotten hashes
(``ghost``) that resolve later events through it.

- Keys are re-derived from token ids (kvroute.indexer.keys), never taken from vLLM's hashes. A store
  that carries ``extra_keys`` is keyed with them. A store in a lower tier that does not carry
  them (vLLM's offloading connector never does) is resolved through the replica's map from
  vLLM's block hash to key, built from the device events, and never re-keyed: re-keying it
  without its LoRA, cache_salt or multimodal keys would give its tier to the plain prefix.
- A hash stored more than once in one tier is held until removed as often (reference
  counts), as vLLM's event docs ask: its block pool keeps one copy per physical block and its
  offloading connector announces blocks shared by two chunks once per chunk. That connector
  never stores a chunk it holds, though: a store of a chunk (named by its last block) the
  tier already holds follows a reset that published nothing (``reset_external``), and is
  taken once, so the stale copy goes with the chunk's next removal. A device store
  from the start of the prompt (no parent) whose blocks vLLM's hit would all have served is
  idempotent instead: that is the shape of vLLM's re-announcement of a prefix-cache hit
  (``kv_cache_report_mode: "full"``), never followed by a removal. One that lists a block the
  hit could not have served is a computation from token 0 (hybrid.py's ``_recomputed``),
  except after the stream lost history (``device_history`` false, until the next device
  clear): a block it lists that the index does not hold may be held since before, so its
  held blocks are not counted twice (a re-announced hit looks the same).
- A partial block (vLLM's prefix-match unit finer than its block size: the prompt's last unit
  boundary inside a block) is held under a key of its own (kvroute.indexer.keys.partial_key),
  the chain of its block's units up to the boundary; a lookup probes it past the last full
  block. vLLM publishes only the boundary's last unit, parented on the unit hash before it:
  a published block when the boundary is its block's first unit, else a unit never published,
  and then the partial is keyed only from the keyed store right before it in its batch (the
  block completed, the partial registered again on it: ``_partial_in_block``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvroute.indexer.index.api import DOMAIN_PREFIX, ApplyResult
from kvroute.indexer.index.state import (
    _CONFIRMED,
    _CPU,
    _GHOST_MAX,
    _GPU,
    _W,
    _WARM_CHAIN,
    IndexStore,
    _ReplicaState,
)
from kvroute.indexer.keys import (
    ExtraKeys,
    block_extra_keys,
    block_keys,
    event_extra_keys,
    pack_tokens,
    partial_key,
    root_key,
)
from kvroute.indexer.wire import BlockRemoved, BlockStored

__all__ = ["ConfirmedHoldings"]


class ConfirmedHoldings(IndexStore):
    """Stores, removals and clears of the confirmed classes (GPU, CPU, STORAGE)."""

    # The keyed device store just applied, and the one before the event being applied:
    # (replica, keys, token ids, parent key, block 0's extra keys)
    _last_full: tuple[_ReplicaState, list[int], list[int], int | None, ExtraKeys] | None
    _prev_full: tuple[_ReplicaState, list[int], list[int], int | None, ExtraKeys] | None

    if TYPE_CHECKING:  # offloaded chunks (chunks.py), hybrid models (hybrid.py)

        def _store_tier_only(
            self, state: _ReplicaState, hashes: list[int], cls: int, result: ApplyResult
        ) -> None: ...

        @staticmethod
        def _chunk_seen(state: _ReplicaState, cls: int, blocks: int) -> None: ...

        # hybrid models (hybrid.py)
        def _recomputed(self, state: _ReplicaState, keys: list[int], block_size: int) -> bool: ...

        @staticmethod
        def _hybrid(state: _ReplicaState) -> bool: ...

        @staticmethod
        def _keyed(state: _ReplicaState, group: int) -> bool: ...

        def _hold_run_native(
            self,
            state: _ReplicaState,
            hashes: list[int],
            keys: list[int],
            cls: int,
            result: ApplyResult,
            count_dup: bool,
        ) -> None: ...  # native_runs.py

        _computed: set[tuple[_ReplicaState, int]]

    # --- confirmed stores -----------------------------------------------------------------------

    def _store(self, state: _ReplicaState, event: BlockStored, result: ApplyResult) -> None:
        cls = int(event.medium)
        if not event.token_ids:
            if cls == _GPU:
                raise ValueError("device BlockStored without token_ids")
            self._store_tier_only(state, event.block_hashes, cls, result)
            return
        bs = event.block_size
        if len(event.token_ids) != len(event.block_hashes) * bs:
            raise ValueError("BlockStored with a block mask in the keyed group")
        if cls == _GPU:
            self._store_device(state, event, result)
            return
        # A lower tier's self-describing store: one chunk per event, as every offloading
        # publisher sends them; its length is what the tier loads at once.
        self._chunk_seen(state, cls, len(event.block_hashes))
        engine_to_key = state.engine_to_key
        if event.extra_keys is None:
            # The publisher does not say which extra keys its blocks had (vLLM's offloading
            # connector): only blocks the device events keyed can be placed.
            state.whole_loads.add(cls)
            if self._held_in(state, event.block_hashes[-1], cls):
                # vLLM's offloading connector never stores a chunk it holds (its CPU manager
                # skips the keys present; a chunk is named by its last block): this is a
                # re-store after a reset that published nothing. Taken once, so the chunk's
                # next removal takes it out (counted twice, the stale copy would stay).
                return
            self._want_ghost(state)
            ghost = state.ghost
            for h in event.block_hashes:
                key = engine_to_key.get(h)
                if key is None and ghost is not None:
                    key = ghost.get(h)
                if key is None:
                    result.unresolved += 1
                    continue
                self._hold(state, h, key, cls, result, count_dup=True)
            return
        if state.block_size is None:
            # kvroute's connector announces the disk files it found at start-up before the
            # device stored anything: a self-describing store teaches the block size too.
            state.block_size = bs
        if bs != state.block_size:
            raise ValueError(
                f"{event.medium.name} BlockStored of block_size {bs}: the replica's is "
                f"{state.block_size}"
            )
        parent = self._parent_key(state, event.parent_block_hash)
        keys = block_keys(
            pack_tokens(event.token_ids), bs, parent=parent, extra_keys=event.extra_keys
        )
        for h, key in zip(event.block_hashes, keys, strict=True):
            known = engine_to_key.get(h)
            # The device events keyed this hash first: they are the authority on its key.
            self._hold(state, h, key if known is None else known, cls, result, count_dup=True)

    def _store_device(self, state: _ReplicaState, event: BlockStored, result: ApplyResult) -> None:
        bs = event.block_size
        hashes = event.block_hashes
        if state.block_size is not None and bs != state.block_size:
            self._device_block_size(state, event, result)
            return
        try:
            parent = self._parent_key(state, event.parent_block_hash)
        except ValueError:
            if len(hashes) == 1 and not state.size_confirmed and self._hybrid(state):
                # Perhaps a partial block whose parent unit vLLM never published, seen before
                # the replica's block size (a short prompt first): unresolved, nothing learned.
                result.unresolved += 1
                return
            raise
        if state.block_size is None:
            state.block_size = bs
        if len(hashes) > 1:
            state.size_confirmed = True  # partial blocks come one at a time
        if parent is not None and event.parent_block_hash not in state.engine_to_key:
            self._rehold_parent(state, event.parent_block_hash, parent, result)
        extra = event_extra_keys(event.extra_keys, event.lora_name, len(hashes))
        keys = block_keys(pack_tokens(event.token_ids), bs, parent=parent, extra_keys=extra)
        # A partial block published right after this store may lie inside its blocks.
        self._last_full = (state, keys, event.token_ids, parent, extra[0] if extra else None)
        chain = state.chain
        chain.update(zip(hashes, (event.parent_block_hash, *hashes[:-1]), strict=False))
        if state.warm_chain and len(chain) > 2 * _WARM_CHAIN:
            state.chain = type(chain)()  # a dict, or the native core's table
            state.chain.update(list(chain.items())[-_WARM_CHAIN:])
        # From the start of a prompt (no parent), a store of blocks already held is vLLM
        # re-announcing a prefix-cache hit (kv_cache_report_mode "full": the same physical
        # blocks, never removed) or a second physical copy (a request that did not read the
        # prefix cache), which is removed once per copy. The two look the same on the wire,
        # so such a store is idempotent: at worst the index loses the block at the first
        # copy's removal, never keeps one vLLM dropped. Anywhere else it is another copy.
        # On a hybrid model, such a store of blocks its hit could not have served is a new
        # computation from token 0 (hybrid.py): its held blocks are second copies.
        computed = parent is not None or self._recomputed(state, keys, bs)
        if parent is None and computed:
            self._computed.add((state, hashes[-1]))  # the other groups' stores of this step too
        # After the index lost the device's history (a gap the replay could not fill), a
        # block of such a store it does not hold may be held since before: the store may be
        # a re-announced hit, and its held blocks are then not counted twice (at worst the
        # index loses a second copy at the first removal: a prediction below vLLM's hit).
        count_dup = computed and (
            parent is not None
            or state.device_history
            or all(self._held_in(state, h, _GPU) for h in hashes)
        )
        if not count_dup and self._held_in(state, hashes[0], _GPU):
            # Perhaps a second copy the index does not count: keep the hashes it forgets, so
            # the blocks vLLM stores on the copy it still holds resolve (_rehold_parent).
            self._want_ghost(state)
        if parent is None and not count_dup:
            # Its held blocks may now have copies the index does not count: once the index
            # loses one, a store naming it is no proof of a computation (_recomputed).
            uncounted = state.uncounted
            engine_to_key = state.engine_to_key
            for h in hashes:
                key = engine_to_key.get(h)
                if key is not None:
                    uncounted[key] = None
            while len(uncounted) > _GHOST_MAX:
                del uncounted[next(iter(uncounted))]
        self._hold_run(state, hashes, keys, _GPU, result, count_dup=count_dup)

    def _rehold_parent(
        self, state: _ReplicaState, parent_hash: int | None, parent: int, result: ApplyResult
    ) -> None:
        """A device store on a parent the index forgot: vLLM stores a block only on a parent
        its request holds on the device, so a copy of the parent is there that the index did
        not count (a second copy of a prompt's start, taken once: ``_store_device``). Hold it
        again (once: its next removal takes it out)."""
        ghost = state.ghost
        if ghost is None or parent_hash is None or ghost.get(parent_hash) != parent:
            return  # resolved through the storage domain: not a device block
        if not self._hybrid(state):
            self._hold(state, parent_hash, parent, _GPU, result, count_dup=False)

    def _device_block_size(
        self, state: _ReplicaState, event: BlockStored, result: ApplyResult
    ) -> None:
        """A device store whose block size is not the replica's: a partial block, or the
        first full block of a replica that so far only published partial ones."""
        bs, known = event.block_size, state.block_size
        assert known is not None
        if bs < known and known % bs == 0 and len(event.block_hashes) == 1:
            extra = event_extra_keys(event.extra_keys, event.lora_name, 1)
            last = extra[0] if extra else None
            try:
                parent = self._parent_key(state, event.parent_block_hash)
            except ValueError:
                # The parent is a unit vLLM hashed but never published (the boundary is not
                # the block's first unit): only a block stored right before may hold it.
                found = self._partial_in_block(state, event, last)
                if found is None:
                    result.unresolved += 1
                    return
                key = found
            else:
                key = partial_key(
                    root_key(known) if parent is None else parent, event.token_ids, last
                )
            state.partial_unit = bs
            h = event.block_hashes[0]
            state.chain[h] = event.parent_block_hash
            self._hold(state, h, key, _GPU, result, count_dup=False)
            result.partial_blocks += 1
            return
        if bs > known and bs % known == 0 and not state.size_confirmed:
            # What looked like the block size was vLLM's prefix-match unit: the replica's
            # first stores were partial blocks of short prompts. Start over at the real size;
            # the other groups' blocks wait to be placed again by hash.
            waiting = dict(state.unplaced)
            for group, (by_hash, _by_key) in state.groups.items():
                for h, (_key, n) in by_hash.items():
                    waiting[(group, h)] = waiting.get((group, h), 0) + n
            self._clear_confirmed(state)
            state.unplaced = waiting
            state.block_size = bs
            state.partial_unit = known
            self._store_device(state, event, result)
            return
        raise ValueError(f"block_size {bs} differs from the replica's {known}")

    def _partial_in_block(
        self, state: _ReplicaState, event: BlockStored, last: ExtraKeys
    ) -> int | None:
        """The key of a partial block whose parent unit vLLM never published, when the keyed
        store just before it (the same request's ``cache_blocks``: vLLM publishes a prompt's
        final unit boundary right after the full blocks it cached, and again on a block just
        completed) holds its block: the one unit offset of those blocks whose tokens are the
        partial's, at least the second unit of its block. None when there is no such store
        or more than one offset fits."""
        prev = self._prev_full
        if prev is None or prev[0] is not state or state.block_size is None:
            return None
        _state, keys, tokens, parent, first_extra = prev
        bs, unit, piece = state.block_size, event.block_size, event.token_ids
        fits = [
            (j, m)
            for j in range(len(keys))
            for m in range(2, bs // unit)
            if tokens[j * bs + (m - 1) * unit : j * bs + m * unit] == piece
        ]
        if len(fits) != 1:
            return None
        j, m = fits[0]
        key = keys[j - 1] if j else (root_key(bs) if parent is None else parent)
        lora = block_extra_keys(event.lora_name)
        base = j * bs
        for i in range(1, m):
            # vLLM's extra keys of unit i: the LoRA name; the cache_salt on the prompt's first
            key = partial_key(
                key,
                tokens[base + (i - 1) * unit : base + i * unit],
                first_extra if j == 0 and i == 1 else lora,
            )
        return partial_key(key, piece, last)

    def _parent_key(self, state: _ReplicaState, parent_hash: int | None) -> int | None:
        if parent_hash is None:
            return None
        parent = state.engine_to_key.get(parent_hash)
        if parent is None and state.ghost is not None:
            parent = state.ghost.get(parent_hash)
        if parent is None and state.name in self._attached:
            # A chunk whose previous chunk only its storage domain holds (a replica announcing
            # the shared files it found at start-up, or storing after a domain hit).
            domain = self._replicas.get(self._attached[state.name])
            if domain is not None:
                parent = domain.engine_to_key.get(parent_hash)
        if parent is None:
            raise ValueError("BlockStored whose parent block is unknown (missed events?)")
        return parent

    def _held_in(self, state: _ReplicaState, h: int, cls: int) -> bool:
        """Whether the replica holds vLLM hash ``h`` in confirmed class ``cls``."""
        key = state.engine_to_key.get(h)
        return key is not None and bool(self._masks.get(key, 0) >> (_W * state.slot + cls) & 1)

    def _want_ghost(self, state: _ReplicaState) -> None:
        if state.ghost is None:
            state.ghost = {}

    def _hold_run(
        self,
        state: _ReplicaState,
        hashes: list[int],
        keys: list[int],
        cls: int,
        result: ApplyResult,
        *,
        count_dup: bool,
    ) -> None:
        """``_hold`` for a run of blocks; the device's common path, kept tight (the native
        core's ``hold_run`` where it runs: the same loop on the same tables)."""
        if state.loss is not None:
            count_dup = False  # losses.py: a lost batch may have removed the first copy
        native = self._native
        if native is not None:
            self._hold_run_native(state, hashes, keys, cls, result, count_dup)
            return
        engine_to_key = state.engine_to_key
        masks = self._masks
        interned = self._interned
        bit = 1 << (_W * state.slot + cls)
        added = 0
        for h, key in zip(hashes, keys, strict=True):
            old = engine_to_key.get(h)
            if old is None:
                self._entries += 1
            else:
                del engine_to_key[h]  # re-inserted below: now the youngest
                if old != key:
                    # vLLM reused a hash for other content: the old block is gone from here.
                    self._forget_key(state, old)
            engine_to_key[h] = key
            mask = masks.get(key, 0)
            if mask & bit:
                if count_dup and old == key:
                    refs = state.refs
                    refs[(key, cls)] = refs.get((key, cls), 0) + 1
                continue
            mask |= bit
            masks[key] = interned.setdefault(mask, mask)
            added += 1
        state.tier_counts[cls] += added
        result.blocks_stored += added

    def _hold(
        self,
        state: _ReplicaState,
        h: int,
        key: int,
        cls: int,
        result: ApplyResult,
        *,
        count_dup: bool,
    ) -> None:
        """One more holding of ``key`` (vLLM hash ``h``) in confirmed class ``cls``."""
        if state.loss is not None:
            count_dup = False  # losses.py: a lost batch may have removed the first copy
        if state.doubted and cls == _CPU:
            state.doubted.pop(h, None)  # stored again: held after the reset it might have had
        engine_to_key = state.engine_to_key
        old = engine_to_key.get(h)
        if old is None:
            self._entries += 1
            if state.ghost:
                state.ghost.pop(h, None)
        elif old != key:
            self._forget_key(state, old)
        engine_to_key[h] = key
        bit = 1 << (_W * state.slot + cls)
        mask = self._masks.get(key, 0)
        if mask & bit:
            # A storage domain holds a file once, however often it was announced.
            if count_dup and not state.name.startswith(DOMAIN_PREFIX):
                state.refs[(key, cls)] = state.refs.get((key, cls), 0) + 1
            return
        self._set_mask(key, mask | bit)
        state.tier_counts[cls] += 1
        result.blocks_stored += 1

    def _forget_key(self, state: _ReplicaState, key: int) -> None:
        """Drop every confirmed class of ``key`` on this replica (its hash now means another
        block)."""
        shift = _W * state.slot
        mask = self._masks.get(key, 0)
        bits = (mask >> shift) & _CONFIRMED
        for c in range(3):
            if bits >> c & 1:
                state.tier_counts[c] -= 1
                state.refs.pop((key, c), None)
        self._set_mask(key, mask & ~(_CONFIRMED << shift))

    def _forget_if_unheld(self, state: _ReplicaState, h: int, key: int, mask: int) -> None:
        """The block left a confirmed class: forget its hash when no confirmed class holds it."""
        if (mask >> (_W * state.slot)) & _CONFIRMED:
            return
        if state.engine_to_key.pop(h, None) is not None:
            self._entries -= 1
        state.chain.pop(h, None)
        ghost = state.ghost
        if ghost is not None:
            ghost[h] = key
            if len(ghost) > _GHOST_MAX:
                del ghost[next(iter(ghost))]

    # --- confirmed removals ---------------------------------------------------------------------

    def _remove(self, state: _ReplicaState, event: BlockRemoved, result: ApplyResult) -> None:
        cls = int(event.medium)
        engine_to_key = state.engine_to_key
        chunks = state.chunks
        removed = 0
        for h in event.block_hashes:
            members: tuple[int, ...] = (h,)
            rec = chunks.get((cls, h)) if chunks else None
            if rec is not None:
                members = rec[0]
                rec[1] -= 1
                if rec[1] <= 0:
                    del chunks[(cls, h)]
            for m in members:
                key = engine_to_key.get(m)
                if key is None:
                    result.unresolved += 1
                    continue
                removed += self._release(state, m, key, cls)
        result.blocks_removed += removed

    def _release(self, state: _ReplicaState, h: int, key: int, cls: int) -> int:
        """One holding of ``key`` in ``cls`` fewer; returns 1 when the class no longer holds it."""
        refs = state.refs
        if refs:
            extra = refs.get((key, cls))
            if extra:
                if extra == 1:
                    del refs[(key, cls)]
                else:
                    refs[(key, cls)] = extra - 1
                return 0
        bit = 1 << (_W * state.slot + cls)
        mask = self._masks.get(key, 0)
        if not mask & bit:
            return 0
        mask &= ~bit
        self._set_mask(key, mask)
        state.tier_counts[cls] -= 1
        self._forget_if_unheld(state, h, key, mask)
        return 1

    # --- clears -------------------------------------------------------------------------------

    def _clear_confirmed(self, state: _ReplicaState) -> None:
        shift = _W * state.slot
        self._drop_bits(state.engine_to_key.values(), _CONFIRMED << shift)
        self._entries -= len(state.engine_to_key)
        state.engine_to_key = type(state.engine_to_key)()
        for c in range(3):
            state.tier_counts[c] = 0
        state.refs = {k: v for k, v in state.refs.items() if k[1] >= 3}
        state.chunks = {}
        state.chain = type(state.chain)()
        state.unsized = {}
        state.groups = {}
        state.unplaced = {}
        # As a fresh replica's: what the index does after a clear must not depend on the
        # history before it (a feed that joins after the clear skips that history). A reset
        # the router still awaits stays awaited: the replay may refill the tiers from batches
        # published before it, whose stores its clear, replayed after them, drops again.
        state.ghost = None
        state.doubted = {}
        state.uncounted = {}
        state.loss = None  # nothing is left that a lost batch could have removed

    def _clear_class(self, state: _ReplicaState, cls: int) -> None:
        """Drop one confirmed class from every block of the replica (a tier's clear)."""
        bit = 1 << (_W * state.slot + cls)
        masks = self._masks
        for h, key in list(state.engine_to_key.items()):
            mask = masks.get(key, 0)
            if mask & bit:
                self._set_mask(key, mask & ~bit)
                state.refs.pop((key, cls), None)
                self._forget_if_unheld(state, h, key, mask & ~bit)
        state.tier_counts[cls] = 0
        state.chunks = {k: v for k, v in state.chunks.items() if k[0] != cls}
