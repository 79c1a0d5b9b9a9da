"""Storage domains: a STORAGE directory several replicas share.

A domain is a pseudo-replica (``domain_key``) whose STORAGE holdings are the domain's; its
evictor's stream is applied under that name. An attached replica's STORAGE stores move to its
domain, which holds each block once (a file is one file however often it was written); the
replica's lookups see all the domain holds as its own STORAGE tier (lookup.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvroute.indexer.index.api import DOMAIN_PREFIX, ApplyResult, DomainSummary, domain_key
from kvroute.indexer.index.state import _STORAGE, _W, IndexStore, _ReplicaState
from kvroute.indexer.wire import BlockStored

__all__ = ["StorageDomains"]


class StorageDomains(IndexStore):
    """Attaching replicas to domains, and moving their STORAGE stores there."""

    if TYPE_CHECKING:  # the replicas (memory.py), confirmed holdings (confirmed.py)

        def _state(self, replica: str) -> _ReplicaState: ...

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

        def _forget_if_unheld(self, state: _ReplicaState, h: int, key: int, mask: int) -> None: ...

    def attach(self, replica: str, domain: str | None) -> None:
        """Attach ``replica`` to storage domain ``domain`` (None: detach): its STORAGE stores
        are held by the domain from now on, and its lookups see all the domain holds."""
        if replica.startswith(DOMAIN_PREFIX):
            raise ValueError(f"{replica!r}: a storage domain cannot be attached to another")
        with self._lock:
            if domain is None:
                self._attached.pop(replica, None)
                return
            self._attached[replica] = domain_key(domain)
            self._state(replica)
            self._state(domain_key(domain))

    def domains(self) -> list[DomainSummary]:
        with self._lock:
            attached: dict[str, list[str]] = {}
            for replica, key in self._attached.items():
                attached.setdefault(key, []).append(replica)
            return [
                DomainSummary(
                    domain=s.name[len(DOMAIN_PREFIX) :],
                    block_size=s.block_size,
                    blocks=s.tier_counts[_STORAGE],
                    attached=sorted(attached.get(s.name, ())),
                    chunk_blocks=s.chunk_blocks.get(_STORAGE),
                )
                for s in self._replicas.values()
                if s.name.startswith(DOMAIN_PREFIX)
            ]

    def _share(
        self, state: _ReplicaState, domain: _ReplicaState, event: BlockStored, result: ApplyResult
    ) -> None:
        """An attached replica stored ``event``'s STORAGE blocks (already applied to it):
        move them to its domain. A file in the domain is one file however often it was
        written, so the domain holds a block once (no reference counts) until removed."""
        if domain.block_size is None:
            domain.block_size = state.block_size
        elif state.block_size is not None and state.block_size != domain.block_size:
            raise ValueError(
                f"STORAGE block_size {state.block_size} differs from its storage domain's "
                f"{domain.block_size}"
            )
        n = state.chunk_blocks.get(_STORAGE)
        if n is not None and n > domain.chunk_blocks.get(_STORAGE, 0):
            domain.chunk_blocks[_STORAGE] = n
        if _STORAGE in state.whole_loads:
            domain.whole_loads.add(_STORAGE)
        masks = self._masks
        bit = 1 << (_W * state.slot + _STORAGE)
        scratch = ApplyResult()
        for h in event.block_hashes:
            rec = state.chunks.pop((_STORAGE, h), None)
            members: tuple[int, ...] = (h,) if rec is None else rec[0]
            if rec is not None:
                domain.chunks[(_STORAGE, h)] = [members, 1]
            for m in members:
                key = state.engine_to_key.get(m)
                if key is None:
                    continue
                self._hold(domain, m, key, _STORAGE, scratch, count_dup=False)
                mask = masks.get(key, 0)
                if mask & bit:
                    self._set_mask(key, mask & ~bit)
                    state.tier_counts[_STORAGE] -= 1
                    state.refs.pop((key, _STORAGE), None)
                    self._forget_if_unheld(state, m, key, mask & ~bit)
