"""``kvroute bench connector``'s CUDA section: its code path runs on CPU with a fake
device (the figures then mean nothing), and without CUDA it reports "unavailable"."""

from __future__ import annotations

import argparse

import pytest
import torch

from kvroute.bench.connector_bench import _cuda_tiers, _device_tiers, add_arguments
from kvroute.connector.copiers import AsyncCopier
from tests.connector.fake_device import FakeBackend


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    small = "--chunk-tokens 8 --block-size 4 --layers 2 --kv-heads 2 --head-size 8"
    return parser.parse_args([*small.split(), "--chunks", "3", "--repeats", "2"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_the_cuda_section_reports_unavailable_without_a_device() -> None:
    assert _cuda_tiers(_args()) == {"cuda": "unavailable"}


def test_the_device_section_compares_our_path_with_plain_copies() -> None:
    args = _args()
    res = _device_tiers(
        args,
        torch.device("cpu"),
        lambda: None,
        pin=False,
        copier=lambda paged: AsyncCopier(paged, 2, FakeBackend()),
    )
    assert res["bytes_per_measurement"] == 3 * res["chunk_bytes"]
    assert res["block_kernel"] == "per_layer"  # the fake device keeps the torch kernels
    for k in ("store_vs_pinned_copy", "load_vs_pinned_copy", "d2h_store_gbps", "h2d_load_gbps"):
        assert res[k] > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_cuda_section_compares_both_kernels_and_breaks_stores_down() -> None:
    cuda = _cuda_tiers(_args())["cuda"]
    assert cuda["block_kernel"] == "triton"
    assert set(cuda["per_layer"]) >= {"store_vs_pinned_copy", "load_vs_pinned_copy"}
    for kernel in ("triton", "per_layer"):
        b = cuda["store_breakdown"][kernel]
        assert b["chunks"] == 3
        assert b["store_total_ms"] >= b["store_issue_ms"] > 0
        assert b["gathers_device_ms"] > 0 and b["d2h_device_ms"] > 0
