"""The bounded LRU behind the tokenization caches and routing tables (router/common/lru.py)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvroute.router.common.lru import LRU, token_list_bytes


def test_least_recently_used_goes_first() -> None:
    lru: LRU[str, int] = LRU(2)
    lru.put("a", 1)
    lru.put("b", 2)
    assert lru.get("a") == 1  # "b" is now the oldest
    lru.put("c", 3)
    assert lru.get("b") is None and lru.get("a") == 1 and lru.get("c") == 3
    assert (lru.hits, lru.misses) == (3, 1)


def test_weight_bounds_memory_whatever_the_entry_count() -> None:
    lru: LRU[str, list[int]] = LRU(1000, max_weight=10_000, weigh=lambda k, v: len(v))
    for i in range(10):
        lru.put(str(i), [0] * 2000)
    assert lru.weight <= 10_000 and len(lru) == 5
    assert lru.get("9") is not None and lru.get("0") is None
    lru.put("huge", [0] * 2501)  # over a quarter of the budget: not worth evicting others for
    assert lru.get("huge") is None and len(lru) == 5
    lru.put("9", [0])  # a replacement gives its old weight back
    assert lru.weight == 4 * 2000 + 1
    lru.clear()
    assert lru.weight == 0 and len(lru) == 0


def test_a_weight_needs_a_weigher() -> None:
    with pytest.raises(ValueError):
        LRU(10, max_weight=100)
    with pytest.raises(ValueError):
        LRU(0)


def test_token_lists_are_weighed_by_what_cpython_holds() -> None:
    assert token_list_bytes([]) < token_list_bytes(list(range(1000, 2000))) <= 56 + 36_000


@given(
    st.lists(st.tuples(st.integers(0, 30), st.integers(0, 400)), max_size=200),
    st.integers(1, 20),
)
def test_weight_is_the_sum_of_what_is_held_and_stays_under_the_bound(
    puts: list[tuple[int, int]], maxsize: int
) -> None:
    lru: LRU[int, int] = LRU(maxsize, max_weight=1000, weigh=lambda k, v: v)
    for key, value in puts:
        lru.put(key, value)
        held = [lru._data[k][1] for k in lru._data]
        assert lru.weight == sum(held) <= 1000
        assert len(lru) <= maxsize


def test_a_membership_check_counts_nothing_and_keeps_the_order() -> None:
    lru: LRU[str, int] = LRU(2)
    lru.put("old", 1)
    lru.put("new", 2)
    assert "old" in lru and "gone" not in lru
    assert (lru.hits, lru.misses) == (0, 0)
    lru.put("newest", 3)  # "old" is still the least recently used: evicted
    assert "old" not in lru and lru.get("new") == 2
