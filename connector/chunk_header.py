"""The fixed prefix and JSON header of a chunk file, readable without torch.

``disk_format`` writes and fully reads chunk files (it needs torch for the payload); the
storage evictor (``storage_gc``) runs as a small sidecar that only needs each file's block
hashes, so the header's reader lives here, and ``disk_format`` builds on it.
"""

from __future__ import annotations

import json
import struct
from typing import BinaryIO

import xxhash

__all__ = [
    "FORMAT_VERSION",
    "MAGIC",
    "PREFIX",
    "PREFIX_SIZE",
    "SUFFIX",
    "TMP_MARK",
    "ChunkFileError",
    "read_header",
]

MAGIC = b"KVRCHUNK"
FORMAT_VERSION = 2
PREFIX = struct.Struct("<8sIIQ")
PREFIX_SIZE = PREFIX.size
SUFFIX = ".kvc"
TMP_MARK = ".tmp-"


class ChunkFileError(Exception):
    """The file is not a valid chunk for us: treat as a miss and remove it."""


def read_header(f: BinaryIO, file_size: int) -> tuple[dict, int]:
    """The header of an open chunk file of ``file_size`` bytes, and where its payload starts;
    ChunkFileError for anything but a whole, intact file of this format version."""
    raw = f.read(PREFIX_SIZE)
    if len(raw) != PREFIX_SIZE:
        raise ChunkFileError("truncated prefix")
    magic, version, hlen, hsum = PREFIX.unpack(raw)
    if magic != MAGIC:
        raise ChunkFileError("bad magic")
    if version != FORMAT_VERSION:
        raise ChunkFileError(f"unsupported format version {version}")
    if hlen <= 0 or PREFIX_SIZE + hlen > file_size:
        raise ChunkFileError("bad header length")
    hbytes = f.read(hlen)
    if len(hbytes) != hlen or xxhash.xxh3_64_intdigest(hbytes) != hsum:
        raise ChunkFileError("header checksum mismatch")
    try:
        header = json.loads(hbytes)
    except ValueError as exc:
        raise ChunkFileError("header is not JSON") from exc
    if not isinstance(header, dict):
        raise ChunkFileError("header is not a JSON object")
    try:
        payload = int(header.get("payload_bytes", -1))
    except (TypeError, ValueError):
        raise ChunkFileError("header has no payload size") from None
    if PREFIX_SIZE + hlen + payload != file_size:
        raise ChunkFileError("file size does not match header (cut short?)")
    return header, PREFIX_SIZE + hlen
