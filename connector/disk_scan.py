"""Start-up scan of the disk tier (scheduler side): what may be served, what must go.

A chunk of a TP x PP layout is stored as one file per rank, each holding that rank's
slice of the KV. It can only be served when EVERY rank's file is there and valid: a
load runs on all workers, and one missing slice would make every worker recompute.
So the scan validates each rank directory with that rank's identity, then keeps the
intersection of the keys. Files are never trusted:

* invalid files (cut short, bad header checksum, foreign layout or rank, a name that
  does not match the key, an older format version) are removed: never served;
* files left directly in the layout directory were written by format version 1 (no
  rank directories) and are removed;
* a key whose rank files disagree on what the chunk is (block hashes, tokens, extra
  keys) is removed from every rank;
* a valid file whose sibling ranks are missing is not announced; it is left for its
  owner (another replica sharing the directory may be writing the other ranks right
  now) and removed only once it is older than ``STALE_S``, like a temp file.

The chunks served come least recently written first (the RAM/disk LRU order), except that a
chunk never comes before its parent chunk: the start-up announcement is a stream of
self-describing ``BlockStored`` events, and a subscriber keys a chunk through its parent's
keys, so a child announced first is unresolvable. Parallel writer threads finish chunks out
of prompt order, so file times alone do not give that order.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvroute.connector.disk_format import (
    SUFFIX,
    TMP_MARK,
    ChunkFileError,
    info_from_header,
    read_chunk_header,
)
from kvroute.connector.disk_tier import rank_directory
from kvroute.connector.identity import RankInfo, rank_identity
from kvroute.connector.keys import ChunkInfo

logger = logging.getLogger(__name__)

# Temp files and rank-incomplete chunks younger than this may belong to a live writer
# sharing the directory.
STALE_S = 600.0


@dataclass(frozen=True)
class FoundFile:
    info: ChunkInfo
    size: int
    mtime: float
    path: Path


def _remove(path: Path, why: str) -> None:
    logger.warning("kvroute: removing %s: %s", path.name, why)
    try:
        os.unlink(path)
    except OSError:
        pass


def _scan_files(
    directory: Path, identity: str, now: float, stale_s: float
) -> dict[bytes, FoundFile]:
    """Valid chunk files of one directory, by key; invalid ones are removed."""
    found: dict[bytes, FoundFile] = {}
    for entry in os.scandir(directory):
        if not entry.is_file(follow_symlinks=False):
            continue
        path = Path(entry.path)
        try:
            st = entry.stat()
        except FileNotFoundError:
            continue
        if TMP_MARK in entry.name:
            if now - st.st_mtime > stale_s:
                _remove(path, "stale temp file")
            continue
        if not entry.name.endswith(SUFFIX):
            continue
        try:
            info = info_from_header(read_chunk_header(path, identity))
        except (ChunkFileError, OSError, KeyError, ValueError, TypeError) as exc:
            _remove(path, f"invalid chunk file ({exc})")
            continue
        found[info.key] = FoundFile(info, st.st_size, st.st_mtime, path)
    return found


def scan_directory(
    directory: Path, identity: str, *, stale_s: float = STALE_S
) -> list[tuple[ChunkInfo, int]]:
    """(chunk, file size) of every valid file of ONE directory checked against one
    (rank) identity, oldest first (LRU order by mtime, parents first). Invalid files are removed."""
    found = _scan_files(Path(directory), identity, time.time(), stale_s)
    ordered = sorted(found.values(), key=lambda f: f.mtime)
    return parents_first([(f.info, f.size) for f in ordered])


def _remove_legacy_files(layout_dir: Path, now: float, stale_s: float) -> None:
    """Chunk files directly in the layout directory predate rank directories."""
    for entry in os.scandir(layout_dir):
        if not entry.is_file(follow_symlinks=False):
            continue
        path = Path(entry.path)
        if TMP_MARK in entry.name:
            try:
                old = now - entry.stat().st_mtime > stale_s
            except FileNotFoundError:
                continue
            if old:
                _remove(path, "stale temp file")
        elif entry.name.endswith(SUFFIX):
            _remove(path, "format version 1 file (no rank directory): foreign")


def scan_layout(
    layout_dir: Path,
    identity: str,
    ranks: Sequence[RankInfo],
    *,
    stale_s: float = STALE_S,
    now: float | None = None,
) -> list[tuple[ChunkInfo, int]]:
    """Chunks whose files are present and valid on every rank of the layout, as
    (chunk, bytes over all ranks), least recently written first."""
    layout_dir = Path(layout_dir)
    now = time.time() if now is None else now
    _remove_legacy_files(layout_dir, now, stale_s)
    per_rank = [
        _scan_files(rank_directory(layout_dir, r), rank_identity(identity, r), now, stale_s)
        for r in ranks
    ]
    all_keys: set[bytes] = set().union(*per_rank) if per_rank else set()
    served: list[tuple[float, ChunkInfo, int]] = []
    for key in all_keys:
        files = [found[key] for found in per_rank if key in found]
        if len(files) < len(per_rank):
            if all(now - f.mtime > stale_s for f in files):
                for f in files:
                    _remove(f.path, "chunk incomplete on the other ranks")
            continue
        if any(f.info != files[0].info for f in files[1:]):
            for f in files:
                _remove(f.path, "rank files disagree on the chunk")
            continue
        newest = max(f.mtime for f in files)
        served.append((newest, files[0].info, sum(f.size for f in files)))
    served.sort(key=lambda x: (x[0], x[1].key))
    return parents_first([(info, size) for _, info, size in served])


def parents_first(chunks: Sequence[tuple[ChunkInfo, int]]) -> list[tuple[ChunkInfo, int]]:
    """``chunks`` in their order, except that a chunk whose parent chunk is among them
    comes after it (the parent moves up to just before its first child)."""
    by_key = {info.key: (info, size) for info, size in chunks}
    out: list[tuple[ChunkInfo, int]] = []
    placed: set[bytes] = set()
    for info, _ in chunks:
        lineage: list[bytes] = []
        key: bytes | None = info.key
        while key is not None and key in by_key and key not in placed:
            lineage.append(key)
            placed.add(key)
            key = by_key[key][0].parent_hash
        out.extend(by_key[k] for k in reversed(lineage))
    return out
