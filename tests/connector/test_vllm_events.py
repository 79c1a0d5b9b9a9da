"""Tier events say what vLLM's own device events say for the same blocks.

Real vLLM ``Request`` objects (LoRA, ``cache_salt``, a multimodal item, a plain prompt)
go through vLLM's ``BlockPool.cache_full_blocks`` with events enabled, and through the
connector's planner; the two ``BlockStored`` events for a chunk must encode to the same
bytes once the tier's own fields (medium, locality, group) are set alike. The same
holds for a chunk announced from its disk file after a restart.
"""

from __future__ import annotations

import os
from pathlib import Path

import msgspec
import pytest

from kvroute.connector.disk_scan import scan_layout
from kvroute.connector.identity import RankInfo
from kvroute.connector.plan import STORED, Report
from kvroute.connector.planner_records import TierEvent
from kvroute.indexer.tiers import Tier
from tests.connector.helpers import BLOCK, BPC, IDENTITY, make_executor, make_paged, make_planner

pytestmark = pytest.mark.vllm

N_CHUNKS = 3
N_TOKENS = N_CHUNKS * BPC * BLOCK + 1


def _request(kind: str):
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    kw: dict = {}
    if kind == "lora":
        kw["lora_request"] = LoRARequest("adapter-a", 7, "/models/adapter-a")
    elif kind == "cache_salt":
        kw["cache_salt"] = "tenant-42"
    elif kind == "multimodal":
        spec = MultiModalFeatureSpec(
            data=None,
            modality="image",
            identifier="img-1",
            mm_position=PlaceholderRange(offset=5, length=9),  # spans chunks 0 and 1
        )
        kw["mm_features"] = [spec]
    return Request(
        f"req-{kind}",
        list(range(100, 100 + N_TOKENS)),
        SamplingParams(max_tokens=1),
        None,
        block_hasher=get_request_block_hasher(BLOCK, sha256),
        **kw,
    )


def _device_events(request) -> list:
    """vLLM's own GPU events, one ``cache_full_blocks`` call per chunk."""
    from vllm.v1.core.block_pool import BlockPool

    pool = BlockPool(64, True, BLOCK, enable_kv_cache_events=True)
    blocks = pool.get_new_blocks(N_CHUNKS * BPC)
    for c in range(N_CHUNKS):
        pool.cache_full_blocks(request, blocks, c * BPC, (c + 1) * BPC, BLOCK, 0)
    return pool.take_events()


def _same_bytes(ours, device) -> bool:
    """Equal msgpack encodings once medium/locality/group are the device's."""
    aligned = msgspec.structs.replace(
        ours, medium=device.medium, locality=device.locality, group_idx=device.group_idx
    )
    return msgspec.msgpack.encode(aligned) == msgspec.msgpack.encode(device)


FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "lora_name",
    "extra_keys",
)


@pytest.mark.parametrize("kind", ["lora", "cache_salt", "multimodal", "plain"])
def test_ram_tier_events_match_the_device_events(kind: str) -> None:
    from kvroute.connector.events import to_vllm_event
    from kvroute.connector.vllm_extras import request_extras

    request = _request(kind)
    device = _device_events(request)
    p = make_planner(num_slots=8)
    p.on_scheduled(
        request.request_id,
        list(range(N_CHUNKS * BPC)),
        request.block_hashes,
        request.all_token_ids,
        request.num_tokens,
        request_extras(request, BLOCK),
    )
    p.on_reports([Report(STORED, s.key, Tier.CPU) for s in p.take_plan().stores])
    ours = [to_vllm_event(e) for e in p.take_events()]
    assert len(ours) == len(device) == N_CHUNKS
    for o, d in zip(ours, device, strict=True):
        assert o.medium == "CPU" and o.locality == "LOCAL"
        for f in FIELDS:
            assert getattr(o, f) == getattr(d, f), f
        assert _same_bytes(o, d)
    if kind == "lora":
        assert ours[0].lora_name == "adapter-a" and ours[0].lora_id == 7
        assert ours[0].extra_keys == [("adapter-a",), ("adapter-a",)]
    if kind == "cache_salt":  # the salt is an extra key of the first block only
        assert ours[0].extra_keys == [("tenant-42",), None]
        assert ours[1].extra_keys == [None, None]
    if kind == "multimodal":
        assert ours[0].extra_keys == [None, (("img-1", 1),)]
        assert ours[1].extra_keys == [(("img-1", -3),), (("img-1", -7),)]


def _write_to_disk(request, disk_dir: Path) -> list:
    """The request's chunks written through the real planner and worker to ``disk_dir``;
    returns the STORAGE events announced as they landed."""
    from kvroute.connector.disk_tier import unlink_chunk_all_ranks
    from kvroute.connector.events import to_vllm_event
    from kvroute.connector.vllm_extras import request_extras

    paged = make_paged()
    p = make_planner(
        num_slots=8,
        disk_enabled=True,
        disk_capacity_bytes=1 << 20,
        payload_bytes=paged.num_layers * BPC * paged.block_bytes(),
        unlink=lambda k: unlink_chunk_all_ranks(disk_dir, [RankInfo()], k),
    )
    ex = make_executor(paged, num_slots=8, disk_dir=disk_dir)
    p.on_scheduled(
        request.request_id,
        list(range(N_CHUNKS * BPC)),
        request.block_hashes,
        request.all_token_ids,
        request.num_tokens,
        request_extras(request, BLOCK),
    )
    plan = p.take_plan()
    ex.after_forward(plan)
    ex.wait_idle()
    p.on_reports(ex.take_reports())
    stored = [to_vllm_event(e) for e in p.take_events() if e.tier == Tier.STORAGE]
    ex.close()
    return stored


@pytest.mark.parametrize("kind", ["lora", "cache_salt", "multimodal"])
def test_disk_chunks_announced_at_start_carry_the_saved_extras(tmp_path: Path, kind: str) -> None:
    from kvroute.connector.events import to_vllm_event

    request = _request(kind)
    device = _device_events(request)
    stored = _write_to_disk(request, tmp_path)
    # Restart: the scan announces every file with the extras from its header.
    found = scan_layout(tmp_path, IDENTITY, [RankInfo()])
    restart = [to_vllm_event(TierEvent("stored", Tier.STORAGE, info)) for info, _ in found]
    by_parent = {e.parent_block_hash: e for e in restart}
    assert len(stored) == len(restart) == N_CHUNKS
    for d in device:
        o = by_parent[d.parent_block_hash]
        assert o.medium == "STORAGE"
        assert _same_bytes(o, d)


def test_a_restart_announces_every_chunk_after_its_parent(tmp_path: Path) -> None:
    """Parallel disk writers finish a prompt's chunks out of order, so a later chunk's file
    can be older than its parent's. The start-up announcement must still name the parent
    first: an indexer keys a self-describing chunk through its parent, and one announced
    before it is lost with every chunk after it (seen in CI: 2 of 11 chunks re-indexed)."""
    from vllm.distributed import kv_events as kv

    from kvroute.connector.disk_tier import rank_directory
    from kvroute.connector.events import to_vllm_event
    from kvroute.indexer.index import InMemoryPrefixIndex
    from kvroute.indexer.wire import decode_batch

    request = _request("plain")
    _write_to_disk(request, tmp_path)
    files = sorted(rank_directory(tmp_path, RankInfo()).iterdir())
    assert len(files) == N_CHUNKS
    found = scan_layout(tmp_path, IDENTITY, [RankInfo()])
    # The last chunk written first, the first chunk last.
    for age, (info, _) in enumerate(found):
        path = next(f for f in files if info.key.hex() in f.name)
        os.utime(path, (1_000_000 - age, 1_000_000 - age))
    found = scan_layout(tmp_path, IDENTITY, [RankInfo()])
    assert [info.index for info, _ in found] == list(range(N_CHUNKS))

    events = [to_vllm_event(TierEvent("stored", Tier.STORAGE, info)) for info, _ in found]
    payload = msgspec.msgpack.encode(kv.KVEventBatch(ts=1.0, events=events))
    index = InMemoryPrefixIndex()
    result = index.apply("r1", decode_batch(payload).events)
    assert result.rejected == [] and result.unresolved == 0, result
    match = index.lookup(request.all_token_ids)["r1"]
    assert match.tokens_in(Tier.STORAGE) == N_CHUNKS * BPC * BLOCK


def test_block_removed_stays_hashes_and_medium() -> None:
    from kvroute.connector.events import to_vllm_event
    from kvroute.connector.keys import ChunkExtras, chunk_info
    from tests.connector.helpers import block_hashes

    tokens = list(range(2 * BPC * BLOCK))
    info = chunk_info(
        block_hashes(tokens),
        tokens,
        BLOCK,
        BPC,
        1,
        ChunkExtras(3, "a", (("a",), ("a",))),
    )
    ev = to_vllm_event(TierEvent("removed", Tier.STORAGE, info))
    assert type(ev).__name__ == "BlockRemoved"
    assert ev.medium == "STORAGE" and len(ev.block_hashes) == BPC


def test_worker_rank_outside_vllm_parallel_groups() -> None:
    from kvroute.connector.kvroute_connector import worker_rank

    assert worker_rank(1, 1) == RankInfo()
    with pytest.raises(RuntimeError, match="rank"):
        worker_rank(2, 1)  # guessing rank 0 on every worker would share files


def test_worker_reports_pass_through_vllms_multiconnector_and_merge_across_workers() -> None:
    """The reports ride in the worker metadata, which vLLM's ``MultiConnector`` gives each
    child back (its ``kv_cache_events`` it drops): two workers' reports of a step, beside
    another connector's none, reach the child as one ``KVRouteReports`` holding both."""
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
        MultiKVConnectorWorkerMetadata,
    )

    from kvroute.connector.events import KVRouteReports

    first = Report(STORED, b"k1", Tier.CPU, req_id="a")
    second = Report(STORED, b"k2", Tier.CPU, req_id="a")
    worker0 = MultiKVConnectorWorkerMetadata(metadata=(None, KVRouteReports([first])))
    worker1 = MultiKVConnectorWorkerMetadata(metadata=(None, KVRouteReports([second])))
    merged = worker0.aggregate(worker1)
    assert isinstance(merged, MultiKVConnectorWorkerMetadata)
    nixl, ours = merged.metadata
    assert nixl is None
    assert isinstance(ours, KVRouteReports) and ours.reports == [first, second]
