"""What a KV event means once decoded: ``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared`` in
an ``EventBatch`` (hashes as u64 ints, the medium as a tier), and the media known publishers
send, each mapped to a tier and to whether its publisher announces removals.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from kvroute.indexer.tiers import Tier

__all__ = [
    "LMCACHE_MEDIUM",
    "MEDIA",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "Event",
    "EventBatch",
    "Frame",
    "Medium",
    "MediumKind",
    "UnknownEvent",
    "UnknownEventType",
    "UnknownMedium",
    "WireError",
    "classify_store",
    "is_device_clear",
    "medium_kind",
    "touches_lower_tier",
]


class WireError(ValueError):
    """A frame or payload that cannot be decoded at all (the whole message is skipped)."""


# The wire's medium is a cache tier; the tiers are defined once, in kvroute.indexer.tiers.
Medium = Tier


@dataclass(frozen=True, slots=True)
class MediumKind:
    """What a wire ``medium`` string means: the tier its blocks sit in, and whether the
    publisher that uses it announces removals (``confirmed``). A tier whose publisher never
    removes anything (LMCache, llm-d's FS backend) can only be believed for a while."""

    tier: Medium
    confirmed: bool = True


# LMCache's medium on its list path (``LMCacheConnectorV1`` forwards LMCache's CacheStoreEvent).
LMCACHE_MEDIUM = "cpu"

# Every medium a known publisher sends, and nothing else: an unknown medium is counted and
# its event dropped, never mapped to a tier by resemblance (a slow tier counted as GPU, or a
# store that is never removed counted as confirmed, would make predictions false).
MEDIA: dict[str | None, MediumKind] = {
    # vLLM's block pool (device cache; None: vLLM before the field, device events only)
    None: MediumKind(Medium.GPU),
    "GPU": MediumKind(Medium.GPU),
    # vLLM's native OffloadingConnector and kvroute's connector: stores and removals
    "CPU": MediumKind(Medium.CPU),
    "STORAGE": MediumKind(Medium.STORAGE),
    # LMCache (LMCacheConnectorV1 forwards LMCache's own events): stores only
    LMCACHE_MEDIUM: MediumKind(Medium.CPU, confirmed=False),
    # llm-d's FS offloading backend, on its own socket: stores only (eviction is external)
    "SHARED_STORAGE": MediumKind(Medium.STORAGE, confirmed=False),
    "OBJECT_STORE": MediumKind(Medium.STORAGE, confirmed=False),
}
CANONICAL_MEDIA = {
    None: Medium.GPU,
    "GPU": Medium.GPU,
    "CPU": Medium.CPU,
    "STORAGE": Medium.STORAGE,
}


class UnknownMedium(ValueError):
    """An event naming a medium no known publisher uses; ``medium`` is what it said."""

    def __init__(self, medium: object) -> None:
        super().__init__(f"unknown medium {medium!r}")
        self.medium = medium if isinstance(medium, str) else repr(medium)


def medium_kind(value: object) -> MediumKind:
    """The tier and confirmation of a wire ``medium``; raises UnknownMedium otherwise."""
    if value is None or isinstance(value, str):
        kind = MEDIA.get(value)
        if kind is not None:
            return kind
    raise UnknownMedium(value)


def classify_store(
    medium: str | None,
    kind: MediumKind,
    *,
    extra_keys: object,
    ownership: str | None,
    group_idx: int | None,
) -> tuple[bool, bool]:
    """``(confirmed, engine_hashes)`` of a ``BlockStored``: whether its publisher announces
    removals, and whether its hashes must be resolved through vLLM's (read from vLLM 0.32).

    - ``"STORAGE"`` without ``extra_keys`` and without ``ownership``: vLLM's offloading
      connector (it never sends extra keys) from a secondary tier other than KVCR (which sets
      ``ownership="kvcr"`` and announces removals): the FS and OBJ tiers
      (``v1/kv_offload/tiering/fs``, ``obj``), which store and never remove (files go when an
      external evictor deletes them). Unconfirmed, resolved through vLLM's hashes.
      kvroute's connector and its evictor always send ``extra_keys`` (one entry per block), so
      their STORAGE stays confirmed.
    - ``"cpu"`` with a ``group_idx``: Mooncake's store connector (LMCache never sends the
      field). vLLM's own block hashes, one block per event, no extra keys even for a LoRA or
      a salted request, no removals. Unconfirmed, resolved through vLLM's hashes.
    """
    if medium == "STORAGE" and extra_keys is None and ownership is None:
        return False, True
    if medium == "cpu" and group_idx is not None:
        return False, True
    return kind.confirmed, False


def kept_medium_name(value: str | None) -> str | None:
    """The wire string to keep on an event: None when it is one of vLLM's own names (the
    encoder writes ``medium.name`` then), the publisher's spelling otherwise."""
    return None if value in CANONICAL_MEDIA else value


@dataclass(slots=True)
class BlockStored:
    """Blocks that landed in a tier.

    ``token_ids`` holds the tokens of all listed blocks, concatenated. A tier-only update (vLLM's
    OffloadingConnector without self-describing events, llm-d's FS backend) has
    ``token_ids=[]`` and ``block_size=0``: it names blocks (the last block of each offloaded
    chunk) already known from earlier events. ``extra_keys`` is None when the event did not
    carry the field, which is not the same as carrying it with no extra keys: vLLM's block pool
    always sends one entry per block, its offloading connector never does.
    ``confirmed`` is False for media whose publisher never announces removals.
    ``medium_name`` keeps the publisher's spelling when it is not one of vLLM's own.
    ``ownership`` is the secondary tier that stored the blocks (vLLM's ``"kvcr"``), None for
    every other publisher.
    ``engine_hashes`` is True for a store whose publisher never removes anything but names
    vLLM's own block hashes without the extra keys behind them (vLLM's FS/OBJ tiers,
    Mooncake's store, ``classify_store``): the index resolves it through the replica's map
    of vLLM hashes to keys, never by keying its tokens.
    ``pool_tier`` is True for a lower tier kept in a vLLM block pool of its own
    (SimpleCPUOffloadConnector: ``locality="LOCAL"``, a ``kv_cache_spec_kind``, one block per
    event), whose reset is a bare ``AllBlocksCleared``.

    ``spec_kind`` and ``sliding_window`` are vLLM's ``kv_cache_spec_kind`` and
    ``kv_cache_spec_sliding_window``: the kind of the KV cache group ``group_idx`` (vLLM's
    ``KVCacheSpecKind`` values: ``"full_attention"``, ``"sliding_window"``, ``"mamba"``...) and
    its window; None where the publisher does not say. A store of a group that caches only
    some blocks (a sliding-window or Mamba group's block mask) lists fewer hashes than its
    ``token_ids`` hold blocks: the tokens still span every block from the parent on.
    """

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    medium: Medium = Medium.GPU
    lora_name: str | None = None
    lora_id: int | None = None
    extra_keys: list[Any] | None = None
    group_idx: int = 0
    locality: str | None = None
    confirmed: bool = True
    medium_name: str | None = None
    ownership: str | None = None
    engine_hashes: bool = False
    pool_tier: bool = False
    spec_kind: str | None = None
    sliding_window: int | None = None


@dataclass(slots=True)
class BlockRemoved:
    """Blocks that left one tier (other tiers of the same blocks are untouched)."""

    block_hashes: list[int]
    medium: Medium = Medium.GPU
    group_idx: int = 0
    confirmed: bool = True
    medium_name: str | None = None


@dataclass(slots=True)
class AllBlocksCleared:
    """A publisher dropped its cache.

    vLLM's event has no fields: its block pool sends it on ``/reset_prefix_cache``, which clears
    the device cache only (vLLM's offloading tiers are kept by default). So ``medium=None``
    means the device tier; a medium, which only kvroute's own publishers send, that tier.
    """

    medium: Medium | None = None


@dataclass(slots=True)
class UnknownEvent:
    """An event of a type this decoder does not know (``type`` is its tag), kept in its place
    in the batch: it may have changed a tier (vLLM's proposed ``TierBlocksCleared``), so the
    index stops vouching for what it could have changed instead of dropping it silently."""

    type: str


class UnknownEventType(ValueError):
    """A tagged event whose tag no definition has; ``tag`` is what it said."""

    def __init__(self, tag: str) -> None:
        super().__init__(f"unknown event type {tag!r}")
        self.tag = tag


Event = BlockStored | BlockRemoved | AllBlocksCleared | UnknownEvent


@dataclass(slots=True)
class EventBatch:
    """One published batch: the events of one engine step, applied atomically in order."""

    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None
    rejected: list[str] = field(default_factory=list)
    unknown_media: Counter[str] = field(default_factory=Counter)
    unknown_types: Counter[str] = field(default_factory=Counter)


@dataclass(slots=True, frozen=True)
class Frame:
    """One PUB message, split but not yet decoded."""

    topic: str
    seq: int
    payload: bytes


def is_device_clear(event: Event) -> bool:
    """Whether ``event`` clears the device tier (vLLM's block pool on a prefix-cache reset)."""
    return isinstance(event, AllBlocksCleared) and event.medium in (None, Medium.GPU)


def touches_lower_tier(event: Event) -> bool:
    """Whether ``event`` changes a tier other than the confirmed device tier."""
    if isinstance(event, AllBlocksCleared):
        return not is_device_clear(event)
    if isinstance(event, UnknownEvent):
        return True
    return event.medium is not Medium.GPU or not event.confirmed
