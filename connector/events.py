"""Tier events as vLLM's own event classes, and the worker->scheduler report carrier.

Tier events are built on the scheduler side (the planner knows when a chunk landed or
left a tier) and returned from ``take_events()``; vLLM appends them to the device
events of the step and publishes one batch with its own sequence number. A
``BlockStored`` carries what vLLM's block pool publishes for the same blocks (every
block hash of the chunk, parent hash, token ids, block size, ``lora_id``, ``lora_name``
and the per-block ``extra_keys``), so an indexer keys a LoRA, ``cache_salt`` or
multimodal prefix's tier entry exactly like its device entry; only ``medium`` ("CPU"
for RAM, "STORAGE" for disk), ``locality`` ("LOCAL") and ``group_idx`` are the tier's
own. ``session_id`` stays unset: a tier event reports where a chunk landed, not which
request's step triggered it. ``BlockRemoved`` carries hashes and medium, as vLLM's.

Worker reports ride in ``KVConnectorOutput.kv_cache_events`` (the
``get_kv_connector_kv_cache_events`` -> ``update_connector_output`` path that exists in
vLLM 0.32 and 0.33): ``KVRouteReports`` is a ``KVConnectorKVEvents`` container whose
items are our ``Report`` records; vLLM's output aggregator merges the containers of
several workers with ``add_events``/``increment_workers``.
"""

from __future__ import annotations

from vllm.distributed.kv_events import (
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVConnectorKVEvents,
)
from vllm.v1.core.kv_cache_utils import BlockHash, maybe_convert_block_hash

from kvroute.connector.plan import Report
from kvroute.connector.planner import TierEvent
from kvroute.indexer.tiers import Tier

LOCALITY = "LOCAL"


def medium_of(tier: Tier) -> str:
    """The wire medium of a tier: its name, which is vLLM's (MEDIUM_CPU, MEDIUM_STORAGE)."""
    return tier.name


def to_vllm_event(ev: TierEvent, *, group_idx: int = 0) -> KVCacheEvent:
    hashes = [maybe_convert_block_hash(BlockHash(h)) for h in ev.info.block_hashes]
    if ev.kind == "stored":
        parent = ev.info.parent_hash
        return BlockStored(
            block_hashes=hashes,
            parent_block_hash=(
                maybe_convert_block_hash(BlockHash(parent)) if parent is not None else None
            ),
            token_ids=list(ev.info.token_ids),
            block_size=ev.info.block_size,
            lora_id=ev.info.lora_id,
            medium=medium_of(ev.tier),
            lora_name=ev.info.lora_name,
            extra_keys=list(ev.info.extra_keys) if ev.info.extra_keys is not None else None,
            group_idx=group_idx,
            locality=LOCALITY,
        )
    return BlockRemoved(
        block_hashes=hashes,
        medium=medium_of(ev.tier),
        group_idx=group_idx,
        locality=LOCALITY,
    )


class KVRouteReports(KVConnectorKVEvents):
    """Carrier of worker ``Report`` records back to the scheduler-side connector."""

    def __init__(self, reports: list[Report] | None = None, num_workers: int = 1) -> None:
        self._reports: list[Report] = list(reports or [])
        self._num_workers = num_workers

    def add_events(self, events: list) -> None:  # type: ignore[override]
        self._reports.extend(events)

    def aggregate(self) -> KVRouteReports:
        return self

    def increment_workers(self, count: int = 1) -> None:
        self._num_workers += count

    def get_all_events(self) -> list:  # type: ignore[override]
        return list(self._reports)

    def get_number_of_workers(self) -> int:
        return self._num_workers

    def clear_events(self) -> None:
        self._reports = []

    def __repr__(self) -> str:
        return f"KVRouteReports(n={len(self._reports)}, workers={self._num_workers})"
