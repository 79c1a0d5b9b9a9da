"""Storage domains keyed by layout, and llm-d's shared PVC as a storage domain.

- A domain's chunks are shared only between replicas of one layout (``attach(replica, domain,
  layout)``): a TP=2 replica, or the next model revision, in the same directory reads none of
  the chunks written at another layout. The evictor's stream names no layout: its removals
  and its loss of history reach every layout.
- llm-d's FS backend (tier-only ``SHARED_STORAGE`` stores, unconfirmed) on an attached replica:
  the chunks are the domain's, a hit for every attached replica of the layout, and llm-d's PVC
  evictor (``BlockRemoved(SHARED_STORAGE)`` on its own stream) removes them.

Events go straight into the index, built as each publisher sends them (tests/indexer/
builders.py; the wire shape of llm-d's evictor is tests/indexer/test_llmd_pvc_wire.py).
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.indexer.index import InMemoryPrefixIndex, domain_key, split_domain_key
from kvroute.indexer.wire import BlockRemoved, Medium
from tests.indexer.builders import BS, DOCS, ehash, removed, stored, tier_only

N = 2  # blocks per chunk
EVICTOR = domain_key("d")
LEARN = list(range(300, 332))
FS = {"medium": Medium.STORAGE, "confirmed": False, "medium_name": "SHARED_STORAGE"}


def _write(index: InMemoryPrefixIndex, replica: str, doc: list[int], chunks: int) -> None:
    """kvroute's connector: the replica computes ``doc`` and writes its first chunks."""
    index.apply(replica, [stored(doc, 0, len(doc) // BS)])
    for k in range(chunks):
        assert not index.apply(replica, [stored(doc, k * N, N, Medium.STORAGE)]).rejected


def _storage(index: InMemoryPrefixIndex, replica: str, doc: list[int]) -> int:
    """The blocks of ``doc`` the replica sees in its STORAGE tier (its domain's), any device
    copy aside."""
    tiers = index.block_tiers(replica, doc)
    return sum(1 for t in tiers if t & {"STORAGE", "STORAGE_UNCONFIRMED"})


def test_domain_keys_name_the_layout() -> None:
    assert domain_key("d") == "domain:d" and domain_key("d", "ab12") == "domain:d#ab12"
    assert split_domain_key("domain:d#ab12") == ("d", "ab12")
    assert split_domain_key("domain:d") == ("d", None)
    index = InMemoryPrefixIndex()
    for bad in ("", "a#b"):
        try:
            index.attach("a", "d", bad)
        except ValueError:
            continue
        raise AssertionError(f"layout {bad!r} accepted")


def test_a_chunk_is_shared_within_its_layout_only() -> None:
    index = InMemoryPrefixIndex()
    index.attach("a", "d", "tp1")
    index.attach("b", "d", "tp1")
    index.attach("t", "d", "tp2")  # TP=2 in the same directory: other files
    index.attach("u", "d")  # names no layout: shares with the others that name none
    doc = DOCS[0]
    _write(index, "a", doc, 3)
    assert _storage(index, "b", doc) == 6
    assert _storage(index, "t", doc) == 0 and _storage(index, "u", doc) == 0
    _write(index, "t", doc, 1)
    assert _storage(index, "t", doc) == 2 and _storage(index, "b", doc) == 6
    by_layout = {d.layout: d for d in index.domains()}
    assert by_layout["tp1"].blocks == 6 and by_layout["tp1"].attached == ["a", "b"]
    assert by_layout["tp2"].blocks == 2 and by_layout["tp2"].attached == ["t"]
    assert by_layout[None].attached == ["u"] and by_layout[None].blocks == 0


def test_the_evictor_removes_from_every_layout_and_its_loss_clears_them_all() -> None:
    index = InMemoryPrefixIndex()
    index.attach("a", "d", "tp1")
    index.attach("t", "d", "tp2")
    doc = DOCS[0]
    _write(index, "a", doc, 3)
    _write(index, "t", doc, 3)
    # The event names no layout: the hash leaves both (low, never false, when only one had it).
    result = index.apply(EVICTOR, [removed(doc, [4, 5], Medium.STORAGE)])
    assert result.blocks_removed == 4 and result.unresolved == 0
    assert _storage(index, "a", doc) == 4 and _storage(index, "t", doc) == 4
    # A hash no layout holds is unresolved once, not once per layout.
    assert index.apply(EVICTOR, [removed(DOCS[1], [5], Medium.STORAGE)]).unresolved == 1
    index.clear_source(EVICTOR, restarted=False)  # a gap the replay could not fill
    assert _storage(index, "a", doc) == 0 and _storage(index, "t", doc) == 0


def _fs_write(index: InMemoryPrefixIndex, replica: str, doc: list[int]) -> None:
    """llm-d's FS backend: vLLM's device stores on vLLM's stream, then one tier-only
    SHARED_STORAGE store per complete_store call on the backend's own stream (its chunks'
    last block hashes)."""
    index.apply(replica, [stored(doc, 0, len(doc) // BS)], source="vllm")
    last = [k * N + N - 1 for k in range(len(doc) // BS // N)]
    assert not index.apply(replica, [tier_only(doc, last, **FS)], source="fs").rejected


def test_an_llmd_pvc_is_a_domain_and_its_evictor_removes_from_it() -> None:
    index = InMemoryPrefixIndex()
    index.attach("a", "pvc", "m1")
    index.attach("b", "pvc", "m1")
    index.add_replica("c")
    doc = DOCS[0]  # 6 blocks: 3 chunks of 2
    _fs_write(index, "a", LEARN)  # a's first store teaches the chunk length (docs/indexer.md)
    _fs_write(index, "a", doc)
    # b never wrote: the PVC's files are its hits too, unconfirmed (llm-d's FS backend never
    # announces a removal; they still age out)
    m = index.lookup(doc, replicas=["b"])["b"]
    assert (m.blocks, m.unconfirmed_by_tier) == (6, {Medium.STORAGE: 6})
    assert index.block_size("b") == BS
    assert index.lookup(doc, replicas=["c"])["c"].blocks == 0
    (summary,) = [d for d in index.domains() if d.layout == "m1"]
    # LEARN: its first chunk, stored before the length was known, claims its last block only
    assert summary.unconfirmed_blocks == 6 + 7 and summary.attached == ["a", "b"]
    assert summary.chunk_blocks == N
    # The writer's FS stream restarting does not delete files on the PVC.
    index.clear_source("a", "fs", restarted=True)
    assert _storage(index, "b", doc) == 6
    # llm-d's PVC evictor: BlockRemoved(SHARED_STORAGE) of the file's hash on its own stream
    evict = BlockRemoved([ehash(tuple(doc[: 6 * BS]))], Medium.STORAGE, confirmed=False)
    assert index.apply(domain_key("pvc"), [evict]).blocks_removed == 2
    assert _storage(index, "b", doc) == 4
    # and they age out like every unconfirmed holding
    index._clock = lambda: 1e12  # type: ignore[method-assign]
    index.expire(domain_key("pvc"))
    assert _storage(index, "b", doc) == 0


def test_an_evictor_restart_drops_the_pvc_holdings_a_gap_keeps_them() -> None:
    index = InMemoryPrefixIndex()
    index.attach("a", "pvc")
    doc = DOCS[0]
    _fs_write(index, "a", LEARN)
    _fs_write(index, "a", doc)
    index.clear_source(domain_key("pvc"), restarted=False)
    assert _storage(index, "a", doc) == 6
    index.clear_source(domain_key("pvc"), restarted=True)
    assert _storage(index, "a", doc) == 0


# --- property: no replica is ever credited a chunk of a layout it cannot read --------------

LAYOUTS = {"a": "tp1", "b": "tp1", "t": "tp2", "u": None}
op_st = st.one_of(
    st.tuples(
        st.just("write"), st.sampled_from(sorted(LAYOUTS)), st.integers(0, 1), st.integers(1, 3)
    ),
    st.tuples(st.just("evict"), st.integers(0, 1), st.integers(0, 2)),
    st.tuples(st.just("evictor_reset")),
)


@settings(max_examples=60, deadline=None)
@given(st.lists(op_st, max_size=25))
def test_no_replica_sees_a_chunk_its_layout_never_wrote(ops: list[tuple]) -> None:
    index = InMemoryPrefixIndex()
    for replica, layout in LAYOUTS.items():
        index.attach(replica, "d", layout)
    # (layout, doc, chunk); the documents share their first chunk: it is doc 0's
    files: set[tuple[str | None, int, int]] = set()
    for op in ops:
        if op[0] == "write":
            _, replica, d, chunks = op
            _write(index, replica, DOCS[d], chunks)
            files |= {(LAYOUTS[replica], d if k else 0, k) for k in range(chunks)}
        elif op[0] == "evict":  # the evictor deletes chunk k of doc d in every layout
            _, d, k = op
            index.apply(EVICTOR, [removed(DOCS[d], [k * N, k * N + 1], Medium.STORAGE)])
            files = {f for f in files if f[1:] != (d if k else 0, k)}
        else:
            index.clear_source(EVICTOR, restarted=True)
        for replica, layout in LAYOUTS.items():
            for d, doc in enumerate(DOCS):
                held = index.block_tiers(replica, doc)
                for b, tiers in enumerate(held):
                    if "STORAGE" in tiers:
                        k = b // N
                        assert (layout, d if k else 0, k) in files, (replica, d, b, files)
