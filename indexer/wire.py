"""vLLM's KV-event wire format: the one module that knows frames, msgpack layouts and replay.

Everything that reads or writes vLLM KV events goes through here, so a change in vLLM's format
is a change in one file. The decoder is strict about what it needs and lenient about what it
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

import enum
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

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
    "WireError",
    "decode_batch",
    "decode_frames",
    "decode_replay_reply",
    "encode_batch",
    "encode_frames",
    "encode_replay_end",
    "encode_replay_reply",
    "encode_replay_request",
    "medium_kind",
    "payload_hints",
]


class WireError(ValueError):
    """A frame or payload that cannot be decoded at all (the whole message is skipped)."""


class Medium(enum.IntEnum):
    """Cache tiers, ordered from fastest to slowest (the order is the tier's bit offset)."""

    GPU = 0
    CPU = 1
    STORAGE = 2


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


# Field order of each event class, as vLLM declares them (positional encoding follows it).
_STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
    "locality",
    "ownership",
    "session_id",
)
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx", "locality", "ownership")
_CLEARED_FIELDS = ("medium",)

_decoder = msgspec.msgpack.Decoder()
_encoder = msgspec.msgpack.Encoder()

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
    """Return (tag, fields by name) for either encoding."""
    if isinstance(raw, dict):
        tag = raw.get("type")
        if not isinstance(tag, str):
            raise ValueError("event map without a string 'type'")
        return tag, raw
    if isinstance(raw, list | tuple) and raw and isinstance(raw[0], str):
        tag = raw[0]
        names = {
            "BlockStored": _STORED_FIELDS,
            "BlockRemoved": _REMOVED_FIELDS,
            "AllBlocksCleared": _CLEARED_FIELDS,
        }.get(tag, ())
        return tag, dict(zip(names, raw[1:], strict=False))
    raise ValueError(f"event is neither a tagged map nor a tagged array: {type(raw).__name__}")


def _stored_medium(f: dict[str, Any]) -> tuple[Medium, bool, str | None]:
    raw = f.get("medium")
    kind = medium_kind(raw)
    return kind.tier, kind.confirmed, _medium_name(raw)


def _decode_event(raw: object) -> Event:
    if type(raw) is dict and raw.get("type") == "BlockRemoved" and len(raw) <= 3:
        # Fast path: vLLM sends one of these per evicted block.
        hashes = raw.get("block_hashes")
        if type(hashes) is list and len(hashes) == 1 and type(hashes[0]) is int:
            group = raw.get("group_idx", 0)
            medium = raw.get("medium")
            if type(group) is int and (medium is None or type(medium) is str):
                kind = MEDIA.get(medium)
                if kind is not None:
                    return BlockRemoved(
                        [hashes[0] & _U64], kind.tier, group, kind.confirmed, _medium_name(medium)
                    )
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
        if not hashes:
            raise ValueError("BlockStored with no block hashes")
        tokens = _token_list(f["token_ids"])
        parent_raw = f.get("parent_block_hash")
        # A tier-only store names known blocks; its parent means nothing (llm-d's FS backend
        # sends 0 for "unknown").
        parent = None if parent_raw is None or not tokens else _block_hash(parent_raw)
        block_size = _int_field(f.get("block_size"), "block_size", default=0)
        if block_size < 0:
            raise ValueError("negative block_size")
        if tokens and block_size == 0:
            raise ValueError("BlockStored with token_ids but block_size 0")
        if tokens and len(tokens) != len(hashes) * block_size:
            raise ValueError(
                f"BlockStored token_ids has {len(tokens)} tokens for {len(hashes)} blocks "
                f"of {block_size}"
            )
        extra = f.get("extra_keys")
        if extra is not None:
            if not isinstance(extra, list | tuple) or len(extra) != len(hashes):
                raise ValueError("extra_keys must hold one entry per block")
            extra = list(extra)
        lora_name = f.get("lora_name")
        if lora_name is not None and not isinstance(lora_name, str):
            raise ValueError("lora_name must be a string")
        lora_id = f.get("lora_id")
        if lora_id is not None:
            lora_id = _int_field(lora_id, "lora_id")
        locality = f.get("locality")
        tier, confirmed, name = _stored_medium(f)
        return BlockStored(
            block_hashes=hashes,
            parent_block_hash=parent,
            token_ids=tokens,
            block_size=block_size,
            medium=tier,
            lora_name=lora_name,
            lora_id=lora_id,
            extra_keys=extra,
            group_idx=_int_field(f.get("group_idx"), "group_idx", default=0),
            locality=locality if isinstance(locality, str) else None,
            confirmed=confirmed,
            medium_name=name,
        )
    if tag == "BlockRemoved":
        if "block_hashes" not in f:
            raise ValueError("BlockRemoved without block_hashes")
        tier, confirmed, name = _stored_medium(f)
        return BlockRemoved(
            block_hashes=_hash_list(f["block_hashes"]),
            medium=tier,
            group_idx=_int_field(f.get("group_idx"), "group_idx", default=0),
            confirmed=confirmed,
            medium_name=name,
        )
    if tag == "AllBlocksCleared":
        medium = f.get("medium")
        return AllBlocksCleared(medium=None if medium is None else medium_kind(medium).tier)
    raise ValueError(f"unknown event type {tag!r}")


class _StoredWire(msgspec.Struct, tag_field="type", tag="BlockStored", gc=False):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    locality: str | None = None


class _RemovedWire(msgspec.Struct, tag_field="type", tag="BlockRemoved", gc=False):
    block_hashes: list[int | bytes]
    medium: str | None = None
    group_idx: int | None = None


class _ClearedWire(msgspec.Struct, tag_field="type", tag="AllBlocksCleared", gc=False):
    medium: str | None = None


class _BatchWire(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_StoredWire | _RemovedWire | _ClearedWire]
    data_parallel_rank: int | None = None


_typed_decoder = msgspec.msgpack.Decoder(_BatchWire)


def _fast_hashes(values: list[int | bytes]) -> list[int]:
    try:
        if min(values) >= 0:  # type: ignore[type-var]
            return values  # type: ignore[return-value]
    except TypeError:  # bytes among them
        pass
    return _hash_list(values)


def _from_wire(wire: _StoredWire | _RemovedWire | _ClearedWire) -> Event:
    """Typed wire struct -> event, with the checks msgspec's types cannot express."""
    if type(wire) is _RemovedWire:
        kind = MEDIA.get(wire.medium)
        if kind is None:
            raise ValueError("unknown medium")  # the generic path counts it
        return BlockRemoved(
            _fast_hashes(wire.block_hashes),
            kind.tier,
            wire.group_idx or 0,
            kind.confirmed,
            _medium_name(wire.medium),
        )
    if type(wire) is _StoredWire:
        n = len(wire.block_hashes)
        tokens, bs = wire.token_ids, wire.block_size
        extra = wire.extra_keys
        kind = MEDIA.get(wire.medium)
        if (
            kind is None
            or not n
            or bs < 0
            or (tokens and len(tokens) != n * bs)
            or (extra is not None and len(extra) != n)
        ):
            raise ValueError("inconsistent BlockStored")  # the slow path says exactly why
        parent = wire.parent_block_hash
        return BlockStored(
            block_hashes=_fast_hashes(wire.block_hashes),
            parent_block_hash=None if parent is None or not tokens else _block_hash(parent),
            token_ids=tokens,
            block_size=bs,
            medium=kind.tier,
            lora_name=wire.lora_name,
            lora_id=wire.lora_id,
            extra_keys=extra,
            group_idx=wire.group_idx or 0,
            locality=wire.locality,
            confirmed=kind.confirmed,
            medium_name=_medium_name(wire.medium),
        )
    assert type(wire) is _ClearedWire
    return AllBlocksCleared(None if wire.medium is None else medium_kind(wire.medium).tier)


def decode_batch(payload: bytes) -> EventBatch:
    """Decode one msgpack payload.

    Raises WireError when the payload is not a batch at all. Individual events that are
    malformed are left out and described in ``EventBatch.rejected``; events naming a medium
    no known publisher uses are left out and counted in ``EventBatch.unknown_media``.

    Well-formed vLLM 0.32/0.33 batches take a typed path decoded in C; anything else (old
    positional events, packed events, other publishers' media, a malformed event) takes the
    generic path, which also says why an event was rejected.
    """
    try:
        wire = _typed_decoder.decode(payload)
        events = [_from_wire(e) for e in wire.events]
        return EventBatch(wire.ts, events, wire.data_parallel_rank)
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError):
        pass
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
    for raw_event in events_raw:
        try:
            batch.events.append(_decode_event(raw_event))
        except UnknownMedium as exc:
            batch.unknown_media[exc.medium] += 1
        except (ValueError, TypeError, OverflowError) as exc:
            batch.rejected.append(str(exc))
    return batch


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


def _event_map(event: Event) -> dict[str, Any]:
    """An event as vLLM 0.32/0.33 encodes it: tagged map, defaults omitted."""
    if isinstance(event, BlockStored):
        out: dict[str, Any] = {
            "type": "BlockStored",
            "block_hashes": event.block_hashes,
            "parent_block_hash": event.parent_block_hash,
            "token_ids": event.token_ids,
            "block_size": event.block_size,
            "lora_id": event.lora_id,
            "medium": _wire_medium(event),
            "lora_name": event.lora_name,
        }
        if event.extra_keys is not None:
            out["extra_keys"] = event.extra_keys
        if event.group_idx:
            out["group_idx"] = event.group_idx
        if event.locality is not None:
            out["locality"] = event.locality
        return out
    if isinstance(event, BlockRemoved):
        out = {
            "type": "BlockRemoved",
            "block_hashes": event.block_hashes,
            "medium": _wire_medium(event),
        }
        if event.group_idx:
            out["group_idx"] = event.group_idx
        return out
    out = {"type": "AllBlocksCleared"}
    if event.medium is not None:
        out["medium"] = event.medium.name
    return out


def _event_array(event: Event) -> list[Any]:
    """An event as older vLLM encoded it: ``[tag, field...]`` in declaration order."""
    if isinstance(event, BlockStored):
        return [
            "BlockStored",
            event.block_hashes,
            event.parent_block_hash,
            event.token_ids,
            event.block_size,
            event.lora_id,
            _wire_medium(event),
            event.lora_name,
        ]
    if isinstance(event, BlockRemoved):
        return ["BlockRemoved", event.block_hashes, _wire_medium(event)]
    return ["AllBlocksCleared"]


def encode_batch(
    events: Sequence[Event],
    *,
    ts: float,
    data_parallel_rank: int | None = None,
    positional: bool = False,
) -> bytes:
    """Encode a batch exactly as vLLM does (``positional=True``: the pre-2026 array events)."""
    encode_event = _event_array if positional else _event_map
    return _encoder.encode([ts, [encode_event(e) for e in events], data_parallel_rank])


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
