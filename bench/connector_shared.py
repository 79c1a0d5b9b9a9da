"""Many replicas on one shared storage domain directory: contention figures.

``kvroute bench connector`` calls ``shared_contention``: for each N in
``--shared-replicas``, N processes (one per replica, each with its own planner, live
``SharedStore`` lookups and worker executor, like N vLLM replicas on one host) first
write their own chunks into one directory at once, then, after the files were dropped
from the page cache, each loads the chunks ANOTHER replica wrote (found live, no
restart). The aggregate GB/s of each phase is timed by the parent between barriers,
so it spans the slowest replica. Ratios are against the sequential write/read baseline
of the disk section, measured in the same run.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from kvroute.connector.disk_format import file_name
from kvroute.connector.identity import RankInfo
from kvroute.connector.plan import StepPlan, StoreOp
from kvroute.connector.planner import Planner
from kvroute.connector.shared_store import SharedStore
from kvroute.connector.transfer import PagedKV
from kvroute.connector.worker import WorkerExecutor

IDENTITY = '{"bench":"connector-shared"}'
_TIMEOUT_S = 300.0


def _hashes(replica: int, n_blocks: int) -> list[bytes]:
    return [(replica << 32 | i).to_bytes(8, "big") * 4 for i in range(1, n_blocks + 1)]


def _drop(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _replica(i: int, n: int, cfg: dict[str, Any], directory: str, barrier: Any) -> None:
    """One replica process: write own chunks, then load replica (i+1) % n's chunks."""
    torch.set_num_threads(1)
    bs, bpc, chunks = cfg["block_size"], cfg["bpc"], cfg["chunks"]
    nb = 2 * chunks * bpc + 1
    shape = (cfg["layers"], nb, cfg["kv_heads"], bs, 2 * cfg["head_size"])
    kv = torch.randn(shape, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)
    paged = PagedKV([kv[j] for j in range(cfg["layers"])], nb)
    chunk_bytes = cfg["layers"] * bpc * paged.block_bytes()
    d = Path(directory)
    shared = SharedStore(d, IDENTITY, [RankInfo()], domain="bench", replica_id=f"r{i}")
    planner = Planner(
        block_size=bs,
        blocks_per_chunk=bpc,
        num_slots=chunks,
        chunk_payload_bytes=chunk_bytes,
        identity=IDENTITY,
        disk_enabled=True,
        disk_capacity_bytes=4 * chunks * chunk_bytes,
        shared=shared,
    )
    ex = WorkerExecutor(
        paged,
        blocks_per_chunk=bpc,
        num_slots=chunks,
        identity=IDENTITY,
        disk_dir=d,
        disk_max_pending_bytes=2 * chunks * chunk_bytes,
        disk_read_threads=cfg["read_threads"],
        disk_write_threads=cfg["write_threads"],
    )
    tokens = list(range(chunks * bpc * bs + 1))
    with torch.inference_mode():
        own = _hashes(i, chunks * bpc)
        planner.on_scheduled("w", list(range(chunks * bpc)), own, tokens, len(tokens))
        plan = planner.take_plan()
        ex.after_forward(
            StepPlan(stores=[StoreOp(x.key, x.slot, x.block_ids) for x in plan.stores])
        )
        assert ex.writer is not None
        barrier.wait(_TIMEOUT_S)  # write phase starts
        for x in plan.stores:
            assert x.disk_header is not None
            ex.writer.submit(x.key, ex.stamp(x.disk_header), ex.pool.slot(x.slot))
        ex.writer.flush(_TIMEOUT_S)
        barrier.wait(_TIMEOUT_S)  # write phase done
        planner.on_reports(ex.take_reports())
        rank_dir = d / RankInfo().dir_name
        for c in range(chunks):
            _drop(rank_dir / file_name(own[(c + 1) * bpc - 1]))
        planner.reset_cpu()
        other = _hashes((i + 1) % n, chunks * bpc)
        barrier.wait(_TIMEOUT_S)  # read phase starts
        res = planner.lookup("r", other, tokens, len(tokens), 0)
        planner.on_alloc("r", list(range(chunks * bpc, 2 * chunks * bpc + 1)), res.num_tokens)
        ex.before_forward(planner.take_plan())
        ex.wait_idle(_TIMEOUT_S)
        barrier.wait(_TIMEOUT_S)  # read phase done
        ok = res.num_tokens == chunks * bpc * bs and not ex.take_load_errors()
    ex.close()
    shared.close()
    if not ok:
        raise SystemExit(f"replica {i}: shared load incomplete ({res.num_tokens} tokens)")


def _run_n(n: int, cfg: dict[str, Any], directory: Path) -> tuple[float, float]:
    directory.mkdir(parents=True, exist_ok=True)
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(n + 1)
    procs = [
        ctx.Process(target=_replica, args=(i, n, cfg, str(directory), barrier)) for i in range(n)
    ]
    for p in procs:
        p.start()
    try:
        barrier.wait(_TIMEOUT_S)
        t0 = time.perf_counter()
        barrier.wait(_TIMEOUT_S)
        t_write = time.perf_counter() - t0
        barrier.wait(_TIMEOUT_S)
        t0 = time.perf_counter()
        barrier.wait(_TIMEOUT_S)
        t_read = time.perf_counter() - t0
    finally:
        for p in procs:
            p.join(_TIMEOUT_S)
    bad = [p.exitcode for p in procs if p.exitcode != 0]
    if bad:
        raise RuntimeError(f"shared-domain replica processes failed: exit codes {bad}")
    return t_write, t_read


def shared_contention(args: Any, base: Path, baseline: dict[str, float]) -> dict[str, Any]:
    """``shared_N_write_gbps`` / ``shared_N_read_gbps`` (aggregate over N replicas) and
    their ratios to the same run's sequential baseline (``baseline``: the disk
    section's ``disk_baseline_write_gbps`` / ``disk_baseline_read_gbps``)."""
    cfg = {
        "block_size": args.block_size,
        "bpc": args.chunk_tokens // args.block_size,
        "chunks": args.shared_chunks,
        "layers": args.layers,
        "kv_heads": args.kv_heads,
        "head_size": args.head_size,
        "read_threads": args.disk_read_threads,
        "write_threads": args.disk_write_threads,
    }
    # bf16 KV: 2 bytes per element of [layers, bpc, kv_heads, block_size, 2 * head_size]
    chunk_bytes = (
        args.layers * cfg["bpc"] * args.kv_heads * args.block_size * 2 * args.head_size * 2
    )
    out: dict[str, Any] = {"shared_chunks_per_replica": args.shared_chunks}
    for n in args.shared_replicas:
        t_write, t_read = _run_n(n, cfg, base / f"shared-{n}")
        shutil.rmtree(base / f"shared-{n}", ignore_errors=True)
        nbytes = n * args.shared_chunks * chunk_bytes
        w, r = nbytes / t_write / 1e9, nbytes / t_read / 1e9
        out[f"shared_{n}_write_gbps"] = w
        out[f"shared_{n}_read_gbps"] = r
        out[f"shared_{n}_write_vs_baseline"] = w / baseline["disk_baseline_write_gbps"]
        out[f"shared_{n}_read_vs_baseline"] = r / baseline["disk_baseline_read_gbps"]
    return out
