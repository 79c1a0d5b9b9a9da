"""Resets: what a clear means, by who can have sent it, and what the index stops vouching for
when a publisher may have cleared something without saying what.

Read from vLLM 0.32 (``v1/core/sched/scheduler.py``, ``v1/core/block_pool.py``,
``v1/simple_kv_offload/manager.py``, ``v1/kv_offload/tiering/manager.py``):

- ``AllBlocksCleared`` has no fields. vLLM's block pool sends it on a prefix-cache reset (the
  device tier). The ``SimpleCPUOffloadConnector`` keeps its CPU (or disk) tier in a block pool
  of its own, whose reset sends the same bare event, on ``reset_prefix_cache(
  reset_connector=True)``; its stores carry ``locality="LOCAL"``, a ``kv_cache_spec_kind`` and
  one block each (``BlockStored.pool_tier``). The scheduler publishes one batch per step: the
  device's events first (``kv_cache_manager.take_events()``), then the connector's. So a bare
  clear followed, in its batch, by a device event is the block pool's; one preceded by a
  lower tier's event is the connector's pool's; any other may be either, and clears both
  (what a replica may have lost is dropped: a prediction may be low, never false).
  A clear naming a medium (kvroute's own publishers) clears that tier.
- ``reset_connector`` is the reset nothing publishes: vLLM's OffloadingConnector empties its
  CPU tier (``TieringOffloadingManager.reset_cache``: the FS/OBJ tiers are kept), Mooncake's
  store runs ``remove_all``; the router sees the request (``/reset_prefix_cache?
  reset_external=true``, ``/pause``, ``/sleep``) and calls this when the replica accepted it.
- An event of a type the decoder does not know (``UnknownEvent``: vLLM's proposed
  ``TierBlocksCleared``, say) may have changed any tier below the device: the replica's lower
  tiers are dropped (confirmed ones, and the unconfirmed holdings of that stream), and
  counted (``ApplyResult.distrusted``). The device tier is kept: vLLM's block pool publishes
  only the three known types.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvroute.indexer.index.api import ApplyResult
from kvroute.indexer.index.state import _GPU, IndexStore, _cls, _ReplicaState
from kvroute.indexer.wire import AllBlocksCleared, BlockRemoved, BlockStored, Event, Medium

__all__ = ["Resets"]

_LOWER = (int(Medium.CPU), int(Medium.STORAGE))


class Resets(IndexStore):
    """Clears with and without a medium, the connector's silent reset, unknown events."""

    if TYPE_CHECKING:  # confirmed holdings (confirmed.py), unconfirmed ones (unconfirmed.py)

        def _clear_class(self, state: _ReplicaState, cls: int) -> None: ...

        def _forget_deferred(self, state: _ReplicaState) -> None: ...  # hybrid.py

        def _drop_class_holdings(
            self, state: _ReplicaState, cls: int, source: str | None = None
        ) -> int: ...

    @staticmethod
    def _note_pool_tier(state: _ReplicaState, event: BlockStored) -> None:
        """Remember the classes a lower-tier block pool (SimpleCPUOffloadConnector) stored in:
        a bare clear may be its reset."""
        if event.pool_tier and event.medium is not Medium.GPU:
            state.pool_tiers.add(_cls(event.medium, event.confirmed))

    def _clear(
        self,
        state: _ReplicaState,
        events: list[Event],
        i: int,
        result: ApplyResult,
    ) -> None:
        """``events[i]``, an ``AllBlocksCleared``, applied to ``state``."""
        event = events[i]
        assert isinstance(event, AllBlocksCleared)
        if event.medium is not None and event.medium is not Medium.GPU:
            self._clear_class(state, int(event.medium))
            result.cleared += 1
            return
        device, pool = True, bool(state.pool_tiers) and event.medium is None
        if pool:
            if any(_is_device_event(e) for e in events[i + 1 :]):
                pool = False  # the block pool's: the device's events come first in a batch
            elif any(_is_lower_event(e) for e in events[:i]):
                device = False  # after the connector's events: its own pool's reset
        if device:
            self._clear_class(state, _GPU)
            # The hashes the clear forgot are no parents of later stores (vLLM stores on a
            # parent its request holds, computed again after the clear), and what the index
            # does next must not depend on the history before the clear: a feed that joins
            # after it skips that history.
            state.ghost = None
            state.groups = {}
            state.device_history = True  # the device is empty: every block from now on is seen
            self._forget_deferred(state)
            result.device_cleared += 1
            if state.reset_pending:  # the connector reset the router forwarded: it is here
                state.reset_pending = False
                self._drop_cpu(state)
        if pool:
            for cls in sorted(state.pool_tiers):
                if cls < 3:
                    self._clear_class(state, cls)
                else:
                    self._drop_class_holdings(state, cls)
        result.cleared += 1

    def _distrust(self, state: _ReplicaState, source: str, result: ApplyResult) -> None:
        """An event of an unknown type from ``source``: drop the replica's lower tiers that
        stream could have changed."""
        if source in state.confirmed_sources:
            for cls in _LOWER:
                self._clear_class(state, cls)
        for cls in _LOWER:
            self._drop_class_holdings(state, cls + 3, source)
        result.distrusted += 1

    def reset_connector(self, replica: str, *, device_cleared: bool = False) -> None:
        with self._lock:
            state = self._replicas.get(replica)
            if state is None:
                if not device_cleared:
                    return
                state = self._state(replica)
            self._drop_cpu(state)
            # The reset's own AllBlocksCleared is still to come on the replica's stream, after
            # every batch published before the reset: what those store in CPU, applied after
            # this call, the clear drops again.
            state.reset_pending = device_cleared

    def _drop_cpu(self, state: _ReplicaState) -> None:
        """What a connector's reset empties: the CPU tier, confirmed and unconfirmed."""
        cpu = int(Medium.CPU)
        self._clear_class(state, cpu)
        self._drop_class_holdings(state, cpu + 3)


def _is_device_event(event: Event) -> bool:
    return (
        isinstance(event, BlockStored | BlockRemoved)
        and event.medium is Medium.GPU
        and event.confirmed
    )


def _is_lower_event(event: Event) -> bool:
    return isinstance(event, BlockStored | BlockRemoved) and (
        event.medium is not Medium.GPU or not event.confirmed
    )
