"""Hybrid models: the device blocks of the other KV cache groups (Mamba, sliding window).

- On a hybrid model a hit must end where every KV-cache group holds its block: the other
  groups' device blocks are tracked and cut the device prefix back (``_cap_hybrid``).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvroute.indexer.index.api import ApplyResult, PrefixMatch
from kvroute.indexer.index.state import IndexStore, _ReplicaState
from kvroute.indexer.keys import RequestKeys
from kvroute.indexer.wire import BlockRemoved, BlockStored, Medium

__all__ = ["HybridGroups"]


class HybridGroups(IndexStore):
    """Stores and removals of KV cache groups > 0, and the cap they put on a device hit."""

    def _store_group(self, state: _ReplicaState, event: BlockStored, result: ApplyResult) -> None:
        """A device store of KV cache group > 0 (Mamba, sliding window). Its blocks carry the
        same vLLM hashes as group 0's at the same positions, so they are placed through the
        replica's hash map; a lower tier of such a group is not tracked (never claimed)."""
        if event.medium is not Medium.GPU or not event.confirmed:
            result.ignored += 1
            return
        by_hash, by_key = state.groups.setdefault(event.group_idx, ({}, {}))
        for h in event.block_hashes:
            rec = by_hash.get(h)
            if rec is None:
                key = state.engine_to_key.get(h)
                if key is None:
                    result.unresolved += 1
                    continue
                by_hash[h] = [key, 1]
                by_key[key] = by_key.get(key, 0) + 1
            else:
                rec[1] += 1

    def _remove_group(self, state: _ReplicaState, event: BlockRemoved, result: ApplyResult) -> None:
        if event.medium is not Medium.GPU or not event.confirmed:
            result.ignored += 1
            return
        group = state.groups.get(event.group_idx)
        if group is None:
            result.unresolved += len(event.block_hashes)
            return
        by_hash, by_key = group
        for h in event.block_hashes:
            rec = by_hash.get(h)
            if rec is None:
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

    def _cap_hybrid(
        self,
        request: RequestKeys,
        keys: Sequence[int],
        states: list[_ReplicaState],
        block_size: int,
        out: dict[str, PrefixMatch],
    ) -> None:
        """On a hybrid model vLLM's hit is the longest device prefix at whose end every other
        group holds its block too (a Mamba group's state at that point). Lower tiers of such
        replicas are not counted: their other groups' copies are not tracked."""
        for state in states:
            if not state.groups:
                continue
            holders = [by_key for _by_hash, by_key in state.groups.values()]
            match = out[state.name]
            device = match.blocks_by_tier.get(Medium.GPU, 0)
            if match.partial_tokens and device == match.blocks:
                unit = state.partial_unit or block_size
                pieces = dict(request.partial_keys(block_size, device, unit))
                key = pieces.get(match.partial_tokens)
                if key is not None and all(key in h for h in holders):
                    match.blocks_by_tier = {Medium.GPU: device}
                    match.unconfirmed_by_tier = {}
                    continue
            b = device
            while b and not all(keys[b - 1] in h for h in holders):
                b -= 1
            match.blocks = b
            match.blocks_by_tier = {Medium.GPU: b} if b else {}
            match.unconfirmed_by_tier = {}
            match.partial_tokens = 0
            match.partial_unit = None
