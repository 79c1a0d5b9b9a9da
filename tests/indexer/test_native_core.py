"""The native index core (indexer/native_core.py, indexer/native/core.cpp) against its Python
specification: random inputs through both, exact agreement.

- keying: ``block_keys`` (native) and ``block_keys_py`` over random tokens, block sizes,
  parents and limits;
- the walk: ``walk_counts`` (native) and ``Lookups._walk_counts`` (and ``walk_into``, which
  records the device-only rows itself, against ``walk_counts``) over random masks of up to
  200 replica slots (masks wider than 64 bits take the native core's wide path), masks equal
  in value but distinct objects (the native walk's same-object shortcut must not be all it
  relies on), repeated slots and storage-domain lifts;
- the whole index: every publisher's events (tests/indexer/builders.py's ``operation``:
  device, lower-tier, by-hash, tier-only stores, removals, clears; LMCache's unconfirmed
  chunks; a storage domain with attached replicas) applied to an index on the native core and
  one on the Python core (keying too), then every lookup and the stats must agree; the
  native index's lookups go through the plans it keeps (indexer/index/plans.py), the Python
  index's are planned afresh each time, so a plan kept past a change of layout disagrees.

These tests need the extension: ``make install`` builds it, and they fail without it. The
Python core on its own (the fallback) is tests/indexer/test_native_fallback.py.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.indexer import keys as keys_module
from kvroute.indexer import native_core
from kvroute.indexer.index import InMemoryPrefixIndex, PrefixMatch
from kvroute.indexer.index.lookup import Lookups
from kvroute.indexer.index.state import _W, _ReplicaState
from kvroute.indexer.keys import RequestKeys, block_keys, block_keys_py, python_keying
from kvroute.indexer.wire import BlockStored, Event, Medium
from tests.indexer.builders import BS, DOCS, hashes_of, lmcache_chunk, operation, removed

NATIVE = native_core.NATIVE


def test_the_native_core_is_built_and_runs() -> None:
    """``make install`` builds it: a missing extension fails here, it is never skipped."""
    assert NATIVE is not None, f"native index core missing: {native_core.UNAVAILABLE}"
    assert native_core.CORE == "native"
    assert InMemoryPrefixIndex().stats().index_core == "native"


# ---- keying ----------------------------------------------------------------------------

u32 = st.integers(0, 2**32 - 1)
u64 = st.integers(0, 2**64 - 1)


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(u32, max_size=300),
    block_size=st.integers(1, 40),
    parent=st.none() | u64,
    max_blocks=st.none() | st.integers(-2, 20),
    packed=st.booleans(),
)
def test_block_keys_native_equals_python(
    tokens: list[int], block_size: int, parent: int | None, max_blocks: int | None, packed: bool
) -> None:
    arg: list[int] | bytes = keys_module.pack_tokens(tokens) if packed else tokens
    expected = block_keys_py(arg, block_size, parent=parent, max_blocks=max_blocks)
    assert block_keys(arg, block_size, parent=parent, max_blocks=max_blocks) == expected
    assert NATIVE is not None
    seed = keys_module.root_key(block_size) if parent is None else parent
    limit = -1 if max_blocks is None else max(0, max_blocks)
    assert NATIVE.block_keys(keys_module.pack_tokens(tokens), block_size, seed, limit) == expected


@settings(max_examples=50, deadline=None)
@given(tokens=st.lists(u32, min_size=8, max_size=64), lora=st.sampled_from([None, "L"]))
def test_chains_with_extra_keys_stay_python_and_agree(tokens: list[int], lora: str | None) -> None:
    extra = [("L",) if lora else None for _ in range(len(tokens) // 4)]
    assert block_keys(tokens, 4, extra_keys=extra) == block_keys_py(tokens, 4, extra_keys=extra)


def test_block_keys_rejects_what_python_rejects() -> None:
    with pytest.raises(ValueError):
        block_keys([1, 2, 3], 0)
    with pytest.raises(ValueError):
        block_keys([-1], 1)


# ---- the walk --------------------------------------------------------------------------


def _python_lifted(
    get: Callable[[int, int], int], slots: list[int], pairs: list[tuple[int, int]]
) -> Callable[[int, int], int]:
    """lookup.py's ``_lifted`` from the native walk's (source bit, replica index) pairs."""

    def lifted(key: int, default: int = 0) -> int:
        mask = get(key, default)
        out = mask
        for src, j in pairs:
            if mask >> src & 1:
                out |= 1 << (_W * slots[j] + src % _W)
        return out

    return lifted


@st.composite
def walks(draw: st.DrawFn) -> tuple[list[int], dict[int, int], list[int], list[tuple[int, int]]]:
    wide = draw(st.booleans())
    max_slot = draw(st.integers(0, 200 if wide else 9))
    n = draw(st.integers(1, 8))
    slots = draw(st.lists(st.integers(0, max_slot), min_size=n, max_size=n))
    n_keys = draw(st.integers(0, 60))
    # A few distinct masks, chosen per replica slot: whole device, lower tiers, nothing.
    slot_bits = st.sampled_from([0, 1, 1, 0b11, 0b10, 0b100, 0b1000, 0b100000, 0b110110, 63])
    every_slot = sorted({*slots, *draw(st.lists(st.integers(0, max_slot + 3), max_size=4))})
    palette = []
    for _ in range(draw(st.integers(1, 6))):
        mask = 0
        for s in every_slot:
            mask |= draw(slot_bits) << (_W * s)
        palette.append(mask)
    keys = list(range(1000, 1000 + n_keys))
    masks: dict[int, int] = {}
    for k in keys:
        choice = draw(st.integers(-1, len(palette) - 1))
        if choice >= 0 and palette[choice]:
            # equal values as distinct objects half the time (int() of a str makes a new one)
            value = palette[choice]
            masks[k] = int(str(value)) if draw(st.booleans()) else value
    pairs = []
    if draw(st.booleans()):
        domain_slot = max_slot + draw(st.integers(1, 3))
        for j in draw(st.lists(st.integers(0, n - 1), max_size=3)):
            for cls in (2, 5):
                pairs.append((_W * domain_slot + cls, j))
                # and the domain holds something
        for k in keys:
            if draw(st.integers(0, 3)) == 0:
                masks[k] = masks.get(k, 0) | (
                    draw(st.sampled_from([0b100, 0b100000])) << (_W * domain_slot)
                )
    return keys, masks, slots, pairs


@settings(max_examples=800, deadline=None)
@given(walk=walks())
def test_walk_counts_native_equals_python(
    walk: tuple[list[int], dict[int, int], list[int], list[tuple[int, int]]],
) -> None:
    keys, masks, slots, pairs = walk
    states = [_ReplicaState(f"r{j}", slot) for j, slot in enumerate(slots)]
    get = _python_lifted(masks.get, slots, pairs) if pairs else masks.get
    index = InMemoryPrefixIndex(core="python")
    counts, ended = Lookups._walk_counts(index, keys, states, get)
    assert NATIVE is not None
    native_counts, native_ended = NATIVE.walk_counts(keys, masks, slots, pairs)
    for j, slot in enumerate(slots):
        assert native_counts[j] == counts[slot], (j, slot)
        assert native_ended[j] == ended.get(slot, len(keys)), (j, slot)


@settings(max_examples=500, deadline=None)
@given(walk=walks())
def test_walk_into_records_device_only_rows_and_returns_the_rest(
    walk: tuple[list[int], dict[int, int], list[int], list[tuple[int, int]]],
) -> None:
    """``walk_into``: the rows the device prefix alone serves are recorded as the Python
    ``_walk`` records them (a match of the device blocks, GPU only); every other row comes
    back with the counts and end ``walk_counts`` gives it, and is not recorded."""
    keys, masks, slots, pairs = walk
    slots = list(dict.fromkeys(slots))  # distinct: the caller walks duplicates the other way
    pairs = [(src, j) for src, j in pairs if j < len(slots)]
    assert NATIVE is not None
    counts, ended = NATIVE.walk_counts(keys, masks, slots, pairs)
    names = [f"r{j}" for j in range(len(slots))]
    out: dict[str, PrefixMatch] = {"elsewhere": PrefixMatch("elsewhere", 16, 1, {})}
    rest = NATIVE.walk_into(keys, masks, slots, pairs, names, 16, PrefixMatch, Medium.GPU, out)
    returned = {j for j, _, _ in rest}
    for j, c, blocks in rest:
        assert (c, blocks) == (counts[j], ended[j]) and blocks > c[0]
        assert names[j] not in out
    for j, name in enumerate(names):
        if j in returned:
            continue
        assert ended[j] == counts[j][0] and not any(counts[j][1:])
        held = counts[j][0]
        assert out[name] == PrefixMatch(name, 16, held, {Medium.GPU: held} if held else {}, {})
    assert out["elsewhere"] == PrefixMatch("elsewhere", 16, 1, {})


# ---- the whole index -------------------------------------------------------------------


def _unconfirmed(draw: st.DrawFn) -> tuple[str, Event]:
    doc = DOCS[draw(st.integers(0, len(DOCS) - 1))]
    chunks = len(doc) // (2 * BS)
    c = draw(st.integers(0, chunks - 1))
    parent = None if c == 0 else 7_000 + c - 1
    return draw(st.sampled_from(["r0", "r1"])), lmcache_chunk(
        doc, c * 2 * BS, 2 * BS, 7_000 + c, parent
    )


def _event(draw: st.DrawFn) -> tuple[str, Event]:
    kind = draw(st.integers(0, 11))
    if kind == 0:
        return _unconfirmed(draw)
    if kind == 1:
        doc = DOCS[draw(st.integers(0, len(DOCS) - 1))]
        return "domain:d", _domain_store(doc, draw(st.integers(1, len(doc) // BS)))
    if kind <= 3:  # vLLM's eviction: one BlockRemoved per device block, often in a row
        doc = DOCS[draw(st.integers(0, len(DOCS) - 1))]
        block = draw(st.integers(0, len(doc) // BS - 1))
        return draw(st.sampled_from(["r0", "r1", "r2"])), removed(doc, [block])
    return draw(operation())


@st.composite
def streams(draw: st.DrawFn) -> list[tuple[str, list[Event]]]:
    """Batches of one replica's events (runs of device removals among them)."""
    out: list[tuple[str, list[Event]]] = []
    for _ in range(draw(st.integers(1, 30))):
        replica, first = _event(draw)
        batch = [first]
        for _ in range(draw(st.integers(0, 5))):
            other, event = _event(draw)
            if other == replica:
                batch.append(event)
        out.append((replica, batch))
    return out


def _domain_store(doc: list[int], n: int) -> BlockStored:
    return BlockStored(hashes_of(doc, 0, n), None, doc[: n * BS], BS, medium=Medium.STORAGE)


def _probes() -> list[list[int]]:
    return [doc[:cut] for doc in DOCS for cut in (3 * BS, 4 * BS + 1, len(doc))]


@settings(max_examples=200, deadline=None)
@given(events=streams(), attach=st.booleans(), max_entries=st.sampled_from([6, 40, 10_000]))
def test_index_on_native_core_answers_as_the_python_index(
    events: list[tuple[str, list[Event]]], attach: bool, max_entries: int
) -> None:
    native = InMemoryPrefixIndex(max_entries, core="native", clock=lambda: 0.0)
    python = InMemoryPrefixIndex(max_entries, core="python", clock=lambda: 0.0)
    if attach:
        for index in (native, python):
            index.attach("r2", "d")
    for replica, batch in events:
        a = native.apply(replica, batch)
        with python_keying():
            b = python.apply(replica, batch)
        assert a == b
        assert native._entries == python._entries
        for name in native.replicas():
            ours, theirs = native._replicas[name], python._replicas[name]
            assert ours.engine_to_key == theirs.engine_to_key
            assert list(ours.engine_to_key) == list(theirs.engine_to_key)  # age order
            assert (ours.refs, ours.chain, ours.ghost) == (theirs.refs, theirs.chain, theirs.ghost)
            assert ours.tier_counts == theirs.tier_counts
        assert native._masks == python._masks
        for tokens in _probes():
            want = native.lookup(tokens)  # through the plans it keeps (plans.py)
            python._plans.clear()  # planned afresh: a plan kept too long shows here
            with python_keying():
                assert python.lookup(RequestKeys(tokens)) == want
                assert python.lookup(tokens, replicas=["r2", "r0", "r2"]) == native.lookup(
                    tokens, replicas=["r2", "r0", "r2"]
                )
    assert native.entries == python.entries
    assert native.summary() == python.summary()
    a, b = native.stats(), python.stats()
    assert (a.index_core, b.index_core) == ("native", "python")
    # the tables differ (native words, dicts of ints), and so do their bytes; nothing else
    assert dataclasses.replace(a, index_core="python", estimated_bytes=b.estimated_bytes) == b


def test_wide_fleet_lookups_agree() -> None:
    """Masks of 150 replicas (900 bits): the native walk's wide path, on a real index."""
    rng = random.Random(7)
    native = InMemoryPrefixIndex(core="native")
    python = InMemoryPrefixIndex(core="python")
    doc = [rng.randrange(50_000) for _ in range(64 * BS)]
    for r in range(150):
        held = rng.randrange(1, 65)
        event = BlockStored(hashes_of(doc, 0, held), None, doc[: held * BS], BS)
        lower = BlockStored(
            hashes_of(doc, 0, 64), None, doc, BS, medium=rng.choice([Medium.CPU, Medium.STORAGE])
        )
        for index in (native, python):
            index.apply(f"r{r}", [event, lower] if r % 3 else [event])
    for cut in (BS, 10 * BS, 33 * BS, 64 * BS):
        assert native.lookup(doc[:cut]) == python.lookup(doc[:cut])


class _Counting:
    """The native module, counting the device-removal runs it applies."""

    def __init__(self, module: object) -> None:
        self._module = module
        self.runs: list[int] = []

    def __getattr__(self, name: str) -> object:
        return getattr(self._module, name)

    def remove_device(self, hash_lists: list[list[int]], *args: object) -> object:
        self.runs.append(len(hash_lists))
        return self._module.remove_device(hash_lists, *args)  # type: ignore[attr-defined]


def test_device_removals_run_natively_and_agree() -> None:
    """A batch of vLLM's evictions (one BlockRemoved per block, a hash stored twice, one
    unknown) is one native call; a CPU removal in between ends the run; the state after is
    the Python core's."""
    doc = DOCS[0]
    n = len(doc) // BS
    batches: list[list[Event]] = [
        [
            BlockStored(hashes_of(doc, 0, n), None, doc, BS),
            BlockStored(hashes_of(doc, 2, 2), hashes_of(doc, 1, 1)[0], doc[2 * BS : 4 * BS], BS),
            BlockStored(hashes_of(doc, 0, 3), None, doc[: 3 * BS], BS, medium=Medium.CPU),
        ],
        [removed(doc, [b]) for b in range(n - 1, 3, -1)]
        + [removed(doc, [1], Medium.CPU)]
        + [removed(doc, [b]) for b in (3, 2, 2, 3, 1)]
        + [removed(DOCS[1], [4])],
    ]
    native = InMemoryPrefixIndex(core="native")
    python = InMemoryPrefixIndex(core="python")
    counting = _Counting(native._native)
    native._native = counting
    for batch in batches:
        assert native.apply("r0", batch) == python.apply("r0", batch)
        assert native._masks == python._masks
        ours, theirs = native._replicas["r0"], python._replicas["r0"]
        assert list(ours.engine_to_key.items()) == list(theirs.engine_to_key.items())
        assert (ours.refs, ours.chain, ours.tier_counts) == (
            theirs.refs,
            theirs.chain,
            theirs.tier_counts,
        )
    assert counting.runs == [n - 4, 6]
    assert native.lookup(doc) == python.lookup(doc)
    assert native.entries == python.entries > 0


def test_device_stores_run_natively_and_agree_when_vllm_reuses_a_hash() -> None:
    """A device store is one native ``hold_run`` call; a hash stored again for other content
    (vLLM reused it) stops the native loop, is taken in Python (the old block forgotten),
    and the loop goes on: the tables after are the Python core's, age order included."""
    doc, other = DOCS[0], DOCS[1]
    hashes = hashes_of(doc, 0, 6)
    batches: list[list[Event]] = [
        [BlockStored(hashes, None, doc[: 6 * BS], BS)],
        # the same hashes, the middle two now naming other content; then the same again
        [BlockStored(hashes[:2], None, doc[: 2 * BS], BS)],
        [BlockStored(hashes[:4], None, doc[: 2 * BS] + other[2 * BS : 4 * BS], BS)],
        [BlockStored(hashes[:4], None, doc[: 2 * BS] + other[2 * BS : 4 * BS], BS)],
    ]
    native = InMemoryPrefixIndex(core="native")
    python = InMemoryPrefixIndex(core="python")
    calls: list[int] = []
    module = native._native

    class Counting:
        def __getattr__(self, name: str) -> object:
            return getattr(module, name)

        def hold_run(self, hashes: list[int], keys: list[int], start: int, *args: object) -> object:
            calls.append(start)
            return module.hold_run(hashes, keys, start, *args)  # type: ignore[attr-defined]

    native._native = Counting()
    for batch in batches:
        with python_keying():
            b = python.apply("r0", batch)
        assert native.apply("r0", batch) == b
        assert native._masks == python._masks
        ours, theirs = native._replicas["r0"], python._replicas["r0"]
        assert list(ours.engine_to_key.items()) == list(theirs.engine_to_key.items())
        assert (ours.refs, ours.tier_counts) == (theirs.refs, theirs.tier_counts)
        assert native.entries == python.entries
    assert 0 in calls and 3 in calls  # stopped at a reused hash, and went on after it
    assert native.lookup(doc[: 6 * BS]) == python.lookup(doc[: 6 * BS])
    assert native.lookup(other[: 4 * BS]) == python.lookup(other[: 4 * BS])
