"""A replica's index state exported from one index and imported into another answers every
lookup the same, and keeps answering the same as both go on applying the same events (so the
chain state travels too: parents, chunk records and lengths, reference counts, holdings).
A record that is forged or damaged is refused before anything is installed."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvroute.indexer.index import InMemoryPrefixIndex
from kvroute.indexer.keys import RequestKeys
from kvroute.indexer.snapshot import ReplicaState, SnapshotError
from kvroute.indexer.wire import Event, Medium
from tests.indexer.builders import DOC, DOCS, OTHER, operation, removed, stored, tier_only
from tests.indexer.index import test_index_truth as truth
from tests.router.manual_clock import ManualClock


def _probes() -> list[RequestKeys]:
    out = [RequestKeys(d) for d in (*DOCS, DOC, OTHER)]
    out += [
        RequestKeys(truth.DOCS[d], lora_name=lora, cache_salt=salt)
        for d in range(len(truth.DOCS))
        for lora, salt in truth.VARIANTS
    ]
    return out


def _same_answers(a: InMemoryPrefixIndex, b: InMemoryPrefixIndex, replicas: list[str]) -> None:
    for request in _probes():
        assert a.lookup(request, replicas=replicas) == b.lookup(request, replicas=replicas)
        for r in replicas:
            assert a.block_tiers(r, request) == b.block_tiers(r, request)
    by_name = {s.replica: s for s in a.summary()}
    for s in b.summary():
        if s.replica in replicas:
            assert s == by_name[s.replica]


def _copy(a: InMemoryPrefixIndex, b: InMemoryPrefixIndex, replica: str) -> None:
    """Through the wire bytes, as a peer receives it."""
    state = a.export_replica(replica)
    assert state is not None
    raw = msgspec.msgpack.encode(state)
    b.import_replica(replica, msgspec.msgpack.decode(raw, type=ReplicaState))


@settings(max_examples=150, deadline=None)
@given(
    st.lists(operation(), min_size=1, max_size=30),
    st.lists(operation(), max_size=15),
)
def test_import_of_export_answers_every_lookup_the_same(
    before: list[tuple[str, Event]], after: list[tuple[str, Event]]
) -> None:
    clock = ManualClock()
    a = InMemoryPrefixIndex(clock=clock)
    b = InMemoryPrefixIndex(clock=clock)
    b.apply("other", [stored(DOC, 0, 3)])  # a replica the importer already has: untouched
    for replica, event in before:
        a.apply(replica, [event])
    names = a.replicas()
    for name in names:
        _copy(a, b, name)
    _same_answers(a, b, names)
    assert b.lookup(RequestKeys(DOC), replicas=["other"])["other"].blocks == 3
    for replica, event in after:
        assert a.apply(replica, [event]) == b.apply(replica, [event])
    _same_answers(a, b, a.replicas())
    assert b.entries == a.entries + 3


@settings(max_examples=120, deadline=None)
@given(
    st.sampled_from(["connector", "native_sd", "native_ph"]),
    st.lists(truth.op_st, min_size=1, max_size=25),
    st.lists(truth.op_st, max_size=15),
)
def test_every_publisher_state_survives_the_copy(
    lower: str, before: list[tuple[Any, ...]], after: list[tuple[Any, ...]]
) -> None:
    """The truth model's publishers (block pool, offloading connectors, LMCache, llm-d's FS
    stream): a copy taken mid-history goes on exactly as the original."""
    clock = ManualClock()
    model = truth.ModelReplica(lower, 10, 3)
    a = InMemoryPrefixIndex(unconfirmed_ttl_s=1e6, clock=clock)
    b = InMemoryPrefixIndex(unconfirmed_ttl_s=1e6, clock=clock)
    for op in before:
        getattr(model, op[0])(*op[1:])
        truth._deliver(a, model.main, "")
        truth._deliver(a, model.aux, "fs")
    assume("r" in a.replicas())
    _copy(a, b, "r")
    _same_answers(a, b, ["r"])
    for op in after:
        getattr(model, op[0])(*op[1:])
        _deliver_both(a, b, model.main, "")
        _deliver_both(a, b, model.aux, "fs")
    _same_answers(a, b, ["r"])


def _deliver_both(
    a: InMemoryPrefixIndex, b: InMemoryPrefixIndex, events: list[Event], source: str
) -> None:
    """The same events to both (the copy must go on exactly as the original)."""
    for index in (a, b):
        truth._deliver(index, list(events), source)
    events.clear()


def _state() -> ReplicaState:
    a = InMemoryPrefixIndex()
    a.apply("r", [stored(DOC, 0, 8), tier_only(DOC, [1, 3], Medium.CPU)])
    state = a.export_replica("r")
    assert state is not None and state.entries == 8
    return state


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"version": 99}, "version 99"),
        ({"tier_counts": [100, 0, 0, 0, 0, 0]}, "tier counts disagree"),
        ({"bit_values": [1 << 7] * 8}, "class bits out of range"),
        ({"engine_keys": [1]}, "differ in length"),
        ({"unconfirmed_blocks": 5}, "unconfirmed block count"),
        ({"block_size": 0}, "block_size 0 out of range"),
        ({"chunk_blocks": [(1, 0)]}, "chunk length"),
        ({"chain": [(1, -2)]}, "chain link"),
        ({"chain": [(1 << 64, None)]}, "chain link"),
        ({"chain": [(1, 2, 3)]}, "chain link"),
    ],
)
def test_a_forged_state_is_refused_and_nothing_is_installed(
    change: dict[str, Any], message: str
) -> None:
    forged = msgspec.structs.replace(_state(), **change)
    b = InMemoryPrefixIndex()
    b.apply("r", [stored(OTHER, 0, 2)])
    with pytest.raises(SnapshotError, match=message):
        b.import_replica("r", forged)
    # What the replica held before is still there, and nothing else.
    assert b.lookup(RequestKeys(OTHER))["r"].blocks == 2
    assert b.lookup(RequestKeys(DOC))["r"].blocks == 2  # DOC shares OTHER's first 2 blocks
    assert b.entries == 2


def test_garbage_bytes_do_not_decode_to_a_state() -> None:
    with pytest.raises(msgspec.DecodeError):
        msgspec.msgpack.decode(b"\x93\x01\x02garbage", type=ReplicaState)


def test_import_replaces_what_the_replica_held() -> None:
    b = InMemoryPrefixIndex()
    b.apply("r", [stored(OTHER, 0, 8)])
    assert b.import_replica("r", _state()) == 8
    assert b.lookup(RequestKeys(OTHER))["r"].blocks == 2  # only the shared blocks now
    assert b.lookup(RequestKeys(DOC))["r"].blocks == 8
    assert b.entries == 8


def test_the_copy_keeps_reference_counts_and_chunks() -> None:
    """Targeted: a block stored twice needs two removals in the copy too, and a tier-only
    store after the copy resolves its chunk through the copied parent links."""
    a, b = InMemoryPrefixIndex(), InMemoryPrefixIndex()
    a.apply("r", [stored(DOC, 0, 4), stored(DOC, 4, 4), stored(DOC, 4, 4)])
    _copy(a, b, "r")
    for index in (a, b):
        index.apply("r", [removed(DOC, [7])])
        assert index.lookup(RequestKeys(DOC))["r"].blocks == 8  # one copy left
        assert index.apply("r", [tier_only(DOC, [1, 3], Medium.CPU)]).blocks_stored == 4
        index.apply("r", [removed(DOC, [0, 1, 2, 3])])
        assert index.block_tiers("r", DOC) == [{"CPU"}] * 4 + [{"GPU"}] * 4
    _same_answers(a, b, ["r"])
