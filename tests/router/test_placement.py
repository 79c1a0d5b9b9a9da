"""The blocks-stored rate new prefixes are balanced by (router/placement.py), read from the
cumulative counts every router's event feeds keep."""

from __future__ import annotations

import math

import pytest

from kvroute.router.placement import StoredRate
from tests.router.manual_clock import ManualClock


def test_a_steady_stream_converges_to_its_rate_and_decays_by_half_lives() -> None:
    clock = ManualClock(1000.0)
    rates = StoredRate(half_life_s=10.0, clock=clock)
    count = 0
    rates.update({"a": count})
    assert rates.rate("a") == 0.0
    for _ in range(2000):  # 40 blocks every 0.25 s: 160 per second, for 50 half-lives
        clock.t += 0.25
        count += 40
        rates.update({"a": count})
    assert rates.rate("a") == pytest.approx(160.0, rel=0.05)
    assert rates.rate("b") == 0.0
    before = rates.rate("a")
    clock.t += 10.0
    assert rates.rate("a") == pytest.approx(before / 2)
    clock.t += 20.0
    rates.update({"a": count})  # nothing new: sampling does not change the decay
    assert rates.rate("a") == pytest.approx(before / 8)


def test_history_before_the_first_sample_is_not_a_burst() -> None:
    """A router that joins late (its feeds replay the fleet's history) starts every replica
    at zero, so it ranks them alike with the routers that were there all along, once they
    have decayed the old blocks too."""
    clock = ManualClock(1000.0)
    rates = StoredRate(half_life_s=30.0, clock=clock)
    rates.update({"old": 50_000, "new": 0})
    assert rates.rate("old") == rates.rate("new") == 0.0
    clock.t += 1.0
    rates.update({"old": 50_000, "new": 250})
    assert rates.rate("new") > 0.0 == rates.rate("old")


def test_a_counter_that_restarts_counts_from_zero_and_forget_drops_a_replica() -> None:
    clock = ManualClock(1000.0)
    rates = StoredRate(half_life_s=30.0, clock=clock)
    rates.update({"a": 1000})
    rates.update({"a": 100})  # a new feed after a restart: its 100 blocks are new
    assert rates.rate("a") == pytest.approx(100 * math.log(2) / 30.0)
    rates.forget("a")
    assert rates.rate("a") == 0.0


def test_half_life_must_be_positive() -> None:
    with pytest.raises(ValueError, match="half_life_s"):
        StoredRate(0.0)
