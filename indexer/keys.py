"""The index's own block keys: chained 64-bit hashes over token ids.

vLLM's block hashes cannot be extended from outside (events carry 64-bit truncations of the
digest, the seed may be random per process, the algorithm is a flag), so the index keys every
block itself from what both sides know for sure: the token ids, the block size and the extra
keys vLLM mixes into a block's hash (LoRA name, cache_salt, multimodal ids: each media item's
identifier and offset in every block its placeholder overlaps). The router computes
a request's keys with the same function, so a request and a stored block meet on equal keys
whatever hash algorithm or seed each replica runs.

key_i = xxh3_64(tokens of block i as little-endian u32 || extra_i, seed = key_{i-1})
key_{-1} = xxh3_64("kvroute-key-v1/<block_size>")

A partial block (vLLM publishes one when its prefix-match unit is finer than its block size:
the tokens of a prompt's tail that end inside a block) is keyed in its own domain,
``xxh3_64(tokens || PARTIAL || extra, seed = key of what precedes it)``, so it never equals a
full block's key and a chain of partial pieces extends from the last full block.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import msgspec
import xxhash

from kvroute.indexer.native_core import NATIVE

__all__ = [
    "ExtraKeys",
    "RequestKeys",
    "block_extra_keys",
    "block_keys",
    "block_keys_py",
    "event_extra_keys",
    "mm_block_keys",
    "pack_tokens",
    "partial_key",
    "python_keying",
    "request_extra_keys",
    "root_key",
]

ExtraKeys = Sequence[Any] | None
"""One block's extra keys as vLLM publishes them (untagged tuple), or None."""

_xxh = xxhash.xxh3_64_intdigest
_encode = msgspec.msgpack.encode
_EXTRA_SEP = b"\xffkvroute-extra\xff"
_PARTIAL_SEP = b"\xfekvroute-partial\xfe"
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
    A chain without extra keys is hashed by the native core when it runs (same keys:
    tests/indexer/test_native_core.py); ``block_keys_py`` is the specification.
    """
    if NATIVE is not None and not (extra_keys and any(extra_keys)):
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        buf = tokens if isinstance(tokens, bytes) else pack_tokens(tokens)
        key = root_key(block_size) if parent is None else parent
        limit = -1 if max_blocks is None else max(0, max_blocks)
        return NATIVE.block_keys(buf, block_size, key, limit)
    return block_keys_py(
        tokens, block_size, parent=parent, extra_keys=extra_keys, max_blocks=max_blocks
    )


@contextmanager
def python_keying() -> Iterator[None]:
    """Key in Python meanwhile, as where the native core is missing: for benchmarks and
    tests that run both cores in one process (not thread-safe: nothing else keys then)."""
    global NATIVE
    saved, NATIVE = NATIVE, None
    try:
        yield
    finally:
        NATIVE = saved


def block_keys_py(
    tokens: Sequence[int] | bytes,
    block_size: int,
    *,
    parent: int | None = None,
    extra_keys: Sequence[ExtraKeys] | None = None,
    max_blocks: int | None = None,
) -> list[int]:
    """``block_keys`` in Python: the specification the native core is tested against."""
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
    if not extra_keys or not any(extra_keys):
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


def partial_key(parent: int, tokens: Sequence[int] | bytes, extra: ExtraKeys = None) -> int:
    """Key of a partial block: ``tokens`` after the block (or partial piece) keyed ``parent``."""
    buf = tokens if isinstance(tokens, bytes) else pack_tokens(tokens)
    if extra:
        return _xxh(buf + _PARTIAL_SEP + _encode(extra), parent)
    return _xxh(buf + _PARTIAL_SEP, parent)


MMItems = Sequence[tuple[str, int, int]]
"""A prompt's multimodal items: (identifier, placeholder offset, placeholder length), sorted
by offset (vLLM's render endpoints return them as ``features``)."""


def mm_block_keys(mm: MMItems, start: int, end: int) -> list[tuple[str, int]]:
    """vLLM's multimodal extra keys of the block of tokens [start, end): every item whose
    placeholder overlaps it, as (identifier, item offset - block start), in order."""
    return [
        (ident, offset - start)
        for ident, offset, length in mm
        if offset < end and start < offset + length
    ]


def block_extra_keys(
    lora_name: str | None = None,
    cache_salt: str | None = None,
    mm: Sequence[tuple[str, int]] = (),
) -> ExtraKeys:
    """One block's extra keys in vLLM's order and untagged form, as its events publish them:
    the LoRA name, the multimodal items the block overlaps, the cache_salt (a prompt's first
    block only: pass it for that block). None when there are none."""
    extra: list[Any] = []
    if lora_name:
        extra.append(lora_name)
    extra.extend(mm)
    if cache_salt:
        extra.append(cache_salt)
    return tuple(extra) or None


def request_extra_keys(
    n_blocks: int,
    *,
    lora_name: str | None = None,
    cache_salt: str | None = None,
    mm: MMItems | None = None,
    block_size: int = 0,
) -> list[ExtraKeys] | None:
    """The per-block extra keys vLLM derives for a request (LoRA name on every block, the
    multimodal items a block overlaps, cache_salt on the first). ``mm`` needs
    ``block_size``."""
    if not lora_name and not cache_salt and not mm:
        return None
    return [
        block_extra_keys(
            lora_name,
            cache_salt if i == 0 else None,
            mm_block_keys(mm, i * block_size, (i + 1) * block_size) if mm else (),
        )
        for i in range(n_blocks)
    ]


def event_extra_keys(
    carried: Sequence[ExtraKeys] | None, lora_name: str | None, n_blocks: int
) -> Sequence[ExtraKeys] | None:
    """The per-block extra keys of a stored event: those it carries, or, from a publisher
    that does not send them (vLLM before the field, LMCache), the LoRA name on every block,
    the one extra key such an event still names."""
    if carried is not None:
        return carried
    return request_extra_keys(n_blocks, lora_name=lora_name)


class RequestKeys:
    """One request's tokens and extra keys, keyed lazily once per block size.

    The router builds one per request and hands it to the index and to everything else that
    needs the request's keys (burst hints, homes), so each block size is keyed once.
    """

    __slots__ = ("_keys", "cache_salt", "lora_name", "mm", "n_tokens", "packed")

    def __init__(
        self,
        tokens: Sequence[int] | bytes,
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        mm: MMItems | None = None,
    ) -> None:
        self.packed = tokens if isinstance(tokens, bytes) else pack_tokens(tokens)
        self.n_tokens = len(self.packed) // 4
        self.lora_name = lora_name
        self.cache_salt = cache_salt
        # Multimodal items (identifier, offset, length): keyed into the blocks they overlap.
        self.mm = tuple(mm) if mm else ()
        self._keys: dict[int, list[int]] = {}

    def keys(self, block_size: int) -> list[int]:
        keys = self._keys.get(block_size)
        if keys is None:
            extra = request_extra_keys(
                self.n_tokens // block_size,
                lora_name=self.lora_name,
                cache_salt=self.cache_salt,
                mm=self.mm,
                block_size=block_size,
            )
            keys = self._keys[block_size] = block_keys(self.packed, block_size, extra_keys=extra)
        return keys

    def partial_keys(self, block_size: int, blocks: int, unit: int) -> list[tuple[int, int]]:
        """(tokens past ``blocks`` full blocks, key) for each partial piece of ``unit`` tokens
        inside block ``blocks``, shortest first: what a replica with vLLM's prefix-match unit
        ``unit`` may hold past its last full block."""
        if unit <= 0 or block_size % unit or unit >= block_size or self.mm:
            # Partial pieces of a multimodal prompt: not keyed (never a false hit).
            return []
        start = blocks * block_size
        key = root_key(block_size) if blocks == 0 else self.keys(block_size)[blocks - 1]
        out: list[tuple[int, int]] = []
        salt = self.cache_salt if blocks == 0 else None
        for m in range(1, block_size // unit):
            end = start + m * unit
            if end > self.n_tokens:
                break
            extra = block_extra_keys(self.lora_name, salt if m == 1 else None)
            piece = self.packed[(end - unit) * 4 : end * 4]
            key = partial_key(key, piece, extra)
            out.append((m * unit, key))
        return out
