"""The native core's tables (``U64Map``, ``MaskMap``) against the dicts they replace.

Differential: random streams of every operation the index uses (set, get, del, pop, in, len,
iteration, keys/values/items, clear) go to a table and to a dict, and every answer and the
iteration order must agree. The streams are long enough, over small key pools, to grow the
tables, fill them with removed entries, compact and shrink them.
"""

from __future__ import annotations

import copy
import pickle
import random
import sys
import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.indexer.native_core import NATIVE

U64 = (1 << 64) - 1
_OPS = (
    "set",
    "set",
    "set",
    "update",
    "get",
    "del",
    "pop",
    "pop_default",
    "in",
    "len",
    "clear_rarely",
)


def _table(kind: str) -> object:
    assert NATIVE is not None, "the native core is not built (make install builds it)"
    return NATIVE.U64Map() if kind == "u64" else NATIVE.MaskMap()


def _value(kind: str, rng: random.Random) -> int | None:
    if kind == "u64":  # a chain's parent may be None
        return rng.choice([0, 1, U64, rng.getrandbits(64), None])
    return rng.choice([0, 5, 1 << 70, rng.getrandbits(200)])  # masks: ints of any width


def _run(kind: str, seed: int, steps: int, pool: int) -> None:
    rng = random.Random(seed)
    # the widths an int's digits change at (30-bit digits: 2**30, 2**60) and 2**64's edge
    edges = [2**30 - 1, 2**30, 2**60 - 1, 2**60, 2**63, U64]
    keys = [rng.choice([0, 1, *edges, rng.getrandbits(64), i]) for i in range(pool)]
    table, ref = _table(kind), {}
    for step in range(steps):
        op = rng.choice(_OPS)
        key = rng.choice(keys)
        if op == "set":
            value = _value(kind, rng)
            table[key] = value  # type: ignore[index]
            ref[key] = value
        elif op == "update":
            pairs = [(rng.choice(keys), _value(kind, rng)) for _ in range(rng.randrange(4))]
            table.update(pairs)  # type: ignore[attr-defined]
            ref.update(pairs)
        elif op == "get":
            assert table.get(key) == ref.get(key)  # type: ignore[attr-defined]
            assert table.get(key, -1) == ref.get(key, -1)  # type: ignore[attr-defined]
        elif op == "del":
            if key in ref:
                del table[key]  # type: ignore[attr-defined]
                del ref[key]
            else:
                with pytest.raises(KeyError):
                    del table[key]  # type: ignore[attr-defined]
        elif op == "pop":
            if key in ref:
                assert table.pop(key) == ref.pop(key)  # type: ignore[attr-defined]
            else:
                with pytest.raises(KeyError):
                    table.pop(key)  # type: ignore[attr-defined]
        elif op == "pop_default":
            assert table.pop(key, None) == ref.pop(key, None)  # type: ignore[attr-defined]
        elif op == "in":
            assert (key in table) == (key in ref)  # type: ignore[operator]
        elif op == "len":
            assert len(table) == len(ref)  # type: ignore[arg-type]
        elif rng.random() < 0.01:
            table.clear()  # type: ignore[attr-defined]
            ref.clear()
        if step % 97 == 0:
            assert list(table) == list(ref)  # type: ignore[call-overload]
            assert table.items() == list(ref.items())  # type: ignore[attr-defined]
            assert table.values() == list(ref.values())  # type: ignore[attr-defined]
            assert table.keys() == list(ref)  # type: ignore[attr-defined]
            assert table == ref and ref == table
            assert not table != ref  # noqa: SIM202  (the table's own !=)
    assert list(table) == list(ref)  # type: ignore[call-overload]
    assert table == ref


@settings(max_examples=40, deadline=None)
@given(
    kind=st.sampled_from(["u64", "masks"]),
    seed=st.integers(0, 2**32),
    steps=st.integers(1, 3000),
    pool=st.sampled_from([1, 3, 40, 500, 5000]),
)
def test_tables_answer_as_dicts(kind: str, seed: int, steps: int, pool: int) -> None:
    _run(kind, seed, steps, pool)


@pytest.mark.parametrize("kind", ["u64", "masks"])
def test_age_order_survives_growth_removal_and_compaction(kind: str) -> None:
    """A key removed and stored again is the youngest; removing most of a large table
    compacts and shrinks it without changing the order of what is left."""
    table, ref = _table(kind), {}
    for k in range(20_000):
        table[k] = ref[k] = k % 7  # type: ignore[index]
    big = sys.getsizeof(table)
    for k in range(0, 20_000, 2):
        del table[k]  # type: ignore[attr-defined]
        del ref[k]
    for k in range(1, 20_000, 2):
        if k % 10 != 9:
            table.pop(k)  # type: ignore[attr-defined]
            ref.pop(k)
    del table[19]  # type: ignore[attr-defined]
    del ref[19]
    table[19] = ref[19] = 1  # type: ignore[index]
    assert list(table) == list(ref) and list(table)[-1] == 19  # type: ignore[call-overload]
    assert table == ref
    assert sys.getsizeof(table) < big / 2  # shrunk with what it holds


def test_iterating_while_the_size_changes_raises_as_a_dict_does() -> None:
    table = _table("u64")
    for k in range(10):
        table[k] = k  # type: ignore[index]
    with pytest.raises(RuntimeError):
        for k in table:  # type: ignore[attr-defined]
            del table[k]  # type: ignore[attr-defined]
    table[3] = 4  # type: ignore[index]  (replacing a value during iteration is allowed)
    seen = []
    for k in table:  # type: ignore[attr-defined]
        table[k] = 0  # type: ignore[index]
        seen.append(k)
    assert seen == list(table)  # type: ignore[call-overload]


def test_bad_keys_and_values_are_refused_or_absent() -> None:
    """Keys outside [0, 2**64) cannot be stored and are never found; a U64Map refuses values
    outside that range and a MaskMap anything but an int."""
    u64, masks = _table("u64"), _table("masks")
    for bad in (-1, -(2**63), 1 << 64, (1 << 64) + 1, 1 << 90, 17 << 60, "x", 1.0):
        for table in (u64, masks):
            assert table.get(bad) is None and bad not in table  # type: ignore[attr-defined,operator]
            assert table.pop(bad, 7) == 7  # type: ignore[attr-defined]
            with pytest.raises(KeyError):
                table[bad]  # type: ignore[index]
            with pytest.raises((OverflowError, TypeError)):
                table[bad] = 1  # type: ignore[index]
    for bad_value in (-1, 1 << 64, "x"):
        with pytest.raises((OverflowError, TypeError)):
            u64[1] = bad_value  # type: ignore[index]
    for bad_value in ("x", None):
        with pytest.raises(TypeError):
            masks[1] = bad_value  # type: ignore[index]
    for bad_pairs in ([(1, 2, 3)], [5], [(-1, 2)]):
        with pytest.raises((ValueError, TypeError, OverflowError)):
            u64.update(bad_pairs)  # type: ignore[attr-defined]
    assert len(u64) == len(masks) == 0  # type: ignore[arg-type]


def test_copying_or_pickling_a_table_is_refused_not_emptied() -> None:
    """The types keep their entries where Python cannot see them: a copy would be empty."""
    for kind in ("u64", "masks"):
        table = _table(kind)
        table[1] = 2  # type: ignore[index]
        for copier in (copy.copy, copy.deepcopy, pickle.dumps):
            with pytest.raises(TypeError, match="cannot be copied"):
                copier(table)


def test_masks_are_held_by_reference() -> None:
    """A MaskMap keeps the int it was given (interned masks stay shared objects)."""
    masks = _table("masks")
    mask = (1 << 300) | 5
    masks[9] = mask  # type: ignore[index]
    assert masks[9] is mask  # type: ignore[index]
    assert masks.pop(9) is mask  # type: ignore[attr-defined]
    assert sys.getrefcount(mask) == 2  # the local and the call's argument: no leak


def test_a_u64_entry_costs_well_under_a_dicts() -> None:
    """Measured with tracemalloc, as the bench measures: a U64Map of 200,000 entries against
    a dict of the same ints (the dict's int objects included)."""
    rng = random.Random(3)
    pairs = [(rng.getrandbits(64), rng.getrandbits(64)) for _ in range(200_000)]

    def measured(make: type) -> int:
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        table = make()
        for k, v in pairs:
            table[int(str(k))] = int(str(v))  # fresh int objects, as decoded events bring
        used = tracemalloc.get_traced_memory()[0] - base
        tracemalloc.stop()
        assert len(table) == len(pairs)
        return used

    native = measured(type(_table("u64")))
    python = measured(dict)
    assert native / len(pairs) <= 40  # 16 bytes of entry, the index, growth slack
    assert native < python / 2
