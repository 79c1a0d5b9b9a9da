"""Multimodal extra keys: a request's media items (from a replica's render endpoint) key the
blocks they overlap exactly as vLLM's block pool publishes them, so an image prompt meets
its stored blocks and a different image never does."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvroute.indexer.index import InMemoryPrefixIndex
from kvroute.indexer.keys import RequestKeys, mm_block_keys, request_extra_keys
from kvroute.indexer.wire import BlockStored

BS = 4
TOKENS = list(range(100, 116))  # 4 blocks
# Two images: one inside block 0-1 (offset 2, 4 tokens: blocks 0 and 1), one in block 3.
MM = [("img-a", 2, 4), ("img-b", 12, 2)]


def test_mm_keys_per_block() -> None:
    assert mm_block_keys(MM, 0, 4) == [("img-a", 2)]
    assert mm_block_keys(MM, 4, 8) == [("img-a", -2)]
    assert mm_block_keys(MM, 8, 12) == []
    assert mm_block_keys(MM, 12, 16) == [("img-b", 0)]
    extra = request_extra_keys(4, lora_name="ad", cache_salt="s", mm=MM, block_size=BS)
    assert extra == [
        ("ad", ("img-a", 2), "s"),
        ("ad", ("img-a", -2)),
        ("ad",),
        ("ad", ("img-b", 0)),
    ]


def test_mm_keys_equal_vllms_event_extra_keys() -> None:
    kv = pytest.importorskip("vllm.v1.core.kv_cache_utils")
    features = [
        SimpleNamespace(identifier=i, mm_position=SimpleNamespace(offset=o, length=n))
        for i, o, n in MM
    ]
    request = SimpleNamespace(
        mm_features=features, lora_request=None, cache_salt="s", prompt_embeds=None
    )
    theirs, mm_idx = [], 0
    for b in range(4):
        keys, mm_idx = kv.generate_block_hash_extra_keys(request, b * BS, (b + 1) * BS, mm_idx)
        theirs.append(keys)
    published = kv.to_event_extra_keys(theirs)
    assert request_extra_keys(4, cache_salt="s", mm=MM, block_size=BS) == published


def test_index_matches_only_the_same_images() -> None:
    index = InMemoryPrefixIndex()
    extra = request_extra_keys(4, mm=MM, block_size=BS)
    # As a replica publishes them (msgpack turns the inner tuples into lists).
    wire_extra = [
        None if e is None else [list(x) if isinstance(x, tuple) else x for x in e] for e in extra
    ]
    index.apply(
        "r0",
        [BlockStored([1, 2, 3, 4], None, TOKENS, BS, extra_keys=wire_extra)],
    )
    assert index.lookup(RequestKeys(TOKENS, mm=MM))["r0"].blocks == 4
    other = [("img-other", 2, 4), MM[1]]
    assert index.lookup(RequestKeys(TOKENS, mm=other))["r0"].blocks == 0
    # Without its media items the request matches nothing past the text-only prefix: none.
    assert index.lookup(RequestKeys(TOKENS))["r0"].blocks == 0
