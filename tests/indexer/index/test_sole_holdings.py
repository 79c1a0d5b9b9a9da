"""``sole_holdings``: per replica, the blocks no other replica and no storage domain holds,
by the fastest tier each is held in. Scale-in's deletion costs rest on it
(router/fleet/deletion_cost.py): a block two replicas hold costs nothing to lose one of them."""

from __future__ import annotations

from kvroute.indexer.index import InMemoryPrefixIndex
from kvroute.indexer.wire import Medium
from tests.indexer.builders import BS, DOCS, stored


def test_blocks_held_by_one_replica_only_count_for_it_by_fastest_tier() -> None:
    index = InMemoryPrefixIndex()
    shared, own = DOCS  # 6 blocks each, the first 2 in common
    index.apply("a", [stored(shared, 0, len(shared) // BS)])
    index.apply("b", [stored(shared, 0, len(shared) // BS)])  # the same blocks: none sole
    index.apply("b", [stored(own, 0, len(own) // BS)])
    # b's own blocks, offloaded too: still counted once, at their fastest tier (GPU)
    index.apply("b", [stored(own, 4, 2, Medium.CPU)])
    assert index.sole_holdings() == {"b": {Medium.GPU: 4}}  # own's last 4 blocks
    index.apply("a", [stored(own, 0, 4)])
    # a now holds own's first 4 too: b keeps 2 sole blocks (GPU)
    assert index.sole_holdings() == {"b": {Medium.GPU: 2}}


def test_a_storage_domains_blocks_are_nobodys_loss() -> None:
    index = InMemoryPrefixIndex()
    index.attach("a", "d")
    doc = DOCS[0]
    index.apply("a", [stored(doc, 0, 2, Medium.STORAGE)])  # into the domain, not into a
    index.apply("c", [stored(doc, 0, 2, Medium.CPU)])
    # The domain holds the two blocks too: c alone holds nothing.
    assert index.sole_holdings() == {}
    index.apply("c", [stored(doc, 2, 2, Medium.CPU)])
    assert index.sole_holdings() == {"c": {Medium.CPU: 2}}
