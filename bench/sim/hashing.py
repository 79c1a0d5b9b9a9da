"""vLLM-like engine block hashes for the simulator.

A simulated replica must name its blocks the way vLLM does, not the way our index keys them:
``h_i = sha256(pickle((parent_digest or NONE_HASH, tuple(block_tokens), extra_keys or None)))``
chained over full digests, published as the low 64 bits of the digest. If the simulator reused
``indexer/keys.py``, an indexer that forgot to re-key from token ids would look correct here and
fail against real vLLM; with these hashes it fails here too.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Sequence
from typing import Any

__all__ = ["EngineHasher", "digest_to_int"]


def digest_to_int(digest: bytes) -> int:
    """What vLLM publishes with int block hashes: the digest's low 64 bits, big-endian."""
    return int.from_bytes(digest[-8:], "big")


class EngineHasher:
    """Chained sha256-over-pickle block digests, as vLLM's default ``sha256`` algorithm.

    ``seed`` plays the part of ``PYTHONHASHSEED``: None gives vLLM's fixed NONE_HASH (the same
    on every replica); a per-replica seed mimics the xxhash modes, whose hashes differ between
    processes. The index must cope with both, since it keys blocks from token ids.
    """

    def __init__(self, seed: str | None = None) -> None:
        self.seed = seed
        self.none_hash = self._hash(seed if seed is not None else "kvroute-sim/NONE_HASH")

    @staticmethod
    def _hash(obj: Any) -> bytes:
        return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()

    def block_digest(
        self, parent: bytes | None, tokens: Sequence[int], extra: tuple[Any, ...] | None = None
    ) -> bytes:
        return self._hash((parent if parent is not None else self.none_hash, tuple(tokens), extra))

    def chain(
        self,
        tokens: Sequence[int],
        block_size: int,
        *,
        extra_keys: Sequence[tuple[Any, ...] | None] | None = None,
    ) -> list[bytes]:
        """Digests of every full block of ``tokens`` (the partial tail block has none)."""
        out: list[bytes] = []
        parent: bytes | None = None
        for i in range(len(tokens) // block_size):
            extra = extra_keys[i] if extra_keys is not None and i < len(extra_keys) else None
            parent = self.block_digest(parent, tokens[i * block_size : (i + 1) * block_size], extra)
            out.append(parent)
        return out
