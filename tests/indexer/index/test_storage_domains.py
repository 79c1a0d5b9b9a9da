"""Storage domains in the index: a STORAGE chunk one replica writes into a shared directory is
a hit for every replica attached to that directory's domain, until the domain's evictor (or a
replica that deleted a bad file) removes it.

Events are built as kvroute's connector publishes them (self-describing STORAGE stores, one
chunk per event; tests/indexer/builders.py) and go straight into the index: the socket side is
tests/connector/test_storage_gc.py.
"""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.indexer.index import InMemoryPrefixIndex, domain_key
from kvroute.indexer.wire import AllBlocksCleared, Medium
from tests.indexer.builders import BS, DOCS, hashes_of, removed, stored

N = 2  # blocks per chunk
DOMAIN = domain_key("d")


def _index() -> InMemoryPrefixIndex:
    index = InMemoryPrefixIndex()
    index.attach("a", "d")
    index.attach("b", "d")
    index.add_replica("c")  # not attached: its storage is its own
    return index


def _offload(index: InMemoryPrefixIndex, replica: str, doc: list[int], chunks: int) -> None:
    """The replica computes the document and writes its first ``chunks`` chunks to disk."""
    index.apply(replica, [stored(doc, 0, len(doc) // BS)])
    for k in range(chunks):
        result = index.apply(replica, [stored(doc, k * N, N, Medium.STORAGE)])
        assert not result.rejected, result.rejected


def test_a_chunk_one_replica_stored_is_a_storage_hit_for_every_replica_of_the_domain() -> None:
    index = _index()
    doc = DOCS[0]  # 6 blocks, 3 chunks
    _offload(index, "a", doc, 3)
    # b published nothing yet: it is as warm as its domain (block size included)
    assert index.block_size("b") == BS
    m = index.lookup(doc, replicas=["a", "b", "c"])
    assert (m["b"].blocks, m["b"].blocks_by_tier) == (6, {Medium.STORAGE: 6})
    assert m["a"].blocks_by_tier == {Medium.GPU: 6}
    assert m["c"].blocks == 0
    assert [s.blocks for s in index.domains()] == [6]
    assert index.domains()[0].attached == ["a", "b"]
    # the attached replica holds nothing in STORAGE itself: the domain does
    assert next(s for s in index.summary() if s.replica == "a").entries_by_tier["STORAGE"] == 0
    assert index.block_tiers("b", doc)[0] == frozenset({"STORAGE"})


def test_a_replica_restart_or_clear_never_clears_the_domain() -> None:
    index = _index()
    doc = DOCS[0]
    _offload(index, "a", doc, 2)
    index.clear_source("a", restarted=True)
    index.clear_replica("b")
    index.apply("a", [AllBlocksCleared(), AllBlocksCleared(Medium.STORAGE)])
    for r in ("a", "b"):
        assert index.lookup(doc, replicas=[r])[r].blocks_by_tier == {Medium.STORAGE: 4}


def test_removals_from_the_evictor_or_an_attached_replica_leave_the_domain() -> None:
    index = _index()
    doc = DOCS[0]
    _offload(index, "a", doc, 3)
    index.apply(DOMAIN, [removed(doc, [4, 5], Medium.STORAGE)])  # the evictor's last chunk
    assert index.lookup(doc, replicas=["b"])["b"].blocks == 4
    index.apply("b", [removed(doc, [2, 3], Medium.STORAGE)])  # b deleted a bad file
    assert index.lookup(doc, replicas=["b"])["b"].blocks == 2
    assert index.domains()[0].blocks == 2


def test_a_storage_chunk_continues_a_match_only_in_load_order() -> None:
    """The connector loads a chunk prefix in order: chunk 1 without chunk 0 is no hit, unless
    the device holds chunk 0's blocks."""
    index = _index()
    doc = DOCS[0]
    _offload(index, "a", doc, 2)
    index.apply(DOMAIN, [removed(doc, [0, 1], Medium.STORAGE)])
    assert index.lookup(doc, replicas=["b"])["b"].blocks == 0
    index.apply("b", [stored(doc, 0, 2)])
    m = index.lookup(doc, replicas=["b"])["b"]
    assert m.blocks_by_tier == {Medium.GPU: 2, Medium.STORAGE: 2}


def test_an_evictor_reset_clears_the_domain_and_its_replicas_refill_it() -> None:
    index = _index()
    doc = DOCS[0]
    _offload(index, "a", doc, 3)
    index.clear_source(DOMAIN, restarted=True)
    assert index.lookup(doc, replicas=["b"])["b"].blocks == 0
    assert index.domains()[0].blocks == 0
    index.apply("a", [stored(doc, 0, N, Medium.STORAGE)])  # a new store after the reset
    assert index.lookup(doc, replicas=["b"])["b"].blocks == 2


def test_a_restarted_replica_announcing_shared_files_resolves_parents_in_the_domain() -> None:
    """A replica that starts announces the shared files it finds; a chunk's parent may be a
    block only the domain holds."""
    index = _index()
    doc = DOCS[0]
    _offload(index, "a", doc, 1)
    assert not index.apply("b", [stored(doc, N, N, Medium.STORAGE)]).rejected
    assert index.lookup(doc, replicas=["b"])["b"].blocks == 4


def test_detaching_and_removing_replicas_keeps_the_domain() -> None:
    index = _index()
    doc = DOCS[0]
    _offload(index, "a", doc, 1)
    index.remove_replica("a")
    index.attach("b", None)
    assert index.lookup(doc, replicas=["b"])["b"].blocks == 0
    index.attach("b", "d")
    assert index.lookup(doc, replicas=["b"])["b"].blocks == 2
    assert "domain:d" not in index.lookup(doc)


# --- the index against a model of the truth --------------------------------------------------

REPLICAS = ("a", "b", "c")
ATTACHED = {"a", "b"}


class Truth:
    """What exists: each replica's device blocks, the domain's files, c's private files."""

    def __init__(self) -> None:
        # physical copies of each block on each replica's device (vLLM keeps one per block
        # computed, and removes each on its own eviction)
        self.device: dict[str, Counter[int]] = {r: Counter() for r in REPLICAS}
        self.domain: set[int] = set()
        self.private: set[int] = set()
        # False once the index may rightly know less than the truth (a reset, a restart)
        self.exact = True

    def compute(self, replica: str, doc: list[int]) -> list:
        """vLLM computing ``doc``: it hits its device prefix and stores the rest, parented on
        the last hit block (a block held past a gap gets a second copy)."""
        hashes = hashes_of(doc, 0, len(doc) // BS)
        hit = 0
        while hit < len(hashes) and self.device[replica][hashes[hit]]:
            hit += 1
        self.device[replica].update(hashes[hit:])
        return [stored(doc, hit, len(hashes) - hit)] if hit < len(hashes) else []

    def storage(self, replica: str) -> set[int]:
        return self.domain if replica in ATTACHED else self.private

    def match(self, replica: str, doc: list[int]) -> tuple[int, int]:
        """(device blocks, storage blocks) vLLM would serve: its device prefix, then the
        storage chunks that continue it, ending on a whole chunk."""
        hashes = hashes_of(doc, 0, len(doc) // BS)
        g = 0
        while g < len(hashes) and hashes[g] in self.device[replica]:
            g += 1
        end = g
        lower = self.storage(replica)
        while end < len(hashes) and hashes[end] in lower:
            end += 1
        end = max(g, end // N * N)
        return g, end - g


_compute = st.tuples(st.just("compute"), st.sampled_from(REPLICAS), st.integers(0, 1))
# the device evicts a document's tail from block b on (its least recently used end)
_evict = st.tuples(
    st.just("evict"), st.sampled_from(REPLICAS), st.integers(0, 1), st.integers(0, 5)
)
_offload_st = st.tuples(
    st.just("offload"), st.sampled_from(REPLICAS), st.integers(0, 1), st.integers(0, 2)
)
_gc = st.tuples(st.just("gc"), st.integers(0, 1), st.integers(0, 2))
_delete = st.tuples(
    st.just("delete"), st.sampled_from(REPLICAS), st.integers(0, 1), st.integers(0, 2)
)
_restart = st.tuples(st.just("restart"), st.sampled_from(REPLICAS))
# weighted by repetition: stores and evictions are what a fleet mostly does
op_st = st.one_of(
    _compute,
    _evict,
    _evict,
    _offload_st,
    _offload_st,
    _offload_st,
    _gc,
    _gc,
    _delete,
    _restart,
    st.tuples(st.just("evictor_reset")),
    st.tuples(st.just("evictor_restart")),
)


def _snapshot(index: InMemoryPrefixIndex, replicas: list[str]) -> list:
    out = []
    for doc in DOCS:
        m = index.lookup(doc, replicas=replicas)
        out.append({r: (m[r].blocks, dict(m[r].blocks_by_tier)) for r in replicas})
    return out


@settings(max_examples=300, deadline=None)
@given(st.lists(op_st, min_size=4, max_size=40))
def test_the_index_never_claims_more_than_the_domain_holds(ops: list[tuple]) -> None:
    """After every step, every replica's match is at most what the truth serves (exactly
    that while nothing gave the index a reason to know less); a replica's restart never
    changes another replica's match."""
    index = _index()
    truth = Truth()
    for op in ops:
        kind = op[0]
        if kind == "compute":
            _, r, d = op
            doc = DOCS[d]
            res = index.apply(r, truth.compute(r, doc))
        elif kind == "evict":
            _, r, d, b = op
            res = index.apply(r, [removed(DOCS[d], list(range(b, 6)))])
            truth.device[r] -= Counter(set(hashes_of(DOCS[d], b, 6 - b)))
        elif kind == "offload":
            _, r, d, k = op
            chunk = set(hashes_of(DOCS[d], k * N, N))
            target = truth.storage(r)
            if r not in ATTACHED and chunk <= target:
                continue  # the connector skips a chunk its own disk has
            # it writes what it computed: the prompt, then the chunk
            doc = DOCS[d]
            res = index.apply(r, [*truth.compute(r, doc), stored(doc, k * N, N, Medium.STORAGE)])
            target |= chunk
        elif kind == "gc":
            _, d, k = op
            res = index.apply(DOMAIN, [removed(DOCS[d], [k * N, k * N + 1], Medium.STORAGE)])
            truth.domain -= set(hashes_of(DOCS[d], k * N, N))
        elif kind == "delete":
            _, r, d, k = op
            res = index.apply(r, [removed(DOCS[d], [k * N, k * N + 1], Medium.STORAGE)])
            truth.storage(r).difference_update(hashes_of(DOCS[d], k * N, N))
        elif kind == "restart":
            (_, r) = op
            others = [x for x in REPLICAS if x != r]
            before = _snapshot(index, others)
            index.clear_source(r, restarted=True)
            truth.device[r] = Counter()
            truth.exact = truth.exact and r in ATTACHED  # c's own files are forgotten
            assert _snapshot(index, others) == before
            continue
        elif kind == "evictor_restart":
            # a new evictor process: the router clears the domain, then takes the new
            # process's announcement of every chunk present, parents first
            index.clear_source(DOMAIN, restarted=True)
            present = [
                (k, d)
                for k in range(3)
                for d in range(len(DOCS))
                if set(hashes_of(DOCS[d], k * N, N)) <= truth.domain
            ]
            res = index.apply(
                DOMAIN, [stored(DOCS[d], k * N, N, Medium.STORAGE) for k, d in present]
            )
        else:
            index.clear_source(DOMAIN, restarted=True)
            truth.exact = False
            continue
        if res.rejected:
            # a store whose parent the index never learned (a chunk after an evicted one)
            truth.exact = False
        for doc in DOCS:
            matches = index.lookup(doc, replicas=list(REPLICAS))
            for r in REPLICAS:
                g, s = truth.match(r, doc)
                m = matches[r]
                got = (m.blocks_by_tier.get(Medium.GPU, 0), m.blocks_by_tier.get(Medium.STORAGE, 0))
                assert m.blocks == sum(got)
                assert got[0] <= g and sum(got) <= g + s, (r, doc[:1], got, (g, s))
                if truth.exact:
                    assert got == (g, s), (r, doc[:1], got, (g, s))
