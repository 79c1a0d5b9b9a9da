"""Disk tier: where chunk files live, and the worker's background writer.

Layout: ``<disk_dir>/<layout digest>/tp<r>-pp<p>/<key hex>.kvc``. The layout digest
separates models, weights, settings and parallel layouts (see ``identity``); the rank
directory separates the workers of one layout, whose files for the same chunk hold
different slices of its KV. A data-parallel engine of rank d > 0 keeps its private
files in ``<layout digest>/dp<d>/`` (``layout.engine_layout_dir``). The start-up scan is
in ``disk_scan``.

* ``DiskWriter`` (worker side): background threads write files so the forward pass
  never waits on disk (several at once: one file write leaves the device idle while
  the writer checksums, so a few in flight keep it busy). Pending bytes are bounded;
  over the bound a write is dropped and reported (a dropped write is only a future
  miss). ENOSPC, and the optional ``byte_cap`` used by tests, become a ``disk_full``
  report.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from kvroute.connector.disk_format import DiskFullError, file_name, max_file_size, write_chunk_file
from kvroute.connector.identity import RankInfo

logger = logging.getLogger(__name__)


def tier_directory(base: Path, identity_digest: str) -> Path:
    """Files of one layout identity live in their own sub-directory, so replicas of
    different models, settings or parallel layouts can share a base directory without
    ever seeing each other's files."""
    d = Path(base) / identity_digest
    d.mkdir(parents=True, exist_ok=True)
    return d


def rank_directory(layout_dir: Path | str, rank: RankInfo) -> Path:
    """The directory of one rank's files (created on first use by either side)."""
    d = Path(layout_dir) / rank.dir_name
    d.mkdir(parents=True, exist_ok=True)
    return d


def chunk_path(directory: Path | str, key: bytes) -> Path:
    # Directories cross processes as str in the connector metadata: accept both.
    return Path(directory) / file_name(key)


def unlink_chunk(directory: Path | str, key: bytes) -> None:
    try:
        os.unlink(chunk_path(directory, key))
    except FileNotFoundError:
        pass
    except OSError as exc:  # pragma: no cover - unusual FS errors
        logger.warning("kvroute: could not remove %s: %s", key.hex(), exc)


def unlink_chunk_all_ranks(layout_dir: Path | str, ranks: Iterable[RankInfo], key: bytes) -> None:
    """Remove every rank's file of a chunk: the scheduler drops a chunk as a whole (one
    rank's file without the others' can never be served)."""
    for rank in ranks:
        unlink_chunk(Path(layout_dir) / rank.dir_name, key)


@dataclass
class WriteResult:
    key: bytes
    ok: bool
    error: str | None = None
    size: int = 0


class DiskWriter:
    """Background writer of chunk files with bounded pending bytes."""

    def __init__(
        self,
        directory: Path,
        *,
        fsync: bool = False,
        max_pending_bytes: int = 256 << 20,
        byte_cap: int | None = None,
        on_done: Callable[[WriteResult], None] | None = None,
        threads: int = 1,
    ) -> None:
        self.directory = Path(directory)
        self.fsync = fsync
        self.max_pending_bytes = max_pending_bytes
        self.byte_cap = byte_cap
        self._written = 0
        self._pending = 0
        self._lock = threading.Lock()
        self._results: list[WriteResult] = []
        self._on_done = on_done
        self._q: queue.Queue[tuple[bytes, dict, torch.Tensor, Callable[[], None] | None] | None] = (
            queue.Queue()
        )
        self._idle = threading.Event()
        self._idle.set()
        self._threads = [
            threading.Thread(target=self._run, name=f"kvroute-disk-writer-{i}", daemon=True)
            for i in range(max(1, threads))
        ]
        for t in self._threads:
            t.start()

    def submit(
        self,
        key: bytes,
        header: dict,
        payload: torch.Tensor,
        on_written: Callable[[], None] | None = None,
    ) -> bool:
        """Queue a write of ``payload`` (which must stay unchanged until written;
        ``on_written`` runs once the writer is done with it, success or not). Returns
        False (and records a failed result) when the queue is over its byte bound."""
        n = payload.numel() * payload.element_size()
        with self._lock:
            if self._pending + n > self.max_pending_bytes and self._pending > 0:
                self._results.append(WriteResult(key, False, "queue_full"))
                drop = True
            else:
                self._pending += n
                self._idle.clear()
                drop = False
        if drop:
            if on_written is not None:
                on_written()
            return False
        self._q.put((key, header, payload, on_written))
        return True

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            key, header, payload, on_written = item
            n = payload.numel() * payload.element_size()
            res: WriteResult
            reserve = 0
            try:
                if self.byte_cap is not None:
                    with self._lock:  # reserve under the lock: writers run in parallel
                        need = max_file_size(header, n)
                        if self._written + need > self.byte_cap:
                            raise DiskFullError(28, "byte cap reached")
                        self._written += need
                        reserve = need
                size = write_chunk_file(self.directory, key, header, payload, fsync=self.fsync)
                with self._lock:
                    self._written += size - reserve
                reserve = 0
                res = WriteResult(key, True, size=size)
            except DiskFullError:
                res = WriteResult(key, False, "disk_full")
            except OSError as exc:
                logger.warning("kvroute: disk write failed for %s: %s", key.hex(), exc)
                res = WriteResult(key, False, "io")
            if reserve:
                with self._lock:
                    self._written -= reserve
            if on_written is not None:
                on_written()
            with self._lock:
                self._pending -= n
                self._results.append(res)
                if self._pending == 0 and self._q.empty():
                    self._idle.set()
            if self._on_done is not None:
                self._on_done(res)

    def take_results(self) -> list[WriteResult]:
        with self._lock:
            out, self._results = self._results, []
        return out

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write finished (tests, benchmarks, shutdown)."""
        return self._idle.wait(timeout)

    def close(self, timeout: float = 30.0) -> None:
        self.flush(timeout)
        for _ in self._threads:
            self._q.put(None)
        for t in self._threads:
            t.join(timeout)
