"""TP/PP ranks sharing a disk tier: each rank reads only its own files.

Under tensor parallelism every rank stores a chunk with the same key and the same
shape but other heads: without the rank in the path and the header, a load would hand
one rank another rank's KV with valid checksums. Two executors of different ranks
share one directory here, as the workers of one TP=2 replica do.
"""

from __future__ import annotations

import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kvroute.connector.disk_format import (
    FORMAT_VERSION,
    file_name,
    header_for_chunk,
    max_file_size,
    read_chunk_header,
    write_chunk_file,
)
from kvroute.connector.disk_scan import STALE_S, scan_layout
from kvroute.connector.disk_tier import tier_directory, unlink_chunk_all_ranks
from kvroute.connector.identity import (
    RankInfo,
    all_ranks,
    layout_digest,
    layout_identity,
    rank_identity,
)
from kvroute.connector.keys import chunk_info
from kvroute.connector.plan import REMOVED
from kvroute.connector.planner import Planner
from kvroute.connector.transfer import PagedKV
from kvroute.connector.worker import WorkerExecutor
from kvroute.indexer.tiers import Tier
from tests.connector.helpers import BLOCK, BPC, CHUNK, block_data, block_hashes, make_paged

FIELDS = {"model": "unit-test"}
TP2 = layout_identity(FIELDS, tp_size=2, pp_size=1)
TP1 = layout_identity(FIELDS, tp_size=1, pp_size=1)
RANKS = all_ranks(2, 1)


def _prompt(seed: int, n_chunks: int = 1) -> tuple[list[int], list[bytes]]:
    tokens = [seed * 7919 + i for i in range(n_chunks * CHUNK + 1)]
    return tokens, block_hashes(tokens)


def _rank_paged(rank: int) -> PagedKV:
    """A rank's KV: same shape as every other rank's, other values (other heads)."""
    paged = make_paged()
    for t in paged.layers:
        t.add_(10.0 * (rank + 1))
    return paged


def _bytes(paged: PagedKV) -> int:
    return paged.num_layers * BPC * paged.block_bytes()


def _executor(paged: PagedKV, layout_dir: Path, identity: str, rank: RankInfo) -> WorkerExecutor:
    return WorkerExecutor(
        paged,
        blocks_per_chunk=BPC,
        num_slots=4,
        identity=identity,
        disk_dir=layout_dir,
        rank=rank,
    )


def _planner(layout_dir: Path, identity: str, nbytes: int, ranks: list[RankInfo]) -> Planner:
    return Planner(
        block_size=BLOCK,
        blocks_per_chunk=BPC,
        num_slots=4,
        chunk_payload_bytes=nbytes,
        identity=identity,
        disk_enabled=True,
        disk_capacity_bytes=1 << 20,
        num_workers=len(ranks),
        files_per_chunk=len(ranks),
        unlink=lambda key: unlink_chunk_all_ranks(layout_dir, ranks, key),
    )


def _step(p: Planner, executors: list[WorkerExecutor]) -> None:
    """One engine step on every worker; their reports are merged, as vLLM does."""
    plan = p.take_plan()
    for ex in executors:
        ex.before_forward(plan)
        ex.after_forward(plan)
    for ex in executors:
        ex.wait_idle()
    p.on_reports([r for ex in executors for r in ex.take_reports()])


@dataclass
class Tp2:
    """A TP=2 replica's two workers and scheduler, one chunk stored on both ranks."""

    layout_dir: Path
    pageds: list[PagedKV]
    exs: list[WorkerExecutor]
    p: Planner
    tokens: list[int]
    hashes: list[bytes]
    want: list[list[torch.Tensor]]  # per rank, per layer: the chunk's blocks

    @property
    def key(self) -> bytes:
        return self.hashes[BPC - 1]

    def close(self) -> None:
        for ex in self.exs:
            ex.close()


def _write_tp2(tmp_path: Path, seed: int = 1) -> Tp2:
    layout_dir = tier_directory(tmp_path, layout_digest(TP2))
    pageds = [_rank_paged(0), _rank_paged(1)]
    exs = [_executor(pg, layout_dir, TP2, r) for pg, r in zip(pageds, RANKS, strict=True)]
    p = _planner(layout_dir, TP2, _bytes(pageds[0]), RANKS)
    tokens, hashes = _prompt(seed)
    want = [block_data(pg, [0, 1]) for pg in pageds]
    p.on_scheduled("a", [0, 1], hashes, tokens, len(tokens))  # write-through
    _step(p, exs)
    return Tp2(layout_dir, pageds, exs, p, tokens, hashes, want)


def test_two_ranks_share_a_directory_and_each_reads_back_its_own_bytes(tmp_path: Path) -> None:
    t = _write_tp2(tmp_path)
    layout_dir, pageds, p, tokens, hashes, want, key = (
        t.layout_dir,
        t.pageds,
        t.p,
        t.tokens,
        t.hashes,
        t.want,
        t.key,
    )
    paths = [layout_dir / r.dir_name / file_name(key) for r in RANKS]
    assert all(path.exists() for path in paths)
    for r, path in zip(RANKS, paths, strict=True):
        assert read_chunk_header(path, rank_identity(TP2, r))["identity"] == rank_identity(TP2, r)
    entry = p.disk.get(key)
    assert entry is not None and entry.state.value == "ready"
    assert entry.size == 2 * max_file_size(p._header(entry.info), p.payload_bytes)
    t.close()

    # Restart: the scan serves the chunk (both ranks have it); each rank loads its own.
    p2 = _planner(layout_dir, TP2, _bytes(pageds[0]), RANKS)
    found = scan_layout(layout_dir, TP2, RANKS)
    assert [info.key for info, _ in found] == [key]
    assert found[0][1] == sum(path.stat().st_size for path in paths)
    p2.add_disk_entries(found)
    for pg in pageds:
        for t in pg.layers:
            t.zero_()
    exs = [_executor(pg, layout_dir, TP2, r) for pg, r in zip(pageds, RANKS, strict=True)]
    res = p2.lookup("b", hashes, tokens, len(tokens), 0)
    assert res.num_tokens == CHUNK and res.is_async
    p2.on_alloc("b", [20, 21, 22], res.num_tokens)
    _step(p2, exs)
    for ex, pg, w in zip(exs, pageds, want, strict=True):
        assert ex.take_finished_loads() == {"b"} and ex.take_load_errors() == set()
        for wl, gl in zip(w, block_data(pg, [20, 21]), strict=True):
            assert torch.equal(wl, gl)
    assert not torch.equal(want[0][0], want[1][0])  # the ranks really hold other KV
    for ex in exs:
        ex.close()


def test_a_chunk_is_ready_only_when_every_rank_confirmed(tmp_path: Path) -> None:
    layout_dir = tier_directory(tmp_path, layout_digest(TP2))
    pageds = [_rank_paged(0), _rank_paged(1)]
    exs = [_executor(pg, layout_dir, TP2, r) for pg, r in zip(pageds, RANKS, strict=True)]
    p = _planner(layout_dir, TP2, _bytes(pageds[0]), RANKS)
    tokens, hashes = _prompt(2)
    p.on_scheduled("a", [0, 1], hashes, tokens, len(tokens))
    plan = p.take_plan()
    for ex in exs:
        ex.after_forward(plan)
        ex.wait_idle()
    p.on_reports(exs[0].take_reports())
    assert p.take_events() == []  # rank 1 has not confirmed yet
    p.on_reports(exs[1].take_reports())
    assert sorted((e.kind, e.tier) for e in p.take_events()) == [
        ("stored", Tier.CPU),
        ("stored", Tier.STORAGE),
    ]
    for ex in exs:
        ex.close()


def test_a_file_renamed_into_another_ranks_directory_is_foreign(tmp_path: Path) -> None:
    t = _write_tp2(tmp_path)
    layout_dir, exs, p, tokens, hashes, key = t.layout_dir, t.exs, t.p, t.tokens, t.hashes, t.key
    rank0_file = layout_dir / "tp0-pp0" / file_name(key)
    rank1_file = layout_dir / "tp1-pp0" / file_name(key)
    os.replace(rank0_file, rank1_file)  # rank 1 now finds rank 0's heads under its name
    (layout_dir / "tp0-pp0" / file_name(key)).write_bytes(rank1_file.read_bytes())
    p.reset_cpu()  # only the disk copies are left
    p.take_events()
    res = p.lookup("b", hashes, tokens, len(tokens), 0)
    dst = [30, 31, 32]
    p.on_alloc("b", dst, res.num_tokens)
    plan = p.take_plan()
    for ex in exs:
        ex.before_forward(plan)
        ex.wait_idle()
    reports = [r for ex in exs for r in ex.take_reports()]
    # Rank 0 got a valid file of its own; rank 1's holds rank 0's identity: rejected.
    assert exs[0].take_load_errors() == set()
    assert exs[1].take_load_errors() == set(dst[:BPC])  # vLLM recomputes these blocks
    assert [(r.kind, r.error) for r in reports if r.kind == REMOVED] == [(REMOVED, "corrupt")]
    p.on_reports(reports)
    # The chunk is dropped as a whole: announced, and every rank's file is removed.
    assert [(e.kind, e.tier) for e in p.take_events()] == [("removed", Tier.STORAGE)]
    assert not rank0_file.exists() and not rank1_file.exists()
    t.close()


def test_the_scan_rejects_a_file_of_another_rank(tmp_path: Path) -> None:
    t = _write_tp2(tmp_path)
    t.close()
    layout_dir, key = t.layout_dir, t.key
    os.replace(layout_dir / "tp0-pp0" / file_name(key), layout_dir / "tp1-pp0" / file_name(key))
    assert scan_layout(layout_dir, TP2, RANKS) == []
    assert list((layout_dir / "tp1-pp0").iterdir()) == []  # foreign: removed


def test_a_directory_written_at_tp2_is_a_miss_at_tp1(tmp_path: Path) -> None:
    t = _write_tp2(tmp_path)
    t.close()
    layout_dir, tokens, hashes = t.layout_dir, t.tokens, t.hashes
    # A TP=1 replica on the same base directory looks in another layout directory.
    tp1_dir = tier_directory(tmp_path, layout_digest(TP1))
    assert tp1_dir != layout_dir
    assert scan_layout(tp1_dir, TP1, [RankInfo()]) == []
    # Even pointed at the TP=2 directory, a TP=1 worker finds its rank-0 path taken by
    # a file of another layout: foreign, a load error (recompute), never served.
    paged = make_paged()
    ex = _executor(paged, layout_dir, TP1, RankInfo())
    p1 = _planner(layout_dir, TP1, _bytes(paged), [RankInfo()])
    p1.add_disk_entries([(chunk_info(hashes, tokens, BLOCK, BPC, 0), 1000)])  # forced
    p1.take_events()
    res = p1.lookup("b", hashes, tokens, len(tokens), 0)
    p1.on_alloc("b", [40, 41, 42], res.num_tokens)
    _step(p1, [ex])
    assert ex.take_load_errors() == {40, 41}
    assert [(e.kind, e.tier) for e in p1.take_events()] == [("removed", Tier.STORAGE)]
    ex.close()


def _rank_file(layout_dir: Path, rank: RankInfo, seed: int, *, tokens_delta: int = 0) -> Path:
    tokens = list(range(seed, seed + 2 * CHUNK))
    hashes = block_hashes(tokens)
    info = chunk_info(hashes, [t + tokens_delta for t in tokens], BLOCK, BPC, 0)
    payload = torch.randn(2, BPC, 2, BLOCK, 8).to(torch.bfloat16)
    header = header_for_chunk(info, identity=TP2, payload_bytes=payload.numel() * 2)
    header["identity"] = rank_identity(TP2, rank)
    d = layout_dir / rank.dir_name
    d.mkdir(parents=True, exist_ok=True)
    write_chunk_file(d, info.key, header, payload)
    return d / file_name(info.key)


def test_the_scan_serves_only_chunks_complete_on_every_rank(tmp_path: Path) -> None:
    layout_dir = tier_directory(tmp_path, layout_digest(TP2))
    r0, r1 = RANKS
    both = [_rank_file(layout_dir, r, 1) for r in RANKS]
    fresh_stray = _rank_file(layout_dir, r0, 100)  # rank 1 may still be writing it
    old_stray = _rank_file(layout_dir, r0, 200)  # rank 1 never wrote it (crash)
    os.utime(old_stray, (time.time() - 2 * STALE_S,) * 2)
    disagree = [_rank_file(layout_dir, r0, 300), _rank_file(layout_dir, r1, 300, tokens_delta=1)]
    legacy = layout_dir / file_name(b"\x07" * 32)  # format 1 kept files here, flat
    legacy.write_bytes(both[0].read_bytes())
    old_version = _rank_file(layout_dir, r1, 400)
    raw = bytearray(old_version.read_bytes())
    struct.pack_into("<I", raw, 8, FORMAT_VERSION - 1)
    old_version.write_bytes(bytes(raw))
    (layout_dir / r0.dir_name / old_version.name).write_bytes(bytes(raw))

    found = scan_layout(layout_dir, TP2, RANKS)
    assert len(found) == 1
    info, size = found[0]
    assert both[0].name == file_name(info.key) and size == sum(p.stat().st_size for p in both)
    assert fresh_stray.exists()  # left for its owner
    assert not old_stray.exists()
    assert not any(p.exists() for p in disagree)
    assert not legacy.exists()
    assert not old_version.exists() and not (layout_dir / r0.dir_name / old_version.name).exists()


def test_rank_identity_names_layout_and_rank() -> None:
    a, b = rank_identity(TP2, RANKS[0]), rank_identity(TP2, RANKS[1])
    assert a != b and a != rank_identity(TP1, RankInfo())
    assert [r.dir_name for r in all_ranks(2, 2)] == ["tp0-pp0", "tp1-pp0", "tp0-pp1", "tp1-pp1"]
    assert layout_digest(TP2) != layout_digest(TP1)
