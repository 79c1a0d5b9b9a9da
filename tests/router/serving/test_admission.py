"""The admission queue's rules (router/serving/admission.py), without HTTP: who goes first
(priority class, then tenants in turn, then cost less aging), the bound, deadlines and
disconnects; properties (the bound holds, nothing starves) with hypothesis."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.router.errors import RouterError
from kvroute.router.serving.admission import (
    Admission,
    AdmissionQueue,
    AdmissionSettings,
    Shed,
    Ticket,
    Waiter,
    ticket_of,
)
from kvroute.router.serving.proxy import ClientGone


def waiter(priority: int = 0, tenant: str = "", cost: float = 0.0, at: float = 0.0) -> Waiter:
    return Waiter(priority, tenant, cost, at, at + 1e9)


def drain(queue: AdmissionQueue, now: float = 0.0) -> list[Waiter]:
    out = []
    while (w := queue.pop(now)) is not None:
        out.append(w)
    return out


def test_a_lower_priority_value_goes_first_as_in_vllm() -> None:
    q = AdmissionQueue(10)
    late_low, urgent, normal = waiter(5), waiter(-1), waiter(0)
    for w in (late_low, urgent, normal):
        q.push(w, 0.0)
    assert drain(q) == [urgent, normal, late_low]


def test_tenants_of_a_class_take_turns() -> None:
    q = AdmissionQueue(20)
    a = [waiter(tenant="a") for _ in range(5)]
    b = [waiter(tenant="b") for _ in range(2)]
    for w in a + b:  # a's burst came first
        q.push(w, 0.0)
    order = [w.tenant for w in drain(q)]
    assert order == ["a", "b", "a", "b", "a", "a", "a"]


def test_a_returning_tenant_banks_no_credit_from_its_absence() -> None:
    q = AdmissionQueue(50)
    for _ in range(10):
        q.push(waiter(tenant="a"), 0.0)
    for _ in range(6):
        assert q.pop(0.0).tenant == "a"  # type: ignore[union-attr]
    for _ in range(4):
        q.push(waiter(tenant="b"), 0.0)
    order = [w.tenant for w in drain(q)]
    assert order == ["a", "b", "a", "b", "a", "b", "a", "b"]


def test_within_a_class_the_cheapest_work_goes_first() -> None:
    q = AdmissionQueue(10)
    cold, cached, middling = waiter(cost=0.5), waiter(cost=0.01), waiter(cost=0.1)
    for w in (cold, cached, middling):
        q.push(w, 0.0)
    assert drain(q) == [cached, middling, cold]


def test_aging_lets_a_request_that_waited_longer_than_its_cost_pass_newcomers() -> None:
    q = AdmissionQueue(10, aging=1.0)
    old_cold = waiter(cost=0.5, at=0.0)
    q.push(old_cold, 0.0)
    fresh_cached = waiter(cost=0.01, at=0.6)
    q.push(fresh_cached, 0.6)
    assert q.pop(0.6) is old_cold  # 0.5 - 0.6 < 0.01 - 0
    # Earlier, the cheap one would have gone first.
    q2 = AdmissionQueue(10, aging=1.0)
    q2.push(waiter(cost=0.5, at=0.0), 0.0)
    cheap = waiter(cost=0.01, at=0.2)
    q2.push(cheap, 0.2)
    assert q2.pop(0.2) is cheap


def test_fifo_order_ignores_priority_and_cost() -> None:
    q = AdmissionQueue(10, order="fifo")
    ws = [waiter(priority=3, cost=1.0), waiter(priority=0, cost=0.0), waiter(cost=0.5)]
    for w in ws:
        q.push(w, 0.0)
    assert drain(q) == ws


def test_priority_order_is_class_then_arrival() -> None:
    q = AdmissionQueue(10, order="priority")
    first_low, costly_high, cheap_high = waiter(1), waiter(0, cost=1.0), waiter(0, cost=0.0)
    for w in (first_low, costly_high, cheap_high):
        q.push(w, 0.0)
    assert drain(q) == [costly_high, cheap_high, first_low]


def test_when_full_the_worst_placed_request_is_shed() -> None:
    q = AdmissionQueue(2)
    low, mid = waiter(priority=2), waiter(priority=1, cost=0.3)
    q.push(low, 0.0)
    q.push(mid, 0.0)
    with pytest.raises(Shed) as shed:
        q.push(waiter(priority=3), 0.0)  # below everything queued: it is the one shed
    assert shed.value.reason == "full"
    high = waiter(priority=0)
    assert q.push(high, 0.0) is low  # the lowest class makes room for a higher one
    cheaper = waiter(priority=1, cost=0.1)
    assert q.push(cheaper, 0.0) is mid  # within a class, the costliest goes
    assert len(q) == 2 and drain(q) == [high, cheaper]


def test_expired_takes_out_only_requests_past_their_deadline() -> None:
    q = AdmissionQueue(10)
    soon = Waiter(0, "", 0.0, 0.0, 1.0)
    later = Waiter(0, "", 0.0, 0.0, 5.0)
    q.push(soon, 0.0)
    q.push(later, 0.0)
    assert q.expired(0.5) == []
    assert q.expired(1.0) == [soon]
    assert drain(q, 1.0) == [later]


@settings(max_examples=150, deadline=None)
@given(
    st.integers(min_value=1, max_value=12),
    st.lists(
        st.tuples(
            st.sampled_from(["push", "push", "pop"]),
            st.integers(min_value=0, max_value=2),
            st.sampled_from(["a", "b", "c"]),
            st.floats(min_value=0.0, max_value=2.0),
        ),
        max_size=80,
    ),
)
def test_the_bound_holds_and_every_waiter_is_accounted_for(bound: int, ops: list) -> None:
    q = AdmissionQueue(bound)
    inside: set[int] = set()
    now = 0.0
    for op, priority, tenant, cost in ops:
        now += 0.05
        if op == "push":
            w = waiter(priority, tenant, cost, now)
            try:
                displaced = q.push(w, now)
            except Shed:
                continue
            inside.add(id(w))
            if displaced is not None:
                inside.remove(id(displaced))
        elif (w := q.pop(now)) is not None:
            inside.remove(id(w))
        assert len(q) <= bound
        assert {id(w) for w in q.waiters()} == inside


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.floats(min_value=0.0, max_value=3.0), min_size=1, max_size=60),
    st.floats(min_value=0.01, max_value=0.5),
    st.floats(min_value=0.25, max_value=2.0),
)
def test_nothing_starves_under_cost_order_with_aging(
    costs: list[float], gap: float, aging: float
) -> None:
    """One arrival per ``gap`` seconds, one admission per ``2 * gap`` (an overloaded class):
    whatever is admitted before a waiter arrived no later than ``cost / aging`` after it,
    so a waiter is passed only by a bounded number of newcomers."""
    q = AdmissionQueue(10_000, aging=aging)
    popped: list[Waiter] = []
    now = 0.0
    for i, cost in enumerate(costs):
        q.push(waiter(cost=cost, at=now), now)
        if i % 2:
            popped.append(q.pop(now))  # type: ignore[arg-type]
        now += gap
    while (w := q.pop(now)) is not None:
        popped.append(w)
        now += gap
    assert len(popped) == len(costs)
    for i, w in enumerate(popped):
        for before in popped[:i]:
            assert before.arrived <= w.arrived + w.cost_s / aging + 1e-9


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sampled_from(["a", "b", "c"]), min_size=3, max_size=40))
def test_tenants_with_waiting_requests_are_served_within_one_of_each_other(
    tenants: list[str],
) -> None:
    q = AdmissionQueue(1000)
    for t in tenants:
        q.push(waiter(tenant=t), 0.0)
    left = {t: tenants.count(t) for t in set(tenants)}
    served = dict.fromkeys(left, 0)
    while (w := q.pop(0.0)) is not None:
        served[w.tenant] += 1
        left[w.tenant] -= 1
        still = [served[t] for t in left if left[t] > 0]
        if still:
            assert max(still) - min(still) <= 1, served


# --- the asyncio side -----------------------------------------------------------------------


@dataclass
class FakeReplica:
    pending_fresh: float = 0.0


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _admission(clock: Clock | None = None, **kw: object) -> Admission:
    s = AdmissionSettings(**kw)  # type: ignore[arg-type]
    return Admission(s, limit=1, retry_after_s=2, clock=clock or Clock())


async def _rank(among: list[FakeReplica]) -> object:
    return type("D", (), {"views": [], "prompt_tokens": 10, "among": among})()


def test_a_saturated_model_queues_and_admits_by_class_as_slots_free() -> None:
    async def scenario() -> list[str]:
        adm = _admission()
        replica = FakeReplica(pending_fresh=1)
        order: list[str] = []

        async def request(name: str, priority: int) -> None:
            await adm.decide("m", [replica], Ticket(priority=priority), _rank)
            order.append(name)

        tasks = []
        for name, prio in (("low1", 1), ("low2", 1), ("high", 0)):
            tasks.append(asyncio.create_task(request(name, prio)))
            await asyncio.sleep(0)
        await asyncio.sleep(0.01)
        assert order == [] and len(adm.queues["m"]) == 3
        for _ in range(3):  # one slot frees at a time; each admitted request takes it
            replica.pending_fresh = 0
            adm.pump("m")
            await asyncio.sleep(0)
            await asyncio.sleep(0)
            replica.pending_fresh = 1
        await asyncio.gather(*tasks)
        assert adm.counts["admitted"] == 3 and adm.reserved["m"] == 0
        return order

    assert asyncio.run(scenario()) == ["high", "low1", "low2"]


def test_a_request_that_cannot_start_before_its_deadline_gets_429_with_retry_after() -> None:
    async def scenario() -> RouterError:
        adm = _admission(max_wait_s=0.05)
        adm.clock = __import__("time").monotonic
        with pytest.raises(RouterError) as err:
            await adm.decide("m", [FakeReplica(pending_fresh=5)], Ticket(), _rank)
        assert adm.shed_by_reason == {"deadline": 1} and len(adm.queues["m"]) == 0
        await adm.close()
        return err.value

    err = asyncio.run(scenario())
    assert err.status == 429 and err.headers["retry-after"] == "2"
    assert err.body()["error"]["type"] == "RateLimitError"


def test_the_measured_drain_rate_sheds_what_would_miss_its_deadline_at_once() -> None:
    async def scenario() -> RouterError:
        clock = Clock()
        adm = _admission(clock, max_wait_s=3.0)
        adm._admitted_at.extend([clock.now - 4 + i for i in range(5)])  # 1 per second
        replica = FakeReplica(pending_fresh=5)
        waiting = [
            asyncio.create_task(adm.decide("m", [replica], Ticket(), _rank)) for _ in range(3)
        ]
        await asyncio.sleep(0)
        with pytest.raises(RouterError) as err:  # 4th in line: 4 s at 1/s > 3 s
            await adm.decide("m", [replica], Ticket(), _rank)
        # A shorter client deadline is honoured too.
        with pytest.raises(RouterError):
            await adm.decide("m", [replica], Ticket(max_wait_s=0.5), _rank)
        assert adm.shed_by_reason == {"predicted": 2} and len(adm.queues["m"]) == 3
        for task in waiting:
            task.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
        assert len(adm.queues["m"]) == 0  # cancelled waiters leave the queue
        await adm.close()
        return err.value

    err = asyncio.run(scenario())
    assert err.status == 429 and err.headers["retry-after"] == "4"  # 3 queued + 1, at 1/s


def test_a_full_queue_sheds_and_a_higher_class_displaces_the_lowest() -> None:
    async def scenario() -> None:
        adm = _admission(max_queued=1)
        replica = FakeReplica(pending_fresh=1)
        low = asyncio.create_task(adm.decide("m", [replica], Ticket(priority=5), _rank))
        await asyncio.sleep(0)
        with pytest.raises(RouterError) as same:
            await adm.decide("m", [replica], Ticket(priority=5), _rank)
        assert same.value.status == 429
        high = asyncio.create_task(adm.decide("m", [replica], Ticket(priority=0), _rank))
        await asyncio.sleep(0)
        with pytest.raises(RouterError) as displaced:
            await low
        assert displaced.value.status == 429
        assert adm.shed_by_reason == {"full": 1, "displaced": 1}
        replica.pending_fresh = 0
        adm.pump("m")
        await high
        await adm.close()

    asyncio.run(scenario())


def test_a_queued_client_that_disconnects_leaves_the_queue() -> None:
    async def scenario() -> None:
        adm = _admission()
        gone = asyncio.Event()
        replica = FakeReplica(pending_fresh=1)
        ticket = Ticket(disconnected=gone.wait)
        task = asyncio.create_task(adm.decide("m", [replica], ticket, _rank))
        stays = asyncio.create_task(adm.decide("m", [replica], Ticket(), _rank))
        await asyncio.sleep(0.01)
        assert len(adm.queues["m"]) == 2
        gone.set()
        with pytest.raises(ClientGone):
            await task
        assert len(adm.queues["m"]) == 1 and adm.counts["disconnected"] == 1
        replica.pending_fresh = 0
        adm.pump("m")
        await stays  # the slot went to the one still there
        await adm.close()

    asyncio.run(scenario())


def test_with_admission_off_a_saturated_fleet_is_refused_at_once() -> None:
    async def scenario() -> None:
        adm = _admission(enabled=False)
        with pytest.raises(RouterError) as err:
            await adm.decide("m", [FakeReplica(pending_fresh=1)], Ticket(), _rank)
        assert err.value.status == 503 and err.value.headers["retry-after"] == "2"
        assert "m" not in adm.queues

    asyncio.run(scenario())


def test_a_ticket_comes_from_headers_then_the_body() -> None:
    s = AdmissionSettings()
    body = {"priority": 3}
    assert ticket_of(s, [], body).priority == 3
    headers = [(b"x-kvroute-priority", b"-2"), (b"x-kvroute-max-wait-s", b"1.5")]
    t = ticket_of(s, headers, body)
    assert (t.priority, t.max_wait_s, t.tenant) == (-2, 1.5, "")
    keyed = ticket_of(s, [(b"authorization", b"Bearer sk-1")], {})
    assert keyed.tenant and "sk-1" not in keyed.tenant  # a digest, never the key
    named = ticket_of(s, [(b"x-kvroute-tenant", b"team-a"), (b"authorization", b"x")], {})
    assert named.tenant == "team-a"


@pytest.mark.parametrize(
    ("headers", "body", "param"),
    [
        ([], {"priority": "high"}, "priority"),
        ([], {"priority": 1.5}, "priority"),
        ([], {"priority": True}, "priority"),
        ([(b"x-kvroute-priority", b"soon")], {}, "x-kvroute-priority"),
        ([(b"x-kvroute-max-wait-s", b"-1")], {}, "x-kvroute-max-wait-s"),
        ([(b"x-kvroute-max-wait-s", b"nan")], {}, "x-kvroute-max-wait-s"),
    ],
)
def test_a_bad_priority_or_wait_is_a_400_naming_it(
    headers: list[tuple[bytes, bytes]], body: dict[str, object], param: str
) -> None:
    with pytest.raises(RouterError) as err:
        ticket_of(AdmissionSettings(), headers, body)
    assert err.value.status == 400 and err.value.param == param


def test_settings_refuse_nonsense() -> None:
    for bad in ({"max_queued": -1}, {"max_wait_s": 0}, {"order": "lifo"}, {"aging": -1}):
        with pytest.raises(ValueError):
            AdmissionSettings(**bad)  # type: ignore[arg-type]


def test_reserved_slots_let_an_urgent_request_pass_a_saturated_normal_class() -> None:
    async def scenario() -> None:
        adm = Admission(AdmissionSettings(reserve=1), limit=2, retry_after_s=2, clock=Clock())
        replica = FakeReplica(pending_fresh=1)  # one slot left: the reserved one
        normal = asyncio.create_task(adm.decide("m", [replica], Ticket(priority=0), _rank))
        await asyncio.sleep(0)
        assert len(adm.queues["m"]) == 1  # the normal class may not take the reserved slot
        urgent = await adm.decide("m", [replica], Ticket(priority=-1), _rank)
        assert urgent.among == [replica]  # type: ignore[attr-defined]
        assert adm.counts["admitted"] == 1 and len(adm.queues["m"]) == 1
        replica.pending_fresh = 0  # a normal slot frees
        adm.pump("m")
        await normal
        assert adm.counts["admitted"] == 2
        # All but one slot at most: with a bound of 1 the reserve cannot shut the class out.
        one = Admission(AdmissionSettings(reserve=5), limit=1, retry_after_s=2)
        assert one.bound(0) == 1 and one.bound(-1) == 1
        await adm.close()

    asyncio.run(scenario())
