"""A replica's own prefill counters as calibration samples (router/routing/calibration.py).

The router learns each replica's prefill and load rates from the answers it proxies: a
streamed answer's first byte, minus the queueing it priced, against the tokens the index
placed in each tier. vLLM (0.32 and later) also counts, per replica, exactly what that
sample has to guess, on the ``/metrics`` page the health checks already scrape:

* ``vllm:request_prefill_time_seconds`` (its sum and count): time from the request being
  scheduled to its first token, so no queueing in it;
* ``vllm:prompt_tokens_by_source_total{source="local_compute"}``: prompt tokens computed;
* ``vllm:prompt_tokens_cached_by_source_total{source="host"|"disk"}``: cached tokens the KV
  connector loaded from RAM and from disk (kvroute's connector reports this split;
  ``device`` hits cost nothing to load).

Between two scrapes those counters' differences describe the requests prefilled in between:
``prefills`` requests, together ``prefill_s`` seconds, ``computed`` tokens computed, ``host``
and ``disk`` tokens loaded. Their mean is one sample of the same linear model the answers
feed (seconds = overhead + p x uncached + c x cpu + s x storage), weighted by the requests it
stands for, worth ``weight_per_request`` of an answer each: an answer measures what the cost
model predicts (the client's time to first token), the counters measure the engine alone.
Non-streamed traffic, which gives the router no first byte, is calibrated this way too.
The loads in such a sample are priced at the current rates, and the sample teaches the
overhead and the prefill rate only (``CalibrationSample.from_counters``): an interval's
prefills share the replica's engine, so its mean time does not tell a disk load apart from
the computing beside it, and fitted as evidence of the load rates those samples drove the
storage rate to its lower clamp (docs/benchmarks.md, calibration on the shared-storage
preset). The load rates are learned from the answers, and follow the prefill rate at the
priors' ratio until answers show loads.

The counters are counted at different moments (the tokens at scheduling or at the first
token, the time at the first token), so differences are taken only once ``min_prefills``
requests are in them; a counter that went backwards (the replica restarted) starts over.
Each router scrapes every replica itself, so these samples are never passed to peers.
"""

from __future__ import annotations

import math

from kvroute.router.fleet.replicas import PREFILL_COUNTERS
from kvroute.router.routing.calibration import CalibrationSample

__all__ = ["PrefillEvidence"]


class PrefillEvidence:
    """Per replica, the counters at the last sample taken; ``sample`` turns a new scrape
    into a calibration sample (or None: not enough new requests, or no counters)."""

    def __init__(self, *, min_prefills: int = 4, weight_per_request: float = 0.5) -> None:
        if min_prefills < 1 or weight_per_request <= 0:
            raise ValueError("need min_prefills >= 1 and weight_per_request > 0")
        self.min_prefills = min_prefills
        self.weight_per_request = weight_per_request
        self._last: dict[str, tuple[float, ...]] = {}
        self.samples = 0  # taken since start, all replicas
        self.restarts = 0  # counters that went backwards

    def sample(self, replica: str, scraped: dict[str, float]) -> CalibrationSample | None:
        if "prefills" not in scraped or "prefill_s" not in scraped:
            return None  # a replica (or a vLLM) without the prefill-time histogram
        values = tuple(float(scraped.get(k, 0.0)) for k in PREFILL_COUNTERS)
        if not all(math.isfinite(v) and v >= 0 for v in values):
            return None
        last = self._last.get(replica)
        if last is None:
            self._last[replica] = values
            return None
        delta = [now - then for now, then in zip(values, last, strict=True)]
        if any(d < 0 for d in delta):
            self.restarts += 1
            self._last[replica] = values
            return None
        seconds, prefills, computed, host, disk = delta
        if prefills < self.min_prefills:
            return None  # keep the baseline: the next scrape adds to these requests
        self._last[replica] = values
        self.samples += 1
        return CalibrationSample(
            computed / prefills,
            host / prefills,
            disk / prefills,
            seconds / prefills,
            self.weight_per_request * prefills,
            from_counters=True,
        )

    def forget(self, replica: str) -> None:
        self._last.pop(replica, None)
