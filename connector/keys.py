"""Chunk keys: how a request's prefix maps onto stored chunks.

A chunk is ``blocks_per_chunk`` consecutive vLLM blocks starting at a chunk boundary.
Its key is vLLM's own hash of its *last* block: the hash chain makes that digest depend
on every token before it (and on LoRA / cache_salt / multimodal extra keys), so equal
keys mean an equal prefix, and tier events can carry exactly the hashes the device cache
publishes.

The hash alone is not enough for an event, though: vLLM's ``BlockStored`` also names
the LoRA adapter and lists each block's extra keys, and an indexer keys its entries on
them. ``ChunkExtras`` carries those, captured on the scheduler side from the request
when the chunk is described, so that every tier event of a chunk (also one announced
from a file after a restart) says what the device event said for the same blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvroute.connector.extra_keys import BlockExtraKeys


@dataclass(frozen=True)
class ChunkExtras:
    """What vLLM's ``BlockStored`` says about a chunk's blocks besides hashes and
    tokens: the LoRA adapter (``lora_id`` is deprecated in vLLM but still published)
    and the untagged per-block extra keys (``None``: vLLM published none)."""

    lora_id: int | None = None
    lora_name: str | None = None
    extra_keys: tuple[BlockExtraKeys, ...] | None = None


NO_EXTRAS = ChunkExtras()

ExtrasSource = Callable[[int, int], ChunkExtras]
"""``(first_block, end_block) -> ChunkExtras`` for a request's blocks [first, end)."""


@dataclass(frozen=True)
class ChunkInfo:
    """Everything needed to describe a chunk in an event or a file header."""

    key: bytes
    index: int  # chunk number within the request (0 = first chunk)
    block_hashes: tuple[bytes, ...]
    parent_hash: bytes | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    lora_name: str | None = None
    extra_keys: tuple[BlockExtraKeys, ...] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def extras(self) -> ChunkExtras:
        return ChunkExtras(self.lora_id, self.lora_name, self.extra_keys)


def num_full_chunks(num_tokens: int, num_hashed_blocks: int, block_size: int, bpc: int) -> int:
    """Chunks fully covered by ``num_tokens`` tokens and by the available block hashes."""
    return min(num_tokens // block_size, num_hashed_blocks) // bpc


def chunk_info(
    block_hashes: Sequence[bytes],
    token_ids: Sequence[int],
    block_size: int,
    bpc: int,
    index: int,
    extras: ChunkExtras = NO_EXTRAS,
) -> ChunkInfo:
    """Describe chunk ``index`` of a request (which must be fully hashed)."""
    b0, b1 = index * bpc, (index + 1) * bpc
    if b1 > len(block_hashes):
        raise ValueError("chunk is not fully hashed")
    if extras.extra_keys is not None and len(extras.extra_keys) != bpc:
        raise ValueError("extra keys must list one entry per block of the chunk")
    return ChunkInfo(
        key=bytes(block_hashes[b1 - 1]),
        index=index,
        block_hashes=tuple(bytes(h) for h in block_hashes[b0:b1]),
        parent_hash=bytes(block_hashes[b0 - 1]) if b0 > 0 else None,
        token_ids=tuple(int(t) for t in token_ids[b0 * block_size : b1 * block_size]),
        block_size=block_size,
        lora_id=extras.lora_id,
        lora_name=extras.lora_name,
        extra_keys=extras.extra_keys,
    )


def chunk_key(block_hashes: Sequence[bytes], bpc: int, index: int) -> bytes:
    return bytes(block_hashes[(index + 1) * bpc - 1])
