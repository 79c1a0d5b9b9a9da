"""llm-d's shared-storage events as llm-d's own modules send them (tests/fixtures/llmd_pvc):
the FS backend's stores and the PVC evictor's removals decode to the STORAGE tier, unconfirmed,
and, on a replica attached to the PVC's storage domain, the evictor's removals reach every
replica of the domain."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

from kvroute.indexer.index import InMemoryPrefixIndex, domain_key
from kvroute.indexer.wire import BlockRemoved, BlockStored, Medium, decode_batch

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "llmd_pvc" / "llmd_pvc.json"
DOC = json.loads(FIXTURE.read_text())
BS = DOC["block_size"]


def _events(frame: dict[str, Any]) -> list:
    batch = decode_batch(base64.b64decode(frame["payload_b64"]))
    assert not batch.rejected and not batch.unknown_media
    return batch.events


def test_the_fs_backend_and_the_evictor_decode_to_unconfirmed_storage() -> None:
    case = DOC["cases"]["short_hashes"]
    model = DOC["model"]
    stores = [e for f in case["fs_frames"] for e in _events(f)]
    assert all(isinstance(e, BlockStored) and not e.token_ids for e in stores)
    assert {(e.medium, e.confirmed, e.medium_name) for e in stores} == {
        (Medium.STORAGE, False, "SHARED_STORAGE")
    }
    p = DOC["p_hashes"]
    assert stores[1].block_hashes == [p[3], p[7], p[11], p[15]]
    (frame,) = case["evictor_frames"]
    assert frame["topic"] == f"kv@SHARED_STORAGE@{model}" and frame["seq"] == 1
    (removal,) = _events(frame)
    assert isinstance(removal, BlockRemoved)
    assert (removal.block_hashes, removal.medium, removal.confirmed) == (
        [p[15]],
        Medium.STORAGE,
        False,
    )


def test_with_vllm_block_hashes_the_evictor_announces_nothing() -> None:
    """vLLM 0.32's block hashes are 32-byte digests: the files are named by 64 hex digits, the
    deleter reads no hash from them and publishes no removal. The index never relies on one:
    llm-d's chunks stay unconfirmed (aged out)."""
    case = DOC["cases"]["vllm_hashes"]
    assert case["deleted_files"] == 1 and case["evictor_frames"] == []
    (store,) = [e for f in case["fs_frames"] for e in _events(f)]
    assert store.block_hashes == [DOC["vllm_hashes_u64"][3], DOC["vllm_hashes_u64"][7]]


def _device(hashes: list[int], first_token: int) -> BlockStored:
    tokens = list(range(first_token, first_token + len(hashes) * BS))
    return BlockStored(hashes, None, tokens, BS, extra_keys=[None] * len(hashes))


def test_an_attached_replica_sees_the_pvc_and_the_evictor_shrinks_it() -> None:
    case = DOC["cases"]["short_hashes"]
    index = InMemoryPrefixIndex()
    layout = case["layout"]
    index.attach("writer", "pvc", layout)
    index.attach("reader", "pvc", layout)
    index.attach("tp2", "pvc", layout + "-tp2")  # same PVC, another layout: none of it
    index.apply("writer", [_device(DOC["w_hashes"], 1000), _device(DOC["p_hashes"], 5000)])
    for frame in case["fs_frames"]:
        result = index.apply("writer", _events(frame), source="fs")
        assert not result.rejected and not result.unresolved
    prompt = list(range(5000, 5000 + 16 * BS))
    match = index.lookup(prompt, replicas=["reader", "tp2"])
    assert match["reader"].unconfirmed_by_tier == {Medium.STORAGE: 16}
    assert match["tp2"].blocks == 0
    (frame,) = case["evictor_frames"]
    index.apply(domain_key("pvc"), _events(frame))
    match = index.lookup(prompt, replicas=["reader"])
    assert match["reader"].unconfirmed_by_tier == {Medium.STORAGE: 12}
