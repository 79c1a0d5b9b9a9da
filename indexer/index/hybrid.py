"""Hybrid models: a replica whose KV cache has several groups (full attention, sliding window,
Mamba), and the hit vLLM serves from them. The rules are vLLM 0.32's (kv_cache_coordinator.py,
single_type_kv_cache_manager.py, block_pool.py, kv_cache_manager.py):

- Groups are numbered in the order vLLM met their layer kinds: group 0 is whichever kind came
  first, not necessarily full attention. vLLM's ``take_events`` names each store's group kind
  (``kv_cache_spec_kind``) and window. Every group's blocks are named by the same hash chain
  (one hash per ``hash_block_size`` tokens; a block by the hash of its last unit), so one hash
  means one token prefix in every group.
- The keyed group (``state.primary``) is the first full-attention group (full, MLA, sink full):
  it caches every block, so its device stores are keyed from their tokens like a plain
  model's. A replica whose stores name no kind (vLLM before the field) keys group 0. Every
  other group's device blocks are placed through the keyed group's hash map (same hash, same
  key): a sliding-window or Mamba group may cache only some blocks (its block mask: fewer
  hashes than the store's tokens hold blocks), which only that map can place. A group's store
  applied before the keyed group's store of the same step is placed at the end of the batch.
  Lower-tier events of the other groups are ignored.
- A hit is vLLM's ``HybridKVCacheCoordinator.find_longest_cache_hit``: capped at
  the prompt's length - 1, the keyed group's hit first (its device prefix, then the longest
  partial piece of the next block), then each other group in turn, full-attention kinds first,
  lowers the length to what it can serve at or below it, until no group lowers it:
  full attention serves every block of the prefix; a sliding window (``w`` tokens, blocks of
  ``b``) the ``ceil((w - 1) / b)`` blocks ending at the hit (or, short of that, the blocks it
  holds from the prompt's start); Mamba its state at the hit's end (the latest position at or
  below the length whose block, or partial piece, it holds). Other kinds (chunked local,
  unknown) are held to the full-attention rule, which is never more than vLLM serves. Hits
  end on a multiple of the groups' common block size, or of the prefix-match unit once the
  replica publishes partial blocks. Lower tiers of hybrid replicas are not counted (their
  other groups' copies are not tracked).
- A store from the prompt's start (no parent) of blocks already held is vLLM re-announcing a
  prefix-cache hit (``kv_cache_report_mode: "full"``: every group's hit, listing every block,
  also those a Mamba or sliding-window group does not hold; never removed) or a computation
  from token 0 (second copies). The keyed group's store is a computation when it lists a
  block this hit could not have served (``_recomputed``); another group's store with a block
  mask is one; another group's store listing every block follows the keyed group's store of
  the same step that ends on the same hash (``_starts``, decided at the batch's end), and is
  otherwise taken as a re-announcement: nothing of it is taken. A keyed block the index lost
  may still be held as a copy it never counted (``uncounted``: a store from the prompt's start
  named it while held, taken once): naming it is then no proof of a computation, so a
  re-announced hit is not taken for one and its groups' listings add nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from math import gcd, lcm
from typing import TYPE_CHECKING

from kvroute.indexer.index.api import ApplyResult, PrefixMatch
from kvroute.indexer.index.state import _GPU, _MAX_UNPLACED, _W, IndexStore, _ReplicaState
from kvroute.indexer.keys import RequestKeys
from kvroute.indexer.wire import BlockRemoved, BlockStored, Medium

__all__ = ["HybridGroups"]

# vLLM's KVCacheSpecKind values, by the hit rule of their manager.
_FULL = frozenset({"full_attention", "mla_attention", "sink_full_attention"})
_WINDOW = frozenset({"sliding_window", "sliding_window_mla"})
_MAMBA = frozenset({"mamba"})

Held = Callable[[int | None], bool]


class HybridGroups(IndexStore):
    """The replica's KV cache groups: which one is keyed, the others' device blocks, and the
    hit vLLM's coordinator serves over all of them."""

    # (replica, group, vLLM hash) of other groups' stores the batch has not placed yet
    _deferred: list[tuple[_ReplicaState, int, int]]
    # other groups' stores from the prompt's start of blocks they hold, and the last hashes
    # of the batch's keyed stores from the prompt's start that were computations
    _starts: list[tuple[_ReplicaState, int, list[int]]]
    _computed: set[tuple[_ReplicaState, int]]

    if TYPE_CHECKING:  # EAGLE-style drafts (drafts.py)

        def _drops(self, state: _ReplicaState) -> str | None: ...

    # --- groups -----------------------------------------------------------------------------

    @staticmethod
    def _learn_group(state: _ReplicaState, event: BlockStored) -> None:
        """Record what a device store says of its group; the first full-attention group (group
        0 when stores name no kind) becomes the keyed one."""
        group = event.group_idx
        old = state.group_specs.get(group)
        kind = event.spec_kind if event.spec_kind is not None else (old and old[0])
        window = event.sliding_window if event.sliding_window is not None else (old and old[1])
        # A partial block's store is one unit long: the group's block size is its largest.
        size = max(event.block_size, old[2] if old else 0)
        spec = (kind or None, window or None, size)
        if spec != old:
            state.group_specs[group] = spec
        if state.primary is None and (kind in _FULL or (kind is None and group == 0)):
            state.primary = group

    @staticmethod
    def _keyed(state: _ReplicaState, group: int) -> bool:
        """Whether events of ``group`` are the keyed (full-attention) group's."""
        if state.primary is not None:
            return group == state.primary
        spec = state.group_specs.get(group)
        return group == 0 and (spec is None or spec[0] is None)

    @staticmethod
    def _keyed_group(state: _ReplicaState) -> int | None:
        """The group ``_keyed`` is true of (None: none yet), for a loop over many events."""
        if state.primary is not None:
            return state.primary
        spec = state.group_specs.get(0)
        return 0 if spec is None or spec[0] is None else None

    def _store_group(self, state: _ReplicaState, event: BlockStored, result: ApplyResult) -> None:
        """A device store of a group other than the keyed one, placed by vLLM hash."""
        if event.medium is not Medium.GPU or not event.confirmed:
            result.ignored += 1
            return
        group = event.group_idx
        by_hash, _by_key = state.groups.setdefault(group, ({}, {}))
        hashes = event.block_hashes
        if (
            event.parent_block_hash is None
            and len(hashes) * event.block_size == len(event.token_ids)
            and hashes[-1] in by_hash
        ):
            # From the prompt's start, every block listed, ending on a block the group holds:
            # a re-announced hit (which lists every block of the hit) or a computation from
            # token 0. The keyed group's store of the same step, ending on the same hash,
            # tells which (``_store_device``): decided at the batch's end.
            self._starts.append((state, group, hashes))
            return
        # Placed at the batch's end: the keyed group's store of the same step may come later,
        # and that store is judged against the groups as they were before the step. A store
        # with a block mask is a computation (a re-announcement lists every block).
        self._deferred.extend((state, group, h) for h in hashes)

    def _place_deferred(self, state: _ReplicaState, result: ApplyResult) -> None:
        """End of a batch: the other groups' stores of the batch, placed by hash; a hash no
        keyed store has placed yet waits (``unplaced``) for one that does (a partial block
        resolved later)."""
        for owner, group, hashes in self._starts:
            if owner is state and (state, hashes[-1]) in self._computed:
                self._deferred.extend((state, group, h) for h in hashes)
            # else a re-announced hit, or a copy we cannot tell from one: nothing to take
        self._starts.clear()
        self._computed.clear()
        unplaced = state.unplaced
        for owner, group, h in self._deferred:
            if owner is state:
                unplaced[(group, h)] = unplaced.pop((group, h), 0) + 1
        self._deferred.clear()
        while len(unplaced) > _MAX_UNPLACED:
            del unplaced[next(iter(unplaced))]
            result.unresolved += 1
        engine_to_key = state.engine_to_key
        for (group, h), n in list(unplaced.items()):
            key = engine_to_key.get(h)
            if key is None:
                continue
            del unplaced[(group, h)]
            by_hash, by_key = state.groups.setdefault(group, ({}, {}))
            rec = by_hash.get(h)
            if rec is not None:
                rec[1] += n
                continue
            by_hash[h] = [key, n]
            by_key[key] = by_key.get(key, 0) + 1

    def _forget_deferred(self, state: _ReplicaState) -> None:
        state.unplaced = {}
        self._deferred[:] = [d for d in self._deferred if d[0] is not state]
        self._starts[:] = [d for d in self._starts if d[0] is not state]

    def _remove_group(self, state: _ReplicaState, event: BlockRemoved, result: ApplyResult) -> None:
        if event.medium is not Medium.GPU or not event.confirmed:
            result.ignored += 1
            return
        group = state.groups.get(event.group_idx)
        by_hash, by_key = group if group is not None else ({}, {})
        for h in event.block_hashes:
            rec = by_hash.get(h)
            if rec is None:
                pending = (state, event.group_idx, h)
                waiting = state.unplaced.get(pending[1:], 0)
                if pending in self._deferred:
                    self._deferred.remove(pending)  # stored and removed in the same batch
                elif waiting > 1:
                    state.unplaced[pending[1:]] = waiting - 1
                elif waiting:
                    del state.unplaced[pending[1:]]
                else:
                    result.unresolved += 1
                continue
            rec[1] -= 1
            if rec[1] <= 0:
                del by_hash[h]
                key = rec[0]
                left = by_key.get(key, 0) - 1
                if left > 0:
                    by_key[key] = left
                else:
                    by_key.pop(key, None)

    # --- the hit ----------------------------------------------------------------------------

    def _cap_hybrid(
        self,
        request: RequestKeys,
        keys: Sequence[int],
        states: list[_ReplicaState],
        block_size: int,
        out: dict[str, PrefixMatch],
    ) -> None:
        """Replace each hybrid replica's match by vLLM's hit over all its groups (device only:
        lower tiers of hybrid replicas are not counted)."""
        for state in states:
            if not self._hybrid(state):
                continue
            match = out[state.name]
            unit = self._fine_unit(state, block_size)

            def pieces(b: int, unit: int | None = unit) -> list[tuple[int, int]]:
                return request.partial_keys(block_size, b, unit) if unit else []

            device = match.blocks_by_tier.get(Medium.GPU, 0)
            hit = self._hybrid_hit(state, keys, request.n_tokens, block_size, device, pieces)
            blocks, partial = divmod(hit, block_size)
            match.blocks = blocks
            match.blocks_by_tier = {Medium.GPU: blocks} if blocks else {}
            match.unconfirmed_by_tier = {}
            match.partial_tokens = partial
            match.partial_unit = unit if partial else None

    @staticmethod
    def _fine_unit(state: _ReplicaState, block_size: int) -> int | None:
        """The prefix-match unit when vLLM serves hits at it (``partial_hash_hits_enabled``:
        a Mamba group in align mode with blocks wider than the unit, every sliding-window
        group's blocks as wide as it), else None. With EAGLE, vLLM also caches a piece past
        the aligned boundary on replicas without partial hits: it is never served."""
        unit = state.partial_unit
        if unit is None or state.primary is None:
            return unit
        specs = state.group_specs
        sides = (set(specs) | set(state.groups)) - {state.primary}
        kinds = {g: specs[g][0] if g in specs else None for g in sides}
        if any(k is None for k in kinds.values()):
            return unit  # groups that name no kind (vLLM before the field): as before
        sizes = {g: specs[g][2] or block_size for g in sides}
        mamba = any(k in _MAMBA and sizes[g] > unit for g, k in kinds.items())
        windows = all(sizes[g] == unit for g, k in kinds.items() if k in _WINDOW)
        return unit if mamba and windows else None

    @staticmethod
    def _hybrid(state: _ReplicaState) -> bool:
        # some group other than the keyed one (a lookup asks this of every replica: no loop)
        specs = state.group_specs
        return bool(state.groups) or len(specs) > 1 or (bool(specs) and state.primary not in specs)

    def _recomputed(self, state: _ReplicaState, keys: Sequence[int], block_size: int) -> bool:
        """Whether a keyed-group store from the prompt's start of these blocks is a new
        computation: on a hybrid model vLLM recomputes from token 0 the blocks its full-
        attention group holds when another group cuts the hit short (a Mamba state or a
        window evicted), and stores second copies of them; a re-announced hit
        (kv_cache_report_mode "full") lists only blocks its hit served."""
        if state.primary is None:
            return False
        bit = 1 << (_W * state.slot + _GPU)
        get = self._masks.get
        uncounted = state.uncounted
        device = 0
        # a block the index lost may still be held as a copy it never counted (``uncounted``):
        # a re-announced hit then names it, which is no computation
        while device < len(keys) and (get(keys[device], 0) & bit or keys[device] in uncounted):
            device += 1
        if device < len(keys) or not self._hybrid(state):
            return device < len(keys)  # a plain model's hit is its held prefix
        n_tokens = len(keys) * block_size + 1  # at most the whole store could have been a hit
        # Without EAGLE's drop: a hit it re-announces ended a block before a held one, which
        # this store does not list (a real computation taken for one: counted once, low).
        hit = self._hybrid_hit(
            state, keys, n_tokens, block_size, device, lambda _b: [], drafts=False
        )
        return hit < len(keys) * block_size

    def _hybrid_hit(
        self,
        state: _ReplicaState,
        keys: Sequence[int],
        n_tokens: int,
        block_size: int,
        device: int,
        pieces: Callable[[int], list[tuple[int, int]]],
        *,
        drafts: bool = True,
    ) -> int:
        """vLLM's hit in tokens for a prompt of ``n_tokens`` keyed ``keys`` whose first
        ``device`` blocks the keyed group holds (``pieces(b)``: the partial pieces of block b,
        shortest first): the keyed group's hit, lowered by every other group's rule until none
        lowers it (``find_longest_cache_hit``'s fixed point). With EAGLE-style drafts
        (drafts.py) every group but Mamba looks one margin past the candidate and drops its
        last block (or unit, with partial hits) once per candidate, as vLLM's
        ``eagle_verified`` does."""
        limit = n_tokens - 1  # vLLM recomputes the last prompt token
        if limit <= 0 or state.primary is None:
            return 0
        unit = self._fine_unit(state, block_size)
        specs = state.group_specs
        sides = sorted((set(specs) | set(state.groups)) - {state.primary})
        sizes = {g: specs[g][2] if g in specs and specs[g][2] else block_size for g in sides}
        align = unit or lcm(block_size, *sizes.values())
        eagle = drafts and self._drops(state) is not None
        # the end of the request's hashes (one per hash_block_size tokens: the prefix-match
        # unit, else the gcd of the groups' blocks): how far an EAGLE margin may look
        hashed = n_tokens // (unit or gcd(block_size, *sizes.values()))
        hashed *= unit or gcd(block_size, *sizes.values())
        found: dict[int, dict[int, int]] = {}

        def key_at(pos: int) -> int | None:
            """Our key of the token prefix ending at ``pos`` (a block's, or a partial piece's)."""
            b, r = divmod(pos, block_size)
            if not r:
                return keys[b - 1] if 0 < b <= len(keys) else None
            piece = found.get(b)
            if piece is None:
                piece = found[b] = dict(pieces(b))
            return piece.get(r)

        # The keyed group: its device prefix, then the longest partial piece of the next block
        # it holds (FullAttentionManager.find_longest_cache_hit).
        reach = min(limit + (unit or block_size), hashed) if eagle else limit
        blocks = min(device, reach // block_size)
        hit = blocks * block_size
        bit = 1 << (_W * state.slot + _GPU)
        get = self._masks.get
        for tokens, key in reversed(pieces(blocks)):
            if hit + tokens <= reach and get(key, 0) & bit:
                hit += tokens
                break
        if eagle and hit > 0:
            hit -= min(unit or block_size, block_size)
        hit -= hit % align
        kinds = {g: specs[g][0] if g in specs else None for g in sides}
        order = sorted(sides, key=lambda g: (kinds[g] not in _FULL, g))
        verified: set[int] = set()  # groups whose EAGLE drop holds at the current candidate
        looked: set[int] = set()  # full-attention groups: looked up once, then only trimmed
        while hit > 0:
            lowered = hit
            for g in order:
                kind, size = kinds[g], sizes[g]
                if kind in _FULL and g in looked:
                    continue  # downward closed: its earlier hit is at least the candidate
                by_key = state.groups.get(g, ({}, {}))[1]

                def held(key: int | None, by_key: dict[int, int] = by_key) -> bool:
                    return key is not None and key in by_key

                window = specs[g][1] if g in specs else None
                mamba = kind in _MAMBA or kind is None
                drop = eagle and g not in verified and not mamba
                reach = min(lowered + size, hashed) if drop else lowered
                if mamba:
                    new = _mamba_hit(held, key_at, size, unit, align, lowered)
                elif kind in _WINDOW and window:
                    new = _window_hit(held, key_at, size, window, align, reach, drop)
                else:
                    new = _full_hit(held, key_at, size, align, reach, drop)
                    looked.add(g)
                if drop:
                    verified.add(g)
                elif new < lowered:
                    verified.clear()
                lowered = new
            if lowered >= hit or len(order) == 1:
                # one pass is the fixed point of full attention and one other group
                hit = min(hit, lowered)
                break
            hit = lowered
        return hit


def _mamba_hit(
    held: Held,
    key_at: Callable[[int], int | None],
    size: int,
    unit: int | None,
    align: int,
    limit: int,
) -> int:
    """MambaManager.find_longest_cache_hit: the latest position at or below ``limit`` where the
    group holds its state (any unit boundary once partial hits are on)."""
    if unit and unit < size:
        pos = limit // unit * unit
        while pos > 0:
            if held(key_at(pos)):
                return pos
            pos -= unit
        return 0
    i = limit // size
    while i > 0:
        pos = i * size
        if not pos % align and held(key_at(pos)):
            return pos
        i -= 1
    return 0


def _window_hit(
    held: Held,
    key_at: Callable[[int], int | None],
    size: int,
    window: int,
    align: int,
    limit: int,
    drop: bool = False,
) -> int:
    """SlidingWindowManager.find_longest_cache_hit: the latest run of ``ceil((window - 1) /
    size)`` held blocks ending at or below ``limit`` (on an aligned end), else the blocks held
    from the prompt's start. ``drop`` (EAGLE): one block more in the run, then the last one
    dropped and the end re-aligned."""
    need = -(-(window - 1) // size) + (1 if drop else 0)
    run = 0
    blocks = -1
    for i in range(limit // size - 1, -1, -1):
        if held(key_at((i + 1) * size)):
            if not run and size != align and (i + (0 if drop else 1)) * size % align:
                continue
            run += 1
            if run >= need:
                blocks = i + run
                break
        else:
            run = 0
    if blocks < 0:
        blocks = run
        while size != align and blocks * size % align:
            blocks -= 1
    if drop and blocks > 0:
        blocks -= 1
        while size != align and blocks * size % align:
            blocks -= 1
    return blocks * size


def _full_hit(
    held: Held,
    key_at: Callable[[int], int | None],
    size: int,
    align: int,
    limit: int,
    drop: bool = False,
) -> int:
    """Full attention: every block of the prefix (``drop``, EAGLE: less its last block)."""
    blocks = 0
    while (blocks + 1) * size <= limit and held(key_at((blocks + 1) * size)):
        blocks += 1
    hit = blocks * size
    if drop and hit > 0:
        hit -= size
    return hit - hit % align
