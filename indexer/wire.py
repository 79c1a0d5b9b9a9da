"""vLLM's KV-event wire format: the one module that knows frames, msgpack layouts and replay.

Everything that reads or writes vLLM KV events goes through here, so a change in vLLM's format
is a change in one file. Each event has one msgspec definition (``WireBlockStored``...,
vLLM's own field for field), used to decode and to encode; the decoded ``BlockStored``...
dataclasses are what the index takes (hashes as u64 ints, the medium as a tier).
The decoder is strict about what it needs and lenient about what it
does not: unknown fields are ignored, both the map-tagged encoding (vLLM 0.32/0.33) and the
positional-array encoding (older vLLM, llm-d's FS backend) are accepted, events packed as
nested msgpack bytes (llm-d's FS backend) are unpacked, and a malformed event is rejected with
a reason while the rest of its batch is still applied. An event naming a medium no known
publisher uses is counted in ``EventBatch.unknown_media`` and dropped.

Wire facts (see docs/indexer.md):
- PUB message: ``[topic utf-8, seq 8-byte big-endian unsigned, payload msgpack]``.
- payload: ``[ts, [event, ...], data_parallel_rank | nil]`` (the rank may be absent).
- event: a map with ``"type"`` (new) or an array ``[tag, field, ...]`` (old), fields in
  declaration order; either may arrive packed as msgpack bytes inside the list.
- replay (ROUTER; we talk to it with a DEALER): request ``[b"", start_seq8]``, replies
  ``[b"", topic, seq8, payload]`` per buffered batch, then the end marker
  ``[b"", b"", -1 as 8 signed bytes, b""]``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from kvroute.indexer.tiers import Tier

__all__ = [
    "MEDIA",
    "REPLAY_END_SEQ",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "Event",
    "EventBatch",
    "Frame",
    "Medium",
    "MediumKind",
    "UnknownMedium",
    "WireAllBlocksCleared",
    "WireBatch",
    "WireBlockRemoved",
    "WireBlockStored",
    "WireError",
    "WireEvent",
    "decode_batch",
    "decode_frames",
    "decode_replay_reply",
    "encode_batch",
    "encode_frames",
    "encode_replay_end",
    "encode_replay_reply",
    "encode_replay_request",
    "is_device_clear",
    "medium_kind",
    "parse_replay_request",
    "payload_hints",
    "to_wire",
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
    "cpu": MediumKind(Medium.CPU, confirmed=False),
    # llm-d's FS offloading backend, on its own socket: stores only (eviction is external)
    "SHARED_STORAGE": MediumKind(Medium.STORAGE, confirmed=False),
    "OBJECT_STORE": MediumKind(Medium.STORAGE, confirmed=False),
}
_CANONICAL = {None: Medium.GPU, "GPU": Medium.GPU, "CPU": Medium.CPU, "STORAGE": Medium.STORAGE}


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


def _medium_name(value: str | None) -> str | None:
    """The wire string to keep on an event: None when it is one of vLLM's own names (the
    encoder writes ``medium.name`` then), the publisher's spelling otherwise."""
    return None if value in _CANONICAL else value


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


Event = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(slots=True)
class EventBatch:
    """One published batch: the events of one engine step, applied atomically in order."""

    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None
    rejected: list[str] = field(default_factory=list)
    unknown_media: Counter[str] = field(default_factory=Counter)


@dataclass(slots=True, frozen=True)
class Frame:
    """One PUB message, split but not yet decoded."""

    topic: str
    seq: int
    payload: bytes


# --- the wire's definitions: vLLM's msgspec classes (vllm/distributed/kv_events.py), field for
# field, in its order. They decode vLLM's batches (in C) and encode ours, byte for byte as vLLM.
# ``medium`` on a clear is kvroute's own addition (vLLM's clear has no fields).


class WireBlockStored(msgspec.Struct, tag="BlockStored", omit_defaults=True, gc=False):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class WireBlockRemoved(msgspec.Struct, tag="BlockRemoved", omit_defaults=True, gc=False):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class WireAllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared", omit_defaults=True, gc=False):
    medium: str | None = None


WireEvent = WireBlockStored | WireBlockRemoved | WireAllBlocksCleared


class WireBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[WireEvent]
    data_parallel_rank: int | None = None


_WIRE_CLASSES: dict[str, type[WireEvent]] = {
    "BlockStored": WireBlockStored,
    "BlockRemoved": WireBlockRemoved,
    "AllBlocksCleared": WireAllBlocksCleared,
}
# How many fields (after the tag) older vLLM's positional events carried.
_POSITIONAL_FIELDS: dict[type[WireEvent], int] = {
    WireBlockStored: 7,
    WireBlockRemoved: 2,
    WireAllBlocksCleared: 0,
}

_decoder = msgspec.msgpack.Decoder()
_encoder = msgspec.msgpack.Encoder()
_typed_decoder = msgspec.msgpack.Decoder(WireBatch)

REPLAY_END_SEQ = -1
_REPLAY_END_SEQ_BYTES = REPLAY_END_SEQ.to_bytes(8, "big", signed=True)
_U64 = (1 << 64) - 1


def _block_hash(value: object) -> int:
    """vLLM sends ints by default and raw digests as bytes otherwise: both become an int."""
    if isinstance(value, bool):
        raise ValueError("block hash must be int or bytes, got bool")
    if isinstance(value, int):
        return value & _U64
    if isinstance(value, bytes | bytearray):
        if not value:
            raise ValueError("empty block hash")
        return int.from_bytes(value[-8:], "big")
    raise ValueError(f"block hash must be int or bytes, got {type(value).__name__}")


def _hash_list(value: object) -> list[int]:
    if not isinstance(value, list | tuple):
        raise ValueError("block_hashes must be a list")
    if all(type(v) is int for v in value):  # the common case, kept cheap
        return [v & _U64 for v in value]
    return [_block_hash(v) for v in value]


def _int_field(value: object, name: str, *, default: int | None = None) -> int:
    if value is None and default is not None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int")
    return value


def _token_list(value: object) -> list[int]:
    # Element types are checked where the tokens are packed for keying (kvroute.indexer.keys), in C.
    if not isinstance(value, list | tuple):
        raise ValueError("token_ids must be a list")
    return value if isinstance(value, list) else list(value)


def _fields(raw: object) -> tuple[str, dict[str, Any]]:
    """Return (tag, fields by name) for either encoding; positional fields are named by the
    wire definition's declaration order."""
    if isinstance(raw, dict):
        tag = raw.get("type")
        if not isinstance(tag, str):
            raise ValueError("event map without a string 'type'")
        return tag, raw
    if isinstance(raw, list | tuple) and raw and isinstance(raw[0], str):
        tag = raw[0]
        cls = _WIRE_CLASSES.get(tag)
        names = cls.__struct_fields__ if cls is not None else ()
        return tag, dict(zip(names, raw[1:], strict=False))
    raise ValueError(f"event is neither a tagged map nor a tagged array: {type(raw).__name__}")


def _medium_field(f: dict[str, Any]) -> str | None:
    medium = f.get("medium")
    if medium is not None and not isinstance(medium, str):
        raise UnknownMedium(medium)
    return medium


def _tolerant_event(raw: object) -> WireEvent:
    """One event the typed decoder refused (older or newer field sets, positional or packed
    events, wrong types) as its wire definition, or ValueError saying what is wrong."""
    if isinstance(raw, bytes):
        # llm-d's FS backend packs each event into msgpack bytes of its own.
        try:
            raw = _decoder.decode(raw)
        except (msgspec.DecodeError, ValueError, TypeError) as exc:
            raise ValueError(f"packed event is not msgpack: {exc}") from exc
        if isinstance(raw, bytes):
            raise ValueError("packed event holds bytes again")
    tag, f = _fields(raw)
    if tag == "BlockStored":
        if "block_hashes" not in f or "token_ids" not in f:
            raise ValueError("BlockStored without block_hashes or token_ids")
        hashes = _hash_list(f["block_hashes"])
        tokens = _token_list(f["token_ids"])
        parent = f.get("parent_block_hash")
        extra = f.get("extra_keys")
        if extra is not None and not isinstance(extra, list | tuple):
            raise ValueError("extra_keys must hold one entry per block")
        lora_name = f.get("lora_name")
        if lora_name is not None and not isinstance(lora_name, str):
            raise ValueError("lora_name must be a string")
        lora_id = f.get("lora_id")
        locality = f.get("locality")
        return WireBlockStored(
            block_hashes=hashes,  # type: ignore[arg-type]
            # A tier-only store's parent means nothing (llm-d's FS backend sends 0).
            parent_block_hash=None if parent is None or not tokens else _block_hash(parent),
            token_ids=tokens,
            block_size=_int_field(f.get("block_size"), "block_size", default=0),
            lora_id=None if lora_id is None else _int_field(lora_id, "lora_id"),
            medium=_medium_field(f),
            lora_name=lora_name,
            extra_keys=None if extra is None else list(extra),
            group_idx=_int_field(f.get("group_idx"), "group_idx", default=0),
            locality=locality if isinstance(locality, str) else None,
        )
    if tag == "BlockRemoved":
        if "block_hashes" not in f:
            raise ValueError("BlockRemoved without block_hashes")
        return WireBlockRemoved(
            block_hashes=_hash_list(f["block_hashes"]),  # type: ignore[arg-type]
            medium=_medium_field(f),
            group_idx=_int_field(f.get("group_idx"), "group_idx", default=0),
        )
    if tag == "AllBlocksCleared":
        return WireAllBlocksCleared(medium=_medium_field(f))
    raise ValueError(f"unknown event type {tag!r}")


def _hashes(values: list[int | bytes]) -> list[int]:
    try:
        if min(values) >= 0:  # type: ignore[type-var]
            return values  # type: ignore[return-value]
    except TypeError:  # bytes among them
        pass
    return _hash_list(values)


def _from_wire(wire: WireEvent) -> Event:
    """A wire event as the index takes it: hashes as u64 ints, the medium as a tier, and the
    checks msgspec's types cannot express (ValueError says which failed; UnknownMedium)."""
    if type(wire) is WireBlockRemoved:
        kind = medium_kind(wire.medium)
        return BlockRemoved(
            _hashes(wire.block_hashes),
            kind.tier,
            wire.group_idx or 0,
            kind.confirmed,
            _medium_name(wire.medium),
        )
    if type(wire) is WireBlockStored:
        n = len(wire.block_hashes)
        tokens, bs = wire.token_ids, wire.block_size
        if not n:
            raise ValueError("BlockStored with no block hashes")
        if bs < 0:
            raise ValueError("negative block_size")
        if tokens and bs == 0:
            raise ValueError("BlockStored with token_ids but block_size 0")
        if tokens and len(tokens) != n * bs:
            raise ValueError(
                f"BlockStored token_ids has {len(tokens)} tokens for {n} blocks of {bs}"
            )
        if wire.extra_keys is not None and len(wire.extra_keys) != n:
            raise ValueError("extra_keys must hold one entry per block")
        kind = medium_kind(wire.medium)
        parent = wire.parent_block_hash
        return BlockStored(
            block_hashes=_hashes(wire.block_hashes),
            # A tier-only store names known blocks; its parent means nothing.
            parent_block_hash=None if parent is None or not tokens else _block_hash(parent),
            token_ids=tokens,
            block_size=bs,
            medium=kind.tier,
            lora_name=wire.lora_name,
            lora_id=wire.lora_id,
            extra_keys=wire.extra_keys,
            group_idx=wire.group_idx or 0,
            locality=wire.locality,
            confirmed=kind.confirmed,
            medium_name=_medium_name(wire.medium),
        )
    assert type(wire) is WireAllBlocksCleared
    return AllBlocksCleared(None if wire.medium is None else medium_kind(wire.medium).tier)


def _from_raw(raw: object) -> Event:
    return _from_wire(_tolerant_event(raw))


def _add_events(batch: EventBatch, items: Sequence[Any], convert: Callable[[Any], Event]) -> None:
    """Append each item as an event, or count why it is none."""
    events, rejected = batch.events, batch.rejected
    for item in items:
        try:
            events.append(convert(item))
        except UnknownMedium as exc:
            batch.unknown_media[exc.medium] += 1
        except (ValueError, TypeError, OverflowError) as exc:
            rejected.append(str(exc))


def decode_batch(payload: bytes) -> EventBatch:
    """Decode one msgpack payload.

    Raises WireError when the payload is not a batch at all. Individual events that are
    malformed are left out and described in ``EventBatch.rejected``; events naming a medium
    no known publisher uses are left out and counted in ``EventBatch.unknown_media``.

    A batch the wire definitions describe (vLLM 0.32/0.33) is decoded by them, in C; any
    other (old positional events, packed events, other field sets or types) is decoded
    generically and each event brought to its wire definition by hand, which says why an
    event was refused. Both end in ``_from_wire``.
    """
    try:
        wire = _typed_decoder.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError):
        return _decode_tolerant(payload)
    batch = EventBatch(wire.ts, [], wire.data_parallel_rank)
    _add_events(batch, wire.events, _from_wire)
    return batch


def _decode_tolerant(payload: bytes) -> EventBatch:
    try:
        raw = _decoder.decode(payload)
    except (msgspec.DecodeError, ValueError, TypeError) as exc:
        raise WireError(f"payload is not msgpack: {exc}") from exc
    if isinstance(raw, dict):
        raw = [raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")]
    if not isinstance(raw, list | tuple) or len(raw) < 2:
        raise WireError("payload is not an [ts, events, dp_rank] array")
    ts, events_raw = raw[0], raw[1]
    dp_rank = raw[2] if len(raw) > 2 else None
    if isinstance(ts, bool) or not isinstance(ts, int | float):
        raise WireError("batch ts is not a number")
    if not isinstance(events_raw, list | tuple):
        raise WireError("batch events is not a list")
    if dp_rank is not None and (isinstance(dp_rank, bool) or not isinstance(dp_rank, int)):
        dp_rank = None
    batch = EventBatch(ts=float(ts), events=[], data_parallel_rank=dp_rank)
    _add_events(batch, events_raw, _from_raw)
    return batch


def is_device_clear(event: Event) -> bool:
    """Whether ``event`` clears the device tier (vLLM's block pool on a prefix-cache reset)."""
    return isinstance(event, AllBlocksCleared) and event.medium in (None, Medium.GPU)


def touches_lower_tier(event: Event) -> bool:
    """Whether ``event`` changes a tier other than the confirmed device tier."""
    if isinstance(event, AllBlocksCleared):
        return not is_device_clear(event)
    return event.medium is not Medium.GPU or not event.confirmed


# The bytes msgpack gives the strings below (fixstr headers): a payload without any of them
# holds no such event, so a replay can be scanned without decoding every batch (a false
# positive only costs a decode).
_CLEAR_TAG = b"AllBlocksCleared"
_TIER_MARKS = tuple(
    msgspec.msgpack.encode(name) for name in MEDIA if name is not None and name != "GPU"
)


def payload_hints(payload: bytes) -> tuple[bool, bool]:
    """(may hold a clear, may hold an event of a tier other than the device), from the raw
    bytes. False is certain; True only means "decode to find out"."""
    return _CLEAR_TAG in payload, any(mark in payload for mark in _TIER_MARKS)


def decode_frames(frames: Sequence[bytes]) -> Frame:
    """Split a PUB message into topic, sequence number and payload."""
    if len(frames) != 3:
        raise WireError(f"expected 3 frames (topic, seq, payload), got {len(frames)}")
    topic_raw, seq_raw, payload = frames
    if len(seq_raw) != 8:
        raise WireError(f"sequence frame has {len(seq_raw)} bytes, expected 8")
    try:
        topic = bytes(topic_raw).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise WireError("topic is not utf-8") from exc
    return Frame(topic=topic, seq=int.from_bytes(seq_raw, "big"), payload=bytes(payload))


def decode_replay_reply(frames: Sequence[bytes]) -> Frame | None:
    """Decode one message a DEALER got from the replay ROUTER; None is the end marker."""
    is_end = len(frames) == 4 and frames[0] == frames[1] == b""
    if is_end and bytes(frames[2]) == _REPLAY_END_SEQ_BYTES:
        return None
    if len(frames) != 4 or frames[0] != b"":
        raise WireError(
            f"replay reply has {len(frames)} frames, expected [b'', topic, seq, payload]"
        )
    return decode_frames(frames[1:])


# --- encoding: used by the simulator, the test publishers and the benchmarks ------------------


def _wire_medium(event: BlockStored | BlockRemoved) -> str:
    return event.medium_name if event.medium_name is not None else event.medium.name


def to_wire(event: Event) -> WireEvent:
    """An event in its wire definition, as vLLM would publish it (defaults omitted)."""
    if isinstance(event, BlockStored):
        return WireBlockStored(
            block_hashes=event.block_hashes,  # type: ignore[arg-type]
            parent_block_hash=event.parent_block_hash,
            token_ids=event.token_ids,
            block_size=event.block_size,
            lora_id=event.lora_id,
            medium=_wire_medium(event),
            lora_name=event.lora_name,
            extra_keys=event.extra_keys,
            group_idx=event.group_idx or None,
            locality=event.locality,
        )
    if isinstance(event, BlockRemoved):
        return WireBlockRemoved(
            block_hashes=event.block_hashes,  # type: ignore[arg-type]
            medium=_wire_medium(event),
            group_idx=event.group_idx or None,
        )
    return WireAllBlocksCleared(None if event.medium is None else event.medium.name)


def _positional(wire: WireEvent) -> list[Any]:
    """A wire event as older vLLM encoded it: ``[tag, field...]``, its fields only."""
    fields = msgspec.structs.astuple(wire)[: _POSITIONAL_FIELDS[type(wire)]]
    return [wire.__struct_config__.tag, *fields]


def encode_batch(
    events: Sequence[Event],
    *,
    ts: float,
    data_parallel_rank: int | None = None,
    positional: bool = False,
) -> bytes:
    """Encode a batch exactly as vLLM does (``positional=True``: the pre-2026 array events)."""
    wire = [to_wire(e) for e in events]
    if positional:
        return _encoder.encode([ts, [_positional(w) for w in wire], data_parallel_rank])
    return _encoder.encode(WireBatch(ts, wire, data_parallel_rank))


def encode_frames(topic: str, seq: int, payload: bytes) -> list[bytes]:
    return [topic.encode("utf-8"), seq.to_bytes(8, "big"), payload]


def encode_replay_request(start_seq: int) -> list[bytes]:
    """What a DEALER sends to a replay ROUTER to get every buffered batch with seq >= start."""
    return [b"", start_seq.to_bytes(8, "big")]


def parse_replay_request(frames: Sequence[bytes]) -> int:
    """The start sequence of a request as a ROUTER sees it: ``[identity, b"", seq8]``."""
    if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
        raise WireError("replay request must be [identity, b'', start_seq8]")
    return int.from_bytes(frames[2], "big")


def encode_replay_reply(identity: bytes, topic: str, seq: int, payload: bytes) -> list[bytes]:
    return [identity, b"", *encode_frames(topic, seq, payload)]


def encode_replay_end(identity: bytes) -> list[bytes]:
    return [identity, b"", b"", _REPLAY_END_SEQ_BYTES, b""]
