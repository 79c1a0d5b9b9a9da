"""vLLM's KV-event wire format: the one package that knows frames, msgpack layouts and replay.

Everything that reads or writes vLLM KV events goes through here, so a change in vLLM's format
is a change in one package. Each event has one msgspec definition (``WireBlockStored``...,
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

Modules: ``events.py`` (the decoded events and the media they name), ``schema.py`` (vLLM's
msgspec definitions), ``decode.py`` (payloads, frames and replay replies in), ``encode.py``
(the same out, for the simulator, the test publishers, the evictor and the benchmarks).
"""

from __future__ import annotations

from kvroute.indexer.wire.decode import (
    decode_batch,
    decode_frames,
    decode_replay_reply,
    payload_hints,
)
from kvroute.indexer.wire.encode import (
    encode_batch,
    encode_frames,
    encode_replay_end,
    encode_replay_reply,
    encode_replay_request,
    parse_replay_request,
    to_wire,
)
from kvroute.indexer.wire.events import (
    MEDIA,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    EventBatch,
    Frame,
    Medium,
    MediumKind,
    UnknownEvent,
    UnknownEventType,
    UnknownMedium,
    WireError,
    classify_store,
    is_device_clear,
    medium_kind,
    touches_lower_tier,
)
from kvroute.indexer.wire.schema import (
    REPLAY_END_SEQ,
    WireAllBlocksCleared,
    WireBatch,
    WireBlockRemoved,
    WireBlockStored,
    WireEvent,
)

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
    "UnknownEvent",
    "UnknownEventType",
    "UnknownMedium",
    "WireAllBlocksCleared",
    "WireBatch",
    "WireBlockRemoved",
    "WireBlockStored",
    "WireError",
    "WireEvent",
    "classify_store",
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
