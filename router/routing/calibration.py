"""Prefill and load rates learned per replica, from the first bytes the router already sees.

The cost model prices a request's work on a replica as ``prefill_s_per_token x uncached +
load_s_per_token_cpu x cpu_tokens + load_s_per_token_storage x storage_tokens``. Those rates
are right for one model on one kind of machine and wrong by an order of magnitude elsewhere
(a 70B model on H100s, an 8B on L4s, a CPU replica, NVMe vs a network file system); peers
hand-set their tier weights too. A wrong rate misprices every choice the cost model makes:
too high a prefill rate keeps a returning user behind a long queue on the replica with
their history; too low a one scatters histories to whichever replica is least loaded.

So each replica's rates are learned online from each answered, streamed request: the router
knows the prompt's length, the tokens its index predicted in each tier, the cached tokens
the replica reported (``usage...cached_tokens``: what it really served from cache), the
queue it sent the request into (and the queue delay its model priced), and when the first
byte came back. One sample is

    first_byte_s  =  overhead + p x uncached + c x cpu + s x storage + q x priced_queue_s

with ``uncached = prompt - delivered`` and the predicted tier split trimmed to what was
delivered (a shortfall is taken from the slowest tier first: storage, then CPU). The priced
queue is a regressor, not subtracted: the queue model learns its seconds per pending request
from what these rates leave unexplained, and its ``pending`` counts requests that are
decoding, which hardly delay a new prefill. Subtracted at face value, a queue priced at
5-10x the real wait (measured on the simulator's chat workload: 77-103 ms priced, 1-6 ms
waited, 12 ms of prefill) made most samples negative, and the fit answered with a negative
overhead and a prefill rate 1.3-6x too high. Its share ``q`` starts at 0 and is fitted with
the rates (it is not a rate the cost model prices). Requests sent into a longer queue carry
more noise (their wait varies with the queue) and weigh less: ``1 / (1 + pending)^2``.

The estimate is a weighted least-squares fit, regularised towards the configured rates (the
priors) with the strength of ``prior_samples`` typical samples: of the mean weight of the
samples seen (where every request is sent into a queue, whole samples would make the prior
outweigh the evidence), and of the spread of each feature (beside a fitted overhead a sample
tells a rate what its size differs from the others', not its size: chat turns whose
uncached parts all lie near 100 tokens tell the prefill rate little each, and a prior worth
half a sample of their size held a rate 10x off at 1.5x after a hundred noiseless ones),
and with the data's weight halving every ``half_life_s``: without
samples an estimate relaxes back to the priors, as the queue model's does. A sample far off
the current fit (more than ``outlier_k`` mean absolute residuals) is clipped to that bound
before it counts, so a stalled request or a replica's cold start cannot drag the rates. A
replica with few samples of its own borrows its pool's (the replicas serving the same
model): its own data counts fully, the pool's with weight ``pool_samples / (pool_samples +
own samples)``.

Rates are clamped to [prior / ``max_ratio``, prior x ``max_ratio``]: a rate can move by
orders of magnitude, never to zero or to infinity.

Loads are often short beside the noise around them (a few ms from RAM under a second of
queueing). A sample's noise is taken as ``noise / sqrt(weight)``, ``noise`` being the running
mean of the residuals scaled by the root of their weights (the variance the weights assume);
a load whose priced time is under ``visible_k`` times that is taken out, priced at the rate
its tier follows (the learned prefill rate at the priors' ratio, or the tier's own once 16 of
its loads showed), and does not count as evidence of its tier. A tier without visible loads
follows the learned prefill rate at the priors' ratio. An overhead is never negative: where the free
fit's is, the fit is made again with none (its slope was steepened by delays growing with
the samples' size).

A replica's own counters (``from_counters``, router/routing/prefill_evidence.py) are timed
inside its engine: they lack the path an answer's first byte travels (the proxy, the
replica's API server, streaming), so they get an intercept of their own (the sixth
regressor, 1 on such samples; free in sign, never priced). With one intercept shared, the
two kinds' different overheads (measured on the simulator's chat workload: about 4 ms on an
answer, under 1 ms in the engine) were read as a slope, and the counters, which weigh
several answers each, pulled the prefill rate to 1.2-1.4x the simulator's. Their time also
cannot tell the loads apart from the computing beside them: a counter sample's loads are
priced at the current rates and taken out, and it teaches the prefill rate only.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["CalibrationSample", "LearnedRates", "Rates"]

# overhead, prefill, load from CPU, load from storage, share of the priced queue, and how
# much less a sample timed inside the engine (a replica's counters) carries than an answer
_N = 6
_TIERS = (2, 3)  # the load rates' indices
_ENGINE = 5  # the engine-timed samples' own intercept: free in sign, never priced
_MIN_TIER_SAMPLES = 16
# Samples a fit needs before its residuals mean something: before then no sample is clipped
# as an outlier, no load is judged against the noise, no negative overhead is refitted at 0.
_SETTLED = 8


@dataclass(frozen=True, slots=True)
class Rates:
    """What the cost model reads for one replica."""

    prefill_s_per_token: float
    load_s_per_token_cpu: float
    load_s_per_token_storage: float
    overhead_s: float = 0.0
    samples: int = 0


@dataclass(frozen=True, slots=True)
class CalibrationSample:
    """One answered request: its work per tier (tokens), and the time that work took."""

    uncached: float
    cpu: float
    storage: float
    seconds: float  # the first byte (a replica's counters: its prefill time, no queue in it)
    weight: float = 1.0
    queue_s: float = 0.0  # the queue delay the cost model priced when it sent the request
    # True: a replica's own counters (router/routing/prefill_evidence.py), timed inside its
    # engine and averaged over an interval's prefills, which share the engine. Such a sample
    # lacks the path an answer's first byte travels (the proxy, the replica's API server,
    # tokenization, streaming), so it has its own intercept; and its time does not tell its
    # loads apart from the computing beside them: its loads are priced at the current rates
    # and taken out, and it teaches the prefill rate (and its intercept) only.
    from_counters: bool = False

    @classmethod
    def from_request(
        cls,
        *,
        prompt_tokens: int,
        gpu: float,
        cpu: float,
        storage: float,
        delivered: int | None,
        first_byte_s: float,
        queue_s: float,
        pending: float,
    ) -> CalibrationSample | None:
        """The sample of a request the index predicted ``gpu``/``cpu``/``storage`` cached
        tokens for, of which the replica reported ``delivered`` (None: not reported; the
        prediction is believed). None when it says nothing (no time, no prompt)."""
        if prompt_tokens <= 0 or not math.isfinite(first_byte_s) or first_byte_s <= 0:
            return None
        gpu, cpu, storage = max(0.0, gpu), max(0.0, cpu), max(0.0, storage)
        if delivered is not None:
            delivered = min(max(0, delivered), prompt_tokens)
            short = gpu + cpu + storage - delivered
            if short > 0:  # taken from the slowest tier first
                for_storage = min(storage, short)
                storage -= for_storage
                short -= for_storage
                for_cpu = min(cpu, short)
                cpu -= for_cpu
                gpu -= short - for_cpu
            else:  # served more than predicted: from the device (where a miss lands)
                gpu -= short
            cached = delivered
        else:
            cached = min(float(prompt_tokens), gpu + cpu + storage)
        uncached = max(0.0, prompt_tokens - cached)
        weight = 1.0 / (1.0 + max(0.0, pending)) ** 2
        return cls(uncached, cpu, storage, first_byte_s, weight, max(0.0, queue_s))

    def features(self) -> tuple[float, float, float, float, float, float]:
        engine = 1.0 if self.from_counters else 0.0
        return (1.0, self.uncached, self.cpu, self.storage, self.queue_s, engine)


@dataclass(slots=True)
class _Fit:
    """Decayed sufficient statistics of a weighted least-squares fit."""

    a: list[list[float]] = field(default_factory=lambda: [[0.0] * _N for _ in range(_N)])
    b: list[float] = field(default_factory=lambda: [0.0] * _N)
    # mean of each feature squared where it is not zero (the scale the prior's strength is
    # given in), and how many samples had it (a tier's loads are a few of all requests)
    x2: list[float] = field(default_factory=lambda: [0.0] * _N)
    # each feature's mean and mean square over all samples (its spread: what a rate learns
    # from beside the overhead)
    m1: list[float] = field(default_factory=lambda: [0.0] * _N)
    m2: list[float] = field(default_factory=lambda: [0.0] * _N)
    seen: list[int] = field(default_factory=lambda: [0] * _N)
    weight: float = 0.0
    count: float = 0.0  # samples, decayed like ``weight`` (their ratio: a sample's mean weight)
    samples: int = 0
    abs_residual: float = 0.0  # decayed mean absolute residual (the outlier bound's unit)
    noise: float = 0.0  # mean absolute residual x sqrt(weight): a weight-1 sample's noise
    at: float = 0.0

    def decay(self, now: float, half_life_s: float) -> None:
        if now <= self.at:
            return
        keep = math.exp(-math.log(2.0) * (now - self.at) / half_life_s)
        self.at = now
        if keep >= 1.0:
            return
        for row in self.a:
            for j in range(_N):
                row[j] *= keep
        for j in range(_N):
            self.b[j] *= keep
        self.weight *= keep
        self.count *= keep

    def add(self, x: tuple[float, ...], y: float, w: float) -> None:
        a, b, x2 = self.a, self.b, self.x2
        for i in range(_N):
            wx = w * x[i]
            b[i] += wx * y
            row = a[i]
            for j in range(_N):
                row[j] += wx * x[j]
        self.weight += w
        self.count += 1.0
        self.samples += 1
        for i in range(_N):
            self.m1[i] += (x[i] - self.m1[i]) / min(self.samples, 50)
            self.m2[i] += (x[i] * x[i] - self.m2[i]) / min(self.samples, 50)
            if x[i] > 0:
                self.seen[i] += 1
                x2[i] += (x[i] * x[i] - x2[i]) / min(self.seen[i], 50)


class LearnedRates:
    """Per replica prefill and load rates: prior, learned fit, relaxation to the prior."""

    def __init__(
        self,
        prior: Rates,
        *,
        half_life_s: float = 300.0,
        prior_samples: float = 0.5,
        pool_samples: float = 32.0,
        outlier_k: float = 4.0,
        visible_k: float = 1.0,
        max_ratio: float = 100.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if half_life_s <= 0 or prior_samples <= 0 or pool_samples < 0:
            raise ValueError("need half_life_s > 0, prior_samples > 0, pool_samples >= 0")
        if outlier_k <= 0 or max_ratio < 1 or visible_k < 0:
            raise ValueError("need outlier_k > 0, visible_k >= 0 and max_ratio >= 1")
        self.prior = prior
        self.half_life_s = half_life_s
        self.prior_samples = prior_samples
        self.pool_samples = pool_samples
        self.outlier_k = outlier_k
        self.visible_k = visible_k
        self.max_ratio = max_ratio
        self._clock = clock
        # The share of the priced queue in a first byte starts at none of it: the queue
        # model's estimate is learned from what these rates leave unexplained, so believing
        # it would let an overpriced queue drive the rates (measured: the priced queue was
        # 5-10x the real wait where most pending requests were decoding).
        self._theta0 = (
            prior.overhead_s,
            prior.prefill_s_per_token,
            prior.load_s_per_token_cpu,
            prior.load_s_per_token_storage,
            0.0,
            0.0,  # the engine-timed samples' intercept: as the answers' until they differ
        )
        self._fits: dict[str, _Fit] = {}
        self._pool_of: dict[str, str] = {}
        self._pools: dict[str, _Fit] = {}
        self._cache: dict[str, tuple[Rates, float]] = {}
        self.outliers = 0
        self.shared_applied = 0  # samples taken from peer routers

    # --- learning ----------------------------------------------------------------------------

    def observe(self, replica: str, sample: CalibrationSample, pool: str = "") -> None:
        """One answered request on ``replica`` (of ``pool``: the replicas that serve the
        same model on the same hardware, whose samples it may borrow)."""
        if not math.isfinite(sample.seconds) or sample.weight <= 0:
            return
        now = self._clock()
        self._pool_of[replica] = pool
        fit = self._fits.get(replica)
        if fit is None:
            fit = self._fits[replica] = _Fit(at=now)
        pooled = self._pools.get(pool)
        if pooled is None:
            pooled = self._pools[pool] = _Fit(at=now)
        x = sample.features()
        theta = self._solve(replica, now)
        y, w = sample.seconds, sample.weight
        if sample.from_counters:
            y -= theta[2] * sample.cpu + theta[3] * sample.storage
            x = (x[0], x[1], 0.0, 0.0, x[4], x[5])
        elif fit.samples >= _SETTLED:
            # A load too short to show above this sample's noise (a weight-1 sample's noise,
            # grown as its weight shrinks: sent into a queue, it waited a varying while) is
            # priced at the rate its tier follows and taken out: fitted, a few ms of load
            # under a second of queueing taught the CPU rate 10-37x the simulator's.
            # Judged at the rate the priors' ratio to the learned prefill rate gives, or the
            # tier's learned one if higher: judged at a low learned rate alone, loads would
            # hide behind the estimate they should correct.
            noise = self.visible_k * fit.noise / math.sqrt(w)
            follow = theta[1] / self._theta0[1] if self._theta0[1] > 0 else 1.0
            xs = list(x)
            for i in _TIERS:
                judged_at = max(theta[i], self._theta0[i] * follow)
                if xs[i] > 0 and judged_at * xs[i] < noise:
                    own = fit.seen[i] >= _MIN_TIER_SAMPLES
                    y -= (theta[i] if own else self._theta0[i] * follow) * xs[i]
                    xs[i] = 0.0
            x = tuple(xs)
        predicted = sum(t * xi for t, xi in zip(theta, x, strict=True))
        residual = abs(y - predicted)
        bound = self.outlier_k * fit.abs_residual
        fit.noise += (min(residual, bound or residual) * math.sqrt(w) - fit.noise) / min(
            fit.samples + 1, 50
        )
        if fit.samples >= _SETTLED and bound > 0 and residual > bound:
            # Huber's weight: beyond the bound a sample's pull no longer grows with its error
            self.outliers += 1
            w *= bound / residual
        fit.abs_residual += (min(residual, bound or residual) - fit.abs_residual) / min(
            fit.samples + 1, 20
        )
        for f in (fit, pooled):
            f.decay(now, self.half_life_s)
            f.add(x, y, w)
        self._cache.clear()  # its pool's replicas read it too

    def forget(self, replica: str) -> None:
        self._fits.pop(replica, None)
        self._pool_of.pop(replica, None)
        self._cache.pop(replica, None)

    # --- reading -----------------------------------------------------------------------------

    def rates(self, replica: str, pool: str | None = None) -> Rates:
        """The rates to price ``replica`` (of ``pool``, when it has no sample of its own yet)
        with: the prior until it or its pool has samples. Solved at most once a second per
        replica between samples (the decay is slow; a decision must not pay for it)."""
        now = self._clock()
        cached = self._cache.get(replica)
        if cached is not None and now - cached[1] < 1.0:
            return cached[0]
        pool = self._pool_of.get(replica, pool)
        if replica not in self._fits and (pool is None or pool not in self._pools):
            return self.prior
        fit = self._fits.get(replica)
        theta = self._solve(replica, now, pool)
        rates = Rates(theta[1], theta[2], theta[3], theta[0], fit.samples if fit is not None else 0)
        self._cache[replica] = (rates, now)
        return rates

    def _solve(self, replica: str, now: float, pool: str | None = None) -> tuple[float, ...]:
        fit = self._fits.get(replica)
        pooled = self._pools.get(self._pool_of.get(replica, pool or ""))
        n = _N
        a = [[0.0] * n for _ in range(n)]
        b = [0.0] * n
        own = fit.samples if fit is not None else 0
        share = self.pool_samples / (self.pool_samples + own) if self.pool_samples else 0.0
        scale = [0.0] * n
        spread = [0.0] * n
        seen = [0] * n
        weight = count = 0.0
        for f, w in ((fit, 1.0), (pooled, share)):
            if f is None or w == 0.0:
                continue
            # the statistics as of now (decay without mutating: reading must not write)
            keep = math.exp(-math.log(2.0) * max(0.0, now - f.at) / self.half_life_s) * w
            weight += keep * f.weight
            count += keep * f.count
            for i in range(n):
                b[i] += keep * f.b[i]
                for j in range(n):
                    a[i][j] += keep * f.a[i][j]
                scale[i] = max(scale[i], f.x2[i])
                spread[i] = max(spread[i], f.m2[i] - f.m1[i] * f.m1[i])
                seen[i] = max(seen[i], f.seen[i])
        # A sample's typical weight: the prior is worth ``prior_samples`` samples like these
        # (requests sent into a queue weigh ``1 / (1 + pending)^2`` each; counted as whole
        # samples, the prior would outweigh a busy replica's evidence many times over).
        unit = weight / count if count > 0 else 1.0
        theta = self._fit(a, b, scale, seen, self._theta0, unit, spread)
        if theta is None:
            return self._theta0
        # No overhead is negative: where the free fit's is, the slope it pairs with is too
        # steep (the samples' delays grow with their size), so fit again with none.
        pin = theta[0] < 0 and count >= _SETTLED
        if pin:
            theta = self._fit(a, b, scale, seen, self._theta0, unit, spread, pin) or theta
        # The priors say how much faster a load is than recomputing: absent evidence of a
        # tier's own, its rate follows the learned prefill rate at the priors' ratio (a
        # replica that prefills 5x faster than assumed is not thereby slower to load).
        ratio = theta[1] / self._theta0[1] if self._theta0[1] > 0 else 1.0
        scaled_prior = tuple(t * ratio if i in _TIERS else t for i, t in enumerate(self._theta0))
        theta = self._fit(a, b, scale, seen, scaled_prior, unit, spread, pin) or theta
        out = [max(0.0, theta[0])]
        for i in range(1, n):
            if i == _ENGINE:
                out.append(theta[i])
                continue
            prior = self._theta0[i]
            lo, hi = prior / self.max_ratio, prior * self.max_ratio
            out.append(min(hi, max(lo, theta[i])) if prior > 0 else max(0.0, theta[i]))
        return tuple(out)

    def _fit(
        self,
        a: list[list[float]],
        b: list[float],
        scale: list[float],
        seen: list[int],
        theta0: tuple[float, ...],
        sample_weight: float = 1.0,
        spread: list[float] | None = None,
        pin_overhead: bool = False,
    ) -> list[float] | None:
        """The regularised fit of the statistics ``a``, ``b`` towards ``theta0``, the prior
        worth samples of ``sample_weight`` each."""
        n = _N
        # The prior: ``prior_samples`` samples' worth of each feature's typical size, pulling
        # each rate to ``theta0``; a feature never seen keeps it exactly. A load rate is
        # held by at least ``_MIN_TIER_SAMPLES`` samples' worth until that many requests
        # loaded from the tier: a few loads among many recomputes identify little.
        a = [row[:] for row in a]
        b = b[:]
        for i in range(n):
            weight = self.prior_samples
            if i in _TIERS:
                weight = max(weight, _MIN_TIER_SAMPLES - seen[i])
            size = scale[i] if scale[i] > 0 else 1.0
            if i > 0 and spread is not None and spread[i] > 0:
                size = min(size, spread[i])
            strength = weight * sample_weight * size
            a[i][i] += strength
            b[i] += strength * theta0[i]
        if pin_overhead:
            for j in range(n):
                a[0][j] = a[j][0] = 0.0
            a[0][0], b[0] = 1.0, 0.0
        # Solved in units of each feature's typical size: tokens and the constant differ by
        # orders of magnitude, and the system is better conditioned scaled.
        unit = [math.sqrt(v) if v > 0 else 1.0 for v in scale]
        a = [[a[i][j] / (unit[i] * unit[j]) for j in range(n)] for i in range(n)]
        scaled = _solve_linear(a, [b[i] / unit[i] for i in range(n)])
        if scaled is None:
            return None
        return [scaled[i] / unit[i] for i in range(n)]

    def to_dict(self) -> dict[str, dict[str, float | int]]:
        """Per replica: the learned rates and their sample counts (/debug/route, stats)."""
        out: dict[str, dict[str, float | int]] = {}
        for name in self._fits:
            r = self.rates(name)
            out[name] = {
                "prefill_s_per_token": float(f"{r.prefill_s_per_token:.4g}"),
                "load_s_per_token_cpu": float(f"{r.load_s_per_token_cpu:.4g}"),
                "load_s_per_token_storage": float(f"{r.load_s_per_token_storage:.4g}"),
                "overhead_s": round(r.overhead_s, 6),
                "samples": r.samples,
            }
        return out


def _solve_linear(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting (a 6x6 system: no numpy on this path)."""
    n = len(b)
    m = [[*row, b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-300:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        p = m[col][col]
        for r in range(col + 1, n):
            f = m[r][col] / p
            if f:
                m[r] = [vr - f * vc for vr, vc in zip(m[r], m[col], strict=True)]
    x = [0.0] * n
    for i in range(n - 1, -1, -1):
        x[i] = (m[i][n] - sum(m[i][j] * x[j] for j in range(i + 1, n))) / m[i][i]
    return x if all(math.isfinite(v) for v in x) else None
