"""One kernel launch per chunk for all layers: the CUDA gather/scatter of KV blocks.

On CUDA a chunk's blocks are scattered over every layer's KV tensor, and vLLM allocates
each layer separately. ``transfer.gather_indexed`` moves them with one ``index_select``
per layer, so a store or load of one chunk costs ``num_layers`` kernel launches on the
host, about 10 µs each. For a 32-layer model that is most of the time a chunk's PCIe
copy takes, and the host cannot launch the next chunk's copy any sooner: measured on an
H100, our store ran at 0.48-0.54 of a plain pinned-memory copy of the same bytes.

``TritonBlockMover`` does the same copy in one Triton launch per chunk: a table of each
layer's address (as a word offset from layer 0) lives on the device, and every program
copies one contiguous segment of one block of one layer. The bytes written are exactly
those ``gather_indexed`` writes (the chunk buffer's layout does not change), so chunks
stored one way load the other way, on disk and across replicas.

It is used only where it is exact: CUDA tensors, Triton importable, the block dimension
0 or 1, and each block made of contiguous segments in the tensor's logical order (an
``HND`` stride order that permutes the dimensions inside a block is left to the
per-layer kernels, which follow the logical order). ``block_mover`` picks.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable
from typing import Any, Protocol

import torch

from kvroute.connector.transfer import PagedKV, gather_indexed, scatter_indexed

logger = logging.getLogger(__name__)

# Words the kernel moves: the widest that divides every size and address it touches.
_WORDS = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))
_TILE = 1024  # words per program
# Arguments that vary from launch to launch (the others are fixed per KV cache).
_VARYING_ARGS = ["buf_off", "n_blocks"]


class BlockMover(Protocol):
    """Moves blocks between the paged KV cache and a chunk buffer on the same device."""

    name: str

    def gather(self, index: torch.Tensor, out: torch.Tensor) -> None:
        """``out[l, j] = layer_l block index[j]``; ``out`` is a contiguous chunk buffer."""
        ...

    def scatter(self, index: torch.Tensor, src: torch.Tensor) -> None:
        """``layer_l block index[j] = src[l, j]``; ``src`` may be a slice of a buffer."""
        ...


class TorchBlockMover:
    """One ``index_select``/``index_copy_`` per layer (any device, any layout)."""

    name = "per_layer"

    def __init__(self, paged: PagedKV) -> None:
        self.paged = paged

    def gather(self, index: torch.Tensor, out: torch.Tensor) -> None:
        gather_indexed(self.paged, index, out)

    def scatter(self, index: torch.Tensor, src: torch.Tensor) -> None:
        scatter_indexed(self.paged, index, src)


@functools.cache
def _kernel() -> Callable[..., Any]:
    """The Triton kernel, built on first use (Triton imports slowly and only CUDA needs it)."""
    import triton
    import triton.language as tl

    # Triton compiles a variant per integer argument that is 1 or divisible by 16, and per
    # pointer aligned to 16 bytes or not, unless told otherwise. The block count and the
    # buffer offset vary from step to step, and a compile (~1 s) on the forward path would
    # stall it: they are not specialized, and ``copiers`` aligns the index slices it
    # passes to 16 bytes. One variant per direction, compiled when the mover is made
    # (``TritonBlockMover._warm_up``).
    @triton.jit(do_not_specialize=_VARYING_ARGS)
    def move_blocks(
        base,  # layer 0's storage, as words
        layer_offs,  # [num_layers] int64: each layer's first word, relative to base
        index,  # [n] int64 block ids
        buf,  # the chunk buffer's storage, as words
        buf_off,  # first word of the chunk buffer slice
        buf_layer_stride,  # words between layers in the buffer
        n_blocks,
        n_segs,  # segments per block: 1 (block dim 0) or the size of dim 0 (block dim 1)
        seg_stride,  # words between segments of a block in a layer
        block_stride,  # words between blocks in a layer
        seg_words,  # words per segment
        TO_BUFFER: tl.constexpr,
        TILE: tl.constexpr,
    ):
        pid = tl.program_id(0)  # (layer, block, segment), segment fastest
        tile = tl.program_id(1)
        seg = (pid % n_segs).to(tl.int64)
        rest = pid // n_segs
        j = (rest % n_blocks).to(tl.int64)
        layer = rest // n_blocks
        blk = tl.load(index + j).to(tl.int64)
        src = tl.load(layer_offs + layer) + seg * seg_stride + blk * block_stride
        dst = buf_off + layer.to(tl.int64) * buf_layer_stride + (j * n_segs + seg) * seg_words
        offs = tile * TILE + tl.arange(0, TILE)
        mask = offs < seg_words
        if TO_BUFFER:
            tl.store(buf + dst + offs, tl.load(base + src + offs, mask=mask), mask=mask)
        else:
            tl.store(base + src + offs, tl.load(buf + dst + offs, mask=mask), mask=mask)

    return move_blocks


def _word_view(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The whole storage under ``t`` as a flat tensor of ``dtype`` words (an alias)."""
    storage = t.untyped_storage()
    words = storage.nbytes() // torch.empty((), dtype=dtype).element_size()
    return torch.empty((0,), dtype=dtype, device=t.device).set_(storage, 0, (words,))


class TritonBlockMover:
    """All layers of a chunk in one launch (see the module docstring)."""

    name = "triton"

    def __init__(self, paged: PagedKV) -> None:
        layout = _layout(paged)
        if layout is None:
            raise ValueError("layout not supported by the one-launch kernel")
        self.paged = paged
        self.n_segs, seg_elems, seg_stride, block_stride = layout
        esize = paged.layers[0].element_size()
        l0 = paged.layers[0]
        addrs = [t.data_ptr() for t in paged.layers]
        sizes = [seg_elems * esize, seg_stride * esize, block_stride * esize]
        sizes += [a - l0.untyped_storage().data_ptr() for a in addrs]
        self.wsize, self.word = next(
            (w, d) for w, d in _WORDS if all(s % w == 0 for s in sizes) and addrs[0] % w == 0
        )
        self.esize = esize
        self.seg_words = seg_elems * esize // self.wsize
        self.seg_stride = seg_stride * esize // self.wsize
        self.block_stride = block_stride * esize // self.wsize
        self.base = _word_view(l0, self.word)
        base_addr = self.base.data_ptr()
        self.layer_offs = torch.tensor(
            [(a - base_addr) // self.wsize for a in addrs], dtype=torch.int64, device=l0.device
        )
        self._buf_views: dict[tuple[int, int], torch.Tensor] = {}
        if paged.device.type == "cuda":
            self._warm_up()

    def _warm_up(self) -> None:
        """Compile both directions now, not on the first store or load: block 0 of every
        layer out to a scratch buffer and back (the same bytes)."""
        p = self.paged
        index = torch.zeros(1, dtype=torch.int64, device=p.device)
        scratch = torch.empty(p.chunk_shape(1), dtype=p.dtype, device=p.device)
        self.gather(index, scratch)
        self.scatter(index, scratch)
        torch.cuda.synchronize(p.device)

    def _buffer(self, t: torch.Tensor) -> tuple[torch.Tensor, int, int]:
        """(word view of ``t``'s storage, first word of ``t``, words between layers)."""
        if t.dtype != self.paged.dtype or t.device != self.paged.device:
            raise ValueError("chunk buffer must match the KV cache's dtype and device")
        block_elems = self.n_segs * self.seg_words * self.wsize // self.esize
        if t.stride(1) != block_elems or any(
            t.stride(d) != math.prod(t.shape[d + 1 :]) for d in range(2, t.dim())
        ):
            raise ValueError("chunk buffer blocks must be contiguous")
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        view = self._buf_views.get(key)
        if view is None:
            if len(self._buf_views) >= 64:  # buffers are long-lived staging buffers
                self._buf_views.clear()
            view = self._buf_views[key] = _word_view(t, self.word)
        first, rem = divmod(t.data_ptr() - view.data_ptr(), self.wsize)
        layer_stride, rem2 = divmod(t.stride(0) * self.esize, self.wsize)
        if rem or rem2:
            raise ValueError("chunk buffer not aligned to the kernel's words")
        return view, first, layer_stride

    def _launch(self, index: torch.Tensor, buf: torch.Tensor, to_buffer: bool) -> None:
        n = index.numel()
        if n == 0:
            return
        view, first, layer_stride = self._buffer(buf)
        grid = (self.paged.num_layers * n * self.n_segs, _cdiv(self.seg_words, _TILE))
        _kernel()[grid](
            self.base,
            self.layer_offs,
            index,
            view,
            first,
            layer_stride,
            n,
            self.n_segs,
            self.seg_stride,
            self.block_stride,
            self.seg_words,
            TO_BUFFER=to_buffer,
            TILE=_TILE,
        )

    def gather(self, index: torch.Tensor, out: torch.Tensor) -> None:
        self._launch(index, out, True)

    def scatter(self, index: torch.Tensor, src: torch.Tensor) -> None:
        self._launch(index, src, False)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _layout(paged: PagedKV) -> tuple[int, int, int, int] | None:
    """(segments per block, elements per segment, segment stride, block stride) when every
    layer's block is ``n_segs`` contiguous runs in logical order at one set of strides."""
    t0 = paged.layers[0]
    shape, stride = tuple(t0.shape), t0.stride()
    if any(t.stride() != stride for t in paged.layers):
        return None
    bd = paged.block_dim
    inner = shape[bd + 1 :]
    # The dimensions after the block dimension: contiguous, in order.
    expect = 1
    for size, st in zip(reversed(inner), reversed(stride[bd + 1 :]), strict=True):
        if size != 1 and st != expect:
            return None
        expect *= size
    seg_elems = math.prod(inner)
    if bd == 0:
        return 1, seg_elems, 0, stride[0]
    if bd == 1:
        return shape[0], seg_elems, stride[0], stride[1]
    return None


def triton_usable() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def block_mover(paged: PagedKV, prefer: str = "auto") -> BlockMover:
    """The fastest exact mover for this KV cache: ``"auto"`` picks Triton on CUDA when the
    layout allows it, else the per-layer kernels; ``"per_layer"``/``"triton"`` force one."""
    if prefer == "per_layer":
        return TorchBlockMover(paged)
    want_triton = prefer == "triton" or (paged.device.type == "cuda" and triton_usable())
    if want_triton and _layout(paged) is not None:
        try:
            return TritonBlockMover(paged)
        except Exception:
            if prefer == "triton":
                raise
            logger.warning("kvroute: one-launch block kernel unavailable", exc_info=True)
    elif prefer == "triton":
        raise ValueError("the one-launch block kernel needs Triton and a supported layout")
    return TorchBlockMover(paged)
