"""The prefix index: one unit test per rule (docs/indexer.md, "Index").

The events are written the way each publisher writes them: vLLM's block pool (device stores
with one ``extra_keys`` entry per block), kvroute's connector (lower-tier stores with the same
fields), vLLM's offloading connector (lower-tier stores without ``extra_keys``, or tier-only
stores naming a chunk's last block), LMCache (its own chunk hashes, 256-token chunks, medium
``cpu``, stores only) and llm-d's FS backend (tier-only, ``SHARED_STORAGE``, stores only, on a
stream of its own). tests/indexer/index/test_index_truth.py checks the same rules against a model
replica; tests/indexer/index/test_vllm_fixtures.py against events vLLM's own classes produced.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvroute.indexer.index import InMemoryPrefixIndex
from kvroute.indexer.keys import RequestKeys
from kvroute.indexer.stats import collect_stats
from kvroute.indexer.wire import AllBlocksCleared, BlockRemoved, BlockStored, Medium
from tests.indexer.builders import (
    BS,
    DOC,
    OTHER,
    ehash,
    lmcache_chunk,
    removed,
    stored,
    tier_only,
)


def test_store_and_lookup_longest_prefix_per_tier() -> None:
    index = InMemoryPrefixIndex()
    index.apply("a", [stored(DOC, 0, 4), stored(DOC, 4, 2, Medium.CPU)])  # a 2-block chunk
    index.apply("b", [stored(DOC, 0, 1)])
    match = index.lookup(DOC)
    assert match["a"].blocks == 6 and match["b"].blocks == 1
    assert match["a"].blocks_by_tier == {Medium.GPU: 4, Medium.CPU: 2}
    assert match["a"].tokens == 24 and match["a"].tokens_in(Medium.CPU) == 8
    assert index.lookup([1, 2, 3, 4, *DOC])["a"].blocks == 0


def test_the_fastest_tier_counts_and_a_removal_leaves_other_tiers_alone() -> None:
    index = InMemoryPrefixIndex()
    index.apply("a", [stored(DOC, 0, 2), stored(DOC, 0, 2, Medium.CPU)])
    assert index.lookup(DOC)["a"].blocks_by_tier == {Medium.GPU: 2}
    index.apply("a", [removed(DOC, [0, 1])])
    assert index.lookup(DOC)["a"].blocks_by_tier == {Medium.CPU: 2}
    index.apply("a", [removed(DOC, [1], Medium.CPU)])
    assert index.block_tiers("a", DOC)[:2] == [{"CPU"}, set()]
    assert index.lookup(DOC)["a"].blocks == 0  # a chunk short of a block loads nothing


def test_lower_tier_store_without_extra_keys_resolves_through_hashes() -> None:
    """vLLM's offloading connector sends no extra_keys: a LoRA prefix's CPU copy must land on
    the LoRA key the device events gave, not on the plain prefix's."""
    index = InMemoryPrefixIndex()
    lora = [("sql",)] * 4
    gpu = stored(DOC, 0, 4, salt="sql", extra=lora, lora_name="sql")
    cpu = stored(DOC, 0, 4, Medium.CPU, salt="sql", lora_name="sql", with_extra_keys=False)
    index.apply("a", [gpu, cpu, removed(DOC, [0, 1, 2, 3], salt="sql")])
    assert index.lookup(DOC)["a"].blocks == 0
    match = index.lookup(DOC, lora_name="sql")["a"]
    assert match.blocks == 4 and match.blocks_by_tier == {Medium.CPU: 4}


def test_lower_tier_store_without_extra_keys_of_an_unknown_block_is_not_guessed() -> None:
    index = InMemoryPrefixIndex()
    result = index.apply("a", [stored(DOC, 0, 2, Medium.CPU, with_extra_keys=False)])
    assert result.unresolved == 2 and result.rejected == []
    assert index.lookup(DOC)["a"].blocks == 0


def test_a_demotion_after_the_device_removal_still_resolves() -> None:
    """vLLM's tiering may publish a block's removal from one tier before its store in the
    next: the hash is remembered for a while after the replica stopped holding it."""
    index = InMemoryPrefixIndex()
    index.apply("a", [stored(DOC, 0, 2), stored(DOC, 0, 2, Medium.CPU, with_extra_keys=False)])
    index.apply("a", [removed(DOC, [0, 1]), removed(DOC, [0, 1], Medium.CPU)])
    index.apply("a", [stored(DOC, 0, 2, Medium.STORAGE, with_extra_keys=False)])
    assert index.lookup(DOC)["a"].blocks_by_tier == {Medium.STORAGE: 2}


def test_salted_and_plain_prefixes_with_the_same_tokens_stay_apart() -> None:
    index = InMemoryPrefixIndex()
    salted_extra: list[Any] = [("s1",), None, None, None]
    index.apply("a", [stored(DOC, 0, 4)])
    index.apply("a", [stored(DOC, 0, 4, salt="s1", extra=salted_extra)])
    # kvroute's connector offloads the salted one, with the same extra keys
    index.apply("a", [stored(DOC, 0, 4, Medium.CPU, salt="s1", extra=salted_extra)])
    index.apply("a", [removed(DOC, [0, 1, 2, 3], salt="s1")])
    plain, salted = index.lookup(DOC)["a"], index.lookup(DOC, cache_salt="s1")["a"]
    assert plain.blocks_by_tier == {Medium.GPU: 4}
    assert salted.blocks_by_tier == {Medium.CPU: 4}
    assert index.lookup(DOC, cache_salt="s2")["a"].blocks == 0


def test_a_hash_stored_twice_is_held_until_removed_twice() -> None:
    index = InMemoryPrefixIndex()
    index.apply("a", [stored(DOC, 0, 1), stored(DOC, 1, 2), stored(DOC, 1, 2)])
    index.apply("a", [removed(DOC, [2])])
    assert index.lookup(DOC)["a"].blocks == 3
    index.apply("a", [removed(DOC, [2])])
    assert index.lookup(DOC)["a"].blocks == 2


def test_a_store_from_the_prompt_start_of_held_blocks_is_idempotent() -> None:
    """vLLM re-announces prefix-cache hits from block 0 (kv_cache_report_mode="full") and
    never removes them again: counting them would keep evicted blocks forever."""
    index = InMemoryPrefixIndex()
    index.apply("a", [stored(DOC, 0, 3), stored(DOC, 0, 3)])
    index.apply("a", [removed(DOC, [0, 1, 2])])
    assert index.lookup(DOC)["a"].blocks == 0


def test_blocks_stored_on_a_second_copy_the_index_let_go_are_indexed_with_it() -> None:
    """A second physical copy of a prompt's start is taken once: the first copy's removal
    drops the block while vLLM still holds the other. vLLM then stores the rest of the
    prompt on that copy (a parent its request holds): the index once rejected that store
    (parent unknown) and predicted nothing; it now resolves it and holds the parent again.
    Found by tests/indexer/subscriber/test_feed_truth.py."""
    index = InMemoryPrefixIndex()
    index.apply("a", [stored(DOC, 0, 1), stored(DOC, 0, 1)])  # two copies of block 0
    index.apply("a", [removed(DOC, [0])])  # the first copy goes
    assert index.lookup(DOC)["a"].blocks == 0  # taken once: low, never high
    result = index.apply("a", [stored(DOC, 1, 3)])  # stored on the copy vLLM still holds
    assert not result.rejected, result.rejected
    assert index.lookup(DOC)["a"].blocks_by_tier == {Medium.GPU: 4}
    index.apply("a", [removed(DOC, [0])])  # the second copy goes: nothing is kept
    assert index.block_tiers("a", DOC)[:2] == [set(), {"GPU"}]
    assert index.lookup(DOC)["a"].blocks == 0


def test_after_a_device_clear_the_index_is_a_fresh_replicas_whatever_came_before() -> None:
    """The hashes a device clear forgets are kept for nothing: a store on one of them as a
    parent is refused as on a replica that never saw them, whether or not the stream had a
    second copy before the clear (which makes the index keep hashes it forgets). A feed
    that joins after the clear skips that history and must end in the same index. Found by
    test_subscriber's moot-history property."""
    tails = []
    for copies in (1, 2):
        index = InMemoryPrefixIndex()
        index.apply("a", [stored(DOC, 0, 1)] * copies)
        index.apply("a", [AllBlocksCleared()])
        result = index.apply("a", [stored(DOC, 1, 1, Medium.CPU)])
        tails.append((result.rejected, index.lookup(DOC)["a"].blocks, index.summary()))
    assert tails[0][0] and tails[0][1] == 0
    assert [(r, b, [(x.entries, x.entries_by_tier) for x in s]) for r, b, s in tails[1:]] == [
        (tails[0][0], tails[0][1], [(x.entries, x.entries_by_tier) for x in tails[0][2]])
    ]


def test_chunks_sharing_blocks_keep_them_until_both_are_gone() -> None:
    """vLLM's offloading connector announces blocks two chunks share once per chunk."""
    index = InMemoryPrefixIndex()
    index.apply("a", [stored(DOC, 0, 4), stored(OTHER, 2, 2)])
    index.apply("a", [stored(DOC, 0, 4, Medium.CPU), stored(OTHER, 0, 4, Medium.CPU)])
    index.apply("a", [removed(DOC, [0, 1, 2, 3]), removed(OTHER, [2, 3])])
    index.apply("a", [removed(DOC, [0, 1, 2, 3], Medium.CPU)])
    # The shared blocks are still held, by OTHER's chunk...
    assert index.block_tiers("a", DOC)[:3] == [{"CPU"}, {"CPU"}, set()]
    # ...which serves OTHER, not DOC: offloading tiers load whole chunks.
    assert index.lookup(DOC)["a"].blocks == 0
    assert index.lookup(OTHER)["a"].blocks_by_tier == {Medium.CPU: 4}


def test_tier_only_chunks_resolve_to_their_blocks_once_the_chunk_length_is_known() -> None:
    """Chunks of 2 blocks named by their last hash: the first two chunks teach the length (the
    first claims only its last block meanwhile), then every chunk is claimed whole, the first
    included. One batch's chunks arrive in any order (vLLM announces them from a set)."""
    index = InMemoryPrefixIndex()
    # Stored before the replica's first tier-only store: its recent parent links are kept.
    index.apply("a", [stored(OTHER, 0, 8), tier_only(OTHER, [1], Medium.CPU)])
    assert index.block_tiers("a", OTHER)[:2] == [{"GPU"}, {"GPU", "CPU"}]  # learning
    index.apply("a", [stored(DOC, 2, 6)])  # DOC hits OTHER's first 2 blocks
    index.apply("a", [tier_only(DOC, [3, 1], Medium.CPU)])  # later chunk first
    assert index.summary()[0].chunk_blocks == {"CPU": 2}
    assert index.block_tiers("a", OTHER)[:2] == [{"GPU", "CPU"}] * 2  # resolved again
    assert index.block_tiers("a", DOC)[:4] == [{"GPU", "CPU"}] * 4
    index.apply("a", [tier_only(DOC, [5, 7], Medium.CPU)])
    index.apply("a", [removed(DOC, [4, 5, 6, 7])])
    match = index.lookup(DOC)["a"]
    assert match.blocks == 8 and match.blocks_by_tier == {Medium.GPU: 4, Medium.CPU: 4}
    # The removal names the last block only, and takes the whole chunk.
    index.apply("a", [BlockRemoved([ehash(tuple(DOC[:32]))], Medium.CPU)])
    assert index.lookup(DOC)["a"].blocks == 6
    # DOC 0-1 (also OTHER's, held twice), DOC 2-3 and DOC 4-5
    assert index.summary()[0].entries_by_tier["CPU"] == 6
    index.apply("a", [removed(DOC, [0, 1, 2, 3])])
    assert index.lookup(DOC)["a"].blocks_by_tier == {Medium.CPU: 6}


def test_the_same_chunk_stored_twice_does_not_teach_a_chunk_length() -> None:
    """A chunk announced again (re-offloaded after a device hit) walks the same blocks: it is
    one observation, not two, so it cannot settle a length that a lost self-describing store
    had said otherwise. Found by the lossy-join property in test_subscriber.py."""
    index = InMemoryPrefixIndex()
    index.apply("a", [stored(DOC, 0, 2), tier_only(DOC, [1], Medium.CPU)])
    index.apply("a", [tier_only(DOC, [1], Medium.CPU)])
    assert index.summary()[0].chunk_blocks == {}
    assert index.block_tiers("a", DOC)[:2] == [{"GPU"}, {"GPU", "CPU"}]  # only what was named


def test_device_reset_clears_the_device_tier_only() -> None:
    """vLLM's /reset_prefix_cache: the block pool sends AllBlocksCleared (no medium) and keeps
    the offloaded tiers."""
    index = InMemoryPrefixIndex()
    index.apply("a", [stored(DOC, 0, 3), stored(DOC, 0, 2, Medium.CPU)])
    index.apply("a", [AllBlocksCleared()])
    assert index.lookup(DOC)["a"].blocks_by_tier == {Medium.CPU: 2}
    index.apply("a", [AllBlocksCleared(Medium.CPU)])
    assert index.lookup(DOC)["a"].blocks == 0


def test_partial_blocks_extend_a_match_past_its_full_blocks() -> None:
    """vLLM publishes a prompt tail ending inside a block as a partial block of the
    prefix-match unit (here 2 tokens of a 4-token block), parented on the last full block."""
    index = InMemoryPrefixIndex()
    index.apply("a", [stored(DOC, 0, 2)])
    tail = BlockStored(
        [ehash(tuple(DOC[:10]))], ehash(tuple(DOC[:8])), DOC[8:10], 2, extra_keys=[None]
    )
    result = index.apply("a", [tail])
    assert result.partial_blocks == 1 and result.rejected == []
    match = index.lookup(DOC)["a"]
    assert (match.blocks, match.partial_tokens, match.tokens) == (2, 2, 10)
    assert match.partial_unit == 2  # what a prediction rounds the partial tokens to
    assert match.tokens_in(Medium.GPU) == 10
    assert index.lookup(DOC[:9])["a"].partial_tokens == 0  # the piece is not all there
    assert index.lookup([*DOC[:8], 7, 7])["a"].partial_tokens == 0
    index.apply("a", [BlockRemoved(tail.block_hashes)])
    assert index.lookup(DOC)["a"].tokens == 8


def test_partial_blocks_first_then_the_real_block_size() -> None:
    """A replica whose first store is a short prompt's partial block: the block size learned
    from it is replaced once a full block shows the real one."""
    index = InMemoryPrefixIndex()
    index.apply("a", [BlockStored([ehash(tuple(DOC[:2]))], None, DOC[:2], 2, extra_keys=[None])])
    assert index.block_size("a") == 2
    result = index.apply("a", [stored(DOC, 0, 2)])
    assert result.rejected == [] and index.block_size("a") == BS
    assert index.partial_unit("a") == 2 and index.lookup(DOC)["a"].blocks == 2


def test_lmcache_chunks_are_rechunked_unconfirmed_and_age_out() -> None:
    now = [0.0]
    index = InMemoryPrefixIndex(unconfirmed_ttl_s=10.0, clock=lambda: now[0])
    index.apply("a", [stored(DOC, 0, 1)])  # the device teaches the block size
    chunks = [
        lmcache_chunk(DOC, 0, 8, 111, None),
        lmcache_chunk(DOC, 8, 8, 222, 111),
        lmcache_chunk(DOC, 16, 6, 333, 222),  # a final partial chunk: one full block in it
    ]
    result = index.apply("a", chunks)
    assert result.rejected == [] and result.unconfirmed_blocks == 5
    assert index.summary()[0].unconfirmed_by_tier == {"GPU": 0, "CPU": 5, "STORAGE": 0}
    match = index.lookup(DOC)["a"]
    # The device's block, then LMCache's: whole chunks (its partial last one does not count).
    assert match.blocks == 4
    assert match.blocks_by_tier == {Medium.GPU: 1}
    assert match.unconfirmed_by_tier == {Medium.CPU: 3} and match.unconfirmed_tokens == 12
    now[0] = 6.0
    index.apply("a", [chunks[0]])  # stored again: its time starts over
    now[0] = 11.0
    assert index.expire("a") == 3
    assert index.lookup(DOC)["a"].blocks == 2
    now[0] = 17.0
    assert index.expire() == 2 and index.lookup(DOC)["a"].blocks == 1


def test_unconfirmed_holdings_are_capped_per_replica() -> None:
    index = InMemoryPrefixIndex(unconfirmed_max_blocks=4)
    index.apply("a", [stored(DOC, 0, 1)])
    index.apply("a", [lmcache_chunk(DOC, 0, 8, 111, None), lmcache_chunk(DOC, 8, 8, 222, 111)])
    index.apply("a", [lmcache_chunk(DOC, 16, 8, 333, 222)])
    assert index.summary()[0].unconfirmed_by_tier["CPU"] == 4
    assert index.lookup(DOC)["a"].blocks == 1  # the oldest chunk went: the chain breaks there


def test_an_fs_stream_resolves_through_the_device_stream_and_keeps_its_own_history() -> None:
    """llm-d's FS backend: tier-only SHARED_STORAGE stores on a stream of their own."""
    index = InMemoryPrefixIndex()
    fs = {"medium": Medium.STORAGE, "confirmed": False, "medium_name": "SHARED_STORAGE"}
    index.apply("a", [stored(OTHER, 0, 8)], source="vllm")
    # Two chunks in one batch teach the length (2 blocks) at once.
    index.apply("a", [tier_only(OTHER, [1, 3], **fs)], source="fs")
    assert index.summary()[0].chunk_blocks == {"STORAGE_UNCONFIRMED": 2}
    learn, doc = list(range(300, 332)), list(range(500, 532))
    index.apply("a", [stored(learn, 0, 8), stored(doc, 0, 8)], source="vllm")
    index.apply("a", [tier_only(learn, [1, 3], **fs)], source="fs")
    index.apply("a", [tier_only(doc, [1, 3, 5, 7], **fs)], source="fs")
    index.apply("a", [removed(doc, list(range(8)))], source="vllm")
    match = index.lookup(doc)["a"]
    assert match.blocks == 8 and match.unconfirmed_by_tier == {Medium.STORAGE: 8}
    # A gap in the device stream clears what removals it may have missed, not the FS tier.
    index.clear_source("a", "vllm", restarted=False)
    assert index.lookup(doc)["a"].unconfirmed_by_tier == {Medium.STORAGE: 8}
    assert index.lookup(learn)["a"].unconfirmed_by_tier == {Medium.STORAGE: 4}
    index.clear_source("a", "fs", restarted=False)  # it never removes: nothing to clear
    assert index.lookup(doc)["a"].blocks == 8
    index.clear_source("a", "fs", restarted=True)
    assert index.lookup(doc)["a"].blocks == 0


def test_a_lying_publisher_costs_its_own_entries_only() -> None:
    index = InMemoryPrefixIndex()
    index.apply("honest", [stored(DOC, 0, 4), stored(DOC, 0, 2, Medium.CPU)])
    index.apply("liar", [stored(list(range(700, 708)), 0, 2)])
    lies = [
        BlockStored([1], 999, DOC[:4], BS, extra_keys=[None]),  # unknown parent
        BlockStored([2, 3], None, DOC[:16], 8, extra_keys=[None, None]),  # another block size
        removed(DOC, [0, 1, 2, 3]),  # removals of blocks it never held
        BlockRemoved([123456], Medium.CPU),
        tier_only(DOC, [3], Medium.CPU),  # tier-only stores of blocks it never held
        stored(DOC, 0, 4, Medium.CPU, with_extra_keys=False),
    ]
    result = index.apply("liar", lies)
    assert len(result.rejected) == 2 and "parent" in result.rejected[0]
    assert "block_size" in result.rejected[1]
    assert result.unresolved == 4 + 1 + 1 + 4
    match = index.lookup(DOC)["honest"]
    assert match.blocks == 4 and match.blocks_by_tier == {Medium.GPU: 4}
    index.apply("liar", [stored(DOC, 0, 4), AllBlocksCleared(), removed(DOC, [0], Medium.CPU)])
    assert index.lookup(DOC)["honest"].blocks_by_tier == {Medium.GPU: 4}
    assert index.lookup(DOC)["liar"].blocks == 0


def test_replica_removal_and_slot_reuse() -> None:
    index = InMemoryPrefixIndex()
    index.apply("a", [stored(DOC, 0, 2)])
    index.apply("b", [stored(DOC, 0, 2)])
    index.remove_replica("a")
    assert "a" not in index.lookup(DOC) and index.lookup(DOC)["b"].blocks == 2
    index.apply("c", [stored(DOC, 0, 1)])
    assert index.lookup(DOC)["c"].blocks == 1 and index.lookup(DOC)["b"].blocks == 2


def test_lora_blocks_only_match_their_own_requests() -> None:
    index = InMemoryPrefixIndex()
    event = stored(DOC, 0, 2, extra=[("sql",), ("sql",)])
    index.apply("a", [event])
    assert index.lookup(DOC)["a"].blocks == 0
    assert index.lookup(DOC, lora_name="sql")["a"].blocks == 2
    # Older vLLM sent lora_name without extra_keys: the name is the extra key.
    index.apply("b", [stored(DOC, 0, 2, lora_name="sql", with_extra_keys=False)])
    assert index.lookup(DOC, lora_name="sql")["b"].blocks == 2


def test_replicas_with_other_block_sizes_are_keyed_at_their_size() -> None:
    index = InMemoryPrefixIndex()
    index.apply("a", [stored(DOC, 0, 4)])
    hashes = [ehash(tuple(DOC[: (b + 1) * 8])) for b in range(2)]
    index.apply("b", [BlockStored(hashes, None, DOC[:16], 8, extra_keys=[None, None])])
    match = index.lookup(RequestKeys(DOC))
    assert match["a"].tokens == 16 and match["b"].tokens == 16


def test_the_default_cap_is_a_memory_budget_per_core() -> None:
    """About 8 GiB at each core's bytes per entry: a thousand GPU replicas of 30,000 device
    and 100,000 CPU blocks (130M entries) fit on the native core."""
    assert InMemoryPrefixIndex(core="python").max_entries == (8 << 30) // 192
    if InMemoryPrefixIndex().stats().index_core == "native":
        assert InMemoryPrefixIndex().max_entries == (8 << 30) // 64 >= 1000 * 130_000


def test_entry_cap_evicts_oldest_and_counts() -> None:
    index = InMemoryPrefixIndex(max_entries=6)
    index.apply("a", [stored(DOC, 0, 8)])
    assert index.entries <= 6 and index.evicted_entries >= 2
    assert index.lookup(DOC)["a"].blocks == 0  # the oldest (first) blocks went
    figures = index.stats()
    assert (figures.max_entries, figures.evicted_entries) == (6, index.evicted_entries)
    assert figures.distinct_blocks == index.entries


def test_stats_are_what_the_interface_reports() -> None:
    """``/index/stats`` is built from the interface alone (``summary`` and ``stats``)."""
    index = InMemoryPrefixIndex(unconfirmed_ttl_s=5.0, unconfirmed_max_blocks=7)
    index.apply("a", [stored(DOC, 0, 3)])
    body = collect_stats(index).to_dict()["fleet"]
    figures = index.stats()
    assert body["entries"] == 3 and body["distinct_blocks"] == figures.distinct_blocks == 3
    assert body["estimated_bytes"] == figures.estimated_bytes > 0
    assert body["unconfirmed"]["ttl_s"] == 5.0
    assert body["unconfirmed"]["max_blocks_per_replica"] == 7


def test_memory_estimate_grows_with_entries() -> None:
    index = InMemoryPrefixIndex()
    empty = index.estimated_bytes()
    index.apply("a", [stored(list(range(4000)), 0, 1000)])
    assert index.estimated_bytes() > empty + 1000 * 72


@pytest.mark.parametrize("medium", [Medium.CPU, Medium.STORAGE])
def test_lower_tier_store_of_another_block_size_is_rejected(medium: Medium) -> None:
    index = InMemoryPrefixIndex()
    index.apply("a", [stored(DOC, 0, 2)])
    event = BlockStored([5], None, DOC[:8], 8, medium=medium, extra_keys=[None])
    assert "block_size" in index.apply("a", [event]).rejected[0]
