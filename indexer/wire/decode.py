"""Payloads, frames and replay replies in. The decoder is strict about what it needs and lenient
about what it does not: unknown fields are ignored, both the map-tagged encoding (vLLM
0.32/0.33) and the positional-array encoding (older vLLM, llm-d's FS backend) are accepted,
events packed as nested msgpack bytes (llm-d's FS backend) are unpacked, and a malformed event
is rejected with a reason while the rest of its batch is still applied. An event naming a
medium no known publisher uses is counted in ``EventBatch.unknown_media`` and dropped. An
event of a type no definition has is kept in its place as ``UnknownEvent`` (it may have
cleared a tier: the index distrusts what it could have changed) and counted in
``EventBatch.unknown_types``. A batch vLLM's own classes decode goes through msgspec's typed
decoder in C; anything else is decoded generically and brought to the same definitions by
hand.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from kvroute.indexer.wire.events import (
    LMCACHE_MEDIUM,
    MEDIA,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    EventBatch,
    Frame,
    Medium,
    UnknownEvent,
    UnknownEventType,
    UnknownMedium,
    WireError,
    classify_store,
    kept_medium_name,
    medium_kind,
)
from kvroute.indexer.wire.schema import (
    REPLAY_END_SEQ_BYTES,
    U64,
    WIRE_CLASSES,
    WireAllBlocksCleared,
    WireBlockRemoved,
    WireBlockStored,
    WireEvent,
    batch_decoder,
    msgpack_decoder,
)

__all__ = ["decode_batch", "decode_frames", "decode_replay_reply", "payload_hints"]


def _block_hash(value: object) -> int:
    """vLLM sends ints by default and raw digests as bytes otherwise: both become an int."""
    if isinstance(value, bool):
        raise ValueError("block hash must be int or bytes, got bool")
    if isinstance(value, int):
        return value & U64
    if isinstance(value, bytes | bytearray):
        if not value:
            raise ValueError("empty block hash")
        return int.from_bytes(value[-8:], "big")
    raise ValueError(f"block hash must be int or bytes, got {type(value).__name__}")


def _hash_list(value: object) -> list[int]:
    if not isinstance(value, list | tuple):
        raise ValueError("block_hashes must be a list")
    if all(type(v) is int for v in value):  # the common case, kept cheap
        return [v & U64 for v in value]
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
        cls = WIRE_CLASSES.get(tag)
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
            raw = msgpack_decoder.decode(raw)
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
        ownership = f.get("ownership")
        group_idx = f.get("group_idx")
        spec_kind = f.get("kv_cache_spec_kind")
        window = f.get("kv_cache_spec_sliding_window")
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
            # None stays None: Mooncake sends the field, LMCache does not (classify_store).
            group_idx=None if group_idx is None else _int_field(group_idx, "group_idx"),
            kv_cache_spec_sliding_window=None if window is None else _int_field(window, "window"),
            locality=locality if isinstance(locality, str) else None,
            ownership=ownership if isinstance(ownership, str) else None,
            kv_cache_spec_kind=spec_kind if isinstance(spec_kind, str) else None,
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
    raise UnknownEventType(tag)


def _hashes(values: list[int | bytes]) -> list[int]:
    try:
        if min(values) >= 0:  # type: ignore[type-var]
            return values  # type: ignore[return-value]
    except TypeError:  # bytes among them
        pass
    return _hash_list(values)


# A removal's medium -> (tier, confirmed, the spelling kept): ``medium_kind`` and
# ``kept_medium_name`` of every known medium, looked up once per event. vLLM publishes one
# ``BlockRemoved`` per evicted block, so removals are most of a busy replica's events and this
# conversion is most of their decoding.
_REMOVAL_MEDIA: dict[str | None, tuple[Medium, bool, str | None]] = {
    medium: (kind.tier, kind.confirmed, kept_medium_name(medium)) for medium, kind in MEDIA.items()
}


def _from_wire(wire: WireEvent) -> Event:
    """A wire event as the index takes it: hashes as u64 ints, the medium as a tier, and the
    checks msgspec's types cannot express (ValueError says which failed; UnknownMedium)."""
    if type(wire) is WireBlockRemoved:
        medium = wire.medium
        known = _REMOVAL_MEDIA.get(medium) if medium is None or type(medium) is str else None
        if known is None:
            kind = medium_kind(medium)  # raises UnknownMedium
            known = (kind.tier, kind.confirmed, kept_medium_name(medium))
        hashes = wire.block_hashes
        if len(hashes) != 1 or type(hashes[0]) is not int or hashes[0] < 0:
            hashes = _hashes(hashes)  # one hash, a non-negative int: already what it must be
        return BlockRemoved(hashes, known[0], wire.group_idx or 0, known[1], known[2])  # type: ignore[arg-type]
    if type(wire) is WireBlockStored:
        n = len(wire.block_hashes)
        tokens, bs = wire.token_ids, wire.block_size
        if not n:
            # vLLM's block pool still queues the event when a block mask or null blocks
            # leave nothing to store (a Mamba group with EAGLE's dropped block): no blocks
            raise _StoresNothing
        if bs < 0:
            raise ValueError("negative block_size")
        if tokens and bs == 0:
            raise ValueError("BlockStored with token_ids but block_size 0")
        if tokens and len(tokens) != n * bs:
            if n == 1 and len(tokens) == bs + 1 and wire.medium == LMCACHE_MEDIUM:
                # LMCache's cache engine lists a chunk's tokens as tokens[start:end + 1]
                # (lmcache.utils.convert_tokens_to_list, inclusive end): a chunk followed
                # by another carries the next chunk's first token too. The chunk (its hash,
                # its KV) is the first block_size of them.
                tokens = tokens[:bs]
            elif len(tokens) % bs or len(tokens) < n * bs:
                # Fewer hashes than blocks is a group's block mask (sliding window, Mamba):
                # the tokens still span every block. Anything else cannot be placed.
                raise ValueError(
                    f"BlockStored token_ids has {len(tokens)} tokens for {n} blocks of {bs}"
                )
        if wire.extra_keys is not None and len(wire.extra_keys) != n:
            raise ValueError("extra_keys must hold one entry per block")
        kind = medium_kind(wire.medium)
        confirmed, engine_hashes = classify_store(
            wire.medium,
            kind,
            extra_keys=wire.extra_keys,
            ownership=wire.ownership,
            group_idx=wire.group_idx,
        )
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
            confirmed=confirmed,
            medium_name=kept_medium_name(wire.medium),
            ownership=wire.ownership,
            engine_hashes=engine_hashes,
            # SimpleCPUOffloadConnector's block pool (see indexer/index/resets.py)
            pool_tier=(
                wire.locality == "LOCAL"
                and wire.kv_cache_spec_kind is not None
                and n == 1
                and kind.tier is not Medium.GPU
            ),
            spec_kind=wire.kv_cache_spec_kind,
            sliding_window=wire.kv_cache_spec_sliding_window,
        )
    assert type(wire) is WireAllBlocksCleared
    return AllBlocksCleared(None if wire.medium is None else medium_kind(wire.medium).tier)


def _from_raw(raw: object) -> Event:
    try:
        wire = _tolerant_event(raw)
    except UnknownEventType as exc:
        return UnknownEvent(exc.tag)
    return _from_wire(wire)


class _StoresNothing(Exception):
    """A ``BlockStored`` without a block: nothing to apply, and not malformed."""


def _add_events(batch: EventBatch, items: Sequence[Any], convert: Callable[[Any], Event]) -> None:
    """Append each item as an event, or count why it is none."""
    events, rejected = batch.events, batch.rejected
    for item in items:
        try:
            event = convert(item)
        except UnknownMedium as exc:
            batch.unknown_media[exc.medium] += 1
        except _StoresNothing:
            continue
        except (ValueError, TypeError, OverflowError) as exc:
            rejected.append(str(exc))
        else:
            if type(event) is UnknownEvent:
                batch.unknown_types[event.type] += 1
            events.append(event)


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
        wire = batch_decoder.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError):
        return _decode_tolerant(payload)
    try:
        # Every event well formed (the rule): converted in one pass. ``_from_wire`` writes
        # nothing, so a batch with a bad or an empty event is converted again, event by event.
        return EventBatch(wire.ts, [_from_wire(e) for e in wire.events], wire.data_parallel_rank)
    except (ValueError, TypeError, OverflowError, _StoresNothing):
        batch = EventBatch(wire.ts, [], wire.data_parallel_rank)
        _add_events(batch, wire.events, _from_wire)
        return batch


def _decode_tolerant(payload: bytes) -> EventBatch:
    try:
        raw = msgpack_decoder.decode(payload)
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
    if is_end and bytes(frames[2]) == REPLAY_END_SEQ_BYTES:
        return None
    if len(frames) != 4 or frames[0] != b"":
        raise WireError(
            f"replay reply has {len(frames)} frames, expected [b'', topic, seq, payload]"
        )
    return decode_frames(frames[1:])
