"""Events, batches, frames and replay messages out, byte for byte as vLLM writes them: used by
the simulator, the test publishers, the storage evictor and the benchmarks, so they cannot
drift from vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from kvroute.indexer.wire.events import BlockRemoved, BlockStored, Event, UnknownEvent, WireError
from kvroute.indexer.wire.schema import (
    POSITIONAL_FIELDS,
    REPLAY_END_SEQ_BYTES,
    WireAllBlocksCleared,
    WireBatch,
    WireBlockRemoved,
    WireBlockStored,
    WireEvent,
    msgpack_encoder,
)

__all__ = [
    "encode_batch",
    "encode_frames",
    "encode_replay_end",
    "encode_replay_reply",
    "encode_replay_request",
    "parse_replay_request",
    "to_wire",
]


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
            # Mooncake's store sends group 0 as 0 (classify_store tells it from LMCache by it).
            group_idx=(
                event.group_idx
                if event.engine_hashes and event.medium_name == "cpu"
                else event.group_idx or None
            ),
            kv_cache_spec_kind=event.spec_kind,
            kv_cache_spec_sliding_window=event.sliding_window,
            locality=event.locality,
            ownership=event.ownership,
        )
    if isinstance(event, BlockRemoved):
        return WireBlockRemoved(
            block_hashes=event.block_hashes,  # type: ignore[arg-type]
            medium=_wire_medium(event),
            group_idx=event.group_idx or None,
        )
    if isinstance(event, UnknownEvent):
        raise TypeError(f"an event of unknown type {event.type!r} has no wire definition")
    return WireAllBlocksCleared(None if event.medium is None else event.medium.name)


def _positional(wire: WireEvent) -> list[Any]:
    """A wire event as older vLLM encoded it: ``[tag, field...]``, its fields only."""
    fields = msgspec.structs.astuple(wire)[: POSITIONAL_FIELDS[type(wire)]]
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
        return msgpack_encoder.encode([ts, [_positional(w) for w in wire], data_parallel_rank])
    return msgpack_encoder.encode(WireBatch(ts, wire, data_parallel_rank))


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
    return [identity, b"", b"", REPLAY_END_SEQ_BYTES, b""]
