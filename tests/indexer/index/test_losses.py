"""Batches lost at their source (indexer/index/losses.py): a window of ``unconfirmed_ttl_s``,
then only what the stream's later events proved held is believed."""

from __future__ import annotations

from kvroute.indexer.index import InMemoryPrefixIndex
from kvroute.indexer.snapshot import export_state, import_state
from kvroute.indexer.wire import AllBlocksCleared, Medium
from tests.indexer.builders import DOC, DOCS, hashes_of, removed, stored, tier_only

TTL = 60.0
A, B = DOCS  # six blocks each, sharing their first two
C = DOC[:24]  # six blocks, nothing in common with A or B


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _index() -> tuple[InMemoryPrefixIndex, Clock]:
    clock = Clock()
    index = InMemoryPrefixIndex(unconfirmed_ttl_s=TTL, clock=clock)
    index.add_replica("r")
    return index, clock


def _tiers(index: InMemoryPrefixIndex, tokens: list[int]) -> list[set[str]]:
    return [set(t) for t in index.block_tiers("r", tokens)]


def test_a_removal_lost_at_the_source_is_believed_one_window_only() -> None:
    index, clock = _index()
    index.apply("r", [stored(A, 0, 6)])
    # the batch evicting A's blocks is lost; the index is told of the loss
    index.note_lost("r")
    clock.now = TTL - 1
    assert index.expire() == 0
    assert all("GPU" in t for t in _tiers(index, A))  # within the window: still believed
    clock.now = TTL
    assert index.expire() == 6
    assert not any(_tiers(index, A))
    assert index.summary()[0].entries == 0


def test_what_the_stream_stores_after_the_loss_is_kept_with_its_ancestors() -> None:
    index, clock = _index()
    index.apply("r", [stored(A, 0, 6), stored(B, 2, 4), stored(C, 0, 2)])
    index.note_lost("r")
    clock.now = 10
    # a request extends A past its end: all its blocks are held (its parent's chain)
    index.apply("r", [stored(A + list(range(900, 904)), 6, 1)])
    index.apply("r", [stored(C, 0, 1)])  # stored again: held
    clock.now = TTL
    index.expire()
    assert ["GPU" in t for t in _tiers(index, A)] == [True] * 6
    assert ["GPU" in t for t in _tiers(index, B)] == [True, True, False, False, False, False]
    assert ["GPU" in t for t in _tiers(index, C)[:2]] == [True, False]


def test_a_chunk_named_by_its_last_block_is_kept_whole() -> None:
    index, clock = _index()
    index.apply("r", [stored(A, 0, 6)])
    index.apply("r", [tier_only(A, [1], Medium.CPU)])
    index.apply("r", [tier_only(A, [1, 3], Medium.CPU), tier_only(A, [5], Medium.CPU)])
    assert all("CPU" in t for t in _tiers(index, A))  # chunks of two blocks, learned
    index.note_lost("r")
    index.apply("r", [removed(A, [3], Medium.CPU)])  # delivered: the chunk of blocks 2-3
    # vLLM's offloading connector stores again only a chunk it lost: chunk 0-1 was
    index.apply("r", [tier_only(A, [1], Medium.CPU)])
    clock.now = TTL
    index.expire()
    assert ["CPU" in t for t in _tiers(index, A)] == [True, True, False, False, False, False]


def test_a_block_stored_in_the_window_is_held_once() -> None:
    """The lost batch may have removed one of two copies: a store while the window is open
    counts no second copy, and the copies counted before are forgotten when it ends."""
    index, clock = _index()
    index.apply("r", [stored(A, 0, 2), stored(A, 2, 1), stored(A, 2, 1)])  # block 2 twice
    index.note_lost("r")  # held one copy less than the index counts
    index.apply("r", [stored(A, 2, 1)])  # in the window: not anB copy
    clock.now = TTL
    index.expire()
    index.apply("r", [removed(A, [2])])
    assert ["GPU" in t for t in _tiers(index, A)[:3]] == [True, True, False]


def test_a_loss_in_the_window_opens_the_next_which_keeps_only_what_follows_it() -> None:
    index, clock = _index()
    index.apply("r", [stored(A, 0, 6)])
    index.note_lost("r")
    clock.now = 30
    index.apply("r", [stored(C, 0, 2)])  # proved held after the first loss only
    index.note_lost("r")
    clock.now = 40
    index.apply("r", [stored(B, 0, 2)])  # A's first two blocks, after the second loss
    clock.now = TTL
    index.expire()
    assert ["GPU" in t for t in _tiers(index, A)] == [True, True, False, False, False, False]
    assert ["GPU" in t for t in _tiers(index, C)[:2]] == [True, True]
    clock.now = 30 + TTL  # the second window ends: what only the first proved goes
    index.expire()
    assert ["GPU" in t for t in _tiers(index, C)[:2]] == [False, False]
    assert ["GPU" in t for t in _tiers(index, A)[:2]] == [True, True]


def test_no_window_without_confirmed_events_and_none_past_a_clear() -> None:
    index, clock = _index()
    index.note_lost("r")  # nothing confirmed published yet: nothing to doubt
    index.apply("r", [stored(A, 0, 6)])
    clock.now = TTL
    index.expire()
    assert all("GPU" in t for t in _tiers(index, A))
    index.note_lost("r", source="fs")  # anB stream's loss: this one vouches for its own
    clock.now = 2 * TTL
    index.expire()
    assert all("GPU" in t for t in _tiers(index, A))
    index.note_lost("r")
    index.clear_source("r", restarted=False)  # everything it vouched for is gone already
    index.apply("r", [stored(A, 0, 6)])
    clock.now = 3 * TTL
    index.expire()
    assert all("GPU" in t for t in _tiers(index, A))
    # a device clear does not end the window: the lower tiers' removals may be the lost ones
    index.apply("r", [tier_only(A, [1], Medium.CPU)])
    index.note_lost("r")
    index.apply("r", [AllBlocksCleared()])
    clock.now = 4 * TTL
    index.expire()
    assert not any(_tiers(index, A))


def test_a_snapshot_carries_the_open_windows() -> None:
    index, clock = _index()
    index.apply("r", [stored(A, 0, 6)])
    index.note_lost("r")
    clock.now = 20
    index.note_lost("r")
    clock.now = 30
    with index._lock:
        rec = export_state(index, "r")
    assert rec is not None and rec.loss_ages_s == [30.0, 10.0]
    peer, peer_clock = _index()
    peer_clock.now = 100.0
    with peer._lock:
        import_state(peer, "r", rec)
    peer_clock.now = 100.0 + TTL - 30 - 1
    peer.expire()
    assert all("GPU" in t for t in _tiers(peer, A))
    peer_clock.now = 100.0 + TTL - 30
    peer.expire()
    assert not any(_tiers(peer, A))


def test_hashes_are_what_the_builders_publish() -> None:
    """The tests above name blocks through the builders' hashes: a store and a removal of the
    same block must agree."""
    assert stored(A, 2, 1).block_hashes == hashes_of(A, 2, 1)
    assert removed(A, [2]).block_hashes == hashes_of(A, 2, 1)


def test_a_snapshot_with_malformed_windows_is_refused() -> None:
    """A forged or corrupted record's windows (more than a window and its next, a negative or
    endless age) are refused before anything is installed."""
    import msgspec
    import pytest

    from kvroute.indexer.snapshot import SnapshotError

    index, _clock = _index()
    index.apply("r", [stored(A, 0, 6)])
    index.note_lost("r")
    with index._lock:
        rec = export_state(index, "r")
    assert rec is not None
    peer, _ = _index()
    for ages in ([1.0, 2.0, 3.0], [-1.0], [float("inf")]):
        forged = msgspec.structs.replace(rec, loss_ages_s=ages)
        with pytest.raises(SnapshotError), peer._lock:
            import_state(peer, "r", forged)
        assert peer.summary()[0].entries == 0  # nothing installed
