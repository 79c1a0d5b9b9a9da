"""Chunk keys: how a request's prefix maps onto stored chunks.

A chunk is ``blocks_per_chunk`` consecutive vLLM blocks starting at a chunk boundary.
Its key is vLLM's own hash of its *last* block: the hash chain makes that digest depend
on every token before it (and on LoRA / cache_salt extra keys), so equal keys mean an
equal prefix, and tier events can carry exactly the hashes the device cache publishes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ChunkInfo:
    """Everything needed to describe a chunk in an event or a file header."""

    key: bytes
    index: int  # chunk number within the request (0 = first chunk)
    block_hashes: tuple[bytes, ...]
    parent_hash: bytes | None
    token_ids: tuple[int, ...]
    block_size: int

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


def num_full_chunks(num_tokens: int, num_hashed_blocks: int, block_size: int, bpc: int) -> int:
    """Chunks fully covered by ``num_tokens`` tokens and by the available block hashes."""
    return min(num_tokens // block_size, num_hashed_blocks) // bpc


def chunk_info(
    block_hashes: Sequence[bytes],
    token_ids: Sequence[int],
    block_size: int,
    bpc: int,
    index: int,
) -> ChunkInfo:
    """Describe chunk ``index`` of a request (which must be fully hashed)."""
    b0, b1 = index * bpc, (index + 1) * bpc
    if b1 > len(block_hashes):
        raise ValueError("chunk is not fully hashed")
    return ChunkInfo(
        key=bytes(block_hashes[b1 - 1]),
        index=index,
        block_hashes=tuple(bytes(h) for h in block_hashes[b0:b1]),
        parent_hash=bytes(block_hashes[b0 - 1]) if b0 > 0 else None,
        token_ids=tuple(int(t) for t in token_ids[b0 * block_size : b1 * block_size]),
        block_size=block_size,
    )


def chunk_key(block_hashes: Sequence[bytes], bpc: int, index: int) -> bytes:
    return bytes(block_hashes[(index + 1) * bpc - 1])
