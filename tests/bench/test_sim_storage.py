"""The simulator's shared STORAGE domain (bench/sim/storage.py) seen through replicas' caches.

Pure state, no sockets: two ``TieredPrefixCache`` instances mount one domain, as two replicas
mount one shared directory. Their events go through the wire encoding into an index (one
replica key each), which must resolve every event's parent, as a router's would.
"""

from __future__ import annotations

import pytest

from kvroute.bench.sim.cache import Allocation, TieredPrefixCache
from kvroute.bench.sim.hashing import EngineHasher, digest_to_int
from kvroute.bench.sim.storage import SharedStorageDomain, StoredBlock
from kvroute.indexer.index import InMemoryPrefixIndex
from kvroute.indexer.wire import (
    BlockRemoved,
    BlockStored,
    Event,
    Medium,
    decode_batch,
    encode_batch,
)

BS = 4
HASHER = EngineHasher()


def _prompt(*block_ids: int) -> list[int]:
    tokens: list[int] = []
    for b in block_ids:
        tokens += [b * 10 + i for i in range(BS)]
    return [*tokens, 999]  # a partial tail: every full block can be a hit


def _run(cache: TieredPrefixCache, tokens: list[int]) -> Allocation:
    digests = HASHER.chain(tokens, BS)
    alloc = cache.allocate(digests, len(tokens), -(-(len(tokens) + 1) // BS))
    assert alloc is not None
    cache.commit(alloc, tokens, digests)
    cache.release(alloc)
    cache.check_invariants()
    return alloc


def _hashes(tokens: list[int]) -> list[int]:
    return [digest_to_int(d) for d in HASHER.chain(tokens, BS)]


class _Feed:
    """Each replica's events, through the wire, into one index under the replica's key."""

    def __init__(self) -> None:
        self.index = InMemoryPrefixIndex()
        self.log: dict[str, list[Event]] = {}

    def feed(self, name: str, cache: TieredPrefixCache) -> list[Event]:
        events = cache.take_events()
        self.log.setdefault(name, []).extend(events)
        if events:
            batch = decode_batch(encode_batch(events, ts=0.0))
            result = self.index.apply(name, batch.events)
            assert not result.rejected and result.unresolved == 0
        return events


def _stored(events: list[Event], medium: Medium) -> set[int]:
    return {
        h
        for e in events
        if isinstance(e, BlockStored) and e.medium == medium
        for h in e.block_hashes
    }


def _removed(events: list[Event], medium: Medium) -> set[int]:
    return {
        h
        for e in events
        if isinstance(e, BlockRemoved) and e.medium == medium
        for h in e.block_hashes
    }


def test_a_block_one_replica_evicts_is_a_storage_hit_for_another() -> None:
    domain = SharedStorageDomain("d", 64)
    a = TieredPrefixCache(BS, gpu_blocks=4, shared=domain)
    b = TieredPrefixCache(BS, gpu_blocks=4, shared=domain)
    feed = _Feed()
    doc = _prompt(1, 2, 3)
    _run(a, doc)
    _run(a, _prompt(7, 8, 9))  # evicts the document's blocks from a's device into the domain
    events = feed.feed("a", a)
    assert _stored(events, Medium.STORAGE) >= set(_hashes(doc)[:3])
    assert _removed(events, Medium.GPU) >= set(_hashes(doc)[:3])
    assert a.tier_of(HASHER.chain(doc, BS)[0]) is None  # written out, not kept locally
    assert len(domain) >= 3

    alloc = _run(b, doc)
    assert alloc.hit_tiers == [Medium.STORAGE] * 3
    events = feed.feed("b", b)
    assert _stored(events, Medium.GPU) >= set(_hashes(doc)[:3])  # loaded onto b's device
    assert not _removed(events, Medium.STORAGE)  # the file stays for everyone else
    assert all(d in domain for d in HASHER.chain(doc, BS)[:3])
    assert domain.reads == 3


def test_a_domain_written_through_has_a_block_while_its_writer_still_holds_it() -> None:
    """The connector's default disk policy: a computed block is on the shared disk at once,
    so another replica loads a document its first replica still holds on its device."""
    domain = SharedStorageDomain("d", 64, writes="through")
    a = TieredPrefixCache(BS, gpu_blocks=8, shared=domain)
    b = TieredPrefixCache(BS, gpu_blocks=8, shared=domain)
    feed = _Feed()
    doc = _prompt(1, 2, 3)
    digests = HASHER.chain(doc, BS)
    alloc = a.allocate(digests, len(doc), 4)
    assert alloc is not None
    created = a.commit(alloc, doc, digests)
    assert len(domain) == 0  # committed is not computed: nothing written before the prefill
    a.write_through(created)
    a.release(alloc)
    a.check_invariants()
    events = feed.feed("a", a)
    assert _stored(events, Medium.GPU) == set(_hashes(doc)[:3])
    assert _stored(events, Medium.STORAGE) == set(_hashes(doc)[:3])  # one run, after the GPU
    assert [a.tier_of(d) for d in digests[:3]] == [Medium.GPU] * 3  # a keeps its copies
    match = feed.index.lookup(doc)["a"]
    assert match.blocks == 3

    loaded = _run(b, doc)
    assert loaded.hit_tiers == [Medium.STORAGE] * 3
    a.write_through(created)  # already there: nothing written, nothing announced
    for filler in range(3):  # the document leaves a's device: the domain had it
        _run(a, _prompt(10 * filler + 7, 10 * filler + 8, 10 * filler + 9))
    assert a.tier_of(digests[0]) is None  # demoted: dropped locally, kept in the domain
    demoted = _stored(feed.feed("a", a), Medium.STORAGE)  # the fillers a evicted since
    assert not demoted & set(_hashes(doc)[:3])
    assert domain.writes == 3 + len(demoted)  # the document's demotion wrote nothing again


def test_write_through_is_a_no_op_for_a_domain_written_by_demotion() -> None:
    domain = SharedStorageDomain("d", 64, writes="demotion")
    a = TieredPrefixCache(BS, gpu_blocks=8, shared=domain)
    doc = _prompt(1, 2, 3)
    digests = HASHER.chain(doc, BS)
    alloc = a.allocate(digests, len(doc), 4)
    assert alloc is not None
    a.write_through(a.commit(alloc, doc, digests))
    assert len(domain) == 0 and not _stored(a.take_events(), Medium.STORAGE)
    with pytest.raises(ValueError):
        SharedStorageDomain("d", 64, writes="sometimes")


def test_only_the_first_writer_announces_a_block() -> None:
    domain = SharedStorageDomain("d", 64)
    a = TieredPrefixCache(BS, gpu_blocks=4, shared=domain)
    b = TieredPrefixCache(BS, gpu_blocks=4, shared=domain)
    feed = _Feed()
    doc = _prompt(1, 2)
    _run(a, doc)
    _run(b, doc)  # both compute it (b before a wrote it)
    _run(a, _prompt(5, 6, 7))
    _run(b, _prompt(5, 6, 7))
    first = feed.feed("a", a)
    second = feed.feed("b", b)
    assert set(_hashes(doc)[:2]) <= _stored(first, Medium.STORAGE)
    assert not set(_hashes(doc)[:2]) & _stored(second, Medium.STORAGE)
    assert set(_hashes(doc)[:2]) <= _removed(second, Medium.GPU)  # b still drops its copies


def test_cpu_tier_sits_between_device_and_domain() -> None:
    domain = SharedStorageDomain("d", 64)
    cache = TieredPrefixCache(BS, gpu_blocks=4, cpu_blocks=3, shared=domain)
    doc = _prompt(1, 2, 3)
    _run(cache, doc)
    _run(cache, _prompt(4, 5, 6))
    assert [cache.tier_of(d) for d in HASHER.chain(doc, BS)[:3]] == [Medium.CPU] * 3
    assert len(domain) == 0
    _run(cache, _prompt(7, 8, 9))
    _run(cache, _prompt(10, 11, 12))
    assert len(domain) >= 3 and all(d in domain for d in HASHER.chain(doc, BS)[:3])


def test_the_evictor_announces_its_removals_on_its_own_stream() -> None:
    domain = SharedStorageDomain("d", 4)
    cache = TieredPrefixCache(BS, gpu_blocks=4, shared=domain)
    feed = _Feed()
    for i in range(4):
        _run(cache, _prompt(10 * i + 1, 10 * i + 2, 10 * i + 3))
    replica_events = feed.feed("a", cache)
    assert not _removed(replica_events, Medium.STORAGE)  # never on the replica's stream
    evictor = domain.take_events()
    gone = _removed(evictor, Medium.STORAGE)
    assert len(domain) == 4 and domain.evictions == len(gone) > 0
    assert not gone & domain.hashes()
    assert gone <= _stored(replica_events, Medium.STORAGE)
    assert domain.take_events() == []


def test_a_block_written_again_before_the_announcement_is_not_announced_removed() -> None:
    """The evictor's removal of a block a replica wrote again meanwhile would reach a router
    after the writer's store (streams are not ordered with each other) and take the block out
    of its index while the domain holds it: it is not announced (kvroute storage gc checks
    the same before publishing)."""
    domain = SharedStorageDomain("d", 2)

    def block(n: int) -> StoredBlock:
        return StoredBlock(
            digest=bytes([n]), hash=n, parent_hash=None, tokens=(n,), extra=None, lora_name=None
        )

    assert domain.put(block(1)) and domain.put(block(2))
    assert domain.put(block(3))  # evicts 1
    assert domain.put(block(1))  # evicts 2; 1 is back before the evictor announced it
    assert domain.put(block(4))  # evicts 3
    (removed,) = domain.take_events()
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == [2, 3]
    assert (domain.evictions, domain.removals_announced, domain.rewritten) == (3, 2, 1)
    assert sorted(domain.hashes()) == [1, 4]


def test_restart_keeps_the_domain_and_the_evictor_announces_it_parents_first() -> None:
    domain = SharedStorageDomain("d", 64)
    cache = TieredPrefixCache(BS, gpu_blocks=4, shared=domain)
    doc = _prompt(1, 2, 3)
    _run(cache, doc)
    _run(cache, _prompt(4, 5, 6))
    cache.take_events()
    assert cache.restart() == []
    assert len(cache) == 0 and len(domain) >= 3
    assert cache.take_events() == []  # a replica never re-announces shared files
    index = InMemoryPrefixIndex()
    batch = decode_batch(encode_batch(domain.announcement(BS), ts=0.0))
    result = index.apply("evictor", batch.events)  # parents first: every one resolves
    assert not result.rejected and result.unresolved == 0
    assert _stored(batch.events, Medium.STORAGE) == domain.hashes()
    alloc = _run(cache, doc)
    assert alloc.hit_tiers == [Medium.STORAGE] * 3


def test_an_orphaned_block_is_not_rescanned() -> None:
    domain = SharedStorageDomain("d", 8)
    root = StoredBlock(b"r", 1, None, (1, 2, 3, 4), None, None)
    orphan = StoredBlock(b"o", 3, 2, (5, 6, 7, 8), None, None)  # its parent 2 is gone
    domain.put(root)
    domain.put(orphan)
    assert _stored(domain.announcement(BS), Medium.STORAGE) == {1}


def test_a_private_storage_tier_and_a_domain_exclude_each_other() -> None:
    with pytest.raises(ValueError, match="either its own or a shared domain"):
        TieredPrefixCache(BS, 4, storage_blocks=4, shared=SharedStorageDomain("d", 4))
    with pytest.raises(ValueError, match="capacity_blocks"):
        SharedStorageDomain("d", 0)
