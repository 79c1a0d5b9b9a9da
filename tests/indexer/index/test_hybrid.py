"""Hybrid models without vLLM: the rules of indexer/index/hybrid.py on hand-made streams.

The property test is a model replica of a hybrid model (full attention, Mamba, a sliding
window of two blocks) that publishes as vLLM 0.32's block pool does: one store per group and
step, in group order, a Mamba group listing only the states it keeps (a block mask), a
removal per physical copy. Its truth is per group a multiset of held blocks; vLLM's hit for a
prompt is then the longest prefix every group can serve (the fixed point of
``find_longest_cache_hit`` is the largest length all groups' rules accept). The index must
predict exactly that, whichever group index each kind has.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.indexer.index import InMemoryPrefixIndex
from kvroute.indexer.keys import RequestKeys
from kvroute.indexer.wire import BlockRemoved, BlockStored, Medium, decode_batch, encode_batch
from kvroute.router.routing.router import predicted_cached_tokens
from tests.indexer.builders import BS, ehash, hashes_of, stored

KINDS = ("full_attention", "mamba", "sliding_window")
WINDOW = 2 * BS  # a hit needs the ceil((WINDOW - 1) / BS) = 2 blocks before its end
NEED = -(-(WINDOW - 1) // BS)
# Prompts: stems of two roots, so prefixes are shared at any length.
ROOTS = [
    list(range(100, 100 + 12 * BS)),
    list(range(100, 100 + 3 * BS)) + list(range(900, 909 * BS)),
]


def group_store(event: BlockStored, group: int, kind: str) -> BlockStored:
    return dataclasses.replace(
        event,
        group_idx=group,
        spec_kind=kind,
        sliding_window=WINDOW if kind == "sliding_window" else None,
    )


def masked(tokens: list[int], start: int, n: int, keep: list[int], group: int) -> BlockStored:
    """A Mamba store of blocks [start, start + n) keeping only the states of ``keep``."""
    full = stored(tokens, start, n)
    return BlockStored(
        [ehash(tuple(tokens[: (b + 1) * BS])) for b in keep],
        full.parent_block_hash,
        full.token_ids,
        BS,
        extra_keys=[None] * len(keep),
        group_idx=group,
        spec_kind="mamba",
    )


def test_a_mamba_group_first_and_its_block_mask() -> None:
    """vLLM numbers groups by the first layer kind: Mamba may be group 0. Its store lists the
    state it keeps only; the hit ends where it holds one, at most the prompt's length - 1."""
    doc = ROOTS[0][: 6 * BS]
    index = InMemoryPrefixIndex()
    batch = [
        masked(doc, 0, 6, [3, 5], 0),
        group_store(stored(doc, 0, 6), 1, "full_attention"),
    ]
    # the wire carries it (fewer hashes than token blocks) and decodes it unchanged
    decoded = decode_batch(encode_batch(batch, ts=1.0)).events
    assert decoded == batch
    result = index.apply("r", decoded)
    assert not result.rejected and not result.unresolved
    for n, hit in ((6 * BS + 1, 6), (6 * BS, 4), (5 * BS, 4), (4 * BS + 1, 4), (4 * BS, 0)):
        match = index.lookup(doc[:n] + [1] * max(0, n - len(doc)))["r"]
        assert (match.blocks, match.blocks_by_tier) == (hit, {Medium.GPU: hit} if hit else {})
    index.apply("r", [BlockRemoved([ehash(tuple(doc[: 6 * BS]))], group_idx=0)])
    assert index.lookup([*doc, 1])["r"].blocks == 4


def test_a_report_mode_full_reannouncement_adds_nothing() -> None:
    """kv_cache_report_mode "full": every group's hit re-announced from block 0, listing also
    the blocks the Mamba group does not hold; nothing is removed afterwards."""
    doc = ROOTS[0][: 6 * BS]
    index = InMemoryPrefixIndex()
    index.apply("r", [masked(doc, 0, 6, [5], 0), group_store(stored(doc, 0, 6), 1, KINDS[0])])
    before = {n: index.lookup(doc[:n])["r"].blocks for n in range(1, len(doc) + 1)}
    again = [
        group_store(stored(doc, 0, 6), 0, "mamba"),
        group_store(stored(doc, 0, 6), 1, KINDS[0]),
    ]
    index.apply("r", again)
    assert {n: index.lookup(doc[:n])["r"].blocks for n in range(1, len(doc) + 1)} == before
    index.apply("r", [BlockRemoved(hashes_of(doc, 0, 6), group_idx=1)])
    assert index.lookup([*doc, 1])["r"].blocks == 0


class Model:
    """The truth: per kind, a multiset of held block hashes."""

    def __init__(self) -> None:
        self.held: dict[str, Counter[int]] = {k: Counter() for k in KINDS}

    def hit(self, tokens: list[int]) -> int:
        """vLLM's hit in blocks: the largest k with k * BS <= len - 1 that every group serves."""
        hashes = hashes_of(tokens, 0, (len(tokens) - 1) // BS)
        full, mamba, window = (self.held[k] for k in KINDS)
        best = 0
        for k in range(1, len(hashes) + 1):
            if not full[hashes[k - 1]]:
                break
            if mamba[hashes[k - 1]] and all(window[h] for h in hashes[max(0, k - NEED) : k]):
                best = k
        return best


op_st = st.one_of(
    # a prompt computed: root, blocks, which of its blocks the Mamba group keeps (bits)
    st.tuples(st.just("compute"), st.integers(0, 1), st.integers(1, 12), st.integers(0, 4095)),
    # one physical copy of a block evicted from one group
    st.tuples(st.just("evict"), st.sampled_from(KINDS), st.integers(0, 1), st.integers(0, 11)),
)


@settings(max_examples=200, deadline=None)
@given(
    order=st.permutations(KINDS),
    ops=st.lists(op_st, min_size=1, max_size=25),
)
def test_the_hit_is_what_every_group_serves_whatever_the_group_order(
    order: list[str], ops: list[tuple]
) -> None:
    group = {kind: g for g, kind in enumerate(order)}
    model = Model()
    index = InMemoryPrefixIndex()
    for op in ops:
        if op[0] == "compute":
            _, root, n, bits = op
            doc = ROOTS[root][: n * BS]
            hashes = hashes_of(doc, 0, n)
            start = model.hit([*doc, 0])  # vLLM stores what its hit did not serve
            if start == n:
                continue
            keep = [b for b in range(start, n) if bits >> b & 1 or b == n - 1]
            events: list[BlockStored | BlockRemoved] = []
            for kind in order:  # one store per group, in group order
                if kind == "mamba":
                    events.append(masked(doc, start, n - start, keep, group[kind]))
                    model.held[kind].update(hashes[b] for b in keep)
                else:
                    events.append(group_store(stored(doc, start, n - start), group[kind], kind))
                    model.held[kind].update(hashes[start:])
        else:
            _, kind, root, b = op
            h = hashes_of(ROOTS[root], b, 1)[0]
            if not model.held[kind][h]:
                continue
            model.held[kind][h] -= 1
            events = [BlockRemoved([h], group_idx=group[kind])]
        result = index.apply("r", events)
        assert not result.rejected, result.rejected
        for root in ROOTS:
            for n in range(1, 13):
                probe = [*root[: n * BS], 7]
                match = index.lookup(RequestKeys(probe))["r"]
                predicted = predicted_cached_tokens(match.tokens, len(probe), BS)
                assert predicted == model.hit(probe) * BS, (
                    order,
                    ops,
                    n,
                    predicted,
                    model.hit(probe),
                )


def test_a_hybrid_replica_survives_a_snapshot() -> None:
    """Warm start copies which group is keyed and every group's kind: the copy answers every
    lookup as the original."""
    doc = ROOTS[0][: 6 * BS]
    index = InMemoryPrefixIndex()
    index.apply("r", [masked(doc, 0, 6, [3, 5], 0), group_store(stored(doc, 0, 6), 1, KINDS[0])])
    copy = InMemoryPrefixIndex()
    state = index.export_replica("r")
    assert state is not None
    copy.import_replica("r", state)
    for n in range(1, len(doc) + 2):
        probe = doc[:n] + [1] * max(0, n - len(doc))
        assert copy.lookup(probe)["r"] == index.lookup(probe)["r"]
    assert copy.lookup([*doc, 1])["r"].blocks == 6
