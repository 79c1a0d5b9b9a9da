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
  ``Scheduler.reset_prefix_cache`` resets the device first, in the same call, when it can
  (``{"success": true}``; ``/pause`` and ``/sleep`` always): the block pool's
  ``AllBlocksCleared`` then marks the reset's place in the stream, and the CPU tier is dropped
  again there (``device_cleared``: stores of batches published before the reset, applied after
  the router's call). A device-only reset the router forwards is announced too
  (``expect_device_reset``); a device clear nobody announced may be a connector reset sent
  directly, so the OffloadingConnector's CPU blocks are held ``unconfirmed_ttl_s`` more only,
  unless stored again (``_doubt_silent_cpu``).
- A connector reset sent to the replica directly whose device reset failed (``{"success":
  false}``: blocks in use) publishes nothing at all; the replica's own answer tells, later:
  a request the router sent predicting a load from CPU whose reported cached tokens stop at
  the device's part (``usage.prompt_tokens_details.cached_tokens``, local and connector hits
  together) proves the CPU tier lacks the first chunk it predicted, and the router drops the
  run it predicted (``refute_cpu``, router/routing/cpu_audit.py). Each stale chunk misleads
  one request per router at most.
- An event of a type the decoder does not know (``UnknownEvent``: vLLM's proposed
  ``TierBlocksCleared``, say) may have changed any tier below the device: the replica's lower
  tiers are dropped (confirmed ones, and the unconfirmed holdings of that stream), and
  counted (``ApplyResult.distrusted``). The device tier is kept: vLLM's block pool publishes
  only the three known types.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvroute.indexer.index.api import ApplyResult
from kvroute.indexer.index.state import _GPU, _W, IndexStore, _cls, _ReplicaState
from kvroute.indexer.wire import AllBlocksCleared, BlockRemoved, BlockStored, Event, Medium

__all__ = ["Resets"]

_LOWER = (int(Medium.CPU), int(Medium.STORAGE))
# What the router said the replica's next device clear is (``_ReplicaState.reset_pending``):
# nothing, a connector reset with the device's, or the device's prefix cache alone.
_NO_RESET, _CONNECTOR_RESET, _DEVICE_RESET = 0, 1, 2


class Resets(IndexStore):
    """Clears with and without a medium, the connector's silent reset, unknown events."""

    if TYPE_CHECKING:  # confirmed holdings (confirmed.py), unconfirmed ones (unconfirmed.py)

        def _clear_class(self, state: _ReplicaState, cls: int) -> None: ...

        def _forget_deferred(self, state: _ReplicaState) -> None: ...  # hybrid.py

        def _forget_if_unheld(self, state: _ReplicaState, h: int, key: int, mask: int) -> None: ...

        def _release(self, state: _ReplicaState, h: int, key: int, cls: int) -> int: ...

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
            state.uncounted = {}  # no copy is left that the index did not count
            state.device_history = True  # the device is empty: every block from now on is seen
            self._forget_deferred(state)
            result.device_cleared += 1
            pending, state.reset_pending = state.reset_pending, _NO_RESET
            if pending == _CONNECTOR_RESET:  # the connector reset the router forwarded
                self._drop_cpu(state)
            elif pending != _DEVICE_RESET:  # perhaps a connector reset the router never saw
                self._doubt_silent_cpu(state)
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
            self._layout_epoch += 1  # may forget hybrid groups (plans.py)
            state = self._replicas.get(replica)
            if state is None:
                if not device_cleared:
                    return
                state = self._state(replica)
            self._drop_cpu(state)
            # The reset's own AllBlocksCleared is still to come on the replica's stream, after
            # every batch published before the reset: what those store in CPU, applied after
            # this call, the clear drops again.
            state.reset_pending = _CONNECTOR_RESET if device_cleared else _NO_RESET

    def expect_device_reset(self, replica: str) -> None:
        with self._lock:
            state = self._replicas.get(replica)
            if state is not None and state.reset_pending == _NO_RESET:
                state.reset_pending = _DEVICE_RESET

    def refute_cpu(self, replica: str, keys: Sequence[int]) -> int:
        with self._lock:
            state = self._replicas.get(replica)
            cpu = int(Medium.CPU)
            if state is None or cpu not in state.whole_loads or cpu in state.pool_tiers:
                return 0  # only a connector that resets without a word can be this wrong
            bit = 1 << (_W * state.slot + cpu)
            masks = self._masks
            wanted = {k for k in keys if masks.get(k, 0) & bit}
            if not wanted:
                return 0
            gone = 0
            for h, key in list(state.engine_to_key.items()):
                if key in wanted:  # every holding goes (two hashes of one key: dropped once)
                    state.refs.pop((key, cpu), None)
                    state.chunks.pop((cpu, h), None)
                    state.doubted.pop(h, None)
                    gone += self._release(state, h, key, cpu)
            self.refuted_blocks += gone
            return gone

    def _drop_cpu(self, state: _ReplicaState) -> None:
        """What a connector's reset empties: the CPU tier, confirmed and unconfirmed."""
        cpu = int(Medium.CPU)
        self._clear_class(state, cpu)
        self._drop_class_holdings(state, cpu + 3)
        state.doubted = {}

    def _doubt_silent_cpu(self, state: _ReplicaState) -> None:
        """A device clear the router did not announce: vLLM resets the device's prefix cache
        with every connector reset it can (``/reset_prefix_cache?reset_external=true``,
        ``/pause``, ``/sleep``), so this may be one sent to the replica directly, which
        emptied vLLM's OffloadingConnector's CPU tier without a word. Its CPU blocks are held
        on, for ``unconfirmed_ttl_s`` only, unless stored again (the connector stores a chunk
        again only once it lost it) or removed meanwhile: a bounded window instead of none,
        at the cost of chunks a device-only reset kept aging out (a prediction below vLLM's
        hit, until they are offloaded again). Connectors that announce their reset
        (kvroute's, the SimpleCPUOffloadConnector's pool) are left alone."""
        cpu = int(Medium.CPU)
        if cpu not in state.whole_loads or cpu in state.pool_tiers or not state.tier_counts[cpu]:
            return
        bit = 1 << (_W * state.slot + cpu)
        expires = self._clock() + self.unconfirmed_ttl_s
        masks = self._masks
        doubted = state.doubted
        for h, key in state.engine_to_key.items():
            if masks.get(key, 0) & bit:
                doubted.setdefault(h, expires)

    def _expire_doubted(self, state: _ReplicaState, now: float) -> int:
        """Drop the doubted CPU blocks whose time is up (``_doubt_silent_cpu``)."""
        cpu = int(Medium.CPU)
        bit = 1 << (_W * state.slot + cpu)
        gone = 0
        for h, expires in list(state.doubted.items()):
            if expires > now:
                continue
            del state.doubted[h]
            key = state.engine_to_key.get(h)
            mask = self._masks.get(key, 0) if key is not None else 0
            if key is None or not mask & bit:
                continue
            self._set_mask(key, mask & ~bit)
            state.refs.pop((key, cpu), None)
            state.tier_counts[cpu] -= 1
            self._forget_if_unheld(state, h, key, mask & ~bit)
            gone += 1
        return gone


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
