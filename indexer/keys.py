"""The index's own block keys: chained 64-bit hashes over token ids.

vLLM's block hashes cannot be extended from outside (events carry 64-bit truncations of the
digest, the seed may be random per process, the algorithm is a flag), so the index keys every
block itself from what both sides know for sure: the token ids, the block size and the extra
keys vLLM mixes into a block's hash (LoRA name, cache_salt, multimodal ids). The router computes
a request's keys with the same function, so a request and a stored block meet on equal keys
whatever hash algorithm or seed each replica runs.

key_i = xxh3_64(tokens of block i as little-endian u32 || extra_i, seed = key_{i-1})
key_{-1} = xxh3_64("kvroute-key-v1/<block_size>")
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Any

import msgspec
import xxhash

__all__ = ["ExtraKeys", "block_keys", "request_extra_keys", "root_key"]

ExtraKeys = Sequence[Any] | None
"""One block's extra keys as vLLM publishes them (untagged tuple), or None."""

_xxh = xxhash.xxh3_64_intdigest
_encode = msgspec.msgpack.encode
_EXTRA_SEP = b"\xffkvroute-extra\xff"
_root_cache: dict[int, int] = {}


def root_key(block_size: int) -> int:
    """The chain's seed for a block size: chains of different block sizes never meet."""
    key = _root_cache.get(block_size)
    if key is None:
        key = _root_cache[block_size] = _xxh(f"kvroute-key-v1/{block_size}".encode())
    return key


def pack_tokens(tokens: Sequence[int]) -> bytes:
    """Token ids as little-endian u32 bytes; raises ValueError on anything else."""
    try:
        packed = array("I", tokens)
    except (TypeError, OverflowError) as exc:
        raise ValueError(f"token ids must be ints in [0, 2**32): {exc}") from exc
    if packed.itemsize != 4:  # pragma: no cover - every platform we run on has a 4-byte "I"
        packed = array("L", tokens)
    return packed.tobytes()


def block_keys(
    tokens: Sequence[int] | bytes,
    block_size: int,
    *,
    parent: int | None = None,
    extra_keys: Sequence[ExtraKeys] | None = None,
    max_blocks: int | None = None,
) -> list[int]:
    """Keys of every full block of ``tokens`` (a trailing partial block has no key).

    ``parent`` continues a chain (None: the chain starts at the first token).
    ``extra_keys`` holds one entry per block (shorter lists: missing entries are None).
    ``tokens`` may already be packed with pack_tokens (4 bytes per token).
    """
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    buf = tokens if isinstance(tokens, bytes) else pack_tokens(tokens)
    step = 4 * block_size
    n = len(buf) // step
    if max_blocks is not None:
        n = min(n, max_blocks)
    key = root_key(block_size) if parent is None else parent
    keys = [0] * n
    view = memoryview(buf)
    if not extra_keys:
        for i in range(n):
            key = keys[i] = _xxh(view[i * step : (i + 1) * step], key)
        return keys
    n_extra = len(extra_keys)
    for i in range(n):
        extra = extra_keys[i] if i < n_extra else None
        block = view[i * step : (i + 1) * step]
        if extra:
            key = _xxh(bytes(block) + _EXTRA_SEP + _encode(extra), key)
        else:
            key = _xxh(block, key)
        keys[i] = key
    return keys


def request_extra_keys(
    n_blocks: int, *, lora_name: str | None = None, cache_salt: str | None = None
) -> list[ExtraKeys] | None:
    """The per-block extra keys vLLM derives for a text request (LoRA name on every block,
    cache_salt on the first), in the untagged form its events publish."""
    if not lora_name and not cache_salt:
        return None
    out: list[ExtraKeys] = []
    for i in range(n_blocks):
        extra: list[Any] = []
        if lora_name:
            extra.append(lora_name)
        if i == 0 and cache_salt:
            extra.append(cache_salt)
        out.append(tuple(extra) or None)
    return out
