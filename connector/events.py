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

Worker reports ride in ``KVConnectorOutput.kv_connector_worker_meta`` (the
``build_connector_worker_meta`` -> ``update_connector_output`` path of vLLM 0.32 and later):
``KVRouteReports`` is a ``KVConnectorWorkerMetadata`` whose ``aggregate`` merges several
workers' reports. Not ``kv_cache_events`` (``get_kv_connector_kv_cache_events``), which the
connector used before: vLLM's ``MultiConnector`` does not pass a child's
``kv_cache_events`` on (vLLM 0.32 leaves it as a TODO) but does pass each child its own
worker metadata, so under a ``MultiConnector`` (NIXL + kvroute, docs/deploy.md P/D) the
reports would never reach the scheduler and no CPU or disk tier event would be published.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
from vllm.v1.core.kv_cache_utils import BlockHash, maybe_convert_block_hash

from kvroute.connector.plan import Report
from kvroute.connector.planner_records import TierEvent
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


@dataclass
class KVRouteReports(KVConnectorWorkerMetadata):
    """Carrier of worker ``Report`` records back to the scheduler-side connector."""

    reports: list[Report] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVRouteReports:
        """Several workers' reports of one step (tensor or pipeline parallel ranks): each
        rank reports its own copies, so they are kept side by side."""
        assert isinstance(other, KVRouteReports), type(other)
        return KVRouteReports([*self.reports, *other.reports])

    def __repr__(self) -> str:
        return f"KVRouteReports(n={len(self.reports)})"
