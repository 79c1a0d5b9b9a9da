"""Worker-side executor: carries out a ``StepPlan`` and reports what happened.

It decides nothing. Order within a step matters and is fixed here:

1. ``before_forward``: snapshot demoted RAM slots into the disk writer (the slot may be
   reused by a store later in the same step), issue RAM loads (the layers need them
   this step: complete on CPU, ordered before the forward on CUDA), start disk loads
   on reader threads, one task per chunk, read straight into the request's blocks
   (vLLM waits for the request's ``finished_recving``).
2. ``after_forward``: copy newly full chunks from the paged cache into their RAM slots
   (the forward has written them). A store is reported STORED, and its write-through
   disk write (straight from the slot; the planner does not reuse a slot before its
   write reported) is queued, once its copy completed: at once on CPU, when its CUDA
   event completed on CUDA (checked whenever reports are taken).

The executor belongs to one rank of the TP x PP layout: it reads and writes only its
rank's directory, stamps its rank identity into every header it writes and checks it
on every read, so another rank's file (same key, same shape, other heads or layers)
is foreign. Every outcome becomes a ``Report`` collected by ``take_reports``; failed
loads add their target blocks to ``take_load_errors`` so vLLM recomputes them.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from kvroute.connector.copiers import Copier, LoadItem, StoreItem, make_copier
from kvroute.connector.copy_ledger import Fence, PendingStore, StoreLedger
from kvroute.connector.cpu_tier import CpuPool
from kvroute.connector.disk_format import ChunkFileError, read_chunk_file, read_chunk_into
from kvroute.connector.disk_tier import DiskWriter, chunk_path, rank_directory, unlink_chunk
from kvroute.connector.identity import RankInfo, rank_identity
from kvroute.connector.plan import LOADED, REMOVED, STORED, LoadOp, Report, StepPlan
from kvroute.connector.transfer import PagedKV
from kvroute.indexer.tiers import Tier

logger = logging.getLogger(__name__)


def _bump_recency(path: Path) -> None:
    """A loaded file was used: set its mtime to now, so an evictor trimming the
    directory by least recent mtime (``kvroute storage gc``) sees the use. A file
    removed since it was opened is fine (the read already had its data)."""
    try:
        os.utime(path)
    except OSError:
        pass


class WorkerExecutor:
    """Executes plans for one worker (one rank). ``identity`` is the layout identity
    and ``disk_dir`` the layout directory, both from the scheduler; ``rank`` is this
    worker's place in the layout (only the worker knows it)."""

    def __init__(
        self,
        paged: PagedKV,
        *,
        blocks_per_chunk: int,
        num_slots: int,
        identity: str,
        disk_dir: Path | None = None,
        rank: RankInfo | None = None,
        disk_fsync: bool = False,
        disk_max_pending_bytes: int = 256 << 20,
        disk_byte_cap: int | None = None,
        pin_memory: bool = False,
        prefault: bool = True,
        disk_read_threads: int = 2,
        disk_write_threads: int = 1,
        copier: Copier | None = None,
        block_kernel: str = "auto",
        pool: CpuPool | None = None,
    ) -> None:
        self.paged = paged
        self.bpc = blocks_per_chunk
        self.identity = identity
        self.rank = rank if rank is not None else RankInfo()
        # What this rank's headers carry and what its reads must find.
        self.file_identity = rank_identity(identity, self.rank)
        self.chunk_shape = paged.chunk_shape(blocks_per_chunk)
        self.copier = (
            copier
            if copier is not None
            else make_copier(paged, blocks_per_chunk, block_kernel=block_kernel)
        )
        # Pinned host buffers (RAM pool, disk staging) when copies are asynchronous.
        self._pin = pin_memory
        if pool is not None and (pool.num_slots, pool.chunk_shape) != (num_slots, self.chunk_shape):
            raise ValueError("the given RAM pool does not match the slots and chunk shape")
        # A pool made at start (the connector's register_kv_caches), else one made here.
        self.pool = (
            pool
            if pool is not None
            else CpuPool(
                num_slots, self.chunk_shape, paged.dtype, pin_memory=pin_memory, prefault=prefault
            )
        )
        self.disk_dir = disk_dir
        self.rank_dir = rank_directory(disk_dir, self.rank) if disk_dir is not None else None
        self.writer = (
            DiskWriter(
                self.rank_dir,
                fsync=disk_fsync,
                max_pending_bytes=disk_max_pending_bytes,
                byte_cap=disk_byte_cap,
                threads=disk_write_threads,
            )
            if self.rank_dir is not None
            else None
        )
        self._stores = StoreLedger()
        self._reader = ThreadPoolExecutor(
            max(1, disk_read_threads), thread_name_prefix="kvroute-disk-reader"
        )
        self._lock = threading.Lock()
        self._reports: list[Report] = []
        self._finished_loads: set[str] = set()
        self._load_errors: set[int] = set()
        self._ops_left: dict[str, int] = {}
        self._futures: set[Future] = set()
        self._tls = threading.local()  # per reader thread staging buffer
        # Staging buffers for demotions, bounded like the writer's pending bytes.
        self._staging_free: list[torch.Tensor] = []
        self._staging_count = 0
        self._staging_max = max(1, disk_max_pending_bytes // max(1, self.pool.chunk_bytes))

    # ------------------------------------------------------------------ step
    def before_forward(self, plan: StepPlan) -> None:
        for d in plan.demotes:
            if self.writer is None or self.pool.key_of(d.slot) != d.key:
                self._report(Report(STORED, d.key, Tier.STORAGE, ok=False, error="slot_mismatch"))
                continue
            # The slot may be reused later in this step: snapshot it into a reused
            # staging buffer (no allocation, no page faults); none free -> drop.
            buf = self._staging_buffer()
            if buf is None:
                self._report(Report(STORED, d.key, Tier.STORAGE, ok=False, error="queue_full"))
                continue
            buf.copy_(self.pool.slot(d.slot))
            self.writer.submit(
                d.key,
                self.stamp(d.disk_header),
                buf,
                on_written=lambda b=buf: self._free_staging(b),
            )
        self._load_from_cpu(plan.cpu_loads)
        after = self.copier.compute_marker() if plan.disk_loads else None
        for req_id, ops in plan.disk_loads.items():
            # One task per chunk: several reads in flight keep the device busy while
            # other chunks are verified and scattered (their target blocks are disjoint).
            with self._lock:
                self._ops_left[req_id] = self._ops_left.get(req_id, 0) + len(ops)
            for op in ops:
                fut = self._reader.submit(self._load_task, req_id, op, after)
                with self._lock:
                    self._futures.add(fut)
                fut.add_done_callback(self._forget_future)

    def after_forward(self, plan: StepPlan) -> None:
        items = [StoreItem(s.block_ids, s.slot, self.pool.slot(s.slot)) for s in plan.stores]
        fences = self.copier.store_many(items)
        for s, fence in zip(plan.stores, fences, strict=True):
            self.pool.mark(s.slot, s.key)
            self._stores.add(PendingStore(s.key, s.slot, fence, s.disk_header))
        self._release_stores()

    def _release_stores(self, *, wait: bool = False) -> None:
        """Report the stores whose copy completed and queue their disk writes."""
        for st in self._stores.take_completed(wait=wait):
            self._report(Report(STORED, st.key, Tier.CPU))
            if st.disk_header is None:
                continue
            if self.writer is None:
                self._report(Report(STORED, st.key, Tier.STORAGE, ok=False, error="no_disk"))
            elif self.pool.key_of(st.slot) != st.key:
                # Cannot happen while the planner holds the slot for the write.
                logger.error("kvroute: RAM slot %d reused before its disk write", st.slot)
                self._report(Report(STORED, st.key, Tier.STORAGE, ok=False, error="slot_mismatch"))
            else:
                # No copy: the planner keeps the slot out of use until it reports.
                self.writer.submit(st.key, self.stamp(st.disk_header), self.pool.slot(st.slot))

    def stamp(self, header: dict) -> dict:
        """The planner's header with this rank's identity (the scheduler has no rank)."""
        return dict(header, identity=self.file_identity)

    def _staging_buffer(self) -> torch.Tensor | None:
        with self._lock:
            if self._staging_free:
                return self._staging_free.pop()
            if self._staging_count >= self._staging_max:
                return None
            self._staging_count += 1
        return torch.empty(self.chunk_shape, dtype=self.pool.dtype, pin_memory=self._pin)

    def _free_staging(self, buf: torch.Tensor) -> None:
        with self._lock:
            self._staging_free.append(buf)

    # ------------------------------------------------------------------ loads
    def _load_from_cpu(self, ops: Sequence[LoadOp]) -> None:
        good = []
        for op in ops:
            if self.pool.key_of(op.slot) != op.key:
                # Never serve a slot that does not hold the chunk we were told about.
                logger.error("kvroute: RAM slot %d does not hold the expected chunk", op.slot)
                self._fail_load(op, "slot_mismatch")
            else:
                good.append(op)
        if not good:
            return
        self.copier.load_many(
            [
                LoadItem(op.slot, self.pool.slot(op.slot), op.block_offset, op.block_ids)
                for op in good
            ]
        )
        self.copier.loads_issued()
        for op in good:
            self._report(Report(LOADED, op.key, Tier.CPU, req_id=op.req_id))

    def _forget_future(self, fut: Future) -> None:
        with self._lock:
            self._futures.discard(fut)

    @torch.inference_mode()
    def _load_task(self, req_id: str, op: LoadOp, after: Fence | None = None) -> None:
        # inference_mode: vLLM's KV tensors are inference tensors, which may only be
        # updated in place under inference mode (a new thread starts outside it).
        try:
            self._load_one_from_disk(op, after)
        except Exception as exc:  # never let a reader error wedge the request
            logger.exception("kvroute: disk load failed: %s", exc)
            self._fail_load(op, "io")
        with self._lock:
            left = self._ops_left.get(req_id, 1) - 1
            if left <= 0:
                self._ops_left.pop(req_id, None)
                self._finished_loads.add(req_id)
            else:
                self._ops_left[req_id] = left

    def _load_one_from_disk(self, op: LoadOp, after: Fence | None = None) -> None:
        assert self.rank_dir is not None
        path = chunk_path(self.rank_dir, op.key)
        if self.paged.direct_io:
            self._load_direct(op, path)
            return
        # Other layouts (e.g. CUDA): read into a (pinned) staging buffer, verify, then
        # copy into the blocks.
        buf = self._thread_buffer()
        try:
            cf = read_chunk_file(path, self.file_identity, key=op.key, out=buf)
            if tuple(cf.payload.shape) != self.chunk_shape or cf.payload.dtype != self.pool.dtype:
                raise ChunkFileError("payload shape/dtype does not match this KV cache")
        except (ChunkFileError, OSError) as exc:
            self._bad_file(op, path, exc)
            return
        self.copier.load_host_chunk(cf.payload, op.block_offset, op.block_ids, after)
        _bump_recency(path)
        self._report(Report(LOADED, op.key, Tier.STORAGE, req_id=op.req_id))

    def _bad_file(self, op: LoadOp, path: Path, exc: Exception) -> None:
        """A missing, cut-short, corrupted or foreign file: a miss, recomputed. A bad
        file is removed; a missing one was removed by someone else (an evictor of a
        shared directory), which the scheduler must tell apart (``error``)."""
        assert self.rank_dir is not None
        missing = isinstance(exc, FileNotFoundError)
        logger.warning("kvroute: bad or missing chunk file %s: %s", path.name, exc)
        if not missing:
            unlink_chunk(self.rank_dir, op.key)
        error = "missing" if missing else "corrupt"
        self._report(Report(REMOVED, op.key, Tier.STORAGE, ok=False, error=error))
        self._fail_load(op, error)

    def _thread_buffer(self) -> torch.Tensor:
        buf = getattr(self._tls, "read_buf", None)
        if buf is None:
            pin = self._pin and self.copier.pinned_host
            buf = torch.empty(self.pool.chunk_bytes, dtype=torch.uint8, pin_memory=pin)
            self._tls.read_buf = buf
        return buf

    def _load_direct(self, op: LoadOp, path: Path) -> None:
        """Read the file straight into the destination blocks (blocks the request does
        not need go to a scratch buffer; the checksum covers all)."""
        assert self.rank_dir is not None
        scratch = memoryview(self._thread_buffer().numpy())
        bb = self.paged.block_bytes()
        n = len(op.block_ids)
        buffers: list[memoryview] = []
        for layer in range(self.paged.num_layers):
            for j in range(self.bpc):
                if op.block_offset <= j < op.block_offset + n:
                    buffers.append(self.paged.block_view(layer, op.block_ids[j - op.block_offset]))
                else:
                    k = (layer * self.bpc + j) * bb
                    buffers.append(scratch[k : k + bb])
        try:
            read_chunk_into(
                path,
                self.file_identity,
                key=op.key,
                buffers=buffers,
                shape=self.chunk_shape,
                dtype=self.pool.dtype,
            )
        except (ChunkFileError, OSError) as exc:
            # The target blocks may hold garbage now: reported as load errors, so vLLM
            # recomputes them before anyone reads them.
            self._bad_file(op, path, exc)
            return
        _bump_recency(path)
        self._report(Report(LOADED, op.key, Tier.STORAGE, req_id=op.req_id))

    def _fail_load(self, op: LoadOp, error: str) -> None:
        with self._lock:
            self._load_errors.update(op.block_ids)
        self._report(Report(LOADED, op.key, op.source, ok=False, req_id=op.req_id, error=error))

    # ------------------------------------------------------------------ results
    def _report(self, r: Report) -> None:
        with self._lock:
            self._reports.append(r)

    def take_reports(self) -> list[Report]:
        self._release_stores()
        if self.writer is not None:
            for w in self.writer.take_results():
                self._report(Report(STORED, w.key, Tier.STORAGE, ok=w.ok, error=w.error))
        with self._lock:
            out, self._reports = self._reports, []
        return out

    def take_finished_loads(self) -> set[str]:
        with self._lock:
            out, self._finished_loads = self._finished_loads, set()
        return out

    def take_load_errors(self) -> set[int]:
        with self._lock:
            out, self._load_errors = self._load_errors, set()
        return out

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Block until copies, reads and writes in flight are done (tests, shutdown)."""
        self._release_stores(wait=True)
        with self._lock:
            futs = list(self._futures)
        for f in futs:
            f.result(timeout)
        if self.writer is not None:
            self.writer.flush(timeout)

    def close(self) -> None:
        self._reader.shutdown(wait=True)
        if self.writer is not None:
            self.writer.close()
