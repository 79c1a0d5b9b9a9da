"""JSON form of the per-block extra keys that vLLM publishes in ``BlockStored``.

vLLM's block hash covers more than tokens: a LoRA adapter, ``cache_salt``,
multimodal items and prompt embeddings ("extra keys"). Its events publish them per
block, untagged (``to_event_extra_keys``): a tuple of bare LoRA names, cache salts,
``(mm_identifier, offset)`` pairs and prompt-embedding digests, or ``None`` for a
block without any. Tier events must carry the same values as the device events, also
for chunks found on disk after a restart, so the disk header stores them; JSON has no
tuples and no bytes, hence this small reversible encoding:

* a tuple becomes a JSON list (event extra keys never contain lists),
* ``bytes`` become ``{"bytes": "<hex>"}``,
* ``str``, ``int``, ``float``, ``bool`` and ``None`` stay as they are.

Anything else raises ``TypeError``: the chunk is then kept out of the disk tier rather
than announced with keys that would not round-trip.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

BlockExtraKeys = tuple[Any, ...] | None
"""One block's published extra keys (``None``: the block has none)."""

_BYTES_TAG = "bytes"


def _encode_value(v: Any) -> Any:
    if v is None or isinstance(v, str | bool | int | float):
        return v
    if isinstance(v, bytes):
        return {_BYTES_TAG: v.hex()}
    if isinstance(v, tuple):
        return [_encode_value(x) for x in v]
    raise TypeError(f"extra key value of type {type(v).__name__} cannot be stored")


def _decode_value(v: Any) -> Any:
    if isinstance(v, list):
        return tuple(_decode_value(x) for x in v)
    if isinstance(v, dict):
        if set(v) != {_BYTES_TAG}:
            raise ValueError(f"unknown extra key encoding {v!r}")
        return bytes.fromhex(v[_BYTES_TAG])
    return v


def encode_extra_keys(keys: Sequence[BlockExtraKeys] | None) -> list[Any] | None:
    """Per-block extra keys -> JSON-safe list (``None`` stays ``None``)."""
    if keys is None:
        return None
    out: list[Any] = []
    for k in keys:
        if k is not None and not isinstance(k, tuple):
            raise TypeError(f"per-block extra keys must be a tuple, got {type(k).__name__}")
        out.append(None if k is None else _encode_value(k))
    return out


def decode_extra_keys(obj: Any) -> tuple[BlockExtraKeys, ...] | None:
    """Inverse of ``encode_extra_keys`` (tuples of tuples, as ``ChunkInfo`` holds them)."""
    if obj is None:
        return None
    if not isinstance(obj, list):
        raise ValueError("extra keys must be a list")
    out: list[BlockExtraKeys] = []
    for k in obj:
        if k is None:
            out.append(None)
        elif isinstance(k, list):
            out.append(_decode_value(k))
        else:
            raise ValueError(f"bad per-block extra keys {k!r}")
    return tuple(out)
