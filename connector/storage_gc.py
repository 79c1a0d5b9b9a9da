"""``kvroute storage gc``: the evictor of a storage domain (a directory replicas share).

Replicas only ever add chunk files to a shared directory; one evictor per domain keeps it
under its byte budget. Each pass scans ``<dir>/<layout digest>/tp<r>-pp<p>/<key hex>.kvc``,
sums the bytes, and when the total is over ``max_bytes`` removes the least recently used
chunks (recency: the newest mtime of the chunk's rank files; replicas bump it when they load
a chunk) until the total is under the low watermark. Every rank file of a chunk goes
together (one rank's file without the others' can never be served). Each removed chunk is
announced as ``BlockRemoved(block_hashes, medium="STORAGE")`` on the evictor's own KV-event
stream, vLLM's wire format, sequence numbers and replay socket included
(kvroute.indexer.publisher), so a router subscribed to the domain (``--storage-domain``)
learns removals like any replica's. On start (``announce``) it publishes
``BlockStored(STORAGE)`` for every complete chunk present, from the headers: a router clears
the domain when the evictor's stream starts over, and this is how it learns the domain again.

What it meets on the way:
- temp files (a writer's ``.<name>.tmp-...``) younger than ``temp_grace_s`` count toward the
  total and are left alone; older ones are a crashed writer's and are removed;
- a ``.kvc`` file whose header cannot be read (cut short, foreign format version, not ours)
  is removed when its turn comes, without an event: no replica could have announced it,
  as the connector refuses such a file too;
- files in a rank directory that are neither chunks nor temp files are reported (counted
  and logged once per pass), never removed: they are not ours to judge;
- a file that vanishes under it (another evictor, a replica deleting a bad file) is
  skipped and counted.

Memory is bounded: a pass keeps the ``max_candidates`` least recently used rank files (a
heap), not the whole directory; a pass that could not free enough with them leaves the rest
to the next pass. Nothing here imports torch or vLLM (the header reader is
kvroute.connector.chunk_header), so the evictor runs as a small sidecar.
"""

from __future__ import annotations

import heapq
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvroute.connector.chunk_header import SUFFIX, TMP_MARK, ChunkFileError, read_header
from kvroute.connector.extra_keys import decode_extra_keys
from kvroute.indexer.publisher import EventPublisher
from kvroute.indexer.wire import BlockRemoved, BlockStored, Event, Medium

__all__ = ["GcPass", "StorageEvictor", "chunk_hashes"]

log = logging.getLogger(__name__)

_RANK_DIR = re.compile(r"tp\d+-pp\d+")
# Chunks announced per published batch (a batch is one message; vLLM's are one engine step).
_EVENTS_PER_BATCH = 256


@dataclass(slots=True)
class GcPass:
    """What one pass saw and did (also the evictor's log line and its ``--once`` output)."""

    bytes_before: int = 0
    bytes_after: int = 0
    chunk_files: int = 0
    removed_chunks: int = 0
    removed_files: int = 0
    removed_bytes: int = 0
    invalid_removed: int = 0
    stale_temp_removed: int = 0
    young_temp_files: int = 0
    unknown_files: int = 0
    vanished: int = 0
    # Removed chunks written again before their removal was published: not announced.
    rewritten: int = 0
    errors: int = 0
    events_published: int = 0
    duration_s: float = 0.0

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class _File:
    size: int
    mtime: float


def _hash(hex_digest: str) -> int:
    return int.from_bytes(bytes.fromhex(hex_digest)[-8:], "big")


def stored_event(header: dict) -> BlockStored:
    """The chunk as its writer announced it (kvroute's connector: self-describing, with the
    blocks' LoRA and extra keys), rebuilt from its header."""
    hashes = chunk_hashes(header)
    extra: Any = decode_extra_keys(header.get("extra_keys"))
    if extra is None and header.get("lora_name") is None:
        # vLLM publishes no extra keys when no block has any (no LoRA, salt, images): the
        # blocks are keyed by their tokens alone, which an index can only do if told so.
        extra = [None] * len(hashes)
    parent = header.get("parent_hash")
    return BlockStored(
        hashes,
        None if parent is None else _hash(parent),
        [int(t) for t in header["token_ids"]],
        int(header["block_size"]),
        Medium.STORAGE,
        lora_name=header.get("lora_name"),
        lora_id=header.get("lora_id"),
        extra_keys=None if extra is None else list(extra),
    )


def chunk_hashes(header: dict) -> list[int]:
    """The chunk's block hashes as vLLM's integer block hashes (its default on the wire:
    the digest's last 8 bytes, big-endian), the form the connector announced them in."""
    hashes = header["block_hashes"]
    if not isinstance(hashes, list) or not hashes:
        raise ChunkFileError("header has no block hashes")
    return [_hash(h) for h in hashes]


class StorageEvictor:
    """Keeps one domain directory under its budget; ``run_pass`` is one scan."""

    def __init__(
        self,
        directory: Path | str,
        max_bytes: int,
        *,
        low_watermark: float = 0.9,
        temp_grace_s: float = 600.0,
        max_candidates: int = 65_536,
        publisher: EventPublisher | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if max_bytes <= 0:
            raise ValueError("max_bytes must be > 0")
        if not 0.0 < low_watermark <= 1.0:
            raise ValueError("low_watermark must be in (0, 1]")
        if max_candidates < 1:
            raise ValueError("max_candidates must be >= 1")
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        self.target_bytes = int(max_bytes * low_watermark)
        self.temp_grace_s = temp_grace_s
        self.max_candidates = max_candidates
        self.publisher = publisher
        self._clock = clock

    # --- scanning ---------------------------------------------------------------------------------

    def _rank_dirs(self) -> Iterator[Path]:
        try:
            layouts = list(os.scandir(self.directory))
        except FileNotFoundError:
            return
        for layout in layouts:
            if layout.name.startswith(".") or not layout.is_dir(follow_symlinks=False):
                continue
            try:
                ranks = list(os.scandir(layout.path))
            except (FileNotFoundError, NotADirectoryError):
                continue
            for rank in ranks:
                if _RANK_DIR.fullmatch(rank.name) and rank.is_dir(follow_symlinks=False):
                    yield Path(rank.path)

    def _scan(self, report: GcPass, now: float) -> list[tuple[float, str, str]]:
        """Sum the bytes; remove stale temp files; return the ``max_candidates`` least
        recently used chunk files as (-mtime, layout dir, key hex), a max-heap by age."""
        heap: list[tuple[float, str, str]] = []
        for rank_dir in self._rank_dirs():
            try:
                entries = list(os.scandir(rank_dir))
            except FileNotFoundError:
                report.vanished += 1
                continue
            for entry in entries:
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    report.vanished += 1
                    continue
                if not entry.is_file(follow_symlinks=False):
                    continue
                if TMP_MARK in entry.name:
                    if now - st.st_mtime > self.temp_grace_s:
                        if self._unlink(Path(entry.path), report):
                            report.stale_temp_removed += 1
                            continue
                    else:
                        report.young_temp_files += 1
                    report.bytes_before += st.st_size
                    continue
                report.bytes_before += st.st_size
                if not entry.name.endswith(SUFFIX):
                    report.unknown_files += 1
                    continue
                report.chunk_files += 1
                item = (-st.st_mtime, str(rank_dir.parent), entry.name[: -len(SUFFIX)])
                if len(heap) < self.max_candidates:
                    heapq.heappush(heap, item)
                elif item > heap[0]:  # older than the newest candidate kept
                    heapq.heapreplace(heap, item)
        return heap

    def _chunk_files(self, layout: str, key: str) -> dict[Path, _File]:
        """Every rank's file of one chunk that exists now."""
        out: dict[Path, _File] = {}
        try:
            ranks = [e.path for e in os.scandir(layout) if _RANK_DIR.fullmatch(e.name)]
        except FileNotFoundError:
            return out
        for rank in ranks:
            path = Path(rank) / (key + SUFFIX)
            try:
                st = path.stat()
            except (FileNotFoundError, NotADirectoryError):
                continue
            out[path] = _File(st.st_size, st.st_mtime)
        return out

    # --- removing ---------------------------------------------------------------------------------

    def _unlink(self, path: Path, report: GcPass) -> bool:
        try:
            os.unlink(path)
            return True
        except FileNotFoundError:
            report.vanished += 1
        except OSError as exc:
            report.errors += 1
            log.warning("storage gc: cannot remove %s: %s", path, exc)
        return False

    @staticmethod
    def _hashes_of(files: dict[Path, _File]) -> list[int] | None:
        """The chunk's block hashes from the first rank file whose header reads."""
        for path, f in files.items():
            try:
                with open(path, "rb") as fh:
                    header, _ = read_header(fh, f.size)
                return chunk_hashes(header)
            except (OSError, ChunkFileError, KeyError, ValueError, TypeError):
                continue
        return None

    def _oldest_chunks(
        self, heap: list[tuple[float, str, str]], report: GcPass
    ) -> list[dict[Path, _File]]:
        """The candidates' chunks, every rank file of each, least recently used first (a
        chunk is as recent as its newest rank file: a load touches every rank's)."""
        chunks: dict[tuple[str, str], dict[Path, _File]] = {}
        for _, layout, key in heap:
            if (layout, key) not in chunks:
                chunks[(layout, key)] = self._chunk_files(layout, key)
        present = [files for files in chunks.values() if files]
        report.vanished += len(chunks) - len(present)
        present.sort(key=lambda files: max(f.mtime for f in files.values()))
        return present

    def announce(self) -> int:
        """Publish ``BlockStored(STORAGE)`` for every complete chunk in the directory, parents
        first (by chunk index). A router clears the domain when this evictor's stream starts
        again (a new process), and replicas never announce files they did not write: this
        is how the domain is known again. Holds one (index, path) per chunk while sorting;
        returns the chunks announced."""
        found: list[tuple[int, str]] = []
        for layout in {d.parent for d in self._rank_dirs()}:
            try:
                ranks = sorted(d for d in layout.iterdir() if _RANK_DIR.fullmatch(d.name))
            except FileNotFoundError:
                continue
            if not ranks:
                continue
            try:
                entries = list(os.scandir(ranks[0]))
            except FileNotFoundError:
                continue
            for entry in entries:
                if not entry.name.endswith(SUFFIX) or TMP_MARK in entry.name:
                    continue
                if not all((r / entry.name).exists() for r in ranks[1:]):
                    continue  # not servable until every rank's file is there
                header = self._header(Path(entry.path))
                if header is not None and isinstance(header.get("index"), int):
                    found.append((header["index"], entry.path))
        found.sort()
        events: list[Event] = []
        announced = 0
        for _, path in found:
            header = self._header(Path(path))
            if header is None:
                continue
            try:
                events.append(stored_event(header))
            except (ChunkFileError, KeyError, ValueError, TypeError):
                continue
            if len(events) >= _EVENTS_PER_BATCH:
                announced += self._publish(events)
                events = []
        return announced + self._publish(events)

    @staticmethod
    def _header(path: Path) -> dict | None:
        try:
            with open(path, "rb") as fh:
                header, _ = read_header(fh, os.fstat(fh.fileno()).st_size)
            return header
        except (OSError, ChunkFileError):
            return None

    def run_pass(self) -> GcPass:
        """One scan, and the removals the budget asks for; publishes what went."""
        start = time.monotonic()
        report = GcPass()
        heap = self._scan(report, self._clock())
        total = report.bytes_before
        if total > self.max_bytes:
            removals: list[tuple[BlockRemoved, list[Path]]] = []
            for files in self._oldest_chunks(heap, report):
                if total <= self.target_bytes:
                    break
                hashes = self._hashes_of(files)
                removed = 0
                for path, f in files.items():
                    if self._unlink(path, report):
                        removed += 1
                        total -= f.size
                        report.removed_bytes += f.size
                report.removed_files += removed
                if not removed:
                    continue
                if hashes is None:
                    report.invalid_removed += 1
                    log.warning("storage gc: removed %s: header unreadable", next(iter(files)))
                    continue
                report.removed_chunks += 1
                removals.append((BlockRemoved(hashes, Medium.STORAGE), list(files)))
                if len(removals) >= _EVENTS_PER_BATCH:
                    self._publish_removals(removals, report)
                    removals = []
            self._publish_removals(removals, report)
        report.bytes_after = total
        report.duration_s = round(time.monotonic() - start, 4)
        if report.unknown_files:
            log.info("storage gc: %d files that are not chunks left alone", report.unknown_files)
        return report

    def _publish_removals(
        self, removals: list[tuple[BlockRemoved, list[Path]]], report: GcPass
    ) -> None:
        """Publish the removals of chunks still gone. A chunk whose every removed file exists
        again was written again since (the same key is the same content): its writer may
        have announced the store already, and a removal reaching a router after that store
        (the writer's stream and ours are not ordered with each other) would take a chunk
        the domain holds out of its index. Not announcing it leaves the index right."""
        events: list[Event] = []
        for event, paths in removals:
            if all(path.exists() for path in paths):
                report.rewritten += 1
                continue
            events.append(event)
        report.events_published += self._publish(events)

    def _publish(self, events: list[Event]) -> int:
        if not events or self.publisher is None:
            return 0
        self.publisher.publish(events)
        return len(events)

    def run(self, stop: threading.Event, interval_s: float) -> None:
        """Pass after pass until ``stop`` is set (SIGTERM, in the CLI)."""
        while not stop.is_set():
            try:
                report = self.run_pass()
            except OSError as exc:  # the directory itself unreadable: try again later
                log.warning("storage gc: pass failed: %s", exc)
            else:
                if report.removed_files or report.stale_temp_removed or report.errors:
                    log.info("storage gc: %s", report.as_dict())
            stop.wait(interval_s)
