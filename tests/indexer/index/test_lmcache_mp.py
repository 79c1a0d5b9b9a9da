"""LMCache 0.5.6's multi-process connector (``LMCacheMPConnector``) publishes its chunks as
medium ``CPU`` (vLLM's own offloading tier's name) with LMCache's chunk hashes, exact token
counts and a full parent chain (``vllm_multi_process_adapter._build_store_kv_events``), and
``BlockRemoved`` on its evictions. Without vLLM's block hashes nothing places them: every such
chunk is counted unresolved and no block is credited a CPU copy it may not have."""

from __future__ import annotations

import msgspec

from kvroute.indexer.index import InMemoryPrefixIndex
from kvroute.indexer.wire import BlockStored, decode_batch

BS, CHUNK = 16, 256
TOKENS = list(range(1000, 1000 + 2 * CHUNK))


def _mp_store(k: int) -> dict:
    return {
        "type": "BlockStored",
        "block_hashes": [0xAA00 + k],
        "parent_block_hash": None if k == 0 else 0xAA00 + k - 1,
        "token_ids": TOKENS[k * CHUNK : (k + 1) * CHUNK],
        "block_size": CHUNK,
        "lora_id": None,
        "medium": "CPU",
        "lora_name": None,
    }


def test_lmcache_mp_chunks_are_unresolved_never_credited() -> None:
    index = InMemoryPrefixIndex()
    n = len(TOKENS) // BS
    index.apply("r", [BlockStored(list(range(1, n + 1)), None, TOKENS, BS, extra_keys=[None] * n)])
    batch = decode_batch(msgspec.msgpack.encode([0.0, [_mp_store(0), _mp_store(1)]]))
    assert not batch.rejected
    result = index.apply("r", batch.events)
    assert result.unresolved == 2 and result.blocks_stored == 0 and not result.rejected
    assert all(tiers == frozenset({"GPU"}) for tiers in index.block_tiers("r", TOKENS))
