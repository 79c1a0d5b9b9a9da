"""The body of ``GET /dashboard/data``: a compact view of one router for its dashboard page.

Built from the sources ``/index/stats`` reads (``RouterService.stats()``), the router's log
of recent decisions (``Router.recent``) and its Prometheus counters, so the page and the JSON
endpoints can never disagree. The hit-rate time series is kept here, server side, so every
open page (and a page opened later) sees the same recent history; it is sampled when the page
polls (at most once per ``min_interval_s``), which costs nothing while nobody looks. Longer
history is Prometheus's job (deploy/grafana).
"""

from __future__ import annotations

import os
import socket
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvroute.indexer.tiers import Tier

if TYPE_CHECKING:
    from kvroute.router.service import RouterService

__all__ = ["DashboardData", "HitRateSeries", "Totals"]

TIERS = tuple(t.label() for t in Tier)  # the keys of entries_by_tier, fastest first


@dataclass(frozen=True, slots=True)
class Totals:
    """Cumulative counters at one instant; the series is made of their differences."""

    at: float
    requests: int
    prompt_tokens: int
    predicted: int
    delivered: int
    reported: int
    ttft_sum_s: float
    ttft_count: float


class HitRateSeries:
    """The last ``points`` intervals: predicted vs delivered hit rate, requests/s, mean TTFT.

    Hit rates are token-weighted over the interval's routed requests: cached tokens over
    prompt tokens. Delivered counts what replicas reported; ``reported_share`` says which
    share of the interval's requests reported at all (a replica without
    ``--enable-prompt-tokens-details`` reports nothing, and the delivered line is then low).
    """

    def __init__(self, points: int = 180, min_interval_s: float = 1.0) -> None:
        self.min_interval_s = min_interval_s
        self._points: deque[dict[str, Any]] = deque(maxlen=points)
        self._last: Totals | None = None

    def sample(self, now: Totals) -> None:
        last = self._last
        if last is not None and now.at - last.at < self.min_interval_s:
            return
        self._last = now
        if last is None:
            return
        dt = now.at - last.at
        requests = now.requests - last.requests
        prompt = now.prompt_tokens - last.prompt_tokens
        first_bytes = now.ttft_count - last.ttft_count
        self._points.append(
            {
                "t": round(now.at, 3),
                "requests_per_s": round(requests / dt, 3) if dt > 0 else 0.0,
                "predicted_hit_rate": round((now.predicted - last.predicted) / prompt, 4)
                if prompt > 0
                else None,
                "delivered_hit_rate": round((now.delivered - last.delivered) / prompt, 4)
                if prompt > 0
                else None,
                "reported_share": round((now.reported - last.reported) / requests, 4)
                if requests > 0
                else None,
                "ttft_mean_s": round((now.ttft_sum_s - last.ttft_sum_s) / first_bytes, 6)
                if first_bytes > 0
                else None,
            }
        )

    def to_list(self) -> list[dict[str, Any]]:
        return list(self._points)


def _sum_samples(metric: Any, suffix: str) -> float:
    return sum(s.value for f in metric.collect() for s in f.samples if s.name.endswith(suffix))


class DashboardData:
    """``snapshot()``: what the page shows, for one router."""

    def __init__(self, service: RouterService, *, decisions: int = 25) -> None:
        self.service = service
        self.decisions = decisions
        self.series = HitRateSeries()
        self.identity = {"host": socket.gethostname(), "pid": os.getpid()}

    def _totals(self, fleet_accuracy: dict[str, Any]) -> Totals:
        ttft = self.service.metrics.ttft
        return Totals(
            at=time.time(),
            requests=fleet_accuracy["requests"],
            prompt_tokens=fleet_accuracy["prompt_tokens"],
            predicted=fleet_accuracy["predicted_cached_tokens"],
            delivered=fleet_accuracy["delivered_cached_tokens"],
            reported=fleet_accuracy["reported_requests"],
            ttft_sum_s=_sum_samples(ttft, "_sum"),
            ttft_count=_sum_samples(ttft, "_count"),
        )

    def _reasons(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for family in self.service.metrics.decisions.collect():
            for s in family.samples:
                if s.name.endswith("_total"):
                    reason = s.labels["reason"]
                    out[reason] = out.get(reason, 0) + int(s.value)
        return out

    def snapshot(self) -> dict[str, Any]:
        service = self.service
        stats = service.stats()
        fleet = stats["fleet"]
        accuracy = fleet["accuracy"]
        self.series.sample(self._totals(accuracy))
        replicas = [_replica(name, r) for name, r in stats["replicas"].items()]
        states: dict[str, int] = {}
        for r in replicas:
            key = r["freshness"] or "no feed"
            states[key] = states.get(key, 0) + 1
        prompt = accuracy["prompt_tokens"]
        recent = service.router.recent
        return {
            "taken_at": stats["taken_at"],
            "router": {
                **self.identity,
                "policy": stats["policy"],
                "started_at": round(service.started_at, 3),
                "uptime_s": round(time.time() - service.started_at, 1),
                "decisions_recorded": recent.recorded,
            },
            # Each router's page is its own view (its load counts, its decisions); the
            # cache state is the same on all. Its peers are those it shares load with.
            "peers": _peers(stats.get("peer_load")),
            "disaggregation": _disaggregation(stats.get("disaggregation"), replicas),
            "fleet": {
                "replicas": len(replicas),
                "healthy_replicas": fleet["healthy_replicas"],
                "in_flight": fleet["in_flight"],
                "entries": fleet["entries"],
                "entries_by_tier": {t: fleet["entries_by_tier"].get(t, 0) for t in TIERS},
                "freshness": states,
                "requests": accuracy["requests"],
                "prompt_tokens": prompt,
                "predicted_cached_tokens": accuracy["predicted_cached_tokens"],
                "delivered_cached_tokens": accuracy["delivered_cached_tokens"],
                "reported_requests": accuracy["reported_requests"],
                "predicted_hit_rate": round(accuracy["predicted_cached_tokens"] / prompt, 4)
                if prompt
                else None,
                "delivered_hit_rate": round(accuracy["delivered_cached_tokens"] / prompt, 4)
                if prompt
                else None,
                "events_applied": fleet.get("events_applied", 0),
                "gaps": fleet.get("gaps", 0),
                "resets": fleet.get("resets", 0),
                "reasons": self._reasons(),
            },
            "replicas": replicas,
            "series": self.series.to_list(),
            "decisions": recent.to_list(self.decisions),
        }


def _peers(peer_load: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The other routers this one shares load with (``--peer``), as /index/stats shows them."""
    if not peer_load:
        return []
    return [
        {"url": url, "router": p.get("router"), "fresh": p.get("fresh"), "error": p.get("error")}
        for url, p in sorted(peer_load.get("peers", {}).items())
        if not p.get("self")
    ]


def _disaggregation(
    disagg: dict[str, Any] | None, replicas: list[dict[str, Any]]
) -> dict[str, Any] | None:
    """The P/D panel's data, or None for a fleet with no prefill or decode replica (the
    panel is then hidden: an aggregated fleet has nothing to show there)."""
    if not disagg or all(r["role"] == "both" for r in replicas):
        return None
    keys = (
        "mode",
        "pools",
        "split",
        "bypassed",
        "bypass_rate",
        "prefill_legs",
        "decode_legs",
        "prefill_failures",
        "prefill_fallbacks",
        "on_prefill",
        "on_prefill_fallbacks",
        "resumed_streams",
        "resume_failures",
        "missing_transfer_params",
        "transfer_failures",
        "pull_failures",
        "expired_leases",
    )
    return {k: disagg.get(k) for k in keys}


def _replica(name: str, r: dict[str, Any]) -> dict[str, Any]:
    """One replica's row: health, role, feed, tiers, load, the rates it is priced with,
    traffic."""
    health = r.get("health") or {}
    load = r.get("load") or {}
    feed = r.get("feed") or {}
    tiers = r.get("entries_by_tier") or {}
    acc = r.get("accuracy") or {}
    rates = r.get("cost_rates") or {}
    return {
        "name": name,
        "role": r.get("role", "both"),
        "url": health.get("url"),
        "healthy": bool(health.get("healthy")),
        "last_error": health.get("last_error"),
        "freshness": r.get("freshness"),
        "freshness_reason": r.get("freshness_reason"),
        "last_event_age_s": feed.get("last_event_age_s"),
        "gaps": feed.get("gaps", 0),
        "entries_by_tier": {t: tiers.get(t, 0) for t in TIERS},
        "entries": r.get("entries", 0),
        "pending": load.get("pending", 0),
        "in_flight": load.get("in_flight", 0),
        "running": load.get("running", 0),
        "waiting": load.get("waiting", 0),
        "kv_cache_usage": load.get("kv_cache_usage", 0),
        "queue_s_per_request": load.get("queue_s_per_request"),
        # The cost model's rates (learned from answered requests, or the configured priors
        # while ``rates_learned`` is false), and the samples behind them.
        "prefill_s_per_token": rates.get("prefill_s_per_token"),
        "load_s_per_token_cpu": rates.get("load_s_per_token_cpu"),
        "load_s_per_token_storage": rates.get("load_s_per_token_storage"),
        "rates_learned": bool(rates.get("learned")),
        "rates_samples": rates.get("samples", 0),
        "requests": acc.get("requests", 0),
        "predicted_cached_tokens": acc.get("predicted_cached_tokens", 0),
        "delivered_cached_tokens": acc.get("delivered_cached_tokens", 0),
    }
