"""The body of ``GET /index/snapshot``: a router's index, replica by replica, for a peer's
warm start (router/peers/warm_start.py).

A stream of frames, each a 4-byte big-endian length and a msgpack record: one ``Header``
(format name and version), one ``ReplicaRecord`` per live replica (its identity, the seq and
payload digest of the last batch its feed applied, and its index state,
kvroute.indexer.snapshot), then one ``End`` with the count. Records are produced one replica
at a time, so the router never holds more than one replica's copy; a body that stops before
``End`` (the producer died, or went over its size bound) is refused whole by the reader.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterable

import msgspec

from kvroute.indexer.snapshot import ReplicaState, SnapshotError, validate
from kvroute.indexer.subscriber import EventSource, ReplicaSnapshot

__all__ = [
    "FORMAT",
    "MEDIA_TYPE",
    "VERSION",
    "End",
    "Header",
    "ReplicaRecord",
    "SnapshotReader",
    "decode_snapshot",
    "encode_stream",
]

FORMAT = "kvroute-index-snapshot"
VERSION = 1
MEDIA_TYPE = "application/vnd.kvroute.index-snapshot"
_LEN = 4


class Header(msgspec.Struct, tag="header", frozen=True):
    format: str
    version: int
    taken_at: float


class ReplicaRecord(msgspec.Struct, tag="replica", frozen=True):
    """One replica: who it is (as the exporting router knows it), where its feed stood."""

    name: str
    events: str
    replay: str
    topic: str
    last_seq: int
    digest: int
    state: ReplicaState

    def snapshot(self) -> ReplicaSnapshot:
        source = EventSource(self.name, self.events, self.replay, self.topic)
        return ReplicaSnapshot(source, self.last_seq, self.digest, self.state)


class End(msgspec.Struct, tag="end", frozen=True):
    replicas: int


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Header | ReplicaRecord | End)


def _frame(record: Header | ReplicaRecord | End) -> bytes:
    body = _encoder.encode(record)
    return len(body).to_bytes(_LEN, "big") + body


def _record(snap: ReplicaSnapshot) -> bytes:
    s = snap.source
    assert s.replay_endpoint is not None  # export_replica only exports replayable streams
    return _frame(
        ReplicaRecord(s.replica, s.endpoint, s.replay_endpoint, s.topic, snap.last_seq,
                      snap.digest, snap.state)
    )  # fmt: skip


async def encode_stream(
    replicas: Iterable[str],
    export: Callable[[str], ReplicaSnapshot | None],
    max_bytes: int,
) -> AsyncIterator[bytes]:
    """The snapshot body: ``export`` runs off the event loop (it holds a feed's lock and
    copies the replica's state). Past ``max_bytes`` the body stops without ``End``."""
    yield _frame(Header(FORMAT, VERSION, time.time()))
    sent = count = 0
    for name in replicas:
        frame = await asyncio.to_thread(_export_frame, export, name)
        if frame is None:
            continue
        sent += len(frame)
        if sent > max_bytes:
            return
        count += 1
        yield frame
    yield _frame(End(count))


def _export_frame(export: Callable[[str], ReplicaSnapshot | None], name: str) -> bytes | None:
    snap = export(name)
    return None if snap is None else _record(snap)


class SnapshotReader:
    """A snapshot body read as it arrives (``feed`` each chunk, then ``finish``): each frame
    is decoded and checked once whole, and only the frame in progress is held as bytes, so
    a large snapshot is never buffered whole (nor copied to join it). SnapshotError says
    what is wrong, as soon as it is seen; ``max_bytes`` bounds the body."""

    def __init__(self, max_bytes: int | None = None) -> None:
        self.max_bytes = max_bytes
        self.received = 0
        self.records: list[ReplicaRecord] = []
        self._names: set[str] = set()
        self._header: Header | None = None
        self._end: End | None = None
        self._pending = bytearray()

    def feed(self, chunk: bytes) -> None:
        self.received += len(chunk)
        if self.max_bytes is not None and self.received > self.max_bytes:
            raise SnapshotError(f"snapshot over {self.max_bytes} bytes")
        self._pending += chunk
        pos = 0
        pending = self._pending
        while len(pending) - pos >= _LEN:
            size = int.from_bytes(pending[pos : pos + _LEN], "big")
            start = pos + _LEN
            if len(pending) - start < size:
                break
            self._record(bytes(pending[start : start + size]))
            pos = start + size
        del pending[:pos]

    def _record(self, frame: bytes) -> None:
        if self._end is not None:
            raise SnapshotError("data after the snapshot's end")
        try:
            record = _decoder.decode(frame)
        except msgspec.DecodeError as exc:
            raise SnapshotError(f"not a snapshot record: {exc}") from exc
        if self._header is None:
            if not isinstance(record, Header):
                raise SnapshotError("snapshot does not start with its header")
            if record.format != FORMAT or record.version != VERSION:
                raise SnapshotError(
                    f"snapshot is {record.format!r} version {record.version}; this router "
                    f"reads {FORMAT!r} version {VERSION}"
                )
            self._header = record
        elif isinstance(record, ReplicaRecord):
            if record.last_seq < 0 or not 0 <= record.digest < 1 << 64:
                raise SnapshotError(f"replica {record.name!r}: position out of range")
            if record.name in self._names:
                raise SnapshotError("a replica appears twice in the snapshot")
            validate(record.state)
            self._names.add(record.name)
            self.records.append(record)
        elif isinstance(record, End):
            self._end = record
        else:
            raise SnapshotError("a second header in the snapshot")

    def finish(self) -> list[ReplicaRecord]:
        """Every replica of the whole body; SnapshotError when it is not whole."""
        if self._header is None and not self._pending:
            raise SnapshotError("empty snapshot")
        if self._pending:
            raise SnapshotError("snapshot cut short (a record runs past the body)")
        if self._end is None:
            raise SnapshotError("snapshot cut short (no end record)")
        if self._end.replicas != len(self.records):
            raise SnapshotError(
                f"snapshot ends claiming {self._end.replicas} replicas, holds {len(self.records)}"
            )
        return self.records


def decode_snapshot(body: bytes) -> list[ReplicaRecord]:
    """Every replica of a whole snapshot body; SnapshotError says what is wrong with one
    that is not (garbage, another format or version, cut short, a count that disagrees)."""
    reader = SnapshotReader()
    reader.feed(body)
    return reader.finish()
