"""Live view of a shared storage domain directory (scheduler side).

Several replicas mount one directory (a *storage domain*) and each must find every
chunk any of them wrote, as soon as it is written, while an external evictor removes
files at any time. So the filesystem is the truth: every lookup stats the chunk's
files (one per rank) and a chunk is a hit only when all of them exist now. Parsed
headers are cached by inode, so a hit costs a ``stat`` per rank after the first one;
the cache never answers for a file that is gone, because the ``stat`` comes first.

After ``reset_cache`` this replica must not serve KV computed before it (weights may
have changed) but must not delete files other replicas still use: ``forget_present``
records the inode of every file present, and such files are misses for this replica
from then on. A chunk written again after the reset is a new file (new inode) and is
served.

Each replica also keeps a marker file in ``.writers/`` and refreshes its mtime, so it
can tell whether it sees any other replica: a "shared" directory in which no other
writer ever shows up is probably not shared (a local path on each host), which is
logged and counted (``peers``).
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path

from kvroute.connector.disk_format import (
    ChunkFileError,
    file_name,
    info_from_header,
    read_chunk_header,
)
from kvroute.connector.identity import RankInfo, rank_identity
from kvroute.connector.keys import ChunkInfo

logger = logging.getLogger(__name__)

WRITERS_DIR = ".writers"
# A replica refreshes its marker this often; another replica's marker older than
# PEER_FRESH_S is a replica that is gone.
HEARTBEAT_S = 30.0
PEER_FRESH_S = 300.0
# Warn once when no other writer was seen this long after start.
LONELY_WARN_S = 300.0


class SharedStore:
    """Chunk files of one layout directory in a storage domain, looked up live."""

    def __init__(
        self,
        layout_dir: Path | str,
        identity: str,
        ranks: Sequence[RankInfo],
        *,
        domain: str,
        cache_size: int = 65536,
        replica_id: str | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.layout_dir = Path(layout_dir)
        self.domain = domain
        self._rank_dirs = [self.layout_dir / r.dir_name for r in ranks]
        for d in self._rank_dirs:
            d.mkdir(parents=True, exist_ok=True)
        self._rank_ids = [rank_identity(identity, r) for r in ranks]
        self._cache: OrderedDict[bytes, tuple[tuple[int, ...], ChunkInfo, int]] = OrderedDict()
        self._cache_size = cache_size
        # (rank index, file name) -> inode of files present at the last reset.
        self._stale: dict[tuple[int, str], int] = {}
        self._clock = clock
        self.replica_id = replica_id or (
            f"{socket.gethostname()}-{os.getpid()}-{os.urandom(3).hex()}"
        )
        self._writers = self.layout_dir / WRITERS_DIR
        self._writers.mkdir(exist_ok=True)
        self._marker = self._writers / self.replica_id
        self._started = clock()
        self._next_beat = 0.0
        self._warned_alone = False
        self._seen_peer = False
        self.peers = 0
        self.removed_bad = 0
        self.heartbeat()

    # ------------------------------------------------------------------ lookup
    def probe(self, key: bytes) -> tuple[ChunkInfo, int] | None:
        """The chunk and its bytes over all ranks when every rank's file exists now,
        is valid and was not present at this replica's last reset; else None. A file
        with a bad or foreign header is removed (a writer renames only complete files,
        so it is never a write in progress)."""
        name = file_name(key)
        inos: list[int] = []
        sizes = 0
        for i, d in enumerate(self._rank_dirs):
            try:
                st = os.stat(d / name)
            except FileNotFoundError:
                self._cache.pop(key, None)
                return None
            if self._stale.get((i, name)) == st.st_ino:
                return None
            inos.append(st.st_ino)
            sizes += st.st_size
        cached = self._cache.get(key)
        if cached is not None and cached[0] == tuple(inos) and cached[2] == sizes:
            self._cache.move_to_end(key)
            return cached[1], sizes
        info = self._read_infos(key, name)
        if info is None:
            return None
        self._cache[key] = (tuple(inos), info, sizes)
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return info, sizes

    def _read_infos(self, key: bytes, name: str) -> ChunkInfo | None:
        infos: list[ChunkInfo] = []
        for d, ident in zip(self._rank_dirs, self._rank_ids, strict=True):
            path = d / name
            try:
                info = info_from_header(read_chunk_header(path, ident))
            except FileNotFoundError:
                return None  # removed since the stat: a miss
            except (ChunkFileError, OSError, KeyError, ValueError, TypeError) as exc:
                self._remove(path, f"invalid chunk file ({exc})")
                return None
            if info.key != key:
                self._remove(path, "header key differs from the file name")
                return None
            infos.append(info)
        if any(x != infos[0] for x in infos[1:]):
            # Rank files of two different chunks under one key: neither is servable.
            for d in self._rank_dirs:
                self._remove(d / name, "rank files disagree on the chunk")
            return None
        return infos[0]

    def cached_info(self, key: bytes) -> ChunkInfo | None:
        """The chunk's description from the last successful probe (for an event about
        a file this replica removed)."""
        c = self._cache.get(key)
        return c[1] if c is not None else None

    def forget(self, key: bytes) -> None:
        self._cache.pop(key, None)

    def _remove(self, path: Path, why: str) -> None:
        logger.warning("kvroute: storage domain %s: removing %s: %s", self.domain, path, why)
        try:
            os.unlink(path)
            self.removed_bad += 1
        except OSError:
            pass

    # ------------------------------------------------------------------ reset
    def forget_present(self) -> int:
        """Never serve a file present now (by inode) again; returns how many there are.
        Files are left in place: other replicas of the domain may still use them."""
        stale: dict[tuple[int, str], int] = {}
        for i, d in enumerate(self._rank_dirs):
            try:
                entries = list(os.scandir(d))
            except FileNotFoundError:
                continue
            for entry in entries:
                try:
                    stale[(i, entry.name)] = entry.inode()
                except OSError:
                    continue
        self._stale = stale
        self._cache.clear()
        return len(stale)

    # ------------------------------------------------------------------ peers
    def heartbeat(self) -> None:
        """Refresh this replica's marker and count the other live ones (at most every
        ``HEARTBEAT_S``; cheap to call on every lookup)."""
        now = self._clock()
        if now < self._next_beat:
            return
        self._next_beat = now + HEARTBEAT_S
        try:
            self._marker.touch()
            os.utime(self._marker, (now, now))
            peers = 0
            for entry in os.scandir(self._writers):
                if entry.name == self.replica_id:
                    continue
                try:
                    if now - entry.stat().st_mtime <= PEER_FRESH_S:
                        peers += 1
                except FileNotFoundError:
                    continue
        except OSError as exc:
            logger.warning("kvroute: storage domain %s: marker update failed: %s", self.domain, exc)
            return
        if peers != self.peers:
            logger.info(
                "kvroute: storage domain %s: %d other replica(s) visible in %s",
                self.domain,
                peers,
                self.layout_dir,
            )
        self.peers = peers
        self._seen_peer = self._seen_peer or peers > 0
        lonely = not self._seen_peer and now - self._started >= LONELY_WARN_S
        if lonely and not self._warned_alone:
            self._warned_alone = True
            logger.warning(
                "kvroute: storage domain %s: no other replica attached to %s in %.0f s: "
                "if it should be shared, it is not (this replica reads only its own files)",
                self.domain,
                self.layout_dir,
                now - self._started,
            )

    @property
    def alone(self) -> bool:
        """No other live replica marker is visible (the directory may not be shared)."""
        return self.peers == 0

    def close(self) -> None:
        try:
            os.unlink(self._marker)
        except OSError:
            pass
