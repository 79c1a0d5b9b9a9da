"""What the index's users see: the ``PrefixIndex`` interface, the types its methods return, and
the names of storage domains. The router, the subscriber and the stats need nothing else of the
index (a backend, ``InMemoryPrefixIndex`` in memory.py, is handed to them)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvroute.indexer.keys import RequestKeys
from kvroute.indexer.wire import Event, Medium

if TYPE_CHECKING:
    from kvroute.indexer.snapshot import ReplicaState

__all__ = [
    "DOMAIN_PREFIX",
    "EAGLE_METHODS",
    "ApplyResult",
    "DomainSummary",
    "IndexFigures",
    "PrefixIndex",
    "PrefixMatch",
    "ReplicaIndexSummary",
    "domain_key",
    "drops_block",
    "split_domain_key",
]

# vLLM 0.32's SpeculativeConfig.use_eagle(): the speculative methods whose prefix-cache hits
# lose their last block (drafts.py says what is dropped where).
EAGLE_METHODS = frozenset({"eagle", "eagle3", "mtp", "dflash", "dspark"})


def drops_block(method: str | None) -> bool:
    """Whether a replica drafting with ``method`` (vLLM's ``speculative_config.method``)
    drops the last block of its prefix-cache hits."""
    return method is not None and method.lower() in EAGLE_METHODS


# The index key of a storage domain: a pseudo-replica whose STORAGE holdings are the domain's
# (its evictor's stream is applied under this name). A domain's holdings are kept per layout
# (``domain:NAME#LAYOUT``): a chunk written at one layout (model revision, dtype, TP/PP) is
# no use to a replica of another, even in the same directory.
DOMAIN_PREFIX = "domain:"
LAYOUT_SEP = "#"


def domain_key(domain: str, layout: str | None = None) -> str:
    """The pseudo-replica a storage domain's holdings (of one layout; None: replicas that
    name none) live under; ``domain_key(domain)`` is also where its evictor's events go."""
    return DOMAIN_PREFIX + domain + ("" if layout is None else LAYOUT_SEP + layout)


def split_domain_key(key: str) -> tuple[str, str | None]:
    """(domain, layout) of a pseudo-replica key made by ``domain_key``."""
    name, sep, layout = key[len(DOMAIN_PREFIX) :].partition(LAYOUT_SEP)
    return name, (layout if sep else None)


@dataclass(slots=True)
class PrefixMatch:
    """A replica's longest cached prefix of one request.

    ``blocks_by_tier[t]`` counts the prefix's blocks whose fastest confirmed copy is in tier t,
    ``unconfirmed_by_tier[t]`` those held only by a publisher that never announces removals;
    together they sum to ``blocks``. ``partial_tokens`` are device-tier tokens past the last
    full block (vLLM's finer prefix-match unit, ``partial_unit`` tokens).
    """

    replica: str
    block_size: int
    blocks: int
    blocks_by_tier: dict[Medium, int]
    unconfirmed_by_tier: dict[Medium, int] = field(default_factory=dict)
    partial_tokens: int = 0
    partial_unit: int | None = None

    @property
    def tokens(self) -> int:
        return self.blocks * self.block_size + self.partial_tokens

    def tokens_in(self, tier: Medium) -> int:
        """Confirmed tokens whose fastest copy is in ``tier``."""
        extra = self.partial_tokens if tier is Medium.GPU else 0
        return self.blocks_by_tier.get(tier, 0) * self.block_size + extra

    def unconfirmed_tokens_in(self, tier: Medium) -> int:
        return self.unconfirmed_by_tier.get(tier, 0) * self.block_size

    @property
    def unconfirmed_tokens(self) -> int:
        return sum(self.unconfirmed_by_tier.values()) * self.block_size


@dataclass(slots=True)
class ApplyResult:
    """What applying one batch did: counts, and the reason of every rejected event."""

    applied: int = 0
    blocks_stored: int = 0
    blocks_removed: int = 0
    cleared: int = 0
    device_cleared: int = 0  # AllBlocksCleared of the device tier: the prefix cache reset
    ignored: int = 0
    unresolved: int = 0
    partial_blocks: int = 0
    unconfirmed_blocks: int = 0
    # events of a type the decoder does not know: each made the index drop what its
    # publisher could have changed (the replica's lower tiers)
    distrusted: int = 0
    rejected: list[str] = field(default_factory=list)

    def merge(self, other: ApplyResult) -> None:
        self.applied += other.applied
        self.blocks_stored += other.blocks_stored
        self.blocks_removed += other.blocks_removed
        self.cleared += other.cleared
        self.device_cleared += other.device_cleared
        self.ignored += other.ignored
        self.unresolved += other.unresolved
        self.partial_blocks += other.partial_blocks
        self.unconfirmed_blocks += other.unconfirmed_blocks
        self.distrusted += other.distrusted
        self.rejected.extend(other.rejected)


@dataclass(slots=True)
class ReplicaIndexSummary:
    replica: str
    block_size: int | None
    entries: int
    entries_by_tier: dict[str, int]
    unconfirmed_by_tier: dict[str, int] = field(default_factory=dict)
    partial_unit: int | None = None
    chunk_blocks: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class DomainSummary:
    """A storage domain as the index sees it: blocks held, and the replicas attached."""

    domain: str
    block_size: int | None
    blocks: int
    attached: list[str]
    chunk_blocks: int | None = None
    layout: str | None = None
    unconfirmed_blocks: int = 0  # llm-d's shared storage (SHARED_STORAGE, OBJECT_STORE)


@dataclass(frozen=True, slots=True)
class IndexFigures:
    """Index-wide figures for ``/index/stats`` and the metrics: size, limits, evictions."""

    distinct_blocks: int
    estimated_bytes: int
    max_entries: int
    evicted_entries: int
    unconfirmed_ttl_s: float
    unconfirmed_max_blocks: int
    expired_unconfirmed_blocks: int
    # which core answers lookups: "native" (C++, indexer/native_core.py) or "python"
    index_core: str = "python"
    # CPU blocks an answer proved gone (``refute_cpu``: a connector reset nothing announced)
    refuted_cpu_blocks: int = 0


class PrefixIndex(ABC):
    """What the subscriber, the router and the stats need from an index backend, and all
    they may use: everything else about a backend is its own business."""

    @abstractmethod
    def apply(self, replica: str, events: Iterable[Event], *, source: str = "") -> ApplyResult:
        """Apply one replica's events in order; ``source`` names the event stream they came
        from when a replica has several (llm-d's FS backend publishes on a socket of its own)."""

    @abstractmethod
    def clear_replica(self, replica: str) -> None:
        """Forget everything the replica holds, keep the replica known (it will re-fill)."""

    @abstractmethod
    def clear_source(self, replica: str, source: str = "", *, restarted: bool) -> None:
        """A stream of the replica lost history: forget what it can no longer vouch for.

        Confirmed tiers depend on every removal being seen, so a gap in a stream that sent
        any confirmed event clears them; unconfirmed holdings never see removals, so only a
        restart of their publisher (``restarted``) drops them.
        """

    @abstractmethod
    def reset_connector(self, replica: str, *, device_cleared: bool = False) -> None:
        """The replica's KV connector was reset without an event (vLLM's
        ``reset_prefix_cache(reset_connector=True)``: ``/reset_prefix_cache?reset_external=
        true``, ``/pause``, ``/sleep``): forget what such a reset empties, its CPU tier
        (confirmed and unconfirmed). Storage tiers outlive it (vLLM keeps its FS/OBJ tiers;
        kvroute's connector announces what it drops). ``device_cleared``: the device's prefix
        cache was reset with it, so its ``AllBlocksCleared`` will mark the reset's place in
        the stream: the CPU tier is dropped again there (batches published before the reset
        but applied after this call stored in it)."""

    @abstractmethod
    def expect_device_reset(self, replica: str) -> None:
        """The router forwarded a prefix-cache reset of the device alone that the replica
        accepted: its coming ``AllBlocksCleared`` left the connectors' tiers as they were. A
        device clear the router was told nothing of may be a connector reset sent to the
        replica directly: a backend that ages the silent connectors' tiers then keeps them
        for this one."""

    @abstractmethod
    def refute_cpu(self, replica: str, keys: Sequence[int]) -> int:
        """The replica's answer proved its CPU tier lacks these blocks (keys as ``lookup``
        walks them): a connector that resets without a word was reset (vLLM's
        OffloadingConnector; router/routing/cpu_audit.py). Returns the blocks dropped; other
        connectors' CPU tiers are left to their own events (0)."""

    @abstractmethod
    def note_lost(self, replica: str, source: str = "", batches: int = 1) -> None:
        """``batches`` of the replica's ``source`` stream were lost at their source (numbered,
        never buffered: no replay will hold them). What they removed is unknowable: a backend
        bounds how long it may still believe it (losses.py: ``2 x unconfirmed_ttl_s``)."""

    @abstractmethod
    def remove_replica(self, replica: str) -> None:
        """Forget the replica entirely."""

    @abstractmethod
    def lookup(
        self,
        tokens: Sequence[int] | RequestKeys,
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        replicas: Iterable[str] | None = None,
    ) -> dict[str, PrefixMatch]:
        """Per replica (``replicas``, or every known one), the longest cached prefix of the
        request, per tier. The router passes a ``RequestKeys`` (its keys are computed once
        per block size and shared with the router's other users); plain token ids are keyed
        here with ``lora_name`` and ``cache_salt``."""

    @abstractmethod
    def block_size(self, replica: str) -> int | None:
        """The block size learned from the replica's events (None until its first store)."""

    @abstractmethod
    def expire(self, replica: str | None = None) -> int:
        """Drop unconfirmed holdings past their time, and what a lost batch's window did not
        prove held once it ends; returns how many blocks (entries) went."""

    @abstractmethod
    def summary(self) -> list[ReplicaIndexSummary]:
        """Entries per replica per tier."""

    @abstractmethod
    def stats(self) -> IndexFigures:
        """Index-wide figures: size in memory, limits, what the limits dropped."""

    def sole_holdings(self) -> dict[str, dict[Medium, int]]:
        """Per replica, the blocks it alone holds (no other replica, no storage domain), by
        the fastest tier it holds each in: what losing it would cost (scale-in's deletion
        costs, router/fleet/deletion_cost.py). A backend that cannot tell raises."""
        raise NotImplementedError(f"{type(self).__name__} cannot count sole holdings")

    def export_replica(self, replica: str) -> ReplicaState | None:
        """Everything known of the replica, for a peer router's warm start
        (indexer/snapshot.py); None when unknown, or when the backend cannot export."""
        return None

    def import_replica(self, replica: str, state: ReplicaState) -> int:
        """Replace what is known of the replica with ``state``, whole or not at all (raises
        ``SnapshotError``); returns the entries installed."""
        raise NotImplementedError(f"{type(self).__name__} cannot import a snapshot")

    def attach(self, replica: str, domain: str | None, layout: str | None = None) -> None:
        """Attach the replica to a storage domain (None: detach), for the chunks of its
        ``layout`` (None: every replica of the domain that names none). A backend without
        domains refuses: a shared prefix would silently count nowhere."""
        if domain is not None:
            raise NotImplementedError(f"{type(self).__name__} has no storage domains")

    def set_speculative(self, replica: str, method: str | None) -> None:
        """The replica's speculative decoding method, as vLLM's ``speculative_config.method``
        names it (None: none): the EAGLE-style ones (``eagle``, ``eagle3``, ``mtp``,
        ``dflash``, ``dspark``) make vLLM drop the last block of every prefix-cache hit,
        which the events do not say. A backend that cannot apply the drop refuses: it would
        predict such a replica one block high."""
        if drops_block(method):
            raise NotImplementedError(f"{type(self).__name__} cannot drop EAGLE's block")

    def domains(self) -> list[DomainSummary]:
        """Every storage domain known (holding blocks, or with replicas attached)."""
        return []
