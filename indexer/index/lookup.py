"""Lookups: per replica, the longest prefix of a request it can serve, per tier, the way vLLM
serves it. The read path: nothing here writes to the index.

The device prefix first, then, from the first block the device lacks, blocks a lower tier
holds, ending on a whole chunk of that tier (``_walk``, ``_trim``); a partial block past the
device prefix (``_probe_partials``); a storage domain's holdings as the STORAGE tier of the
replicas attached to it, and its llm-d shared storage chunks as their unconfirmed STORAGE
(``_lifted``); an EAGLE replica's dropped block (drafts.py); and a hybrid model's cap
(hybrid.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from kvroute.indexer.index.api import DOMAIN_PREFIX, PrefixMatch
from kvroute.indexer.index.plans import LookupPlan, WalkGroup, build_plan
from kvroute.indexer.index.state import (
    _CLASS_NAMES,
    _GPU,
    _SLOT,
    _STORAGE,
    _TIERS,
    _W,
    IndexStore,
    _cls,
    _ReplicaState,
)
from kvroute.indexer.keys import RequestKeys
from kvroute.indexer.wire import Medium

__all__ = ["Lookups"]

# Plans kept (per list of replicas asked: a router asks for its few candidate sets).
_MAX_PLANS = 64
# The classes a storage domain holds for its replicas: STORAGE, confirmed and not.
_DOMAIN_CLASSES = (_STORAGE, _cls(Medium.STORAGE, confirmed=False))


class Lookups(IndexStore):
    """``lookup`` and ``block_tiers``, and the walk behind them."""

    if TYPE_CHECKING:  # the replicas (memory.py), hybrid models (hybrid.py)

        def block_size(self, replica: str) -> int | None: ...

        def _drop_drafted(
            self,
            n_tokens: int,
            keys: Sequence[int],
            states: list[_ReplicaState],
            block_size: int,
            out: dict[str, PrefixMatch],
        ) -> None: ...

        def _cap_hybrid(
            self,
            request: RequestKeys,
            keys: Sequence[int],
            states: list[_ReplicaState],
            block_size: int,
            out: dict[str, PrefixMatch],
        ) -> None: ...

    def lookup(
        self,
        tokens: Sequence[int] | RequestKeys,
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        replicas: Iterable[str] | None = None,
    ) -> dict[str, PrefixMatch]:
        request = (
            tokens
            if isinstance(tokens, RequestKeys)
            else RequestKeys(tokens, lora_name=lora_name, cache_salt=cache_salt)
        )
        # Hashing the keys reads every token (about 0.1 ms per thousand): done before taking
        # the lock, so the event feeds apply meanwhile. The block sizes read here without the
        # lock are a hint (a list of a dict's values is taken whole under the GIL); a size
        # that appears in between is hashed under the lock as before.
        for size in {s.block_size for s in list(self._replicas.values())}:
            if size is not None:
                request.keys(size)
        with self._lock:
            plan = self._plan(replicas)
            out: dict[str, PrefixMatch] = {}
            for name in plan.unsized:
                out[name] = PrefixMatch(name, 0, 0, {})
            for group in plan.groups:
                block_size = group.block_size
                keys = request.keys(block_size)
                self._walk(keys, group.states, block_size, out, group=group)
                if group.partial:
                    self._probe_partials(request, group.partial, block_size, out)
                self._drop_drafted(request.n_tokens, keys, group.states, block_size, out)
                if group.hybrids:
                    self._cap_hybrid(request, keys, group.hybrids, block_size, out)
            return out

    def _plan(self, replicas: Iterable[str] | None) -> LookupPlan:
        """The plan of a lookup of ``replicas`` (plans.py), kept per list of replicas asked
        until the layout changes. Call with the lock held."""
        asked = None if replicas is None else tuple(replicas)
        plans = self._plans
        plan = plans.get(asked)
        if plan is None or plan.epoch != self._layout_epoch:
            wanted = (
                [s for s in self._replicas.values() if not s.name.startswith(DOMAIN_PREFIX)]
                if asked is None
                else [self._replicas[r] for r in asked if r in self._replicas]
            )
            plan = build_plan(wanted, self._layout_epoch, self.block_size, self._attached)
            if len(plans) >= _MAX_PLANS:
                plans.clear()
            plans[asked] = plan
        return plan

    def _probe_partials(
        self,
        request: RequestKeys,
        states: list[_ReplicaState],
        block_size: int,
        out: dict[str, PrefixMatch],
    ) -> None:
        get = self._masks.get
        for state in states:
            unit = state.partial_unit
            if unit is None:
                continue
            match = out[state.name]
            if match.blocks_by_tier.get(Medium.GPU, 0) != match.blocks:
                continue  # vLLM probes partial blocks right after its device prefix only
            bit = 1 << (_W * state.slot + _GPU)
            for tokens, key in reversed(request.partial_keys(block_size, match.blocks, unit)):
                if get(key, 0) & bit:
                    match.partial_tokens = tokens
                    match.partial_unit = unit
                    break

    def _lifted(self, states: list[_ReplicaState]) -> Callable[[int, int], int]:
        """``_masks.get``, with each storage domain's STORAGE bit copied to the STORAGE bit of
        the replicas among ``states`` attached to it: a lookup sees the domain's holdings as
        the replica's own STORAGE tier."""
        get = self._masks.get
        lifts: dict[int, int] = {}
        for state in states:
            domain = self._replicas.get(self._attached.get(state.name, ""))
            if domain is not None:
                # kvroute's (confirmed), llm-d's and vLLM's REMOTE FS tier (unconfirmed)
                for cls in _DOMAIN_CLASSES:
                    dbit = 1 << (_W * domain.slot + cls)
                    lifts[dbit] = lifts.get(dbit, 0) | 1 << (_W * state.slot + cls)
        if not lifts:
            return get
        pairs = tuple(lifts.items())
        memo: dict[int, int] = {}  # a fleet has few distinct masks (they are interned)

        def lifted(key: int, default: int = 0) -> int:
            mask = get(key, default)
            out = memo.get(mask)
            if out is None:
                out = mask
                for dbit, bits in pairs:
                    if mask & dbit:
                        out |= bits
                memo[mask] = out
            return out

        return lifted

    def _walk(
        self,
        keys: Sequence[int],
        states: list[_ReplicaState],
        block_size: int,
        out: dict[str, PrefixMatch],
        get: Callable[[int, int], int] | None = None,
        group: WalkGroup | None = None,
    ) -> None:
        """What each replica can serve of ``keys``, into ``out``: the walk's counts
        (``_walk_counts``, or the native core's twin when it runs, the keys are a list and
        no ``get`` replaces the index's masks), each lower-tier run ended on a whole chunk
        (``_trim``). ``group``: ``states``' plan (plans.py), its lists made once."""
        if group is None:
            attached = self._attached
            lifting = bool(attached) and any(s.name in attached for s in states)
            slots = [s.slot for s in states]
            names = [s.name for s in states]
            distinct = len(set(slots)) == len(slots)
        else:
            lifting, distinct = group.lifting, group.distinct
            slots, names = group.slots, group.names
        native = self._native is not None and isinstance(keys, list) and get is None
        if get is None:
            get = self._lifted(states) if lifting else self._masks.get
        rows: Iterable[tuple[_ReplicaState, list[int], int]]
        # a replica named twice shares its counts (the trim below edits them in place)
        shared: dict[int, list[int]] | None = None if distinct else {}
        if native and shared is None:
            # The native core records the replicas its device prefix alone serves (most of a
            # fleet); the rest come back to be trimmed here.
            rest = self._native.walk_into(
                keys,
                self._masks,
                slots,
                self._lift_pairs(states) if lifting else [],
                names,
                block_size,
                PrefixMatch,
                Medium.GPU,
                out,
            )
            rows = [(states[j], c, blocks) for j, c, blocks in rest]
        elif native:
            native_counts, native_ended = self._native.walk_counts(
                keys, self._masks, slots, self._lift_pairs(states) if lifting else []
            )
            rows = zip(states, native_counts, native_ended, strict=True)
        else:
            counts, ended = self._walk_counts(keys, states, get)
            n = len(keys)
            rows = [(s, counts[s.slot], ended.get(s.slot, n)) for s in states]
        gpu = Medium.GPU
        for s, c, blocks in rows:
            if shared is not None:
                c = shared.setdefault(s.slot, c)
            if blocks > c[0]:
                blocks = self._trim(s, keys, blocks, c, get)
            if c[1] or c[2] or c[3] or c[4] or c[5]:
                by_tier = {tier: c[tier] for tier in _TIERS if c[tier]}
                unconfirmed = {tier: c[tier + 3] for tier in _TIERS if c[tier + 3]}
            else:  # the device prefix alone: most replicas
                by_tier = {gpu: c[0]} if c[0] else {}
                unconfirmed = {}
            out[s.name] = PrefixMatch(s.name, block_size, blocks, by_tier, unconfirmed)

    def _lift_pairs(self, states: list[_ReplicaState]) -> list[tuple[int, int]]:
        """``_lifted`` for the native walk: (a domain's class bit, index in ``states`` of a
        replica that sees it as its own class)."""
        pairs: list[tuple[int, int]] = []
        for j, state in enumerate(states):
            domain = self._replicas.get(self._attached.get(state.name, ""))
            if domain is not None:
                pairs.extend((_W * domain.slot + cls, j) for cls in _DOMAIN_CLASSES)
        return pairs

    def _walk_counts(
        self,
        keys: Sequence[int],
        states: list[_ReplicaState],
        get: Callable[[int, int], int],
    ) -> tuple[dict[int, list[int]], dict[int, int]]:
        """One pass over the request's keys, tracking what each replica can serve, the way
        vLLM serves it: its device prefix first, then, from the first block the device
        lacks, blocks a lower tier holds (a device copy after that point is no use: vLLM does
        not go back to its prefix cache after the connector's hit). Returns the blocks each
        slot serves per class, and the block each slot's run ended at (absent: the end).
        The specification of the native core's ``walk_counts``.

        Consecutive blocks usually have the same mask, so the per-replica accounting runs once
        per run of equal masks, not once per block: a replica's phase can only change on the
        first block of a run.
        """
        counts = {s.slot: [0] * _W for s in states}
        ended: dict[int, int] = {}
        device = 0  # slots still in their device prefix, as bits at the slots' GPU positions
        for s in states:
            device |= 1 << (_W * s.slot)
        lower = 0  # slots past their device prefix, served by a lower tier
        alive_bits = device * _SLOT
        prev = -1
        run = 0
        for i, key in enumerate(keys):
            mask = get(key, 0) & alive_bits
            if mask == prev:
                run += 1
                continue
            if run:
                self._account(prev, run, device, counts)
            alive = device | lower
            in_lower = (mask >> 1 | mask >> 2 | mask >> 3 | mask >> 4 | mask >> 5) & alive
            still_device = mask & device
            lower = (lower | (device & ~still_device)) & in_lower
            device = still_device
            if device | lower != alive:
                gone = alive & ~(device | lower)
                while gone:
                    low = gone & -gone
                    ended[low.bit_length() // _W] = i
                    gone ^= low
                alive_bits = (device | lower) * _SLOT
                mask &= alive_bits
                if not alive_bits:
                    run = 0
                    break
            prev = mask
            run = 1
        if run and alive_bits:
            self._account(prev, run, device, counts)
        return counts, ended

    @staticmethod
    def _account(mask: int, run: int, device: int, counts: dict[int, list[int]]) -> None:
        """Count ``run`` blocks of ``mask`` per slot: in the device prefix as GPU, past it as
        the fastest lower class holding them."""
        for slot, c in counts.items():
            shift = _W * slot
            if device >> shift & 1:
                c[0] += run
                continue
            bits = (mask >> shift) & (_SLOT & ~1)
            if bits:
                c[(bits & -bits).bit_length() - 1] += run

    def _trim(
        self,
        state: _ReplicaState,
        keys: Sequence[int],
        blocks: int,
        c: list[int],
        get: Callable[[int, int], int],
    ) -> int:
        """End a lower-tier run on a whole chunk of the tier its last block is in. vLLM's
        offloading connector also skips a load shorter than one chunk (a device prefix that
        ends inside the only held chunk), so for its tiers such a run counts nothing."""
        shift = _W * state.slot

        def fastest_lower(i: int) -> int:
            bits = (get(keys[i], 0) >> shift) & (_SLOT & ~1)
            return (bits & -bits).bit_length() - 1

        cls = fastest_lower(blocks - 1)
        # A storage domain's chunks are what its replicas wrote: their length is learned there.
        domain = (
            self._replicas.get(self._attached.get(state.name, ""))
            if cls in _DOMAIN_CLASSES
            else None
        )
        learned = state if domain is None or cls not in domain.chunk_blocks else domain
        n = learned.chunk_blocks.get(cls, 1)
        end = max(c[0], blocks // n * n)
        if cls in learned.whole_loads and end - c[0] < n:
            end = c[0]  # vLLM's offloading connector loads at least a chunk, or nothing
        for i in range(end, blocks):
            c[fastest_lower(i)] -= 1
        return end

    def block_tiers(
        self, replica: str, tokens: Sequence[int] | RequestKeys
    ) -> list[frozenset[str]]:
        """Per full block of ``tokens``, the classes the replica holds it in (``"CPU"``,
        ``"STORAGE_UNCONFIRMED"``...): what ``/debug`` pages and tests look at."""
        request = tokens if isinstance(tokens, RequestKeys) else RequestKeys(tokens)
        with self._lock:
            state = self._replicas.get(replica)
            block_size = self.block_size(replica)
            if state is None or block_size is None:
                return []
            shift = _W * state.slot
            get = self._lifted([state])
            out = []
            for key in request.keys(block_size):
                bits = (get(key, 0) >> shift) & _SLOT
                out.append(frozenset(_CLASS_NAMES[c] for c in range(_W) if bits >> c & 1))
            return out
