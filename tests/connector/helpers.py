"""Shared helpers for connector unit tests: fake requests and a fake paged KV cache."""

from __future__ import annotations

import hashlib
import pickle

import torch

from kvroute.connector.planner import Planner
from kvroute.connector.transfer import PagedKV
from kvroute.connector.worker import WorkerExecutor

BLOCK = 4  # tokens per block in unit tests
BPC = 2  # blocks per chunk
CHUNK = BLOCK * BPC
IDENTITY = '{"model":"unit-test"}'


def block_hashes(tokens: list[int], block_size: int = BLOCK) -> list[bytes]:
    """A vLLM-like hash chain (sha256 of pickle of (parent, tokens, None))."""
    out: list[bytes] = []
    parent = b"seed"
    for i in range(len(tokens) // block_size):
        parent = hashlib.sha256(
            pickle.dumps((parent, tuple(tokens[i * block_size : (i + 1) * block_size]), None))
        ).digest()
        out.append(parent)
    return out


def make_paged(num_blocks: int = 64, layers: int = 2, block_dim: int = 0) -> PagedKV:
    """Random paged KV in the CPU layout [blocks, heads, block, 2*head] (block_dim=0) or a
    FlashAttention-like [2, blocks, block, heads, head] layout (block_dim=1)."""
    g = torch.Generator().manual_seed(1)
    if block_dim == 0:
        shape: tuple[int, ...] = (num_blocks, 2, BLOCK, 8)
    else:
        shape = (2, num_blocks, BLOCK, 2, 4)
    ts = [torch.randn(shape, generator=g).to(torch.bfloat16) for _ in range(layers)]
    return PagedKV(ts, num_blocks)


def block_data(paged: PagedKV, block_ids: list[int]) -> list[torch.Tensor]:
    idx = torch.tensor(block_ids)
    return [t.index_select(paged.block_dim, idx).clone() for t in paged.layers]


def make_planner(num_slots: int = 4, **kw) -> Planner:
    paged_bytes = kw.pop("payload_bytes", 1024)
    return Planner(
        block_size=BLOCK,
        blocks_per_chunk=BPC,
        num_slots=num_slots,
        chunk_payload_bytes=paged_bytes,
        identity=IDENTITY,
        **kw,
    )


def make_executor(paged: PagedKV, num_slots: int, disk_dir=None, **kw) -> WorkerExecutor:
    return WorkerExecutor(
        paged,
        blocks_per_chunk=BPC,
        num_slots=num_slots,
        identity=IDENTITY,
        disk_dir=disk_dir,
        **kw,
    )


def step(planner: Planner, executor: WorkerExecutor, *, wait: bool = True) -> None:
    """One engine step: plan -> worker before/after forward -> reports back."""
    plan = planner.take_plan()
    executor.before_forward(plan)
    executor.after_forward(plan)
    if wait:
        executor.wait_idle()
    planner.on_reports(executor.take_reports())
