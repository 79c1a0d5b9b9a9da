"""Prometheus metrics of one router instance (its own registry: tests run several apps).

Label sets are bounded: endpoint and outcome are fixed vocabularies, reasons come from
``POLICY_REASONS``, and replica labels exist only for configured replicas and are removed
with them. Index and replica gauges are read at scrape time by a collector, so the request
path pays nothing for them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

__all__ = ["ENDPOINTS", "EPP_OUTCOMES", "OUTCOMES", "RouterMetrics"]

ENDPOINTS = (
    "completions",
    "chat",
    "tokenize",
    "detokenize",
    "responses",
    "messages",
    "embeddings",
    "pooling",
    "classify",
    "score",
    "rerank",
    "generate",
    "audio",
    "other",
)
OUTCOMES = (
    "ok",  # upstream answered 2xx
    "upstream_4xx",  # the replica refused the request
    "upstream_5xx",  # the replica failed it (after retries)
    "client_error",  # refused by the router (400/404/413)
    "unavailable",  # no healthy replica / every attempt failed before the first byte
    "midstream_error",  # the stream broke after it started
    "cancelled",  # the client went away
    "router_error",  # a bug in the router (answered 500)
)
EPP_OUTCOMES = (
    "picked",  # an endpoint went back to the gateway
    "client_error",  # refused: 400/401/404/413
    "unavailable",  # no replica could take it (503), the subset hint's included
    "router_error",  # a bug in the router (answered 500)
)
_POOL_PREFIX = "kvroute_pd_pool_"  # the P/D pool gauges': kvroute_pd_pool_<field of pools>
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class _StateCollector(Collector):
    def __init__(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        self.snapshot = snapshot

    def collect(self) -> Iterable[Metric]:
        snap = self.snapshot()
        healthy = GaugeMetricFamily(
            "kvroute_replica_healthy", "1 when the replica passes health checks", labels=["replica"]
        )
        in_flight = GaugeMetricFamily(
            "kvroute_replica_in_flight", "Requests this router has in flight", labels=["replica"]
        )
        pending = GaugeMetricFamily(
            "kvroute_replica_pending",
            "max(router in-flight, vLLM running + waiting)",
            labels=["replica"],
        )
        fresh = GaugeMetricFamily(
            "kvroute_index_freshness",
            "1 for the replica's current event-feed state",
            labels=["replica", "state"],
        )
        entries = GaugeMetricFamily(
            "kvroute_index_entries", "Index entries by replica and tier", labels=["replica", "tier"]
        )
        throttled = CounterMetricFamily(
            "kvroute_event_throttled_bytes",
            "Event bytes dropped unread because the replica's publisher was over its budget",
            labels=["replica"],
        )
        lost = CounterMetricFamily(
            "kvroute_event_lost_batches",
            "Event batches the replica's publisher numbered but never sent or buffered "
            "(lost at the source; docs/indexer.md)",
            labels=["replica"],
        )
        queued = GaugeMetricFamily(
            "kvroute_replica_queued_prefill_tokens",
            "Prompt tokens sent to the replica to compute (by this router and its peers) "
            "that its event feed has not announced stored yet",
            labels=["replica"],
        )
        healthy_queued: list[float] = []
        for name, r in snap["replicas"].items():
            queued.add_metric([name], r.get("queued_prefill_tokens", 0))
            if r["healthy"]:
                healthy_queued.append(r.get("queued_prefill_tokens", 0))
            throttled.add_metric([name], r.get("throttled_bytes", 0))
            lost.add_metric([name], r.get("lost_batches", 0))
            healthy.add_metric([name], 1.0 if r["healthy"] else 0.0)
            in_flight.add_metric([name], r["in_flight"])
            pending.add_metric([name], r["pending"])
            if r.get("freshness"):
                fresh.add_metric([name, r["freshness"]], 1.0)
            for tier, n in (r.get("entries_by_tier") or {}).items():
                entries.add_metric([name, tier], n)
        yield from (healthy, in_flight, pending, fresh, entries, throttled, lost, queued)
        # The autoscaling signal (llm-d's and Dynamo's planners scale on queued prefill):
        # the fleet's queued prefill tokens per healthy replica. Every router sees its
        # peers' work too (GET /peer/load), so each reports the fleet's figure.
        yield GaugeMetricFamily(
            "kvroute_fleet_saturation",
            "Queued prefill tokens per healthy replica, fleet-wide (the autoscaling signal; "
            "no healthy replica: the total queued)",
            value=sum(healthy_queued) / len(healthy_queued)
            if healthy_queued
            else sum(r.get("queued_prefill_tokens", 0) for r in snap["replicas"].values()),
        )
        modes = GaugeMetricFamily(
            "kvroute_tokenizer_mode",
            "1 for how the model's prompts are tokenized now (local, or remote after a mismatch)",
            labels=["model", "mode"],
        )
        for model, mode in (snap.get("tokenizer_modes") or {}).items():
            for m in ("local", "remote"):
                modes.add_metric([model, m], 1.0 if m == mode else 0.0)
        yield modes
        yield GaugeMetricFamily(
            "kvroute_index_estimated_bytes", "Index memory estimate", value=snap["index_bytes"]
        )
        yield GaugeMetricFamily(
            "kvroute_burst_hints", "Live burst-hint keys", value=snap["hint_keys"]
        )
        yield from _pd_metrics(snap.get("pd"))
        yield from _pd_transport_metrics(snap["replicas"])


def _pd_metrics(pd: dict[str, Any] | None) -> Iterable[Metric]:
    """Prefill/decode disaggregation (router/routing/disagg.py): decisions by reason, legs
    sent, and each failure kind."""
    if not pd:
        return
    decisions = CounterMetricFamily(
        "kvroute_pd_decisions",
        "P/D decisions by reason (split*: two legs; whole_on_prefill: whole on a prefill "
        "replica; the others: decode only)",
        labels=["reason"],
    )
    for reason, n in pd["decisions"].items():
        decisions.add_metric([reason], n)
    yield decisions
    legs = CounterMetricFamily("kvroute_pd_legs", "P/D legs sent", labels=["leg"])
    legs.add_metric(["prefill"], pd["prefill_legs"])
    legs.add_metric(["decode"], pd["decode_legs"])
    yield legs
    failures = CounterMetricFamily(
        "kvroute_pd_failures",
        "P/D failures: prefill leg failed, served decode-only after them, prefill answer "
        "without kv_transfer_params, decode failed after a split (transfer), decode that "
        "could not pull and recomputed (pull: the replicas' own counters), a whole request "
        "its prefill replica did not serve (on_prefill_fallback), a whole streamed answer "
        "finished on another replica after its own failed (resumed_stream) or that could "
        "not be (resume_failure)",
        labels=["kind"],
    )
    for kind in ("prefill_failures", "prefill_fallbacks", "missing_transfer_params"):
        failures.add_metric([kind.removesuffix("s")], pd[kind])
    failures.add_metric(["transfer_failure"], pd["transfer_failures"])
    failures.add_metric(["pull_failure"], pd.get("pull_failures", 0))
    failures.add_metric(["on_prefill_fallback"], pd.get("on_prefill_fallbacks", 0))
    failures.add_metric(["resumed_stream"], pd.get("resumed_streams", 0))
    failures.add_metric(["resume_failure"], pd.get("resume_failures", 0))
    yield failures
    if pd.get("bypass_rate") is not None:
        yield GaugeMetricFamily(
            "kvroute_pd_bypass_ratio",
            "Share of P/D decisions served decode-only (the prefill leg skipped)",
            value=pd["bypass_rate"],
        )
    pools = pd.get("pools") or {}
    # Each name written out whole, so that a search for a dashboard's metric finds it here
    # (tests/deploy/test_grafana_dashboard.py reads the names so).
    for family in (
        GaugeMetricFamily(
            "kvroute_pd_pool_replicas",
            "Replicas in each P/D pool (role: prefill, decode, both)",
            labels=["pool"],
        ),
        GaugeMetricFamily(
            "kvroute_pd_pool_healthy", "Healthy replicas in each P/D pool", labels=["pool"]
        ),
        GaugeMetricFamily(
            "kvroute_pd_pool_in_flight",
            "Requests this router has in flight to each P/D pool",
            labels=["pool"],
        ),
        GaugeMetricFamily(
            "kvroute_pd_pool_pending",
            "max(router in-flight, vLLM running + waiting), summed over each pool",
            labels=["pool"],
        ),
    ):
        field_ = family.name[len(_POOL_PREFIX) :]
        for role, pool in sorted(pools.items()):
            family.add_metric([role], pool[field_])
        yield family


def _pd_transport_metrics(replicas: dict[str, dict[str, Any]]) -> Iterable[Metric]:
    """The replicas' own P/D transport counters, as their metrics pages had them at the last
    scrape (router/fleet/replicas.py ``PD_TRANSPORT_COUNTERS``): NIXL's failed transfers and
    expired leases, the storage domain's transfers, waits, timeouts and mismatches."""
    family = CounterMetricFamily(
        "kvroute_pd_transport",
        "P/D transport counters each replica reports (vllm:nixl_*, vllm:kvroute_pd_*): "
        "nixl_failed_transfers, storage_timeouts and storage_mismatches are decodes that "
        "could not pull their prefill's KV",
        labels=["replica", "counter"],
    )
    for name, r in replicas.items():
        for counter, value in sorted((r.get("pd_transport") or {}).items()):
            family.add_metric([name, counter], value)
    yield family


class RouterMetrics:
    def __init__(self, state: Callable[[], dict[str, Any]] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self.requests = Counter(
            "kvroute_requests",
            "Requests by endpoint and outcome",
            ["endpoint", "outcome"],
            registry=r,
        )
        self.decisions = Counter(
            "kvroute_routing_decisions",
            "Routing decisions by policy and reason",
            ["policy", "reason"],
            registry=r,
        )
        self.retries = Counter(
            "kvroute_retries",
            "Attempts moved to the next replica before the first byte",
            registry=r,
        )
        self.predicted = Counter(
            "kvroute_predicted_cached_tokens",
            "Cached prompt tokens the router predicted",
            ["replica"],
            registry=r,
        )
        self.delivered = Counter(
            "kvroute_delivered_cached_tokens",
            "Cached prompt tokens replicas reported (usage.prompt_tokens_details)",
            ["replica"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "kvroute_prompt_tokens", "Prompt tokens routed", ["replica"], registry=r
        )
        self.upstream_latency = Histogram(
            "kvroute_upstream_latency_seconds",
            "Request sent to response complete",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "kvroute_upstream_ttft_seconds",
            "Request sent to the first body byte",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.decision_time = Histogram(
            "kvroute_decision_seconds",
            "Time to tokenize, look up and rank",
            buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05, 0.25),
            registry=r,
        )
        self.tokenizer_checks = Counter(
            "kvroute_tokenizer_checks",
            "Live checks of the local tokenizer against a replica, by outcome",
            ["model", "outcome"],
            registry=r,
        )
        self.tokenizer_mismatches = Counter(
            "kvroute_tokenizer_mismatches",
            "Live checks whose router ids differed from the replica's",
            ["model"],
            registry=r,
        )
        # The endpoint picker (router/epp/): requests the gateway asked about, by outcome
        # (picked, or refused with an ImmediateResponse: EPP_OUTCOMES).
        self.epp_requests = Counter(
            "kvroute_epp_requests",
            "Endpoint-picker (ext_proc) requests by endpoint and outcome",
            ["endpoint", "outcome"],
            registry=r,
        )
        # Pre-bind the children used on every request (label lookup is not free).
        self._requests = {(e, o): self.requests.labels(e, o) for e in ENDPOINTS for o in OUTCOMES}
        self._latency = {e: self.upstream_latency.labels(e) for e in ENDPOINTS}
        self._ttft = {e: self.ttft.labels(e) for e in ENDPOINTS}
        if state is not None:
            r.register(_StateCollector(state))

    def request(self, endpoint: str, outcome: str) -> None:
        self._requests[endpoint, outcome].inc()

    def epp_request(self, endpoint: str, outcome: str) -> None:
        """An endpoint-picker request ended its request phase: ``outcome`` in EPP_OUTCOMES."""
        self.epp_requests.labels(endpoint, outcome).inc()

    def latency(self, endpoint: str, seconds: float) -> None:
        self._latency[endpoint].observe(seconds)

    def first_byte(self, endpoint: str, seconds: float) -> None:
        self._ttft[endpoint].observe(seconds)

    def cached_tokens(
        self, replica: str, prompt: int | None, predicted: int, delivered: int | None
    ) -> None:
        self.predicted.labels(replica).inc(predicted)
        if prompt:
            self.prompt_tokens.labels(replica).inc(prompt)
        if delivered is not None:
            self.delivered.labels(replica).inc(delivered)

    def tokenizer_check(self, model: str, outcome: str) -> None:
        """A live tokenizer check ended: ``clean``, ``mismatch`` or ``error``."""
        self.tokenizer_checks.labels(model, outcome).inc()
        if outcome == "mismatch":
            self.tokenizer_mismatches.labels(model).inc()

    def forget(self, replica: str) -> None:
        for metric in (self.predicted, self.delivered, self.prompt_tokens):
            try:
                metric.remove(replica)
            except KeyError:
                pass

    def render(self) -> bytes:
        return generate_latest(self.registry)
