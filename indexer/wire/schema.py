"""vLLM's msgspec classes (vllm/distributed/kv_events.py), field for field, in its order: they
decode vLLM's batches (in C) and encode ours, byte for byte as vLLM. ``medium`` on a clear is
kvroute's own addition (vLLM's clear has no fields). Also the positional layout older vLLM
sent, the replay end marker, and the shared codecs.
"""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = [
    "REPLAY_END_SEQ",
    "WireAllBlocksCleared",
    "WireBatch",
    "WireBlockRemoved",
    "WireBlockStored",
    "WireEvent",
]


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


WIRE_CLASSES: dict[str, type[WireEvent]] = {
    "BlockStored": WireBlockStored,
    "BlockRemoved": WireBlockRemoved,
    "AllBlocksCleared": WireAllBlocksCleared,
}
# How many fields (after the tag) older vLLM's positional events carried.
POSITIONAL_FIELDS: dict[type[WireEvent], int] = {
    WireBlockStored: 7,
    WireBlockRemoved: 2,
    WireAllBlocksCleared: 0,
}

msgpack_decoder = msgspec.msgpack.Decoder()
msgpack_encoder = msgspec.msgpack.Encoder()
batch_decoder = msgspec.msgpack.Decoder(WireBatch)

REPLAY_END_SEQ = -1
REPLAY_END_SEQ_BYTES = REPLAY_END_SEQ.to_bytes(8, "big", signed=True)
U64 = (1 << 64) - 1
