"""What the routing benchmark reads from the routers it drives, over their own HTTP surface
(``/metrics``, ``/index/stats``): decisions by reason, decision and upstream-TTFT timings,
and the event volume their feeds took in."""

from __future__ import annotations

import math
from collections.abc import Iterator

import httpx
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

__all__ = ["decision_reasons", "feed_volume", "router_timing_row", "router_timings"]


def _metric_samples(router_urls: list[str]) -> Iterator[Sample]:
    """Every sample of every router's /metrics (a router that does not answer is skipped)."""
    for url in router_urls:
        try:
            text = httpx.get(f"{url}/metrics", timeout=5.0).text
        except httpx.HTTPError:
            continue
        for family in text_string_to_metric_families(text):
            yield from family.samples


def decision_reasons(router_urls: list[str]) -> dict[str, float]:
    """The routers' own count of routing decisions by reason (their /metrics, summed), so a
    row says why a policy placed requests where it did (e.g. how often kvroute spilled)."""
    out: dict[str, float] = {}
    for sample in _metric_samples(router_urls):
        if sample.name == "kvroute_routing_decisions_total":
            reason = sample.labels["reason"]
            out[reason] = out.get(reason, 0.0) + sample.value
    return out


_TIMING_SAMPLES = (
    "kvroute_decision_seconds_sum",
    "kvroute_decision_seconds_count",
    "kvroute_upstream_ttft_seconds_sum",
    "kvroute_upstream_ttft_seconds_count",
)


def router_timings(router_urls: list[str]) -> dict[str, float]:
    """The routers' decision-time and upstream-TTFT histograms (sums and counts, summed over
    the routers): with the client's TTFT, what the routers themselves added to it."""
    out = dict.fromkeys(_TIMING_SAMPLES, 0.0)
    for sample in _metric_samples(router_urls):
        if sample.name in out:
            out[sample.name] += sample.value
        elif sample.name == "kvroute_decision_seconds_bucket":
            key = f"decision_le_{sample.labels['le']}"  # cumulative, per bucket bound
            out[key] = out.get(key, 0.0) + sample.value
    return out


def _decision_p90_bound_ms(d: dict[str, float]) -> float | None:
    """The smallest decision-time bucket bound (ms) under which 90% of this run's decisions
    fell: the histogram's resolution, enough to tell a tail from a shift of the mean."""
    total = d.get("kvroute_decision_seconds_count", 0.0)
    bounds = sorted(
        (float(k.removeprefix("decision_le_")), v)
        for k, v in d.items()
        if k.startswith("decision_le_")
    )
    for bound, count in bounds:
        if total and count >= 0.9 * total:
            return None if math.isinf(bound) else 1000 * bound
    return None


def router_timing_row(
    before: dict[str, float], after: dict[str, float], client_ttft_mean_s: float, time_scale: float
) -> dict[str, float | None]:
    """One run's ``router_timing``: the mean decision time (tokenize, look up, rank) and the
    mean time from forwarding to the replica's first byte, both as the routers measured them,
    and the client's mean TTFT minus the latter (ms, wall clock): the router's own share
    of every request's TTFT (parsing, deciding, proxying, and waiting for a busy core)."""
    d = {k: after[k] - before.get(k, 0.0) for k in after}
    n_dec, n_up = d["kvroute_decision_seconds_count"], d["kvroute_upstream_ttft_seconds_count"]
    upstream_ms = 1000 * d["kvroute_upstream_ttft_seconds_sum"] / n_up if n_up else None
    return {
        "decision_ms_mean": round(1000 * d["kvroute_decision_seconds_sum"] / n_dec, 3)
        if n_dec
        else None,
        "decision_ms_p90_bound": _decision_p90_bound_ms(d),
        "upstream_ttft_ms_mean": None if upstream_ms is None else round(upstream_ms, 2),
        "router_added_ms_mean": None
        if upstream_ms is None or not math.isfinite(client_ttft_mean_s)
        else round(1000 * client_ttft_mean_s * time_scale - upstream_ms, 2),
    }


_FEED_COUNTERS = ("batches", "events_applied", "blocks_stored", "blocks_removed")


def feed_volume(router_url: str) -> dict[str, int]:
    """What one router's event feeds took in so far, summed over the replicas (every router
    reads the same feeds): the KV-event volume a workload puts on an indexer, per replica
    and simulated second once divided (docs/benchmarks.md, "Index at 1,000 replicas")."""
    try:
        replicas = httpx.get(f"{router_url}/index/stats", timeout=5.0).json()["replicas"]
    except (httpx.HTTPError, ValueError, KeyError):
        return {}
    out = dict.fromkeys(_FEED_COUNTERS, 0)
    for entry in replicas.values():
        feed = entry.get("feed") or {}
        for key in _FEED_COUNTERS:
            out[key] += int(feed.get(key) or 0)
    return out
