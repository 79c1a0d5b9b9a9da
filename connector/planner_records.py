"""What the planner hands out and counts: tier events, a lookup's hits, a request's state,
its counters (the records of ``connector/planner.py``, which decides).

``TierEvent`` is what the adapter (connector/events.py) turns into vLLM's KV events: a chunk
that landed in a tier (``stored``) or left it (``removed``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvroute.connector.bookkeeping import TierEntry
from kvroute.connector.keys import ChunkInfo
from kvroute.indexer.tiers import Tier

__all__ = ["Hit", "LookupResult", "PlannerStats", "ReqState", "TierEvent"]


@dataclass(frozen=True)
class TierEvent:
    kind: str  # "stored" | "removed"
    tier: Tier  # CPU (RAM) | STORAGE (disk)
    info: ChunkInfo


@dataclass
class Hit:
    info: ChunkInfo
    tier: Tier
    block_offset: int  # first block of the chunk to load (local hit may cover some)
    # Shared storage: the entry to pin (a chunk another replica wrote is not indexed).
    entry: TierEntry | None = None


@dataclass
class LookupResult:
    num_computed: int
    hits: list[Hit]
    num_tokens: int

    @property
    def is_async(self) -> bool:
        return any(h.tier == Tier.STORAGE for h in self.hits)


@dataclass
class ReqState:
    req_id: str
    block_ids: list[int] = field(default_factory=list)
    next_store_chunk: int = 0
    lookup: LookupResult | None = None
    loading: bool = False


@dataclass
class PlannerStats:
    cpu_hits_tokens: int = 0
    disk_hits_tokens: int = 0
    stores: int = 0
    store_skipped_full: int = 0
    disk_writes: int = 0
    disk_write_failures: int = 0
    disk_full_events: int = 0
    load_failures: int = 0
    store_skipped_in_flight: int = 0
    evictions_cpu: int = 0
    evictions_disk: int = 0
    # Shared storage: hits on files other replicas wrote; own files found gone.
    shared_foreign_hits: int = 0
    shared_files_gone: int = 0
    shared_writes_skipped_present: int = 0
