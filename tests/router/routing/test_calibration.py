"""The prefill and load rates learned per replica (router/routing/calibration.py)."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.router.routing.calibration import CalibrationSample, LearnedRates, Rates
from tests.router.manual_clock import ManualClock

TRUE = (0.005, 6e-5, 5e-6, 2.5e-5)  # overhead, prefill, load from CPU, from storage


def _prior(scale: float) -> Rates:
    return Rates(TRUE[1] * scale, TRUE[2] * scale, TRUE[3] * scale)


def _samples(n: int, seed: int = 1, noise: float = 0.0, outliers: float = 0.0):
    rnd = random.Random(seed)
    for _ in range(n):
        u = rnd.randint(0, 4000)
        c = rnd.choice([0, rnd.randint(0, 8000)])
        s = rnd.choice([0, 0, rnd.randint(0, 8000)])
        y = TRUE[0] + TRUE[1] * u + TRUE[2] * c + TRUE[3] * s
        if noise:
            y *= rnd.lognormvariate(0.0, noise)
        if rnd.random() < outliers:
            y *= 20  # a stalled request
        yield CalibrationSample(u, c, s, y)


def _ratios(r: Rates) -> list[float]:
    got = (r.prefill_s_per_token, r.load_s_per_token_cpu, r.load_s_per_token_storage)
    return [g / t for g, t in zip(got, TRUE[1:], strict=True)]


@pytest.mark.parametrize("scale", [10.0, 0.1])
def test_priors_ten_times_off_are_learned_within_a_few_hundred_requests(scale: float) -> None:
    clock = ManualClock()
    rates = LearnedRates(_prior(scale), clock=clock)
    assert rates.rates("r") == _prior(scale)  # the prior until a sample
    for sample in _samples(300, noise=0.1):
        clock.t += 0.2
        rates.observe("r", sample)
    learned = rates.rates("r")
    assert learned.samples == 300
    assert all(0.9 < x < 1.1 for x in _ratios(learned)), _ratios(learned)


def test_outliers_are_clipped_not_averaged_in() -> None:
    clock = ManualClock()
    robust = LearnedRates(_prior(1.0), clock=clock)
    naive = LearnedRates(_prior(1.0), clock=clock, outlier_k=1e12)
    for sample in _samples(300, noise=0.1, outliers=0.05):
        clock.t += 0.2
        robust.observe("r", sample)
        naive.observe("r", sample)
    assert robust.outliers > 5
    assert all(0.75 < x < 1.25 for x in _ratios(robust.rates("r"))), _ratios(robust.rates("r"))
    # the same samples without the bound: the stalls drag the rates far off
    assert max(abs(x - 1) for x in _ratios(naive.rates("r"))) > 0.3


def test_without_samples_the_rates_relax_to_the_prior() -> None:
    clock = ManualClock()
    rates = LearnedRates(_prior(10.0), half_life_s=60.0, clock=clock)
    for sample in _samples(200):
        rates.observe("r", sample)
    assert _ratios(rates.rates("r"))[0] < 1.2
    clock.t += 60.0 * 30  # thirty half-lives
    assert _ratios(rates.rates("r"))[0] == pytest.approx(10.0, rel=0.01)


def test_a_replica_without_samples_borrows_its_pool_and_no_other() -> None:
    clock = ManualClock()
    rates = LearnedRates(_prior(10.0), clock=clock)
    for sample in _samples(200):
        rates.observe("a", sample, pool="8b-h100")
    rates.observe("b", next(_samples(1, seed=9)), pool="8b-h100")
    rates.observe("c", next(_samples(1, seed=9)), pool="70b-l4")
    assert _ratios(rates.rates("b"))[0] < 1.5  # mostly its pool's fit
    assert _ratios(rates.rates("c"))[0] > 5  # one sample of its own, nothing to borrow
    assert rates.rates("never-seen") == _prior(10.0)


def test_rates_stay_within_the_bound_and_garbage_is_ignored() -> None:
    clock = ManualClock()
    rates = LearnedRates(_prior(1.0), max_ratio=10.0, clock=clock)
    for _ in range(100):
        rates.observe("r", CalibrationSample(1000, 0, 0, 1e6))  # absurdly slow
        rates.observe("r", CalibrationSample(1000, 0, 0, float("nan")))
        rates.observe("r", CalibrationSample(1000, 0, 0, 1.0, weight=0.0))
    learned = rates.rates("r")
    assert learned.samples == 100
    assert learned.prefill_s_per_token == pytest.approx(TRUE[1] * 10)
    rates.forget("r")
    assert rates.rates("r") == _prior(1.0)


@pytest.mark.parametrize(
    "kw",
    [{"half_life_s": 0}, {"prior_samples": 0}, {"outlier_k": 0}, {"max_ratio": 0.5}],
)
def test_bad_settings_are_refused(kw: dict) -> None:
    with pytest.raises(ValueError):
        LearnedRates(_prior(1.0), **kw)


def test_a_sample_trims_the_prediction_to_what_the_replica_served() -> None:
    """A shortfall is taken from the slowest tier first; more than predicted was a device hit;
    unreported: the prediction is believed."""
    kw = dict(prompt_tokens=1000, gpu=200, cpu=300, storage=400, first_byte_s=1.0, queue_s=0.25)
    short = CalibrationSample.from_request(delivered=600, pending=1, **kw)
    assert short is not None
    assert (short.uncached, short.cpu, short.storage) == (400, 300, 100)
    # the first byte, with the queue delay priced beside it (a regressor, not subtracted)
    assert (short.seconds, short.queue_s, short.weight) == (1.0, 0.25, 0.25)
    shorter = CalibrationSample.from_request(delivered=100, pending=0, **kw)
    assert shorter is not None and (shorter.uncached, shorter.cpu, shorter.storage) == (900, 0, 0)
    more = CalibrationSample.from_request(delivered=950, pending=0, **kw)
    assert more is not None and (more.uncached, more.cpu, more.storage) == (50, 300, 400)
    unreported = CalibrationSample.from_request(delivered=None, pending=0, **kw)
    assert unreported is not None and unreported.uncached == 100
    assert (
        CalibrationSample.from_request(delivered=None, pending=0, **{**kw, "prompt_tokens": 0})
        is None
    )
    assert (
        CalibrationSample.from_request(delivered=None, pending=0, **{**kw, "first_byte_s": 0})
        is None
    )


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.floats(0, 1e5), st.floats(0, 1e5), st.floats(0, 1e5), st.floats(-10, 1e3)),
        max_size=60,
    )
)
def test_any_samples_give_finite_rates_within_the_bound(raw: list) -> None:
    clock = ManualClock()
    prior = _prior(1.0)
    rates = LearnedRates(prior, max_ratio=100.0, clock=clock)
    for u, c, s, y in raw:
        clock.t += 1.0
        rates.observe("r", CalibrationSample(u, c, s, y))
    r = rates.rates("r")
    for got, p in zip(_ratios(r), (1.0, 1.0, 1.0), strict=True):
        assert 1 / 100 - 1e-12 <= got / p <= 100 + 1e-9
    assert r.overhead_s >= 0


def test_a_tier_without_samples_keeps_the_priors_ratio_to_the_learned_prefill() -> None:
    """Only recomputes seen (no CPU or disk hit yet): the prefill rate is learned 10x below
    its prior, and the load rates follow at the priors' ratios, so a disk hit is still
    cheaper than recomputing it, as the priors said."""
    clock = ManualClock()
    rates = LearnedRates(_prior(10.0), clock=clock)
    for sample in _samples(200):
        rates.observe(
            "r", CalibrationSample(sample.uncached, 0, 0, TRUE[0] + TRUE[1] * sample.uncached)
        )
    learned = rates.rates("r")
    prefill, cpu, storage = _ratios(learned)
    assert 0.9 < prefill < 1.1
    assert cpu == pytest.approx(prefill, rel=0.05) and storage == pytest.approx(prefill, rel=0.05)


def _queued_answers(n: int, seed: int = 3):
    """Answers from a replica whose queue the cost model overprices 10x (its ``pending``
    counts requests that are decoding, which hardly delay a prefill): the busier the replica,
    the higher the priced queue, and the shorter the uncached part (later turns of a
    conversation, cached elsewhere in the prompt), as on the simulator's chat workload."""
    rnd = random.Random(seed)
    for _ in range(n):
        pending = rnd.randint(0, 8)
        uncached = max(16, int(rnd.gauss(700 - 70 * pending, 80)))
        priced = 0.02 * pending * (1 + pending / 8)
        waited = 0.1 * priced * rnd.random() * 2  # a tenth of the priced queue, on average
        first_byte = TRUE[0] + TRUE[1] * uncached + waited
        sample = CalibrationSample.from_request(
            prompt_tokens=uncached + 64,
            gpu=64,
            cpu=0,
            storage=0,
            delivered=64,
            first_byte_s=first_byte,
            queue_s=priced,
            pending=pending,
        )
        assert sample is not None
        yield sample


@pytest.mark.parametrize(
    ("scale", "requests", "within"), [(1.0, 300, 0.1), (0.1, 300, 0.1), (10.0, 1000, 0.25)]
)
def test_an_overpriced_queue_does_not_drive_the_prefill_rate(
    scale: float, requests: int, within: float
) -> None:
    """The priced queue is fitted as a share, not subtracted: subtracted, a queue priced
    10x the real wait made the samples of busy moments negative and the prefill rate 4-5x
    too steep, whatever the prior. (From a prior 10x too high the fit needs more requests:
    the prior holds the slope harder than its half a sample suggests, see docs/router.md.)"""
    clock = ManualClock()
    rates = LearnedRates(_prior(scale), clock=clock)
    for sample in _queued_answers(requests):
        clock.t += 0.2
        rates.observe("r", sample)
    prefill = _ratios(rates.rates("r"))[0]
    assert 1 - within < prefill < 1 + within, prefill


@pytest.mark.parametrize("scale", [10.0, 0.1])
def test_the_prior_weighs_as_much_as_the_samples_it_is_compared_with(scale: float) -> None:
    """Every request sent into a queue of three (each weighs 1/16): the prior is worth half
    of such a sample, not half of one sent into an empty queue, so the same requests teach
    the same rates whatever weight they share."""
    learned = []
    for weight in (1.0, 1 / 16):
        clock = ManualClock()
        rates = LearnedRates(_prior(scale), clock=clock)
        for sample in _samples(100, seed=5):
            clock.t += 0.2
            rates.observe("r", replace(sample, weight=weight))
        learned.append(_ratios(rates.rates("r")))
    assert learned[1] == pytest.approx(learned[0], rel=1e-6)
    assert all(0.85 < x < 1.15 for x in learned[1]), learned[1]


@pytest.mark.parametrize("scale", [10.0, 0.1])
def test_the_prior_holds_a_rate_by_what_the_samples_tell_of_it(scale: float) -> None:
    """Chat turns: most uncached parts near 120 tokens. Beside a fitted overhead, a sample
    tells the prefill rate what its size differs from the others', not its size: a prior
    worth half a sample of the size held a rate 10x off at 1.5x after a hundred noiseless
    answers; worth half a sample of the spread, it gives way to them."""
    rnd = random.Random(11)
    clock = ManualClock()
    rates = LearnedRates(_prior(scale), clock=clock)
    for _ in range(100):
        u = max(1, int(rnd.gauss(120, 40)))
        clock.t += 0.2
        rates.observe("r", CalibrationSample(u, 0, 0, TRUE[0] + TRUE[1] * u))
    learned = rates.rates("r")
    assert 0.9 < _ratios(learned)[0] < 1.1, _ratios(learned)
    assert learned.overhead_s == pytest.approx(TRUE[0], rel=0.2)


@pytest.mark.parametrize("scale", [10.0, 0.1])
def test_counter_samples_teach_the_prefill_rate_and_leave_the_loads_to_the_answers(
    scale: float,
) -> None:
    """A replica's counters are interval means of prefills that share its engine: here the
    disk loads' time hides under the computing beside them (each interval takes what its
    computed tokens cost, whatever it loaded). Fitted as load evidence, such samples drove
    the storage rate to its lower clamp (docs/benchmarks.md); taken as what they are
    (``loads_known=False``), they teach the prefill rate, and the load rates follow it at
    the priors' ratio until answers show loads."""
    rnd = random.Random(5)
    blind = LearnedRates(_prior(scale), clock=ManualClock())
    as_loads = LearnedRates(_prior(scale), clock=ManualClock())
    for _ in range(300):
        computed, disk = rnd.randint(100, 3000), rnd.randint(0, 6000)
        seconds = TRUE[0] + TRUE[1] * computed  # the loads are not seen in the time
        for rates, known in ((blind, False), (as_loads, True)):
            rates.observe("r", CalibrationSample(computed, 0, disk, seconds, loads_known=known))
    prefill, cpu, storage = _ratios(blind.rates("r"))
    assert 0.9 < prefill < 1.1
    assert storage == pytest.approx(prefill, rel=0.05) and cpu == pytest.approx(prefill, rel=0.05)
    # The old reading of the same samples: disk loads are free.
    assert _ratios(as_loads.rates("r"))[2] < 0.2
    # Answers that load from disk still teach the storage rate beside the counters.
    for sample in _samples(300, seed=7):
        blind.observe("r", sample)
    assert 0.8 < _ratios(blind.rates("r"))[2] < 1.25
