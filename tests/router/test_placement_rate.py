"""The per-replica rate of new homes that new prefixes are placed by (router/placement_rate.py)."""

from __future__ import annotations

import pytest

from kvroute.router.placement_rate import PlacementRate
from tests.router.manual_clock import ManualClock


def test_a_steady_stream_converges_to_its_rate_and_decays_by_half_lives() -> None:
    clock = ManualClock(1000.0)
    rates = PlacementRate(half_life_s=10.0, clock=clock)
    assert rates.rate("a") == 0.0
    for _ in range(2000):  # 4 requests per second for 500 s (50 half-lives)
        clock.t += 0.25
        rates.record("a")
    assert rates.rate("a") == pytest.approx(4.0, rel=0.05)
    assert rates.rate("b") == 0.0
    before = rates.rate("a")
    clock.t += 10.0
    assert rates.rate("a") == pytest.approx(before / 2)
    clock.t += 20.0
    assert rates.rate("a") == pytest.approx(before / 8)


def test_rates_rank_replicas_by_their_recent_placements() -> None:
    clock = ManualClock(1000.0)
    rates = PlacementRate(half_life_s=30.0, clock=clock)
    for i in range(60):
        clock.t += 0.5
        rates.record("busy")
        if i % 3 == 0:
            rates.record("quiet")
    assert rates.rate("busy") > 2 * rates.rate("quiet") > 0
    rates.forget("busy")
    assert rates.rate("busy") == 0.0


def test_half_life_must_be_positive() -> None:
    with pytest.raises(ValueError):
        PlacementRate(0.0)
