"""Speculative decoding with EAGLE-style drafts: the prefix-cache hit vLLM drops a block of.

vLLM 0.32 (``SpeculativeConfig.use_eagle_block_drop``: ``method`` one of ``eagle``, ``eagle3``,
``mtp``, ``dflash``, ``dspark``, unless ``disable_eagle_block_drop``) gives its KV cache
manager ``use_eagle``: the drafter writes the KV of the token after a chunk into the chunk's
last block, so a hit must not end on a block that may hold it. What is dropped:

- the device hit: ``find_longest_cache_hit`` caps the hit at the prompt's length - 1, then
  drops its last block (``FullAttentionManager``: ``hit_length -= block_size``; a one-group
  model's group always drops, vLLM's coordinator flags every group when no group is annotated
  as the drafter's);
- the SimpleCPUOffloadConnector's pool: its own coordinator is built with the same flag, so its
  hit past the device prefix loses its last block too;
- vLLM's OffloadingConnector: only groups annotated as holding the drafter's layers
  (``is_eagle_group``: ``mtp``, whose drafter layers register last, and ``dspark``) pop one
  chunk of the hit past the device prefix (``eagle_verified`` in its scheduler); ``eagle``,
  ``eagle3`` and ``dflash`` drafters are not annotated and its hit is whole.

The events say none of this, so the method is a replica setting (``set_speculative``, from the
router's replica option ``speculative=``). Methods that do not use the target's hidden states
(``ngram``, ``ngram_gpu``, ``suffix``, ``draft_model``...) drop nothing. A hybrid replica's hit
is capped by hybrid.py, which reads the same setting.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from kvroute.indexer.index.api import PrefixMatch, drops_block
from kvroute.indexer.index.state import _GPU, _SLOT, _W, IndexStore, _ReplicaState
from kvroute.indexer.wire import Medium

__all__ = ["ANNOTATED_METHODS", "SpeculativeDrafts"]

# The methods whose drafter's KV cache group vLLM annotates (kv_cache_utils.
# annotate_eagle_groups): the OffloadingConnector pops a chunk of those groups' hit.
ANNOTATED_METHODS = frozenset({"mtp", "dspark"})


class SpeculativeDrafts(IndexStore):
    """Per replica, its speculative method; and the lookup's drop for the EAGLE-style ones."""

    # replica -> its speculative method (lower case), for methods that drop a block only
    _drafts: dict[str, str]

    if TYPE_CHECKING:  # lookup.py, hybrid.py

        def _walk(
            self,
            keys: Sequence[int],
            states: list[_ReplicaState],
            block_size: int,
            out: dict[str, PrefixMatch],
            get: Callable[[int, int], int] | None = None,
        ) -> None: ...

        def _lifted(self, states: list[_ReplicaState]) -> Callable[[int, int], int]: ...

        @staticmethod
        def _hybrid(state: _ReplicaState) -> bool: ...

    def set_speculative(self, replica: str, method: str | None) -> None:
        with self._lock:
            if drops_block(method):
                self._drafts[replica] = str(method).lower()
            else:
                self._drafts.pop(replica, None)

    def _drops(self, state: _ReplicaState) -> str | None:
        """The replica's block-dropping method, or None (most replicas: one dict lookup)."""
        return self._drafts.get(state.name) if self._drafts else None

    def _drop_drafted(
        self,
        n_tokens: int,
        keys: Sequence[int],
        states: list[_ReplicaState],
        block_size: int,
        out: dict[str, PrefixMatch],
    ) -> None:
        """Replace each plain EAGLE replica's match by vLLM's: its device hit, capped at the
        prompt's length - 1, less one block; then what its lower tiers serve from there, less
        their own drop (``_lower_cut``)."""
        if not self._drafts:
            return
        for state in states:
            method = self._drops(state)
            if method is None or self._hybrid(state):
                continue
            match = out[state.name]
            device = min(match.blocks_by_tier.get(Medium.GPU, 0), (n_tokens - 1) // block_size)
            if device <= 0 and match.blocks == match.blocks_by_tier.get(Medium.GPU, 0):
                continue  # nothing held past the device prefix: the hit is 0 either way
            base = self._lifted([state])
            bit = 1 << (_W * state.slot + _GPU)
            # The device prefix ends one block earlier: that block is served only by a lower
            # tier holding it (the connector's hit starts where the device's ends). The keys
            # chain, so the key of block ``device - 1`` names that block alone.
            get = _hiding(base, bit, keys[device - 1] if device > 0 else None)
            # a tuple keeps the walk on the Python core, which reads ``get``
            found: dict[str, PrefixMatch] = {}
            self._walk(tuple(keys), [state], block_size, found, get)
            walked = found[state.name]
            device = walked.blocks_by_tier.get(Medium.GPU, 0)
            end = walked.blocks - self._lower_cut(state, method, walked, device, keys, get)
            out[state.name] = _recount(state, keys, device, end, block_size, get)

    def _lower_cut(
        self,
        state: _ReplicaState,
        method: str,
        match: PrefixMatch,
        device: int,
        keys: Sequence[int],
        get: Callable[[int, int], int],
    ) -> int:
        """Blocks the lower tier's own drop takes off the end of the hit: one of the
        SimpleCPUOffloadConnector's pool, one chunk of vLLM's OffloadingConnector for an
        annotated drafter (all of it when less than a chunk is left: no load), nothing for
        the other engines (kvroute's connector, LMCache, vLLM's FS/OBJ tiers, Mooncake)."""
        lower = match.blocks - device
        if lower <= 0:
            return 0
        bits = (get(keys[match.blocks - 1], 0) >> (_W * state.slot)) & (_SLOT & ~1)
        cls = (bits & -bits).bit_length() - 1
        if cls in state.pool_tiers:
            return 1
        if cls in state.whole_loads and method in ANNOTATED_METHODS:
            n = state.chunk_blocks.get(cls, 1)
            return lower if lower - n < n else n
        return 0


def _hiding(
    base: Callable[[int, int], int], bit: int, hidden: int | None
) -> Callable[[int, int], int]:
    """``base`` with ``bit`` cleared in the mask of the key ``hidden``."""

    def get(key: int, default: int = 0) -> int:
        mask = base(key, default)
        return mask & ~bit if key == hidden else mask

    return get


def _recount(
    state: _ReplicaState,
    keys: Sequence[int],
    device: int,
    end: int,
    block_size: int,
    get: Callable[[int, int], int],
) -> PrefixMatch:
    """The match of ``device`` device blocks then blocks ``device..end`` from lower tiers,
    each counted in the fastest lower class holding it (as the walk counts)."""
    shift = _W * state.slot
    by_tier: dict[Medium, int] = {Medium.GPU: device} if device else {}
    unconfirmed: dict[Medium, int] = {}
    for i in range(device, end):
        bits = (get(keys[i], 0) >> shift) & (_SLOT & ~1)
        cls = (bits & -bits).bit_length() - 1
        into = by_tier if cls < 3 else unconfirmed
        tier = Medium(cls % 3)
        into[tier] = into.get(tier, 0) + 1
    return PrefixMatch(state.name, block_size, end, by_tier, unconfirmed)
