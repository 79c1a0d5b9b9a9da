"""The learned per-request queue delay: samples, bounds, relaxation to the prior."""

from __future__ import annotations

import pytest

from kvroute.router.routing.queue_model import SAMPLE_LOG_MAX, LearnedQueueDelay
from tests.router.manual_clock import ManualClock


def test_prior_until_samples_then_follows_them() -> None:
    clock = ManualClock()
    q = LearnedQueueDelay(0.02, weight=0.5, half_life_s=30.0, clock=clock)
    assert q.per_request_s("r") == 0.02
    # 2.0 s to first byte, 0.4 s of it prefill, 4 requests ahead: 0.4 s each.
    q.observe("r", pending=4, explained_s=0.4, first_byte_s=2.0)
    assert q.per_request_s("r") == pytest.approx(0.02 + 0.5 * (0.4 - 0.02))
    for _ in range(20):
        q.observe("r", pending=4, explained_s=0.4, first_byte_s=2.0)
    assert q.per_request_s("r") == pytest.approx(0.4, rel=1e-3)
    assert q.per_request_s("other") == 0.02
    assert q.to_dict()["r"]["samples"] == 21


def test_empty_queues_and_garbage_are_not_samples() -> None:
    q = LearnedQueueDelay(0.02, weight=1.0)
    q.observe("r", pending=0, explained_s=0.0, first_byte_s=9.0)
    q.observe("r", pending=0.5, explained_s=0.0, first_byte_s=9.0)
    q.observe("r", pending=3, explained_s=0.0, first_byte_s=float("nan"))
    q.observe("r", pending=3, explained_s=0.0, first_byte_s=-1.0)
    assert q.per_request_s("r") == 0.02 and q.to_dict() == {}
    # Faster than predicted: no negative queue.
    q.observe("r", pending=3, explained_s=1.0, first_byte_s=0.2)
    assert q.per_request_s("r") == pytest.approx(0.0, abs=1e-6)


def test_bounded_and_relaxes_back_to_the_prior() -> None:
    clock = ManualClock()
    q = LearnedQueueDelay(0.02, weight=1.0, half_life_s=10.0, max_s=5.0, clock=clock)
    q.observe("r", pending=1, explained_s=0.0, first_byte_s=60.0)
    assert q.per_request_s("r") == 5.0
    clock.t += 10.0
    assert q.per_request_s("r") == pytest.approx(0.02 + (5.0 - 0.02) / 2)
    clock.t += 1000.0
    assert q.per_request_s("r") == pytest.approx(0.02)
    q.forget("r")
    assert q.to_dict() == {}


@pytest.mark.parametrize(
    "kw", [dict(prior_s=-1.0), dict(prior_s=1.0, max_s=0.5), dict(weight=0.0), dict(half_life_s=0)]
)
def test_rejects_bad_settings(kw: dict) -> None:
    args = {"prior_s": 0.02, **kw}
    prior = args.pop("prior_s")
    with pytest.raises(ValueError):
        LearnedQueueDelay(prior, **args)


def test_own_samples_are_numbered_for_the_peers_and_shared_ones_are_not_passed_on() -> None:
    # a manual clock: with the real one, the estimate decays (half-life 30 s) between the
    # sample and the reading by as much as a loaded machine's scheduling takes
    q = LearnedQueueDelay(0.02, weight=1.0, clock=ManualClock())
    woken: list[int] = []
    q.on_sample = lambda: woken.append(q.next_sample)
    assert q.next_sample == 0 and q.samples_since(0) == []
    q.observe("r", pending=2, explained_s=0.0, first_byte_s=1.0)  # 0.5 s each
    q.observe("s", pending=0, explained_s=0.0, first_byte_s=1.0)  # no sample: empty queue
    q.observe("s", pending=4, explained_s=0.2, first_byte_s=1.0)  # 0.2 s each
    assert q.next_sample == 2 and woken == [1, 2]
    assert q.samples_since(0) == [("r", 0.5), ("s", pytest.approx(0.2))]
    assert q.samples_since(1) == [("s", pytest.approx(0.2))]
    assert q.samples_since(2) == [] and q.samples_since(99) == []
    # A peer's sample moves the estimate like an own one, but is neither numbered nor logged.
    q.observe_shared("r", 0.1)
    assert q.per_request_s("r") == pytest.approx(0.1)
    assert q.next_sample == 2 and len(q.samples_since(0)) == 2 and woken == [1, 2]
    assert q.shared_applied == 1 and q.to_dict()["r"]["samples"] == 2


def test_a_peers_samples_are_bounded_and_garbage_is_ignored() -> None:
    q = LearnedQueueDelay(0.02, weight=1.0, max_s=5.0, clock=ManualClock())
    q.observe_shared("r", 1e9)
    assert q.per_request_s("r") == 5.0
    q.observe_shared("r", -3.0)
    assert q.per_request_s("r") == 0.0
    q.observe_shared("r", float("nan"))
    q.observe_shared("r", float("inf"))
    assert q.per_request_s("r") == 0.0 and q.shared_applied == 2


def test_the_log_keeps_the_last_samples_and_a_late_peer_gets_what_is_left() -> None:
    q = LearnedQueueDelay(0.02, weight=1.0)
    for i in range(SAMPLE_LOG_MAX + 10):
        q.observe("r", pending=1, explained_s=0.0, first_byte_s=i * 1e-3)
    assert q.next_sample == SAMPLE_LOG_MAX + 10
    kept = q.samples_since(0)
    assert len(kept) == SAMPLE_LOG_MAX
    assert kept[0][1] == pytest.approx(10e-3)  # the oldest ten were dropped
    assert q.samples_since(SAMPLE_LOG_MAX + 5) == [
        ("r", pytest.approx(i * 1e-3)) for i in range(SAMPLE_LOG_MAX + 5, SAMPLE_LOG_MAX + 10)
    ]
