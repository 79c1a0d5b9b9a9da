"""The queued prefill behind each pick (bench/pick_quality.py), on hand-made records."""

from __future__ import annotations

from kvroute.bench.pick_quality import queued_prefill_at_pick
from kvroute.bench.workloads.runner import RequestRecord


def _rec(sent: float, first: float | None, replica: str | None, prompt: int, cached: int = 0):
    return RequestRecord(
        session="s",
        turn=0,
        messages=[],
        max_tokens=1,
        sent=sent,
        first_token=first,
        done=None if first is None else first + 0.1,
        prompt_tokens=prompt,
        cached_tokens=cached,
        replica=replica,
    )


def test_counts_the_uncached_prefill_still_queued_beyond_the_shortest_queue() -> None:
    records = [
        _rec(0.0, 1.0, "a", 1000, cached=200),  # 800 uncached on a until t=1
        _rec(0.1, 0.5, "b", 300),  # 300 on b until t=0.5
        _rec(0.2, 0.9, "a", 500),  # a holds 800, b 300: 500 more than b
        _rec(0.6, 0.8, "a", 100),  # a holds 1300, b is empty again: 1300
        _rec(1.0, 1.5, "b", 100),  # a's first request ended at this very instant: 0
        _rec(2.0, None, "a", 5000),  # failed: neither counted nor queued
    ]
    got = queued_prefill_at_pick(records, ["a", "b", "c"])
    # Picks: 0 (all empty), 0 (c empty), 800 - 0 (c is the shortest queue), 1300, 0.
    assert got["requests"] == 5
    assert got["mean_tokens"] == (0 + 0 + 800 + 1300 + 0) / 5
    assert got["p90_tokens"] == 1300
    assert got["over_2000"] == 0


def test_a_replica_named_only_by_the_records_counts_and_no_records_give_none() -> None:
    records = [_rec(0.0, 2.0, "a", 3000), _rec(1.0, 2.0, "a", 10), _rec(1.5, 2.5, "b", 10)]
    got = queued_prefill_at_pick(records, [])
    assert got["mean_tokens"] == 1000  # b (named by a record) was empty when a's second came
    assert got["over_2000"] == round(1 / 3, 4)
    got = queued_prefill_at_pick(records[:2], [])  # only a: its own queue is the shortest
    assert got["mean_tokens"] == 0
    got = queued_prefill_at_pick(records[:2], ["a", "b"])
    assert got["mean_tokens"] == 1500 and got["over_2000"] == 0.5
    assert queued_prefill_at_pick([], ["a"])["mean_tokens"] is None
