"""The prefix index: unit tests per rule, and a property test against a plain reference model."""

from __future__ import annotations

import hashlib

from hypothesis import given, settings
from hypothesis import strategies as st

from indexer.index import InMemoryPrefixIndex
from indexer.wire import AllBlocksCleared, BlockRemoved, BlockStored, Medium

BS = 4


def ehash(tokens: tuple[int, ...], salt: str = "") -> int:
    """A vLLM-like engine hash: a digest of the whole prefix, as an int (not our keys)."""
    digest = hashlib.sha256(repr((salt, tokens)).encode()).digest()
    return int.from_bytes(digest[-8:], "big")


def stored(tokens: list[int], start: int, n: int, medium: Medium = Medium.GPU) -> BlockStored:
    """BlockStored for blocks [start, start+n) of ``tokens``, as vLLM would publish it."""
    hashes = [ehash(tuple(tokens[: (b + 1) * BS])) for b in range(start, start + n)]
    parent = None if start == 0 else ehash(tuple(tokens[: start * BS]))
    return BlockStored(hashes, parent, tokens[start * BS : (start + n) * BS], BS, medium=medium)


def removed(tokens: list[int], blocks: list[int], medium: Medium = Medium.GPU) -> BlockRemoved:
    return BlockRemoved([ehash(tuple(tokens[: (b + 1) * BS])) for b in blocks], medium)


DOC = list(range(100, 132))  # 8 blocks


def test_store_and_lookup_longest_prefix_per_tier() -> None:
    index = InMemoryPrefixIndex()
    index.apply("a", [stored(DOC, 0, 3), stored(DOC, 3, 2, Medium.CPU)])
    index.apply("b", [stored(DOC, 0, 1)])
    match = index.lookup(DOC)
    assert match["a"].blocks == 5 and match["a"].tokens == 20
    assert match["a"].blocks_by_tier == {Medium.GPU: 3, Medium.CPU: 2}
    assert match["b"].blocks == 1
    assert index.lookup([1, 2, 3, 4, *DOC])["a"].blocks == 0


def test_duplicate_store_is_idempotent() -> None:
    index = InMemoryPrefixIndex()
    for _ in range(3):
        result = index.apply("a", [stored(DOC, 0, 2)])
    assert result.blocks_stored == 0 and result.applied == 1
    assert index.entries == 2
    assert index.summary()[0].entries_by_tier == {"GPU": 2, "CPU": 0, "STORAGE": 0}


def test_tier_removal_leaves_other_tiers_alone() -> None:
    index = InMemoryPrefixIndex()
    index.apply("a", [stored(DOC, 0, 2), stored(DOC, 0, 2, Medium.CPU)])
    index.apply("a", [removed(DOC, [0, 1])])
    match = index.lookup(DOC)["a"]
    assert match.blocks == 2 and match.blocks_by_tier == {Medium.CPU: 2}
    index.apply("a", [removed(DOC, [1], Medium.CPU)])
    assert index.lookup(DOC)["a"].blocks == 1
    assert index.entries == 1


def test_tier_only_events_resolve_through_engine_hashes() -> None:
    index = InMemoryPrefixIndex()
    index.apply("a", [stored(DOC, 0, 2)])
    full = stored(DOC, 0, 2)
    tier_only = BlockStored(full.block_hashes, None, [], 0, medium=Medium.STORAGE)
    result = index.apply("a", [tier_only, BlockStored([12345], None, [], 0, medium=Medium.CPU)])
    assert result.unresolved == 1
    index.apply("a", [removed(DOC, [0, 1])])
    assert index.lookup(DOC)["a"].blocks_by_tier == {Medium.STORAGE: 2}


def test_all_blocks_cleared_and_replica_removal() -> None:
    index = InMemoryPrefixIndex()
    index.apply("a", [stored(DOC, 0, 2)])
    index.apply("b", [stored(DOC, 0, 2)])
    index.apply("a", [AllBlocksCleared()])
    assert index.lookup(DOC)["a"].blocks == 0 and index.lookup(DOC)["b"].blocks == 2
    index.remove_replica("b")
    assert "b" not in index.lookup(DOC)
    assert index.entries == 0 and index.distinct_blocks == 0


def test_cleared_tier_only() -> None:
    index = InMemoryPrefixIndex()
    index.apply("a", [stored(DOC, 0, 2), stored(DOC, 0, 2, Medium.CPU)])
    index.apply("a", [AllBlocksCleared(medium=Medium.GPU)])
    assert index.lookup(DOC)["a"].blocks_by_tier == {Medium.CPU: 2}


def test_unknown_parent_and_block_size_mismatch_are_rejected() -> None:
    index = InMemoryPrefixIndex()
    result = index.apply("a", [stored(DOC, 2, 1)])
    assert result.applied == 0 and "parent" in result.rejected[0]
    index.apply("a", [stored(DOC, 0, 1)])
    odd = BlockStored([1], None, [1, 2], 2)
    result = index.apply("a", [odd])
    assert "block_size" in result.rejected[0]
    assert index.block_size("a") == BS


def test_lora_and_salted_blocks_only_match_their_own_requests() -> None:
    index = InMemoryPrefixIndex()
    event = stored(DOC, 0, 2)
    event.lora_name = "sql"
    index.apply("a", [event])
    assert index.lookup(DOC)["a"].blocks == 0
    assert index.lookup(DOC, lora_name="sql")["a"].blocks == 2
    salted = stored(DOC, 0, 2)
    salted.extra_keys = [("s1",), None]
    index.apply("b", [salted])
    assert index.lookup(DOC, replicas=["b"])["b"].blocks == 0
    assert index.lookup(DOC, cache_salt="s1", replicas=["b"])["b"].blocks == 2
    assert index.lookup(DOC, cache_salt="s2", replicas=["b"])["b"].blocks == 0


def test_replicas_with_other_block_sizes_are_keyed_at_their_size() -> None:
    index = InMemoryPrefixIndex()
    index.apply("a", [stored(DOC, 0, 2)])
    index.apply("big", [BlockStored([7], None, DOC[:8], 8)])
    match = index.lookup(DOC)
    assert (match["a"].blocks, match["a"].tokens) == (2, 8)
    assert (match["big"].blocks, match["big"].tokens) == (1, 8)


def test_entry_cap_evicts_oldest_and_counts() -> None:
    index = InMemoryPrefixIndex(max_entries=5)
    index.apply("a", [stored(DOC, 0, 8)])
    assert index.entries <= 5 and index.evicted_entries >= 3
    # the oldest (the prefix's head) went first, so the prefix no longer matches from 0
    assert index.lookup(DOC)["a"].blocks == 0
    assert sum(index.summary()[0].entries_by_tier.values()) == index.entries


def test_memory_estimate_grows_with_entries() -> None:
    index = InMemoryPrefixIndex()
    empty = index.estimated_bytes()
    index.apply("a", [stored(list(range(4000)), 0, 1000)])
    assert index.estimated_bytes() > empty + 1000 * 72


# --- property test ------------------------------------------------------------------------------


class Reference:
    """The obvious model: per replica, engine hash -> (full token prefix, set of tiers)."""

    def __init__(self) -> None:
        self.held: dict[str, dict[int, tuple[tuple[int, ...], set[Medium]]]] = {}

    def apply(self, replica: str, event: object) -> None:
        held = self.held.setdefault(replica, {})
        if isinstance(event, BlockStored):
            if event.token_ids:
                if event.parent_block_hash is None:
                    prefix: tuple[int, ...] = ()
                elif event.parent_block_hash in held:
                    prefix = held[event.parent_block_hash][0]
                else:
                    return  # rejected: unknown parent
                for i, h in enumerate(event.block_hashes):
                    prefix = prefix + tuple(event.token_ids[i * BS : (i + 1) * BS])
                    tiers = held[h][1] if h in held else set()
                    held[h] = (prefix, tiers | {event.medium})
            else:
                for h in event.block_hashes:
                    if h in held:
                        held[h][1].add(event.medium)
        elif isinstance(event, BlockRemoved):
            for h in event.block_hashes:
                if h in held:
                    held[h][1].discard(event.medium)
                    if not held[h][1]:
                        del held[h]
        elif isinstance(event, AllBlocksCleared):
            held.clear()

    def lookup(self, tokens: list[int]) -> dict[str, tuple[int, dict[Medium, int]]]:
        out = {}
        for replica, held in self.held.items():
            by_prefix: dict[tuple[int, ...], set[Medium]] = {}
            for prefix, tiers in held.values():
                by_prefix.setdefault(prefix, set()).update(tiers)
            n, tiers_count = 0, {}
            while (n + 1) * BS <= len(tokens) and tuple(tokens[: (n + 1) * BS]) in by_prefix:
                best = min(by_prefix[tuple(tokens[: (n + 1) * BS])])
                tiers_count[best] = tiers_count.get(best, 0) + 1
                n += 1
            out[replica] = (n, tiers_count)
        return out


# Two documents sharing their first two blocks, so replicas hold overlapping prefixes.
DOCS = [list(range(24)), list(range(8)) + list(range(500, 516))]
replica_st = st.sampled_from(["r0", "r1", "r2"])
doc_st = st.integers(0, len(DOCS) - 1)
medium_st = st.sampled_from(list(Medium))


@st.composite
def operation(draw: st.DrawFn) -> tuple[str, object]:
    replica = draw(replica_st)
    doc = DOCS[draw(doc_st)]
    n_blocks = len(doc) // BS
    kind = draw(st.sampled_from(["store", "store", "store", "tier_only", "remove", "clear"]))
    if kind == "store":
        start = draw(st.integers(0, n_blocks - 1))
        n = draw(st.integers(1, n_blocks - start))
        return replica, stored(doc, start, n, draw(medium_st))
    if kind == "tier_only":
        blocks = draw(st.lists(st.integers(0, n_blocks - 1), min_size=1, max_size=3))
        hashes = [ehash(tuple(doc[: (b + 1) * BS])) for b in blocks]
        return replica, BlockStored(hashes, None, [], 0, medium=draw(medium_st))
    if kind == "remove":
        blocks = draw(st.lists(st.integers(0, n_blocks - 1), min_size=1, max_size=3))
        return replica, removed(doc, blocks, draw(medium_st))
    return replica, AllBlocksCleared()


@settings(max_examples=300, deadline=None)
@given(st.lists(operation(), max_size=30))
def test_index_agrees_with_reference_model(ops: list[tuple[str, object]]) -> None:
    index = InMemoryPrefixIndex()
    ref = Reference()
    for replica, event in ops:
        index.add_replica(replica)
        index.apply(replica, [event])  # type: ignore[list-item]
        ref.apply(replica, event)
    for doc in DOCS:
        for length in (len(doc), 9, 4):
            got = index.lookup(doc[:length])
            want = ref.lookup(doc[:length])
            for replica, (blocks, tiers) in want.items():
                match = got[replica]
                assert match.blocks == blocks, (replica, doc[:length])
                assert match.blocks_by_tier == tiers
    for summary in index.summary():
        held = ref.held.get(summary.replica, {})
        assert summary.entries == len(held)
        for tier in Medium:
            assert summary.entries_by_tier[tier.name] == sum(tier in t for _, t in held.values())
