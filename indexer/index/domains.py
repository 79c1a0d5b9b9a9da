"""Storage domains: a STORAGE directory several replicas share.

A domain is a pseudo-replica (``domain_key``) whose STORAGE holdings are the domain's; its
evictor's stream is applied under that name. An attached replica's STORAGE stores move to its
domain, which holds each block once (a file is one file however often it was written); the
replica's lookups see all the domain holds as its own STORAGE tier (lookup.py).

Holdings are kept per layout: a replica attached with ``layout=L`` shares ``domain:NAME#L``
with the replicas of that layout only (kvroute's connector and llm-d's FS backend both write
each layout -- model, dtype, block geometry, TP/PP -- to a directory of its own, and a
replica never reads another's). The evictor's stream names no layout: its removals apply to
every layout of the domain (a hash removed from one layout's directory may still be a file in
another's; forgetting it there too only makes a prediction lower, never false), and so does
its loss of history.

llm-d's FS backend (``SHARED_STORAGE``, ``OBJECT_STORE``; unconfirmed: it never announces a
removal) on an attached replica is a domain too: its chunks are held by the domain, for every
replica of the layout, as unconfirmed holdings (they still age out), and the removals llm-d's
PVC evictor publishes on its own stream (``BlockRemoved(SHARED_STORAGE)``, topic
``kv@SHARED_STORAGE@<model>``) take them out.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvroute.indexer.index.api import (
    DOMAIN_PREFIX,
    LAYOUT_SEP,
    ApplyResult,
    DomainSummary,
    domain_key,
    split_domain_key,
)
from kvroute.indexer.index.state import _STORAGE, _W, IndexStore, _cls, _ReplicaState
from kvroute.indexer.wire import BlockRemoved, BlockStored, Medium

__all__ = ["StorageDomains"]

# llm-d's shared storage media: the unconfirmed class of the STORAGE tier
_SHARED = _cls(Medium.STORAGE, confirmed=False)


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

        def _remove(
            self, state: _ReplicaState, event: BlockRemoved, result: ApplyResult
        ) -> None: ...

        def _remove_unconfirmed(
            self, state: _ReplicaState, event: BlockRemoved, source: str, result: ApplyResult
        ) -> None: ...

    def attach(self, replica: str, domain: str | None, layout: str | None = None) -> None:
        """Attach ``replica`` to storage domain ``domain`` (None: detach) for the chunks of
        ``layout``: its STORAGE stores are held by the domain's layout from now on, and its
        lookups see all that layout holds."""
        if replica.startswith(DOMAIN_PREFIX):
            raise ValueError(f"{replica!r}: a storage domain cannot be attached to another")
        if layout is not None and (not layout or LAYOUT_SEP in layout):
            raise ValueError(f"layout {layout!r}: non-empty, without {LAYOUT_SEP!r}")
        with self._lock:
            self._layout_epoch += 1  # lookups lift the domain's bits (plans.py)
            if domain is None:
                self._attached.pop(replica, None)
                return
            self._attached[replica] = domain_key(domain, layout)
            self._state(replica)
            self._state(domain_key(domain))  # where its evictor's events go
            self._state(domain_key(domain, layout))

    def _layouts(self, key: str) -> list[_ReplicaState]:
        """Every layout's holder of the domain whose evictor stream is applied as ``key``
        (``domain_key(name)``), besides ``key`` itself; [] for any other key."""
        if not key.startswith(DOMAIN_PREFIX) or LAYOUT_SEP in key:
            return []
        prefix = key + LAYOUT_SEP
        return [s for name, s in self._replicas.items() if name.startswith(prefix)]

    def _remove_from_layouts(
        self,
        holders: list[_ReplicaState],
        event: BlockRemoved,
        source: str,
        result: ApplyResult,
    ) -> None:
        """A removal on a domain's evictor stream, from every layout's holdings (the event
        names no layout). A block is unresolved only when no layout held it."""
        unresolved = []
        for holder in holders:
            scratch = ApplyResult()
            if event.confirmed:
                self._remove(holder, event, scratch)
            else:
                self._remove_unconfirmed(holder, event, source, scratch)
            result.blocks_removed += scratch.blocks_removed
            unresolved.append(scratch.unresolved)
        result.unresolved += min(unresolved)

    def domains(self) -> list[DomainSummary]:
        with self._lock:
            attached: dict[str, list[str]] = {}
            for replica, key in self._attached.items():
                attached.setdefault(key, []).append(replica)
            out = []
            for s in self._replicas.values():
                if not s.name.startswith(DOMAIN_PREFIX):
                    continue
                name, layout = split_domain_key(s.name)
                out.append(
                    DomainSummary(
                        domain=name,
                        block_size=s.block_size,
                        blocks=s.tier_counts[_STORAGE],
                        attached=sorted(attached.get(s.name, ())),
                        chunk_blocks=s.chunk_blocks.get(_STORAGE, s.chunk_blocks.get(_SHARED)),
                        layout=layout,
                        unconfirmed_blocks=s.tier_counts[_SHARED],
                    )
                )
            return out

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
