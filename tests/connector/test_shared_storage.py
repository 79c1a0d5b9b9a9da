"""Shared storage domain: several replicas (planner + worker executor each, plain torch
CPU tensors, real files in one directory) find each other's chunks live, while files
vanish, go bad, race or fill the disk. No vLLM: the real-vLLM check is
``test_vllm_shared_storage.py``."""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import pytest
import torch

from kvroute.connector.config import ConnectorConfig
from kvroute.connector.disk_format import (
    ChunkFileError,
    file_name,
    read_chunk_file,
    write_chunk_file,
)
from kvroute.connector.disk_tier import DiskWriter, unlink_chunk_all_ranks
from kvroute.connector.identity import RankInfo, rank_identity
from kvroute.connector.planner import Planner
from kvroute.connector.shared_store import LONELY_WARN_S, SharedStore
from kvroute.connector.worker import WorkerExecutor
from kvroute.indexer.tiers import Tier
from tests.connector.helpers import (
    BPC,
    CHUNK,
    IDENTITY,
    block_data,
    block_hashes,
    make_executor,
    make_paged,
    make_planner,
    step,
)

RANK_ID = rank_identity(IDENTITY, RankInfo())


class Replica:
    """One replica attached to the domain directory ``d``."""

    def __init__(self, d: Path, *, seed: int = 1, disk_capacity: int = 1 << 20, **ex_kw) -> None:
        self.paged = make_paged()
        g = torch.Generator().manual_seed(seed)
        for t in self.paged.layers:
            t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
        nbytes = self.paged.num_layers * BPC * self.paged.block_bytes()
        self.shared = SharedStore(d, IDENTITY, [RankInfo()], domain="unit")
        self.p: Planner = make_planner(
            num_slots=8,
            disk_enabled=True,
            disk_capacity_bytes=disk_capacity,
            payload_bytes=nbytes,
            unlink=lambda k: unlink_chunk_all_ranks(d, [RankInfo()], k),
            shared=self.shared,
        )
        self.ex: WorkerExecutor = make_executor(self.paged, num_slots=8, disk_dir=d, **ex_kw)

    def store(self, req: str, tokens: list[int], hashes: list[bytes], blocks: list[int]) -> None:
        self.p.on_scheduled(req, blocks, hashes, tokens, len(tokens))
        step(self.p, self.ex)
        step(self.p, self.ex)  # disk write reports

    def load(self, req: str, tokens: list[int], hashes: list[bytes], dst: list[int]):
        res = self.p.lookup(req, hashes, tokens, len(tokens), 0)
        if res.num_tokens:
            self.p.on_alloc(req, dst, res.num_tokens)
            step(self.p, self.ex)
        return res

    def close(self) -> None:
        self.ex.close()
        self.shared.close()


def _prompt(seed: int, n_chunks: int) -> tuple[list[int], list[bytes]]:
    tokens = [seed * 7919 + i for i in range(n_chunks * CHUNK + 1)]
    return tokens, block_hashes(tokens)


def _path(d: Path, key: bytes) -> Path:
    return d / RankInfo().dir_name / file_name(key)


def _kinds(events) -> list[tuple[str, Tier]]:
    return sorted((e.kind, e.tier) for e in events)


def test_a_chunk_written_by_one_replica_is_served_live_by_another(tmp_path: Path) -> None:
    a, b = Replica(tmp_path, seed=1), Replica(tmp_path, seed=2)
    tokens, hashes = _prompt(1, 2)
    want = block_data(a.paged, list(range(2 * BPC)))
    assert b.p.lookup("x", hashes, tokens, len(tokens), 0).num_tokens == 0  # nothing yet
    a.store("a", tokens, hashes, list(range(2 * BPC)))
    # The writer announces its files; the reader announces nothing for them.
    assert _kinds(a.p.take_events()) == [("stored", Tier.CPU)] * 2 + [("stored", Tier.STORAGE)] * 2
    path = _path(tmp_path, hashes[BPC - 1])
    os.utime(path, (1_000_000, 1_000_000))  # old, so the reader's recency bump shows
    dst = list(range(30, 30 + 2 * BPC + 1))
    res = b.load("b", tokens, hashes, dst)
    assert res.num_tokens == 2 * CHUNK and res.is_async  # no restart, no scan
    assert b.ex.take_finished_loads() == {"b"} and b.ex.take_load_errors() == set()
    for w, g in zip(want, block_data(b.paged, dst[: 2 * BPC]), strict=True):
        assert torch.equal(w, g)
    assert path.stat().st_mtime > 1_000_000 + 3600  # the load bumped the file's mtime
    assert b.p.stats.shared_foreign_hits == 2
    # B promotes the chunks to its RAM (announced, CPU) but never re-writes the files
    # nor announces them on STORAGE.
    b.p.on_scheduled("b", dst, hashes, tokens, len(tokens))
    step(b.p, b.ex)
    step(b.p, b.ex)
    assert _kinds(b.p.take_events()) == [("stored", Tier.CPU)] * 2
    assert b.p.stats.shared_writes_skipped_present == 2
    a.close()
    b.close()


def test_a_file_deleted_between_lookup_and_load_is_a_recompute(tmp_path: Path) -> None:
    a, b = Replica(tmp_path), Replica(tmp_path)
    tokens, hashes = _prompt(2, 1)
    a.store("a", tokens, hashes, list(range(BPC)))
    a.p.take_events()
    res = b.p.lookup("b", hashes, tokens, len(tokens), 0)
    assert res.is_async
    _path(tmp_path, hashes[BPC - 1]).unlink()  # the evictor trims the domain
    dst = list(range(40, 40 + BPC + 1))
    b.p.on_alloc("b", dst, res.num_tokens)
    step(b.p, b.ex)
    assert b.ex.take_finished_loads() == {"b"}  # released: vLLM recomputes
    assert b.ex.take_load_errors() == set(dst[:BPC])
    assert b.p.take_events() == []  # not B's file, not B's deletion: no event
    assert b.p.lookup("c", hashes, tokens, len(tokens), 0).num_tokens == 0
    # The writer forgets its own entry silently (the evictor announced the removal).
    a.p.reset_cpu()
    a.p.take_events()
    assert a.p.lookup("d", hashes, tokens, len(tokens), 0).num_tokens == 0
    assert a.p.take_events() == [] and a.p.stats.shared_files_gone == 1
    assert len(a.p.disk) == 0
    a.close()
    b.close()


def test_replicas_keep_writing_and_serving_while_an_evictor_trims_the_domain(
    tmp_path: Path,
) -> None:
    """A thread plays the evictor (removes the oldest chunk files, bounded count) while
    A writes prompts and B loads them: every load is exact or a recompute, never wrong
    KV, and both go on writing and serving."""
    a, b = Replica(tmp_path, seed=1), Replica(tmp_path, seed=2)
    rank_dir = tmp_path / RankInfo().dir_name
    stop = threading.Event()
    removed: list[str] = []

    def evictor() -> None:
        while not stop.is_set() and len(removed) < 40:
            files = sorted(rank_dir.glob("*.kvc"), key=lambda q: q.stat().st_mtime)
            if len(files) > 3:
                try:
                    files[0].unlink()
                    removed.append(files[0].name)
                except FileNotFoundError:
                    pass
            stop.wait(0.002)

    th = threading.Thread(target=evictor)
    th.start()
    exact = recomputed = 0
    try:
        for i in range(12):
            tokens, hashes = _prompt(100 + i, 2)
            src = list(range(2 * BPC))
            a.store(f"a{i}", tokens, hashes, src)
            want = block_data(a.paged, src)
            dst = list(range(30, 30 + 2 * BPC + 1))
            res = b.load(f"b{i}", tokens, hashes, dst)
            b.p.request_finished(f"b{i}")
            errors = b.ex.take_load_errors()
            b.ex.take_finished_loads()
            got = block_data(b.paged, dst[: 2 * BPC])
            for c in range(res.num_tokens // CHUNK):
                blocks = set(dst[c * BPC : (c + 1) * BPC])
                if blocks & errors:
                    recomputed += 1
                    continue
                for w, g in zip(want, got, strict=True):
                    assert torch.equal(w[c * BPC : (c + 1) * BPC], g[c * BPC : (c + 1) * BPC])
                exact += 1
    finally:
        stop.set()
        th.join(10)
    assert removed and exact > 0  # the evictor ran and the domain kept serving
    assert a.p.stats.stores == 24 and a.p.stats.disk_write_failures == 0
    assert all(e.kind == "stored" for e in b.p.take_events())  # B never announces removals
    a.close()
    b.close()


def test_a_file_deleted_after_open_is_still_served_exactly(tmp_path: Path) -> None:
    """POSIX keeps an unlinked file's data for readers that opened it: the bytes read
    are the whole file and pass the checksum."""
    a = Replica(tmp_path)
    tokens, hashes = _prompt(3, 1)
    a.store("a", tokens, hashes, list(range(BPC)))
    path = _path(tmp_path, hashes[BPC - 1])
    with open(path, "rb") as f:
        path.unlink()
        data = f.read()
    copy = tmp_path / "copy" / path.name
    copy.parent.mkdir()
    copy.write_bytes(data)
    assert read_chunk_file(copy, RANK_ID, key=hashes[BPC - 1]).header["key"] == path.stem
    a.close()


def test_truncated_and_foreign_files_are_misses_and_removed(tmp_path: Path) -> None:
    a, b = Replica(tmp_path), Replica(tmp_path)
    t1, h1 = _prompt(4, 1)
    t2, h2 = _prompt(5, 1)
    a.store("a1", t1, h1, list(range(BPC)))
    a.store("a2", t2, h2, list(range(BPC, 2 * BPC)))
    p1, p2 = _path(tmp_path, h1[BPC - 1]), _path(tmp_path, h2[BPC - 1])
    os.truncate(p1, p1.stat().st_size // 2)  # cut short (e.g. a copy tool)
    # A file of another layout under a valid name of this one.
    foreign = Replica(tmp_path / "other")
    foreign.store("f", t2, h2, list(range(BPC)))
    p2.write_bytes(_path(tmp_path / "other", h2[BPC - 1]).read_bytes().replace(b"unit", b"uniT"))
    assert b.p.lookup("b1", h1, t1, len(t1), 0).num_tokens == 0
    assert b.p.lookup("b2", h2, t2, len(t2), 0).num_tokens == 0
    assert not p1.exists() and not p2.exists()
    assert b.shared.removed_bad == 2
    assert b.p.take_events() == []  # no chunk description to announce from a bad header
    for r in (a, b, foreign):
        r.close()


def test_a_bad_payload_is_removed_and_announced_by_the_replica_that_deleted_it(
    tmp_path: Path,
) -> None:
    a, b = Replica(tmp_path), Replica(tmp_path)
    tokens, hashes = _prompt(6, 1)
    a.store("a", tokens, hashes, list(range(BPC)))
    path = _path(tmp_path, hashes[BPC - 1])
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x33  # header valid, payload checksum wrong
    path.write_bytes(bytes(data))
    dst = list(range(20, 20 + BPC + 1))
    b.load("b", tokens, hashes, dst)
    assert b.ex.take_load_errors() == set(dst[:BPC])  # recomputed, never wrong KV
    assert not path.exists()
    assert _kinds(b.p.take_events()) == [("removed", Tier.STORAGE)]
    a.close()
    b.close()


def test_two_writers_racing_on_one_chunk_never_expose_a_partial_file(tmp_path: Path) -> None:
    rank_dir = tmp_path / RankInfo().dir_name
    rank_dir.mkdir()
    key = b"\x01" * 32
    payload = torch.arange(64 * 1024, dtype=torch.int32).view(torch.uint8)
    header = {"identity": RANK_ID, "key": key.hex(), "payload_bytes": payload.numel()}
    stop = threading.Event()
    errors: list[Exception] = []
    reads = 0

    def writer() -> None:
        for _ in range(60):
            write_chunk_file(rank_dir, key, header, payload)
        stop.set()

    def reader() -> None:
        nonlocal reads
        while not stop.is_set():
            try:
                cf = read_chunk_file(rank_dir / file_name(key), RANK_ID, key=key)
                assert torch.equal(cf.payload.view(torch.uint8).view(-1), payload)
                reads += 1
            except FileNotFoundError:
                continue  # before the first rename
            except (ChunkFileError, AssertionError) as exc:
                errors.append(exc)

    threads = [threading.Thread(target=writer) for _ in range(2)] + [
        threading.Thread(target=reader)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == [] and reads > 0
    assert [p.name for p in rank_dir.iterdir()] == [file_name(key)]  # no temp file left


def test_two_replicas_storing_one_chunk_at_once_both_serve_it(tmp_path: Path) -> None:
    a, b = Replica(tmp_path, seed=3), Replica(tmp_path, seed=3)
    tokens, hashes = _prompt(7, 1)
    # Both plan the write before either file exists: both write (same bytes).
    a.p.on_scheduled("a", list(range(BPC)), hashes, tokens, len(tokens))
    b.p.on_scheduled("b", list(range(BPC)), hashes, tokens, len(tokens))
    for r in (a, b):
        step(r.p, r.ex)
        step(r.p, r.ex)
        assert ("stored", Tier.STORAGE) in _kinds(r.p.take_events())
    c = Replica(tmp_path, seed=9)
    dst = list(range(40, 40 + BPC + 1))
    c.load("c", tokens, hashes, dst)
    assert c.ex.take_load_errors() == set()
    assert torch.equal(block_data(a.paged, list(range(BPC)))[0], block_data(c.paged, dst[:BPC])[0])
    for r in (a, b, c):
        r.close()


def test_a_full_disk_pauses_writes_while_serving_goes_on(tmp_path: Path) -> None:
    a = Replica(tmp_path)
    full = Replica(tmp_path, seed=5, disk_byte_cap=1)  # every write hits ENOSPC
    t1, h1 = _prompt(8, 1)
    t2, h2 = _prompt(9, 1)
    a.store("a", t1, h1, list(range(BPC)))
    full.store("f", t2, h2, list(range(BPC)))
    assert full.p.stats.disk_full_events == 1
    assert not _path(tmp_path, h2[BPC - 1]).exists()
    # Writes pause (no new write planned) ...
    t3, h3 = _prompt(10, 1)
    full.p.on_scheduled("g", list(range(BPC, 2 * BPC)), h3, t3, len(t3))
    assert all(s.disk_header is None for s in full.p.take_plan().stores)
    # ... and the full replica still serves the domain.
    dst = list(range(40, 40 + BPC + 1))
    assert full.load("h", t1, h1, dst).num_tokens == CHUNK
    assert full.ex.take_load_errors() == set()
    a.close()
    full.close()


def test_own_index_bound_forgets_without_deleting_shared_files(tmp_path: Path) -> None:
    one_file = Replica(tmp_path)
    t0, h0 = _prompt(11, 1)
    one_file.store("x", t0, h0, list(range(BPC)))
    size = _path(tmp_path, h0[BPC - 1]).stat().st_size
    one_file.close()
    a = Replica(tmp_path / "d", disk_capacity=size + 2048)  # room for one chunk
    t1, h1 = _prompt(12, 1)
    t2, h2 = _prompt(13, 1)
    a.store("a", t1, h1, list(range(BPC)))
    a.store("b", t2, h2, list(range(BPC, 2 * BPC)))
    assert _kinds(a.p.take_events()) == [("stored", Tier.CPU)] * 2 + [("stored", Tier.STORAGE)] * 2
    assert len(a.p.disk) == 1 and a.p.stats.evictions_disk == 1
    # The evictor owns the files: the first one is still there and still served.
    assert _path(tmp_path / "d", h1[BPC - 1]).exists()
    a.p.reset_cpu()
    assert a.p.lookup("c", h1, t1, len(t1), 0).num_tokens == CHUNK
    a.close()


def test_reset_keeps_shared_files_and_stops_serving_them_here(tmp_path: Path) -> None:
    a, b = Replica(tmp_path), Replica(tmp_path)
    tokens, hashes = _prompt(14, 1)
    a.store("a", tokens, hashes, list(range(BPC)))
    a.p.take_events()
    path = _path(tmp_path, hashes[BPC - 1])
    a.p.reset()
    assert _kinds(a.p.take_events()) == [("removed", Tier.CPU)]  # nothing for STORAGE
    assert path.exists()
    assert a.p.lookup("x", hashes, tokens, len(tokens), 0).num_tokens == 0
    assert b.p.lookup("y", hashes, tokens, len(tokens), 0).num_tokens == CHUNK
    # Recomputed after the reset, the chunk is written again (a new file) and served.
    a.store("z", tokens, hashes, list(range(BPC, 2 * BPC)))
    assert _kinds(a.p.take_events()) == [("stored", Tier.CPU), ("stored", Tier.STORAGE)]
    a.p.reset_cpu()
    assert a.p.lookup("w", hashes, tokens, len(tokens), 0).num_tokens == CHUNK
    a.close()
    b.close()


def test_a_directory_that_is_not_shared_is_noticed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    now = [1000.0]
    s1 = SharedStore(tmp_path / "d", IDENTITY, [RankInfo()], domain="x", clock=lambda: now[0])
    s2 = SharedStore(tmp_path / "d", IDENTITY, [RankInfo()], domain="x", clock=lambda: now[0])
    assert s2.peers == 1 and not s2.alone
    alone = SharedStore(tmp_path / "e", IDENTITY, [RankInfo()], domain="x", clock=lambda: now[0])
    assert alone.alone
    with caplog.at_level(logging.WARNING, logger="kvroute.connector.shared_store"):
        now[0] += LONELY_WARN_S + 1
        alone.heartbeat()
        s2.heartbeat()
        s1.heartbeat()
    lonely = [r for r in caplog.records if "is not" in r.getMessage()]
    assert len(lonely) == 1 and str(tmp_path / "e") in lonely[0].getMessage()
    assert s1.peers == 1  # s2's marker is fresh enough
    s2.close()
    now[0] += 31
    s1.heartbeat()
    assert s1.alone  # s2 left: its marker is gone
    s1.close()
    alone.close()


def test_parallel_writers_respect_the_byte_cap(tmp_path: Path) -> None:
    payload = torch.zeros(4096, dtype=torch.uint8)
    header = {"identity": RANK_ID, "payload_bytes": 4096}
    cap = 5 * 4096 + 5 * 1400
    w = DiskWriter(tmp_path, byte_cap=cap, threads=4, max_pending_bytes=1 << 30)
    for i in range(20):
        key = bytes([i]) * 32
        w.submit(key, dict(header, key=key.hex()), payload)
    assert w.flush(30)
    res = w.take_results()
    assert len(res) == 20
    ok = [r for r in res if r.ok]
    assert 1 <= len(ok) < 20 and all(r.error == "disk_full" for r in res if not r.ok)
    # Four threads reserved concurrently, yet the files written stay under the cap.
    assert sum(p.stat().st_size for p in tmp_path.iterdir()) <= cap
    assert sum(r.size for r in ok) <= cap
    w.close()


def test_storage_domain_config_is_checked() -> None:
    cfg = ConnectorConfig.from_extra_config({"disk_dir": "/tmp/x", "storage_domain": "rack-1"})
    assert cfg.storage_domain == "rack-1"
    with pytest.raises(ValueError, match="needs disk_dir"):
        ConnectorConfig.from_extra_config({"storage_domain": "rack-1"})
    with pytest.raises(ValueError, match="storage_domain"):
        ConnectorConfig.from_extra_config({"disk_dir": "/tmp/x", "storage_domain": "a:b"})
    with pytest.raises(ValueError, match="nondeterministic"):
        ConnectorConfig.from_extra_config(
            {
                "disk_dir": "/tmp/x",
                "storage_domain": "d",
                "allow_nondeterministic_hash_seed": True,
            }
        )
    with pytest.raises(ValueError, match="threads"):
        ConnectorConfig.from_extra_config({"disk_write_threads": 0})
