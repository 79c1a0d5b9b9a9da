"""The per-publisher byte budget (indexer/subscriber/budget.py), on a manual clock."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvroute.indexer.subscriber.budget import ByteBudget


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_burst_passes_then_the_rate_holds() -> None:
    clock = Clock()
    budget = ByteBudget(1000, 3000, clock=clock)
    assert budget.take(3000)
    assert not budget.take(1)  # empty: refused, nothing spent
    clock.now += 0.5
    assert budget.take(500) and not budget.take(1)
    clock.now += 100  # refills to the burst, never past it
    assert budget.level == 3000


def test_a_charge_leaves_debt_paid_before_anything_else_passes() -> None:
    clock = Clock()
    budget = ByteBudget(1000, 1000, clock=clock)
    budget.charge(3000)  # a replay asked for: taken whole
    assert budget.level == -2000
    clock.now += 2.5
    assert not budget.take(600) and budget.take(500)
    budget.charge(10_000, floor=-1000)
    assert budget.level == -1000


def test_nonsense_rates_are_refused() -> None:
    with pytest.raises(ValueError):
        ByteBudget(0, 10)
    with pytest.raises(ValueError):
        ByteBudget(10, -1)


@given(st.lists(st.tuples(st.floats(0, 5), st.integers(0, 5000)), max_size=60))
def test_what_passes_never_exceeds_burst_plus_rate_times_time(
    steps: list[tuple[float, int]],
) -> None:
    clock = Clock()
    budget = ByteBudget(1000, 2000, clock=clock)
    start = clock.now
    passed = 0
    for dt, size in steps:
        clock.now += dt
        if budget.take(size):
            passed += size
    assert passed <= 2000 + 1000 * (clock.now - start) + 1e-6
