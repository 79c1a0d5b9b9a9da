"""The storage domain evictor against a real directory of real chunk files (written with
disk_format's writer, two TP ranks per chunk), publishing on real ZMQ sockets to our own
EventSubscriber feeding an InMemoryPrefixIndex, as a router subscribed to the domain does.

The replica that wrote the chunks is not run: its stores (device, then STORAGE per chunk,
as kvroute's connector announces them) are applied to the index directly, since what is
tested is the evictor's stream.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import zmq

from kvroute.connector.disk_format import header_for_chunk, write_chunk_file
from kvroute.connector.identity import all_ranks, rank_identity
from kvroute.connector.keys import ChunkExtras, ChunkInfo, chunk_info
from kvroute.connector.storage_gc import StorageEvictor
from kvroute.indexer.index import InMemoryPrefixIndex, domain_key
from kvroute.indexer.publisher import EventPublisher
from kvroute.indexer.subscriber import EventSource, EventSubscriber, Freshness
from kvroute.indexer.wire import BlockStored, Medium
from tests.connector.helpers import BLOCK, BPC, IDENTITY, block_hashes
from tests.waiting import wait_until

RANKS = all_ranks(2, 1)
PAYLOAD = 4096
DOMAIN = domain_key("d")


def _int(h: bytes) -> int:
    return int.from_bytes(h[-8:], "big")


def doc(i: int, chunks: int = 1) -> list[int]:
    return [100_000 + 1000 * i + t for t in range(chunks * BPC * BLOCK)]  # one file size


class Domain:
    """A domain directory with one layout of two ranks, and an index that knows it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.layout = root / "layout0"
        self.index = InMemoryPrefixIndex()
        self.index.attach("a", "d")
        self.index.attach("b", "d")
        self.clock = 1_000_000.0

    def rank_dir(self, rank: int) -> Path:
        d = self.layout / RANKS[rank].dir_name
        d.mkdir(parents=True, exist_ok=True)
        return d

    def write(
        self,
        tokens: list[int],
        *,
        age_s: float,
        ranks: tuple[int, ...] = (0, 1),
        lora: str | None = None,
    ) -> None:
        """Replica a computes ``tokens`` (for LoRA ``lora``), writes every chunk (all ranks)
        and announces it as kvroute's connector does."""
        hashes = block_hashes(tokens)
        n = len(hashes)
        ints = [_int(h) for h in hashes]
        extra = [None if lora is None else (lora,)] * n
        events = [
            BlockStored(
                ints, None, tokens, BLOCK, Medium.GPU, lora_name=lora, extra_keys=list(extra)
            )
        ]
        mtime = time.time() - age_s
        extras = ChunkExtras(
            None if lora is None else 1, lora, None if lora is None else tuple(extra[:BPC])
        )
        for k in range(n // BPC):
            info = chunk_info(hashes, tokens, BLOCK, BPC, k, extras)
            for r in ranks:
                self._file(info, r, mtime)
            events.append(
                BlockStored(
                    [_int(h) for h in info.block_hashes],
                    None if info.parent_hash is None else _int(info.parent_hash),
                    list(info.token_ids),
                    BLOCK,
                    Medium.STORAGE,
                    lora_name=lora,
                    extra_keys=list(extra[:BPC]),
                )
            )
        assert not self.index.apply("a", events).rejected

    def _file(self, info: ChunkInfo, rank: int, mtime: float) -> Path:
        identity = rank_identity(IDENTITY, RANKS[rank])
        header = header_for_chunk(info, identity=identity, payload_bytes=PAYLOAD)
        d = self.rank_dir(rank)
        write_chunk_file(d, info.key, header, torch.zeros(PAYLOAD, dtype=torch.uint8))
        path = d / (info.key.hex() + ".kvc")
        os.utime(path, (mtime, mtime))
        return path

    def files(self) -> list[Path]:
        return sorted(p for p in self.layout.rglob("*") if p.is_file())

    def bytes(self) -> int:
        return sum(p.stat().st_size for p in self.files())

    def cached(self, tokens: list[int], replica: str = "b", lora: str | None = None) -> int:
        found = self.index.lookup(tokens, lora_name=lora, replicas=[replica])
        return found[replica].blocks


def chunk_bytes(domain: Domain) -> int:
    """The size of one chunk over its two ranks."""
    probe = Domain(domain.root.parent / "probe")
    probe.write(doc(99), age_s=0)
    return probe.bytes()


@pytest.fixture
def domain(tmp_path: Path) -> Domain:
    return Domain(tmp_path / "d")


@pytest.fixture
def publisher() -> Iterator[EventPublisher]:
    pub = EventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0", bind=True)
    yield pub
    pub.close()


@pytest.fixture
def subscriber(domain: Domain) -> Iterator[EventSubscriber]:
    sub = EventSubscriber(domain.index, replay_timeout_s=2.0)
    yield sub
    sub.close()


def subscribe(sub: EventSubscriber, pub: EventPublisher) -> None:
    sub.add_source(EventSource(DOMAIN, pub.endpoint, pub.replay_endpoint))
    wait_until(lambda: sub.freshness(DOMAIN)[0] is Freshness.LIVE)


def test_over_budget_the_least_recently_used_chunks_go_and_the_router_hears_it(
    domain: Domain, publisher: EventPublisher, subscriber: EventSubscriber
) -> None:
    size = chunk_bytes(domain)
    for i in range(4):
        domain.write(doc(i), age_s=100 - 10 * i)  # doc 0 is the least recently used
    subscribe(subscriber, publisher)
    assert [domain.cached(doc(i)) for i in range(4)] == [BPC] * 4
    evictor = StorageEvictor(domain.root, int(2.5 * size), low_watermark=1.0, publisher=publisher)
    report = evictor.run_pass()
    assert (report.bytes_before, report.removed_chunks, report.removed_files) == (4 * size, 2, 4)
    assert report.bytes_after == domain.bytes() == 2 * size
    assert report.events_published == 2
    wait_until(lambda: [domain.cached(doc(i)) for i in range(4)] == [0, 0, BPC, BPC])
    # under budget now: the next pass removes nothing and publishes nothing
    assert evictor.run_pass().removed_chunks == 0
    assert subscriber.feed_stats()[DOMAIN].batches == 1


def test_a_router_joining_late_replays_the_removals(
    domain: Domain, publisher: EventPublisher, subscriber: EventSubscriber
) -> None:
    size = chunk_bytes(domain)
    domain.write(doc(0, chunks=2), age_s=50)  # two chunks of one document
    domain.write(doc(1), age_s=10)
    StorageEvictor(domain.root, size, low_watermark=1.0, publisher=publisher).run_pass()
    subscribe(subscriber, publisher)  # after the pass: only the replay has the removal
    wait_until(lambda: domain.cached(doc(0, chunks=2)) == 0)
    assert domain.cached(doc(1)) == BPC
    assert subscriber.feed_stats()[DOMAIN].replays == 1


def test_a_chunk_written_again_before_its_removal_is_published_stays_in_the_index(
    domain: Domain, publisher: EventPublisher, subscriber: EventSubscriber
) -> None:
    """A replica misses a chunk right after the evictor deleted it, computes it again and
    writes and announces it before the evictor's pass publishes: the removal, published
    after that store, would take a chunk the domain holds out of the router's index."""
    size = chunk_bytes(domain)
    for i in range(3):
        domain.write(doc(i), age_s=100 - 10 * i)
    subscribe(subscriber, publisher)

    class Rewritten(StorageEvictor):
        def _publish_removals(self, removals, report):  # type: ignore[no-untyped-def]
            domain.write(doc(0), age_s=0)  # its store reaches the index first
            super()._publish_removals(removals, report)

    evictor = Rewritten(domain.root, int(1.5 * size), low_watermark=1.0, publisher=publisher)
    report = evictor.run_pass()
    assert (report.removed_chunks, report.rewritten, report.events_published) == (2, 1, 1)
    wait_until(lambda: domain.cached(doc(1)) == 0)
    assert domain.cached(doc(0)) == BPC and domain.cached(doc(2)) == BPC
    assert len(domain.files()) == 4  # doc 0 (written again) and doc 2, two ranks each


def test_the_budget_holds_and_only_the_oldest_go(domain: Domain) -> None:
    for i in range(30):
        domain.write(doc(i), age_s=1000 - i)
    before = {p.name: p.stat().st_mtime for p in domain.files()}
    budget = domain.bytes() // 3
    report = StorageEvictor(domain.root, budget, low_watermark=0.8).run_pass()
    after = {p.name: p.stat().st_mtime for p in domain.files()}
    assert domain.bytes() == report.bytes_after <= 0.8 * budget
    gone = set(before) - set(after)
    assert gone and max(before[n] for n in gone) <= min(after.values())
    # every chunk keeps both rank files or neither
    for rank_file in after:
        assert sum(1 for p in domain.files() if p.name == rank_file) == 2


def test_a_pass_keeps_bounded_candidates_and_the_next_passes_finish(domain: Domain) -> None:
    size = chunk_bytes(domain)
    for i in range(12):
        domain.write(doc(i), age_s=100 - i)
    evictor = StorageEvictor(domain.root, 2 * size, low_watermark=1.0, max_candidates=4)
    first = evictor.run_pass()
    assert first.removed_chunks == 2  # 4 rank files: 2 chunks
    passes = 1
    while evictor.run_pass().removed_chunks:
        passes += 1
        assert passes < 10
    assert domain.bytes() <= 2 * size


def test_temp_foreign_and_incomplete_files(domain: Domain, publisher: EventPublisher) -> None:
    size = chunk_bytes(domain)
    domain.write(doc(0), age_s=500, ranks=(0,))  # one rank only: removed alone, no orphan
    domain.write(doc(1), age_s=10)
    rank0 = domain.rank_dir(0)
    young_tmp = rank0 / ".abc.kvc.tmp-1-young"
    young_tmp.write_bytes(b"x" * 100)
    stale_tmp = rank0 / ".abc.kvc.tmp-1-stale"
    stale_tmp.write_bytes(b"x" * 100)
    os.utime(stale_tmp, (time.time() - 3600, time.time() - 3600))
    notes = rank0 / "notes.txt"
    notes.write_text("not a chunk")
    bad = rank0 / ("ab" * 32 + ".kvc")
    bad.write_bytes(b"KVRCHUNK" + b"\0" * 64)
    os.utime(bad, (time.time() - 900, time.time() - 900))
    (domain.layout / ".writers").mkdir()
    (domain.layout / ".writers" / "replica-a").write_text("")
    # room for doc 1 and the small files: the bad file and doc 0 (the oldest) go
    evictor = StorageEvictor(domain.root, size + 1000, low_watermark=1.0, publisher=publisher)
    report = evictor.run_pass()
    assert report.stale_temp_removed == 1 and not stale_tmp.exists()
    assert report.young_temp_files == 1 and young_tmp.exists()
    assert report.unknown_files == 1 and notes.exists()
    assert report.invalid_removed == 1 and not bad.exists()
    assert report.removed_chunks == 1  # doc 0's lone rank file, announced
    assert report.events_published == 1
    assert (domain.layout / ".writers" / "replica-a").exists()
    assert report.bytes_after == domain.bytes()


def test_files_vanishing_under_the_evictor_are_skipped(domain: Domain) -> None:
    """Another evictor (or a replica deleting a bad file) removes files between this one's
    scan and its removals: simulated by deleting them at that point."""
    size = chunk_bytes(domain)
    for i in range(6):
        domain.write(doc(i), age_s=100 - i)

    class Raced(StorageEvictor):
        def _oldest_chunks(self, heap, report):  # type: ignore[no-untyped-def]
            chunks = super()._oldest_chunks(heap, report)
            for path in [*chunks[0], next(iter(chunks[1]))]:
                path.unlink()  # chunk 0 wholly, chunk 1 half
            return chunks

    report = Raced(domain.root, 3 * size, low_watermark=1.0).run_pass()
    assert report.vanished >= 3 and report.errors == 0
    assert domain.bytes() <= 3 * size


def test_two_evictors_racing_on_one_directory(domain: Domain) -> None:
    size = chunk_bytes(domain)
    for i in range(40):
        domain.write(doc(i), age_s=1000 - i)
    evictors = [StorageEvictor(domain.root, 10 * size, low_watermark=0.5) for _ in range(2)]
    errors: list[BaseException] = []

    def run(e: StorageEvictor) -> None:
        try:
            for _ in range(3):
                e.run_pass()
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(e,)) for e in evictors]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors
    assert domain.bytes() <= 10 * size


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvroute.deploy.cli", "storage", "gc", *args]


def test_the_cli_as_a_sidecar_publishes_removals_and_stops_on_sigterm(
    domain: Domain, subscriber: EventSubscriber
) -> None:
    size = chunk_bytes(domain)
    for i in range(3):
        domain.write(doc(i), age_s=100 - i)
    events, replay = _free_port(), _free_port()
    max_gib = (2 * size + 100) / 2**30  # + slack: GiB round trip
    proc = subprocess.Popen(
        _cli(
            "--dir",
            str(domain.root),
            "--max-gib",
            repr(max_gib),
            "--low-watermark",
            "1.0",
            "--interval-s",
            "0.2",
            "--events",
            f"tcp://127.0.0.1:{events}",
            "--replay",
            f"tcp://127.0.0.1:{replay}",
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        subscriber.add_source(
            EventSource(DOMAIN, f"tcp://127.0.0.1:{events}", f"tcp://127.0.0.1:{replay}")
        )
        wait_until(lambda: domain.cached(doc(0)) == 0, timeout_s=20)
        assert domain.cached(doc(2)) == BPC
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=5)
    assert domain.bytes() <= 2 * size


def test_the_cli_once_prints_its_pass(domain: Domain) -> None:
    size = chunk_bytes(domain)
    for i in range(3):
        domain.write(doc(i), age_s=100 - i)
    out = subprocess.run(
        _cli(
            "--dir",
            str(domain.root),
            "--max-gib",
            repr((size + 100) / 2**30),  # + slack: GiB round trip
            "--low-watermark",
            "1.0",
            "--once",
            "--once-linger-s",
            "0",
            "--events",
            f"tcp://127.0.0.1:{_free_port()}",
            "--replay",
            f"tcp://127.0.0.1:{_free_port()}",
        ),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["removed_chunks"] == 2 and report["bytes_after"] <= size
    bad = subprocess.run(
        _cli("--dir", str(domain.root), "--max-gib", "0", "--once"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "--max-gib" in bad.stderr


def _endpoints() -> tuple[str, str]:
    return f"tcp://127.0.0.1:{_free_port()}", f"tcp://127.0.0.1:{_free_port()}"


def _bind_again(events: str, replay: str) -> EventPublisher:
    """A new evictor process on the old one's ports (ZMQ releases a closed socket's port
    asynchronously: retry for a while, as a restarted sidecar would)."""
    deadline = time.monotonic() + 10
    while True:
        try:
            return EventPublisher(events, replay_endpoint=replay, bind=True)
        except zmq.ZMQError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def test_a_restarted_evictor_announces_the_domain_so_routers_know_it_again(
    domain: Domain, subscriber: EventSubscriber
) -> None:
    """Its new stream makes the router clear the domain (seq restart); the announcement of
    the chunks present (LoRA extra keys included) rebuilds exactly what it held."""
    size = chunk_bytes(domain)
    for i in range(3):
        domain.write(doc(i), age_s=100 - i)
    lora_doc = [200_000 + t for t in range(2 * BPC * BLOCK)]
    domain.write(lora_doc, age_s=1, lora="sql")
    events, replay = _endpoints()
    first = EventPublisher(events, replay_endpoint=replay, bind=True)
    try:
        subscribe(subscriber, first)
        budget = 4 * size + 1000  # the LoRA chunks' headers are a little longer
        StorageEvictor(domain.root, budget, low_watermark=1.0, publisher=first).run_pass()
        wait_until(lambda: domain.cached(doc(0)) == 0)
    finally:
        first.close()
    held = [domain.cached(doc(i)) for i in range(3)] + [domain.cached(lora_doc, lora="sql")]
    assert held == [0, BPC, BPC, 2 * BPC]
    assert domain.cached(lora_doc) == 0  # a LoRA's chunks are not the base model's
    second = _bind_again(events, replay)
    try:
        announced = StorageEvictor(domain.root, 4 * size, publisher=second).announce()
        assert announced == 4
        second.publish([])  # seq 1: the subscriber sees the restart, clears, replays from 0
        wait_until(lambda: subscriber.feed_stats()[DOMAIN].resets >= 1)
        wait_until(
            lambda: (
                [domain.cached(doc(i)) for i in range(3)] + [domain.cached(lora_doc, lora="sql")]
                == held
            )
        )
        assert domain.cached(lora_doc) == 0
    finally:
        second.close()
