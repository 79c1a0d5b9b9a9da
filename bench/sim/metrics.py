"""A simulated replica's /metrics, under vLLM's metric names and labels.

The router reads load (running, waiting, KV usage) and hit counters from here exactly as from
vLLM, so the names, types and ``model_name``/``engine`` labels follow vLLM 0.32. Gauges and
counters are read from the engine at scrape time (a custom collector); the latency histograms
are observed as requests progress. Latencies are in simulated seconds.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from kvroute.bench.sim.scheduler import Scheduler
from kvroute.indexer.wire import Medium

__all__ = ["ReplicaMetrics"]

# vLLM does not export the *_created series; neither does a replica of the simulated fleet.
disable_created_metrics()

_TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
_E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)


class _EngineCollector(Collector):
    def __init__(self, scheduler: Scheduler, labels: dict[str, str]) -> None:
        self._scheduler = scheduler
        self._names = list(labels)
        self._values = list(labels.values())

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=self._names)
        g.add_metric(self._values, value)
        return g

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(name, doc, labels=self._names)
        c.add_metric(self._values, value)
        return c

    def collect(self) -> Iterator[Metric]:
        s = self._scheduler
        st = s.stats
        yield self._gauge(
            "vllm:num_requests_running", "Requests in model execution batches.", s.num_running
        )
        yield self._gauge(
            "vllm:num_requests_waiting", "Requests waiting to be processed.", s.num_waiting
        )
        # vLLM's info gauge of its CacheConfig: the fields are labels, the value always 1
        # (vllm/v1/metrics/loggers.py, log_metrics_info); the cache's size is num_gpu_blocks.
        cache = s.cache
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=["block_size", "num_gpu_blocks", "num_cpu_blocks", *self._names],
        )
        info.add_metric(
            [str(cache.block_size), str(cache.capacity[Medium.GPU]), "None", *self._values], 1.0
        )
        yield info
        yield self._gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            s.cache.usage(),
        )
        yield self._counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in tokens.", st.prefix_queries
        )
        yield self._counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in tokens.", st.prefix_hits
        )
        yield self._counter(
            "vllm:external_prefix_cache_queries",
            "External prefix cache queries, in tokens.",
            st.prefix_queries,
        )
        yield self._counter(
            "vllm:external_prefix_cache_hits",
            "External prefix cache hits, in tokens.",
            st.external_hits,
        )
        yield self._counter("vllm:prompt_tokens", "Prefill tokens processed.", st.prompt_tokens)
        yield self._counter(
            "vllm:generation_tokens", "Generation tokens processed.", st.generation_tokens
        )
        # vLLM 0.32's two per-source counters (v1/metrics/loggers.py): every prompt token by
        # where it came from, and cached ones by the tier that supplied them
        # (v1/metrics/cache_hit_source.py's CacheHitSource values).
        by_source = CounterMetricFamily(
            "vllm:prompt_tokens_by_source",
            "Number of prompt tokens by source.",
            labels=[*self._names, "source"],
        )
        by_source.add_metric([*self._values, "local_compute"], st.computed_tokens)
        by_source.add_metric([*self._values, "local_cache_hit"], st.prefix_hits)
        by_source.add_metric(
            [*self._values, "external_kv_transfer"], st.external_hits + st.p2p_hits
        )
        yield by_source
        cached = CounterMetricFamily(
            "vllm:prompt_tokens_cached_by_source",
            "Prefix-cache hit tokens by the cache tier that supplied them.",
            labels=[*self._names, "source"],
        )
        for source, value in (
            ("device", st.prefix_hits),
            ("host", st.host_hits),
            ("disk", st.disk_hits),
            ("p2p", st.p2p_hits),
            ("external_unspecified", 0),
        ):
            cached.add_metric([*self._values, source], value)
        yield cached
        # Its sum and count only (one +Inf bucket): the router reads nothing else of it.
        prefill = HistogramMetricFamily(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            labels=self._names,
        )
        prefill.add_metric(self._values, [("+Inf", st.prefills)], st.prefill_time_s)
        yield prefill
        success = CounterMetricFamily(
            "vllm:request_success",
            "Successfully processed requests.",
            labels=[*self._names, "finished_reason"],
        )
        success.add_metric([*self._values, "length"], st.requests_finished)
        yield success
        # NixlConnector's (vllm/distributed/kv_transfer/kv_connector/v1/nixl/stats.py)
        yield self._counter(
            "vllm:nixl_num_failed_transfers",
            "Number of failed NIXL KV Cache transfers, including handshake and notification "
            "failures.",
            st.nixl_failed_transfers,
        )
        yield self._counter(
            "vllm:nixl_num_kv_expired_reqs",
            "Number of requests that had their KV expire.",
            st.nixl_expired_reqs,
        )


class ReplicaMetrics:
    """The registry of one replica (each replica has its own; many share a process)."""

    def __init__(self, scheduler: Scheduler, model_name: str, engine: str = "0") -> None:
        labels = {"engine": engine, "model_name": model_name}
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_EngineCollector(scheduler, labels))
        self._ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            labelnames=list(labels),
            buckets=_TTFT_BUCKETS,
            registry=self.registry,
        ).labels(**labels)
        self._e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            labelnames=list(labels),
            buckets=_E2E_BUCKETS,
            registry=self.registry,
        ).labels(**labels)

    def observe_ttft(self, seconds: float) -> None:
        self._ttft.observe(seconds)

    def observe_e2e(self, seconds: float) -> None:
        self._e2e.observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
