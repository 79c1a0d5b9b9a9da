"""Picklable instructions (scheduler -> worker) and reports (worker -> scheduler).

Plain dataclasses of ints/bytes/lists only: they cross the process boundary inside
vLLM's connector metadata and KV-event containers. A tier is a ``Tier`` (an int): the
connector's RAM is ``Tier.CPU`` and its disk ``Tier.STORAGE``, the media its events announce.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvroute.indexer.tiers import Tier


@dataclass
class StoreOp:
    """Copy paged blocks into RAM slot ``slot``; also write a disk file when
    ``disk_header`` is set (write-through)."""

    key: bytes
    slot: int
    block_ids: list[int]
    disk_header: dict | None = None


@dataclass
class DemoteOp:
    """Write RAM slot ``slot`` (holding ``key``) to disk before the slot is reused."""

    key: bytes
    slot: int
    disk_header: dict


@dataclass
class LoadOp:
    """Copy chunk ``key`` blocks [block_offset:] into ``block_ids``.

    ``source`` is ``Tier.CPU`` (``slot`` is the RAM slot to read) or ``Tier.STORAGE`` (disk;
    ``slot`` is -1).
    """

    req_id: str
    key: bytes
    source: Tier
    slot: int
    block_offset: int
    block_ids: list[int]


@dataclass
class StepPlan:
    demotes: list[DemoteOp] = field(default_factory=list)
    cpu_loads: list[LoadOp] = field(default_factory=list)
    # Disk loads are asynchronous and grouped per request: the request is reported
    # finished-receiving once all of its loads completed (or failed).
    disk_loads: dict[str, list[LoadOp]] = field(default_factory=dict)
    stores: list[StoreOp] = field(default_factory=list)

    def is_empty(self) -> bool:
        return not (self.demotes or self.cpu_loads or self.disk_loads or self.stores)


# Report kinds
STORED = "stored"  # chunk landed in a tier (ok) or failed to (not ok)
LOADED = "loaded"  # a load finished (ok or not); releases pins
REMOVED = "removed"  # worker found a bad file and removed it


@dataclass
class Report:
    kind: str
    key: bytes
    tier: Tier
    ok: bool = True
    req_id: str | None = None
    error: str | None = None  # "disk_full", "corrupt", "queue_full", "io", ...
