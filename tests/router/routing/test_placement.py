"""The blocks-stored rate new prefixes are balanced by (router/routing/placement.py), read from the
cumulative counts every router's event feeds keep."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.router.routing.placement import StoredRate, UnstoredBlocks
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
    with pytest.raises(ValueError, match="max_age_s"):
        UnstoredBlocks(0.0)


def test_update_reports_the_blocks_each_replica_stored_since_the_last_sample() -> None:
    rates = StoredRate(half_life_s=30.0, clock=ManualClock(1000.0))
    assert rates.update({"a": 100, "b": 7}) == {}  # first samples: nothing is new
    assert rates.update({"a": 350, "b": 7}) == {"a": 250}
    assert rates.update({"a": 40}) == {"a": 40}  # a restarted feed counts from zero


def test_blocks_in_progress_count_as_stored_now() -> None:
    """A replica that was just sent a 250-block prefix ranks like one that just stored it,
    before its feed says so."""
    clock = ManualClock(1000.0)
    rates = StoredRate(half_life_s=30.0, clock=clock)
    rates.update({"a": 0, "b": 0})
    clock.t += 1.0
    rates.update({"a": 250, "b": 0})
    assert rates.rate("b", unstored=250) == pytest.approx(rates.rate("a"))
    assert rates.rate("never-seen", unstored=250) == pytest.approx(rates.rate("a"))


def test_unstored_blocks_settle_as_the_feed_announces_them_and_expire() -> None:
    clock = ManualClock(1000.0)
    unstored = UnstoredBlocks(max_age_s=10.0, clock=clock)
    unstored.add("a", 250)
    clock.t += 1.0
    unstored.add("a", 3)
    unstored.add("b", 0)  # a full hit: nothing to compute
    assert unstored.snapshot(["a", "b"]) == {"a": 253, "b": 0}
    unstored.settle({"a": 100})  # the feed announced part of the prefix
    assert unstored.blocks("a") == 153
    unstored.settle({"a": 151, "b": 40})  # more than was sent (another router's request)
    assert unstored.blocks("a") == 2 and unstored.blocks("b") == 0
    clock.t += 5.0
    unstored.add("c", 125)  # a request that never stored anything (it failed)
    clock.t += 5.5
    assert unstored.blocks("a") == 0  # past max_age_s
    assert unstored.blocks("c") == 125
    clock.t += 5.0
    assert unstored.blocks("c") == 0
    unstored.add("d", 5)
    unstored.forget("d")
    assert unstored.blocks("d") == 0


def test_a_prefix_cache_reset_starts_the_replica_from_zero() -> None:
    """What a replica stored before its cache was reset is no longer there: it must not keep
    new prefixes away from it (the benchmark resets every cache between workloads, and the
    last workload's residue decided the next one's first placements)."""
    clock = ManualClock(1000.0)
    rates = StoredRate(half_life_s=30.0, clock=clock)
    rates.update({"a": 0, "b": 0}, {"a": 0, "b": 0})
    clock.t += 1.0
    rates.update({"a": 5000, "b": 1000}, {"a": 0, "b": 0})
    assert rates.rate("a") > rates.rate("b")
    clock.t += 1.0
    added = rates.update({"a": 5250, "b": 1000}, {"a": 1, "b": 1})  # both caches reset
    assert added == {"a": 250}
    assert rates.rate("a") == pytest.approx(250 * math.log(2) / 30.0)  # only what came after
    assert rates.rate("b") == 0.0


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["add", "settle", "tick", "forget"]),
            st.sampled_from(["a", "b"]),
            st.integers(0, 40),
        ),
        max_size=60,
    )
)
def test_the_running_total_is_the_sum_of_what_is_outstanding(
    ops: list[tuple[str, str, int]],
) -> None:
    """Differential: ``blocks`` keeps a running total instead of summing its queue on each
    read (thousands of entries deep when no feed settles them); after any sequence of sends,
    settles, expiries and forgets, it equals the queue's sum."""
    clock = ManualClock(1000.0)
    unstored = UnstoredBlocks(5.0, clock=clock)
    for op, name, n in ops:
        if op == "add":
            unstored.add(name, n)
        elif op == "settle":
            unstored.settle({name: n})
        elif op == "tick":
            clock.t += n / 8
        else:
            unstored.forget(name)
        for who in ("a", "b"):
            queue = unstored._sent.get(who, ())
            expected = int(sum(b for at, b in queue if at >= clock() - 5.0))
            assert unstored.blocks(who) == expected
