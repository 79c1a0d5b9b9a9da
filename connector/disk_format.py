"""On-disk chunk file format (version 2).

Layout::

    magic   8 bytes  b"KVRCHUNK"
    version u32 LE   FORMAT_VERSION
    hlen    u32 LE   length of the JSON header
    hsum    u64 LE   xxh3_64 of the JSON header bytes
    header  hlen     UTF-8 JSON: identity (layout + rank of the writer), key, block
                     hashes, parent, token ids, block size, chunk tokens, lora_id,
                     lora_name, extra_keys (per block, see ``extra_keys``), dtype,
                     shape, payload_bytes, payload_xxh3 (xxh3_64 of the payload)
    payload          raw tensor bytes, C order

Version 2 added the writer's rank to the identity and the LoRA / extra keys of the
blocks (so a chunk found at start-up is announced exactly as the device announced it).
A version 1 file lacks both: it is foreign (removed by the scan, never served).

Files are written to a temporary name in the same directory and renamed when complete,
so a crash leaves a temp file (removed by the next scan), never a half file under a
real name. A reader trusts nothing: magic, version, header checksum, identity, key,
size and payload checksum must all match, otherwise the file is a miss (and removed).
The prefix and header reader are in ``chunk_header`` (no torch: the evictor uses them).
"""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch
import xxhash

from kvroute.connector.chunk_header import (
    FORMAT_VERSION,
    MAGIC,
    PREFIX_SIZE,
    SUFFIX,
    TMP_MARK,
    ChunkFileError,
)
from kvroute.connector.chunk_header import PREFIX as _PREFIX
from kvroute.connector.chunk_header import read_header as _read_header
from kvroute.connector.extra_keys import decode_extra_keys, encode_extra_keys
from kvroute.connector.keys import ChunkInfo

# Room for what the worker adds to the planner's header (its rank in the identity,
# dtype, shape, checksum): only used to reserve disk capacity before a write.
_HEADER_SLACK = 1024
# iovecs per preadv call (IOV_MAX is 1024 on Linux)
_IOV_BATCH = 512

_DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}


class DiskFullError(OSError):
    """No space left (ENOSPC/EDQUOT or the configured byte cap)."""


@dataclass
class ChunkFile:
    header: dict
    payload: torch.Tensor  # typed, shaped


def file_name(key: bytes) -> str:
    return key.hex() + SUFFIX


def header_for_chunk(info: ChunkInfo, *, identity: str, payload_bytes: int) -> dict:
    """The self-describing part of a header (the worker replaces ``identity`` with its
    rank identity and adds dtype/shape/checksum). Raises ``TypeError`` when the chunk's
    extra keys cannot be stored (the chunk then stays out of the disk tier)."""
    return {
        "identity": identity,
        "key": info.key.hex(),
        "index": info.index,
        "block_hashes": [h.hex() for h in info.block_hashes],
        "parent_hash": info.parent_hash.hex() if info.parent_hash is not None else None,
        "token_ids": list(info.token_ids),
        "block_size": info.block_size,
        "chunk_tokens": info.num_tokens,
        "lora_id": info.lora_id,
        "lora_name": info.lora_name,
        "extra_keys": encode_extra_keys(info.extra_keys),
        "payload_bytes": payload_bytes,
    }


def info_from_header(h: dict) -> ChunkInfo:
    return ChunkInfo(
        key=bytes.fromhex(h["key"]),
        index=int(h["index"]),
        block_hashes=tuple(bytes.fromhex(x) for x in h["block_hashes"]),
        parent_hash=bytes.fromhex(h["parent_hash"]) if h["parent_hash"] else None,
        token_ids=tuple(int(t) for t in h["token_ids"]),
        block_size=int(h["block_size"]),
        lora_id=None if h["lora_id"] is None else int(h["lora_id"]),
        lora_name=None if h["lora_name"] is None else str(h["lora_name"]),
        extra_keys=decode_extra_keys(h["extra_keys"]),
    )


def _encode_header(header: dict) -> bytes:
    return json.dumps(header, separators=(",", ":"), sort_keys=True).encode()


def max_file_size(header: dict, payload_bytes: int) -> int:
    """Upper bound of the file size, used to reserve disk capacity before writing."""
    return PREFIX_SIZE + len(_encode_header(header)) + _HEADER_SLACK + payload_bytes


def _as_bytes_view(t: torch.Tensor) -> memoryview:
    flat = t.contiguous().view(-1).view(torch.uint8)
    return memoryview(flat.numpy())


def _write_all(f: BinaryIO, data: bytes | memoryview) -> None:
    """Single place that writes file data (tests inject ENOSPC here)."""
    f.write(data)


def write_chunk_file(
    directory: Path, key: bytes, header: dict, payload: torch.Tensor, *, fsync: bool = False
) -> int:
    """Write atomically (temp file + rename); return the file size.

    Raises DiskFullError on ENOSPC/EDQUOT (the temp file is removed)."""
    header = dict(header)
    view = _as_bytes_view(payload)
    header["dtype"] = str(payload.dtype).removeprefix("torch.")
    header["shape"] = list(payload.shape)
    header["payload_bytes"] = len(view)
    header["payload_xxh3"] = xxhash.xxh3_64_intdigest(view)
    hbytes = _encode_header(header)
    prefix = _PREFIX.pack(MAGIC, FORMAT_VERSION, len(hbytes), xxhash.xxh3_64_intdigest(hbytes))
    final = directory / file_name(key)
    tmp = directory / f".{final.name}{TMP_MARK}{os.getpid()}-{os.urandom(4).hex()}"
    try:
        with open(tmp, "wb", buffering=0) as f:
            _write_all(f, prefix + hbytes)
            _write_all(f, view)
            if fsync:
                os.fsync(f.fileno())
        os.replace(tmp, final)
    except OSError as exc:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if exc.errno in (errno.ENOSPC, errno.EDQUOT) or isinstance(exc, DiskFullError):
            raise DiskFullError(errno.ENOSPC, f"disk full writing {final.name}") from exc
        raise
    return len(prefix) + len(hbytes) + len(view)


def read_chunk_header(path: Path, identity: str) -> dict:
    """Validate everything but the payload checksum (cheap; used by the start-up scan)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        header, _ = _read_header(f, size)
    _check_identity(header, identity, path)
    return header


def _check_identity(header: dict, identity: str, path: Path) -> None:
    if header.get("identity") != identity:
        raise ChunkFileError("foreign file (layout or rank identity differs)")
    if path.name != file_name(bytes.fromhex(header.get("key", ""))):
        raise ChunkFileError("file name does not match its key")


def read_chunk_file(
    path: Path, identity: str, *, out: torch.Tensor | None = None, key: bytes | None = None
) -> ChunkFile:
    """Read and fully verify a chunk file. ``out`` (a uint8 tensor of payload_bytes) lets
    the caller read straight into a reusable buffer."""
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        header, _ = _read_header(f, size)
        _check_identity(header, identity, path)
        if key is not None and header["key"] != key.hex():
            raise ChunkFileError("key mismatch")
        nbytes = int(header["payload_bytes"])
        if out is None or out.numel() != nbytes or out.dtype != torch.uint8:
            out = torch.empty(nbytes, dtype=torch.uint8)
        view = memoryview(out.numpy())
        got = 0
        while got < nbytes:
            n = f.readinto(view[got:])
            if not n:
                raise ChunkFileError("payload cut short")
            got += n
    if xxhash.xxh3_64_intdigest(view) != header["payload_xxh3"]:
        raise ChunkFileError("payload checksum mismatch")
    dtype = _DTYPES.get(header.get("dtype", ""))
    if dtype is None:
        raise ChunkFileError(f"unknown dtype {header.get('dtype')}")
    payload = out.view(dtype).view(tuple(header["shape"]))
    return ChunkFile(header=header, payload=payload)


def read_chunk_into(
    path: Path,
    identity: str,
    *,
    key: bytes,
    buffers: Sequence[memoryview],
    shape: Sequence[int],
    dtype: torch.dtype,
) -> dict:
    """Read a chunk's payload straight into ``buffers`` (writable views listed in file
    order, e.g. the destination KV blocks; their sizes must add up to the payload) with
    ``preadv``, then verify the checksum over them. Avoids a staging copy. On any error
    the buffers hold garbage: the caller must treat them as failed (recompute)."""
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        header, start = _read_header(f, size)
        _check_identity(header, identity, path)
        if header["key"] != key.hex():
            raise ChunkFileError("key mismatch")
        if list(header.get("shape", [])) != list(shape) or header.get("dtype") != str(
            dtype
        ).removeprefix("torch."):
            raise ChunkFileError("payload shape/dtype does not match this KV cache")
        nbytes = int(header["payload_bytes"])
        if sum(len(b) for b in buffers) != nbytes:
            raise ChunkFileError("payload size does not match the destination")
        off = start
        fd = f.fileno()
        for i in range(0, len(buffers), _IOV_BATCH):
            batch = list(buffers[i : i + _IOV_BATCH])
            want = sum(len(b) for b in batch)
            got = os.preadv(fd, batch, off)
            while got < want:  # short read: finish buffer by buffer
                done = 0
                for b in batch:
                    if done + len(b) <= got:
                        done += len(b)
                        continue
                    skip = max(0, got - done)
                    n = os.preadv(fd, [b[skip:]], off + done + skip)
                    if n <= 0:
                        raise ChunkFileError("payload cut short")
                    got += n
                    break
            off += want
    h = xxhash.xxh3_64()
    for b in buffers:
        h.update(b)
    if h.intdigest() != header["payload_xxh3"]:
        raise ChunkFileError("payload checksum mismatch")
    return header
