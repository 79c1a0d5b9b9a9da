"""The simulator's tiered prefix cache, and the index that its events build.

The agreement checks are the point of the simulator ("never hides a mismatch"): every change
the cache makes is published as vLLM events, and an ``InMemoryPrefixIndex`` fed only those
events, decoded from the wire bytes, must answer every lookup exactly as the cache itself.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvroute.bench.sim.cache import Allocation, TieredPrefixCache
from kvroute.bench.sim.hashing import EngineHasher, digest_to_int
from kvroute.indexer.index import InMemoryPrefixIndex
from kvroute.indexer.keys import request_extra_keys
from kvroute.indexer.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Medium,
    decode_batch,
    encode_batch,
)

BS = 4
HASHER = EngineHasher()


def _prompt(*block_ids: int, tail: int = 1) -> list[int]:
    """Blocks of BS tokens named by ids (same id, same block content), plus a partial tail."""
    tokens: list[int] = []
    for b in block_ids:
        tokens += [b * 10 + i for i in range(BS)]
    return tokens + [999] * tail


def _run(cache: TieredPrefixCache, tokens: list[int], max_tokens: int = 1) -> Allocation:
    """Admit, compute and finish one request (no output blocks)."""
    digests = HASHER.chain(tokens, BS)
    alloc = cache.allocate(digests, len(tokens), -(-(len(tokens) + max_tokens) // BS))
    assert alloc is not None
    cache.commit(alloc, tokens, digests)
    cache.release(alloc)
    cache.check_invariants()
    return alloc


def _tiers(cache: TieredPrefixCache, tokens: list[int]) -> list[Medium | None]:
    return [cache.tier_of(d) for d in HASHER.chain(tokens, BS)]


class _Mirror:
    """An index fed with the cache's events through the wire encoding, as a subscriber would."""

    def __init__(self) -> None:
        self.index = InMemoryPrefixIndex()

    def feed(self, cache: TieredPrefixCache) -> None:
        events = cache.take_events()
        if not events:
            return
        batch = decode_batch(encode_batch(events, ts=0.0))
        assert not batch.rejected
        result = self.index.apply("r", batch.events)
        assert not result.rejected, result.rejected
        assert result.unresolved == 0

    def assert_agrees(self, cache: TieredPrefixCache, prompts: list[list[int]]) -> None:
        contents = cache.contents()
        summary = {s.replica: s for s in self.index.summary()}.get("r")
        by_tier = summary.entries_by_tier if summary else {}
        for tier in Medium:
            assert by_tier.get(tier.name, 0) == len(contents[tier]), tier
        for tokens in prompts:
            digests = HASHER.chain(tokens, BS)
            held = cache.match(digests)
            match = self.index.lookup(tokens, replicas=["r"]).get("r")
            blocks = match.blocks if match else 0
            assert blocks == len(held), (tokens, blocks, len(held))
            if held:
                want = {t: sum(1 for b in held if b.tier is t) for t in Medium}
                assert {t: match.blocks_by_tier.get(t, 0) for t in Medium} == want


def test_hit_and_last_token_rule() -> None:
    cache = TieredPrefixCache(BS, gpu_blocks=32)
    _run(cache, _prompt(1, 2, 3))
    digests = HASHER.chain(_prompt(1, 2, 3), BS)
    alloc = cache.allocate(digests, len(_prompt(1, 2, 3)), 4)
    assert alloc is not None and alloc.hit_blocks == 3
    cache.release(alloc)
    # A prompt of exactly three blocks: its last token must be computed, so two blocks hit.
    exact = _prompt(1, 2, 3, tail=0)
    alloc = cache.allocate(HASHER.chain(exact, BS), len(exact), 4)
    assert alloc is not None and alloc.hit_blocks == 2
    cache.release(alloc)
    cache.check_invariants()


def test_lru_evicts_tail_first_and_least_recent() -> None:
    cache = TieredPrefixCache(BS, gpu_blocks=6)
    _run(cache, _prompt(1, 2, 3))  # 3 cached + 1 private while running
    _run(cache, _prompt(4, 5))
    # Needs 3 blocks: only 1 is free, so 2 are evicted: request A's tail (3, then 2).
    _run(cache, _prompt(6, 7))
    assert _tiers(cache, _prompt(1, 2, 3)) == [Medium.GPU, None, None]
    assert _tiers(cache, _prompt(4, 5)) == [Medium.GPU, Medium.GPU]


def test_demotion_chain_and_promotion_on_hit() -> None:
    cache = TieredPrefixCache(BS, gpu_blocks=3, cpu_blocks=2, storage_blocks=2)
    _run(cache, _prompt(1, 2))
    _run(cache, _prompt(3, 4))  # evicts 2 then 1 to CPU
    assert _tiers(cache, _prompt(1, 2)) == [Medium.CPU, Medium.CPU]
    _run(cache, _prompt(5, 6))  # 3, 4 to CPU; CPU pushes 1, 2 down to STORAGE
    assert _tiers(cache, _prompt(1, 2)) == [Medium.STORAGE, Medium.STORAGE]
    assert _tiers(cache, _prompt(3, 4)) == [Medium.CPU, Medium.CPU]
    digests = HASHER.chain(_prompt(1, 2), BS)
    alloc = cache.allocate(digests, len(_prompt(1, 2)), 3)
    assert alloc is not None
    assert alloc.hit_tiers == [Medium.STORAGE, Medium.STORAGE]
    assert _tiers(cache, _prompt(1, 2)) == [Medium.GPU, Medium.GPU]
    cache.release(alloc)
    cache.check_invariants()


def test_blocks_in_use_are_never_evicted() -> None:
    cache = TieredPrefixCache(BS, gpu_blocks=5)
    tokens = _prompt(1, 2, 3)
    digests = HASHER.chain(tokens, BS)
    held = cache.allocate(digests, len(tokens), 4)
    assert held is not None
    cache.commit(held, tokens, digests)
    # One block left: a request needing two must wait (None), not steal a block in use.
    other = _prompt(7)
    assert cache.allocate(HASHER.chain(other, BS), len(other), 2) is None
    assert _tiers(cache, tokens) == [Medium.GPU] * 3
    assert cache.reset() is False  # vLLM refuses to reset while requests hold blocks
    cache.release(held)
    assert cache.allocate(HASHER.chain(other, BS), len(other), 2) is not None
    cache.check_invariants()


def test_drop_takes_descendants_and_events_stay_resolvable() -> None:
    cache = TieredPrefixCache(BS, gpu_blocks=4, cpu_blocks=1)
    mirror = _Mirror()
    _run(cache, _prompt(1, 2))
    mirror.feed(cache)
    _run(cache, _prompt(3, 4, 5))
    mirror.feed(cache)
    # Block 2 went to CPU and out again: block 1 (its parent) may linger only if it has no
    # orphaned children, and every event still names known parents (mirror asserts that).
    mirror.assert_agrees(cache, [_prompt(1, 2), _prompt(3, 4, 5)])
    cache.check_invariants()


def test_events_are_vllm_shaped() -> None:
    cache = TieredPrefixCache(BS, gpu_blocks=4, cpu_blocks=4)
    _run(cache, _prompt(1, 2))
    stored = cache.take_events()
    assert len(stored) == 1 and isinstance(stored[0], BlockStored)
    ev = stored[0]
    digests = HASHER.chain(_prompt(1, 2), BS)
    assert ev.block_hashes == [digest_to_int(d) for d in digests]
    assert ev.parent_block_hash is None and ev.block_size == BS and ev.medium is Medium.GPU
    assert ev.token_ids == _prompt(1, 2, tail=0)
    _run(cache, _prompt(1, 2))  # a pure hit: reuse is not re-announced
    assert cache.take_events() == []
    _run(cache, _prompt(3, 4, 5))  # demotes block 2 then 1: store to CPU before removal
    events = cache.take_events()
    kinds = [(type(e).__name__, e.medium) for e in events if not isinstance(e, AllBlocksCleared)]
    assert kinds[:2] == [("BlockStored", Medium.CPU), ("BlockRemoved", Medium.GPU)]
    demoted = events[0]
    assert isinstance(demoted, BlockStored) and demoted.token_ids  # self-describing
    assert demoted.parent_block_hash == digest_to_int(digests[0])
    assert all(len(e.block_hashes) == 1 for e in events if isinstance(e, BlockRemoved))
    assert cache.reset() is True
    assert cache.take_events() == [AllBlocksCleared()]


def test_a_reset_of_every_tier_leaves_nothing_and_says_so() -> None:
    """The benchmarks' reset between runs: the device and the replica's own lower tiers are
    emptied, each lower-tier block with its BlockRemoved, so the index empties too."""
    cache = TieredPrefixCache(BS, gpu_blocks=4, cpu_blocks=2, storage_blocks=2)
    mirror = _Mirror()
    for ids in ((1, 2), (3, 4), (5, 6)):
        _run(cache, _prompt(*ids))
    before = cache.contents()
    lower = len(before[Medium.CPU]) + len(before[Medium.STORAGE])
    assert before[Medium.CPU] and before[Medium.STORAGE]
    mirror.feed(cache)
    plain = TieredPrefixCache(BS, gpu_blocks=4, cpu_blocks=2, storage_blocks=2)
    for ids in ((1, 2), (3, 4), (5, 6)):
        _run(plain, _prompt(*ids))
    assert plain.reset() is True  # vLLM's reset keeps the offloaded tiers
    assert plain.contents()[Medium.CPU]
    assert cache.reset(every_tier=True) is True
    assert all(not blocks for blocks in cache.contents().values())
    removed = [e for e in cache.take_events() if isinstance(e, BlockRemoved)]
    assert len(removed) == lower and {e.medium for e in removed} == {Medium.CPU, Medium.STORAGE}
    cache.check_invariants()
    mirror.index.apply("r", [AllBlocksCleared(), *removed])
    mirror.assert_agrees(cache, [_prompt(1, 2), _prompt(3, 4)])


def test_cache_salt_blocks_never_meet_unsalted_ones() -> None:
    cache = TieredPrefixCache(BS, gpu_blocks=16)
    mirror = _Mirror()
    tokens = _prompt(1, 2, 3)
    extra = request_extra_keys(3, cache_salt="tenant-a")
    digests = HASHER.chain(tokens, BS, extra_keys=extra)
    alloc = cache.allocate(digests, len(tokens), 4)
    assert alloc is not None
    cache.commit(alloc, tokens, digests, extra)
    cache.release(alloc)
    mirror.feed(cache)
    assert cache.match(HASHER.chain(tokens, BS)) == []
    salted = mirror.index.lookup(tokens, cache_salt="tenant-a", replicas=["r"])["r"]
    plain = mirror.index.lookup(tokens, replicas=["r"])["r"]
    assert (salted.blocks, plain.blocks) == (3, 0)


def test_restart_keeps_storage_only() -> None:
    cache = TieredPrefixCache(BS, gpu_blocks=3, cpu_blocks=2, storage_blocks=8)
    for i in range(4):
        _run(cache, _prompt(10 * i + 1, 10 * i + 2))
    before = cache.contents()
    assert before[Medium.STORAGE]
    survivors = cache.restart()
    after = cache.contents()
    assert not after[Medium.GPU] and not after[Medium.CPU]
    assert after[Medium.STORAGE] <= before[Medium.STORAGE]
    assert {b.hash for b in survivors} == after[Medium.STORAGE]
    for b in survivors:  # parents first, and only chains that are complete in STORAGE
        assert b.parent is None or b.parent.tier is Medium.STORAGE
    cache.check_invariants()


def test_hasher_is_vllm_like_and_seed_dependent() -> None:
    tokens = _prompt(1, 2)
    a = EngineHasher().chain(tokens, BS)
    assert a == EngineHasher().chain(tokens, BS)
    assert a != EngineHasher("other-seed").chain(tokens, BS)
    assert len(a) == 2 and all(len(d) == 32 for d in a)
    # Chained: the second block's digest depends on the first block's tokens.
    assert EngineHasher().chain(_prompt(9, 2), BS)[1] != a[1]


# --- property test: random traffic against the index mirror ---------------------------------

_ops = st.lists(
    st.tuples(
        st.sampled_from(["run", "run", "run", "hold", "release", "reset"]),
        st.lists(st.integers(0, 5), min_size=1, max_size=6),
        st.integers(0, 9),
    ),
    min_size=1,
    max_size=60,
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=_ops,
    gpu=st.integers(8, 20),
    cpu=st.integers(0, 6),
    storage=st.integers(0, 6),
)
def test_random_traffic_keeps_invariants_and_index_agreement(
    ops: list[tuple[str, list[int], int]], gpu: int, cpu: int, storage: int
) -> None:
    """Prompts come from a small tree of shared prefixes (block ids 0..5 along random paths),
    so hits, partial hits, demotions, promotions and drops all happen; some requests stay
    running ("hold") while others evict around them."""
    cache = TieredPrefixCache(BS, gpu_blocks=gpu, cpu_blocks=cpu, storage_blocks=storage)
    mirror = _Mirror()
    held: list[Allocation] = []
    seen: list[list[int]] = []
    for op, path, out in ops:
        # Block content depends on its position too, so paths share prefixes like a tree.
        tokens = _prompt(*[p + 10 * i for i, p in enumerate(path)], tail=out % 3)
        seen.append(tokens)
        if op == "release":
            if held:
                cache.release(held.pop(random.Random(out).randrange(len(held))))
        elif op == "reset":
            if cache.reset():
                held.clear()
        else:
            digests = HASHER.chain(tokens, BS)
            alloc = cache.allocate(digests, len(tokens), -(-(len(tokens) + out) // BS))
            if alloc is not None:
                in_use = {id(b) for a in held for b in a.blocks}
                cache.commit(alloc, tokens, digests)
                # Output tokens complete more blocks, which are cached at finish too.
                full = tokens + [500 + i for i in range(out)]
                cache.commit(alloc, full, HASHER.chain(full, BS))
                assert all(b.tier is Medium.GPU for a in held for b in a.blocks)
                assert in_use <= {id(b) for a in held for b in a.blocks}
                if op == "hold":
                    held.append(alloc)
                else:
                    cache.release(alloc)
        cache.check_invariants()
        mirror.feed(cache)
        mirror.assert_agrees(cache, seen[-8:])
    for alloc in held:
        cache.release(alloc)
    cache.check_invariants()


@pytest.mark.parametrize("n", [1, 3])
def test_allocate_rejects_what_can_never_fit(n: int) -> None:
    cache = TieredPrefixCache(BS, gpu_blocks=2)
    tokens = _prompt(*range(n), tail=3)
    assert cache.allocate(HASHER.chain(tokens, BS), len(tokens), n + 2) is None
