"""``PrefillBacklog`` (router/routing/prefill_backlog.py): the prefill work sent to a replica
and not yet done drains as one in-order server's, re-based on each reported end."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.router.routing.prefill_backlog import PrefillBacklog


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_work_queues_in_order_and_drains_with_time() -> None:
    clock = Clock()
    b = PrefillBacklog(clock=clock)
    b.add("p0", "a", 0.75)
    b.add("p0", "b", 0.75)
    assert b.wait_s("p0") == pytest.approx(1.5)
    assert b.count("p0") == 2
    clock.now += 1.0  # a done, b half done: 0.5 s left
    assert b.wait_s("p0") == pytest.approx(0.5)
    clock.now += 1.0
    assert b.wait_s("p0") == 0.0
    assert b.wait_s("other") == 0.0 and b.count("other") == 0


def test_a_reported_end_rebases_the_rest_and_ends_those_sent_before() -> None:
    clock = Clock()
    b = PrefillBacklog(clock=clock)
    for key in ("a", "b", "c"):
        b.add("p0", key, 0.5)
    clock.now += 0.2  # b answered early (a was cached after all): a and b are done
    b.done("p0", "b")
    assert b.count("p0") == 1
    assert b.wait_s("p0") == pytest.approx(0.5)  # c's work, from now
    b.done("p0", "unknown")  # not ours: nothing changes
    assert b.count("p0") == 1


def test_no_work_is_not_a_prefill_and_a_failed_request_stops_counting() -> None:
    clock = Clock()
    b = PrefillBacklog(clock=clock)
    b.add("d0", "decode-leg", 0.0)  # a pulled prompt: nothing ahead of anyone
    assert (b.count("d0"), b.wait_s("d0")) == (0, 0.0)
    b.add("p0", "a", 0.4)
    b.add("p0", "b", 0.4)
    b.drop("p0", "a")
    assert b.count("p0") == 1


def test_a_request_never_reported_done_is_dropped_after_its_predicted_end() -> None:
    clock = Clock()
    b = PrefillBacklog(stale_after_s=5.0, clock=clock)
    b.add("p0", "a", 1.0)
    clock.now += 5.5
    assert b.count("p0") == 1
    clock.now += 1.0
    assert b.count("p0") == 0


def test_the_router_feeds_the_deciders_backlog_from_what_it_sends() -> None:
    """Committing a request adds its priced work on that replica, a decode leg (its prompt
    pulled) adds none, and its first byte ends it: the decider reads the same backlog."""
    from kvroute.router.config import ReplicaConfig, RouterSettings
    from kvroute.router.routing.policies import ReplicaView
    from kvroute.router.routing.router import Decision
    from kvroute.router.service import RouterService

    configs = [
        ReplicaConfig(url="http://p0:8000", name="p0", role="prefill"),
        ReplicaConfig(url="http://d0:8000", name="d0", role="decode"),
    ]
    service = RouterService(RouterSettings(replicas=configs))
    assert service.disagg.backlog is service.router.backlog
    p0, d0 = (service.add_replica(config) for config in configs)

    def decision(replica: object, name: str) -> Decision:
        view = ReplicaView(name=name)
        view.compute_s, view.load_s = 0.4, 0.0
        return Decision("kvroute", "load", [replica], [view], 4000)  # type: ignore[list-item]

    prefill, decode = decision(p0, "p0"), decision(d0, "d0")
    service.router.commit(prefill, p0, home=False)
    decode.remote_prefill = True  # a split's decode leg
    service.router.commit(decode, d0)
    backlog = service.router.backlog
    assert backlog.wait_s("p0") == pytest.approx(0.4, abs=0.05)
    assert (backlog.count("p0"), backlog.count("d0")) == (1, 0)
    whole = decision(d0, "d0")  # decode-only: the whole prompt computed there
    service.router.commit(whole, d0)
    assert backlog.count("d0") == 1
    service.router.first_byte(whole, d0, 0.41)
    assert (backlog.count("d0"), backlog.wait_s("d0")) == (0, 0.0)


def test_a_whole_request_decodes_once_its_prefill_is_done_or_due_and_stops_when_ended() -> None:
    """A whole request on a prefill replica: prefilling while its work is ahead, decoding
    once reported done (a streamed first byte) or once its predicted end has passed (an
    unstreamed answer reports no first byte), and nothing once ended."""
    clock = Clock()
    b = PrefillBacklog(clock=clock)
    b.add("p0", "streamed", 0.5)
    b.add("p0", "unstreamed", 0.5)
    b.serving("p0", "streamed")
    b.serving("p0", "unstreamed")
    assert b.decoding("p0") == 0
    clock.now += 0.3
    b.done("p0", "streamed")
    assert b.decoding("p0") == 1
    clock.now += 0.8  # past the second one's predicted end (1.0 s after it was sent)
    assert b.decoding("p0") == 2
    b.ended("p0", "streamed")
    b.ended("p0", "unstreamed")
    b.ended("p1", "never-sent")
    assert b.decoding("p0") == 0 and b.decoding("p1") == 0


class _ScanEveryTime(PrefillBacklog):
    """The specification of pruning: scan every entry on every read (what ``_prune`` did
    before it kept a bound on when the next entry can go stale)."""

    def _prune(self, r, now):  # type: ignore[no-untyped-def]
        for k in [k for k, e in r.entries.items() if e.ends_at + self.stale_after_s < now]:
            del r.entries[k]


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["add", "done", "drop", "tick", "count", "wait"]),
            st.integers(0, 7),
            st.floats(0.0, 3.0),
        ),
        max_size=60,
    )
)
def test_pruning_only_when_an_entry_may_be_stale_keeps_what_scanning_every_time_keeps(
    ops: list[tuple[str, int, float]],
) -> None:
    """Differential: the bounded prune (skip the scan while no entry can be stale yet)
    and a scan on every read agree on every count and wait, through re-based ends
    (``done``), drops and re-added keys."""
    clock = Clock()
    fast, spec = (
        PrefillBacklog(stale_after_s=2.0, clock=clock),
        _ScanEveryTime(stale_after_s=2.0, clock=clock),
    )
    for op, key, amount in ops:
        if op == "tick":
            clock.now += amount
            continue
        for b in (fast, spec):
            if op == "add":
                b.add("p0", key, amount)
            elif op == "done":
                b.done("p0", key)
            elif op == "drop":
                b.drop("p0", key)
        assert fast.count("p0") == spec.count("p0")
        assert fast.wait_s("p0") == spec.wait_s("p0")


def test_an_unstreamed_answer_ends_its_prefill_in_the_backlog(local_tokenizer) -> None:
    """Through the real proxy: an answer sent whole (no stream, so no first byte to report)
    still says its prefill is done when its headers come. Before, such requests stayed in
    the backlog until ``stale_after_s`` after their predicted end, and every read scanned
    them all: seconds of an unstreamed workload's requests per request routed."""
    import httpx

    from tests.router.sim_fleet import make_fleet

    with make_fleet(local_tokenizer, n=1) as fleet:
        backlog = fleet.service.router.backlog
        for i in range(3):
            body = {"model": "tiny", "prompt": f"{i} " + "tokens " * 60, "max_tokens": 2}
            answer = httpx.post(f"{fleet.url}/v1/completions", json=body, timeout=10)
            assert answer.status_code == 200
            assert backlog.count("r0") == 0
        stream = {"model": "tiny", "prompt": "more " * 60, "max_tokens": 2, "stream": True}
        with httpx.stream("POST", f"{fleet.url}/v1/completions", json=stream, timeout=10) as r:
            assert r.status_code == 200
            r.read()
        assert backlog.count("r0") == 0
