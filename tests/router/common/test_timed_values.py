"""``TimedValues`` (router/common/timed_values.py): a count read as of a past moment, or the
most it was over a window."""

from __future__ import annotations

from kvroute.router.common.timed_values import TimedValues


def test_the_value_at_a_moment_and_the_most_over_a_window() -> None:
    values = TimedValues(horizon_s=30.0)
    assert values.at(5.0) == 0 and len(values) == 0  # nothing yet
    values.add(10.0, 22)
    values.add(10.02, 0)
    values.add(10.5, 7)
    assert values.at(9.0) == 0
    assert values.at(10.01) == 22 and values.at(10.03) == 0
    assert values.at(10.01, 10.03) == 22  # the most from the first moment to the second
    assert values.at(10.03, 10.6) == 7
    assert values.at(10.03, 10.4) == 0
    assert list(values) == [(10.0, 22), (10.02, 0), (10.5, 7)]


def test_changes_past_the_horizon_are_dropped_but_the_value_before_them_is_kept() -> None:
    values = TimedValues(horizon_s=1.0)
    values.add(0.0, 5)
    values.add(0.5, 6)
    values.add(2.0, 7)  # 0.0 is dropped; 0.5 stays as the value before 2.0
    assert list(values) == [(0.5, 6), (2.0, 7)]
    assert values.at(1.9) == 6 and values.at(2.0) == 7
