"""A replica's load as the router sees it: vLLM's gauges plus what the router sent since.

Pure logic on ``Replica`` (no servers): the proxy calls ``begin_request``/``end_request``
around every attempt and the health loop calls ``set_gauges`` with each scraped page.
"""

from __future__ import annotations

from kvroute.router.config import ReplicaConfig
from kvroute.router.fleet.replicas import Replica


def _replica() -> Replica:
    return Replica(ReplicaConfig(url="http://127.0.0.1:9"))


def test_requests_sent_since_the_scrape_add_to_its_gauges() -> None:
    r = _replica()
    r.set_gauges(running=3, waiting=2, kv_usage=0.5)
    assert r.pending == 5
    # Another router's five requests are in the gauges; ours since the scrape are not yet.
    e1, e2 = r.begin_request(), r.begin_request()
    assert r.in_flight == 2 and r.pending == 7
    r.end_request(e1)
    assert r.pending == 6
    # The next page counts the one still running: it is not added twice.
    r.set_gauges(running=6, waiting=0, kv_usage=0.5)
    assert r.pending == 6
    r.end_request(e2)  # sent before that scrape: the gauges dropping is the replica's news
    assert r.in_flight == 0 and r.sent_since_scrape == 0 and r.pending == 6


def test_own_in_flight_bounds_pending_from_below() -> None:
    r = _replica()
    epochs = [r.begin_request() for _ in range(4)]
    r.set_gauges(running=1, waiting=0, kv_usage=0.1)  # a page older than our requests' arrival
    assert r.pending == 4
    for e in epochs:
        r.end_request(e)
    assert r.in_flight == 0 and r.pending == 1


def test_sent_since_scrape_never_goes_negative() -> None:
    r = _replica()
    e = r.begin_request()
    r.set_gauges(running=0, waiting=0, kv_usage=0.0)
    r.end_request(e)
    r.end_request(r.scrape_epoch)  # a stray end (an error path) cannot drive it below zero
    assert r.sent_since_scrape == 0


def test_pending_fresh_counts_a_request_that_ended_since_the_scrape_as_gone() -> None:
    """Admission's view (router/serving/admission.py): the gauges are a scrape old; one of
    ours they counted that has ended frees its slot now, not at the next scrape."""
    r = _replica()
    e1, e2 = r.begin_request(), r.begin_request()
    r.set_gauges(running=3, waiting=0, kv_usage=0.1)  # ours two and another router's one
    assert r.pending == r.pending_fresh == 3
    r.end_request(e1)
    assert r.pending == 3 and r.pending_fresh == 2  # routing waits for the replica's word
    e3 = r.begin_request()  # sent after the scrape: counted once, by both
    assert r.pending == 4 and r.pending_fresh == 3
    r.end_request(e3)
    r.end_request(e2)
    assert r.pending_fresh == 1
    r.set_gauges(running=1, waiting=0, kv_usage=0.1)
    assert r.ended_since_scrape == 0 and r.pending_fresh == r.pending == 1
