"""EAGLE-style speculative decoding (indexer/index/drafts.py): vLLM drops the last block of the
device hit (after capping it at the prompt's length - 1), the SimpleCPUOffloadConnector's pool
one block of its hit, and vLLM's OffloadingConnector one chunk for an annotated drafter
(``mtp``, ``dspark``). The router's prediction (``predicted_cached_tokens``) must equal that.
tests/indexer/index/test_hybrid_vllm.py checks the same against vLLM's own scheduler."""

from __future__ import annotations

import pytest

from kvroute.indexer.index import InMemoryPrefixIndex, drops_block
from kvroute.indexer.wire import Medium
from kvroute.router.routing.router import predicted_cached_tokens
from tests.indexer.builders import BS, DOC, removed, stored, tier_only


def _predicted(index: InMemoryPrefixIndex, tokens: list[int], replica: str = "a") -> int:
    match = index.lookup(tokens)[replica]
    return predicted_cached_tokens(match.tokens, len(tokens), match.block_size)


@pytest.mark.parametrize("method", ["eagle", "EAGLE3", "mtp", "dflash", "dspark"])
def test_an_eagle_replica_is_predicted_one_block_lower(method: str) -> None:
    index = InMemoryPrefixIndex()
    index.apply("a", [stored(DOC, 0, 5)])
    index.apply("b", [stored(DOC, 0, 5)])
    index.set_speculative("a", method)
    prompt = DOC[: 7 * BS]
    assert _predicted(index, prompt, "b") == 5 * BS
    assert _predicted(index, prompt, "a") == 4 * BS
    assert index.lookup(prompt)["a"].blocks_by_tier == {Medium.GPU: 4}


@pytest.mark.parametrize("method", ["ngram", "ngram_gpu", "suffix", "draft_model", None])
def test_methods_without_the_drop_change_nothing(method: str | None) -> None:
    assert not drops_block(method)
    index = InMemoryPrefixIndex()
    index.apply("a", [stored(DOC, 0, 5)])
    index.set_speculative("a", method)
    assert _predicted(index, DOC[: 7 * BS]) == 5 * BS


def test_the_drop_comes_after_the_prompt_length_cap() -> None:
    """vLLM caps the hit at the prompt's length - 1 first: a block-aligned prompt of 3 blocks
    all held hits 2 blocks, then EAGLE drops one: 1 (not min(3 - 1, 2) = 2)."""
    index = InMemoryPrefixIndex()
    index.apply("a", [stored(DOC, 0, 5)])
    index.set_speculative("a", "eagle")
    assert _predicted(index, DOC[: 3 * BS]) == 1 * BS
    assert _predicted(index, DOC[: 3 * BS + 1]) == 2 * BS
    assert _predicted(index, DOC[: 1 * BS]) == 0


def test_the_setting_is_kept_across_a_clear_and_dropped_with_the_replica() -> None:
    index = InMemoryPrefixIndex()
    index.set_speculative("a", "mtp")
    index.apply("a", [stored(DOC, 0, 5)])
    index.clear_replica("a")
    index.apply("a", [stored(DOC, 0, 5)])
    assert _predicted(index, DOC) == 4 * BS
    index.set_speculative("a", None)
    assert _predicted(index, DOC) == 5 * BS
    index.set_speculative("a", "eagle")
    index.remove_replica("a")
    index.apply("a", [stored(DOC, 0, 5)])
    assert _predicted(index, DOC) == 5 * BS


def test_a_lower_tier_serves_the_dropped_block_from_the_device_end() -> None:
    """kvroute's connector (no drop of its own): the block the device hit lost is loaded from
    the CPU copy, so the hit stays whole; a CPU tier without it ends the hit there."""
    index = InMemoryPrefixIndex()
    index.apply("a", [stored(DOC, 0, 4), stored(DOC, 0, 6, Medium.CPU)])
    index.set_speculative("a", "eagle")
    match = index.lookup(DOC)["a"]
    assert match.blocks == 6 and match.blocks_by_tier == {Medium.GPU: 3, Medium.CPU: 3}
    index.apply("b", [stored(DOC, 0, 4), stored(DOC, 4, 2, Medium.CPU)])
    index.set_speculative("b", "eagle")
    match = index.lookup(DOC)["b"]
    assert match.blocks == 3 and match.blocks_by_tier == {Medium.GPU: 3}


def _offloaded(index: InMemoryPrefixIndex, replica: str, chunks: int) -> None:
    """vLLM's OffloadingConnector with 2-block chunks (tier-only stores naming each chunk's
    last block; the length is learned from two chunks); the device then keeps blocks 0-1."""
    index.apply(replica, [stored(DOC, 0, 8)])
    index.apply(replica, [tier_only(DOC, [2 * c + 1], Medium.CPU) for c in range(chunks)])
    index.apply(replica, [removed(DOC, list(range(2, 8)))])


@pytest.mark.parametrize(
    ("method", "device", "cpu"),
    [(None, 2, 4), ("eagle", 1, 5), ("eagle3", 1, 5), ("dflash", 1, 5), ("mtp", 1, 3)],
)
def test_the_offloading_connector_pops_a_chunk_for_an_annotated_drafter(
    method: str | None, device: int, cpu: int
) -> None:
    """Device blocks 0-1, CPU chunks 0-2 (blocks 0-5), a 32-token prompt. Without drafts:
    device 2, then chunks 1-2 (4 blocks). EAGLE: device 1; the connector starts at that
    block's chunk (0) and serves chunks 0-2, blocks 1-5; an ``mtp`` drafter's group is
    annotated, so the connector pops one chunk: blocks 1-3."""
    index = InMemoryPrefixIndex()
    _offloaded(index, "a", 3)
    index.set_speculative("a", method)
    match = index.lookup(DOC)["a"]
    assert match.blocks_by_tier == {Medium.GPU: device, Medium.CPU: cpu}
    assert match.blocks == device + cpu


def test_the_offloading_connector_loads_nothing_short_of_a_chunk_after_its_pop() -> None:
    """One CPU chunk past the device's: ``mtp`` pops it, and a load shorter than a chunk is
    skipped (the connector's "less than a chunk")."""
    index = InMemoryPrefixIndex()
    _offloaded(index, "a", 2)
    index.set_speculative("a", "mtp")
    match = index.lookup(DOC)["a"]
    assert match.blocks_by_tier == {Medium.GPU: 1} and match.blocks == 1


def test_the_simple_cpu_pool_drops_a_block_of_its_hit() -> None:
    """The SimpleCPUOffloadConnector's pool (a block pool of its own: ``pool_tier``) is looked
    up by a coordinator built with the same flag: its hit past the device's loses a block."""
    index = InMemoryPrefixIndex()
    pool = stored(DOC, 0, 6, Medium.CPU)
    pool.pool_tier = True
    index.apply("a", [stored(DOC, 0, 2), pool])
    index.set_speculative("a", "eagle")
    match = index.lookup(DOC)["a"]
    # device 2 -> 1; the pool holds blocks 1-5 and serves them less its last: 1-4
    assert match.blocks == 5 and match.blocks_by_tier == {Medium.GPU: 1, Medium.CPU: 4}
