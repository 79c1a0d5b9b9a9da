"""The storage-domain P/D transport's counters on vLLM's own metrics page.

``PdStats`` (connector/pd_store.py) lives in the scheduler process. vLLM carries a
connector's counters to its ``/metrics`` through its connector-stats path (vLLM >= 0.11,
``vllm/distributed/kv_transfer/kv_connector/v1/metrics.py``): the scheduler calls
``get_kv_connector_stats()`` on its connector after every step
(``Scheduler.update_from_output``), ships the object's ``to_dict()`` with the scheduler
stats, and the API server's Prometheus logger hands that dict to the connector class's
``build_prom_metrics()`` object (``observe``), once per engine. NixlConnector does the same
(``vllm:nixl_num_failed_transfers``, ``vllm:nixl_num_kv_expired_reqs``). Inside a
``MultiConnector`` each child's stats travel under its class name and reach its own
Prometheus object, so the counters are the same either way.

What each counter is (all ``vllm:kvroute_pd_*``, each a Prometheus counter, engine labelled):

* ``transfers``: decode requests that carried this transport's parameters;
* ``ready``: every named chunk was in the domain by the deadline (loaded);
* ``waited``: ... after at least one "not yet" (the prefill's writes were still landing);
* ``timeouts``: the deadline passed with chunks missing: a decode that could not pull
  (the missing chunks are recomputed);
* ``mismatches``: parameters of another domain, layout or prompt: recomputed;
* ``prefill_answers`` and ``named_chunks``: the prefill side's answers and the chunks named;
* ``wait_seconds``: the decode requests' time spent waiting, summed.

The router reads ``timeouts``, ``mismatches`` and NIXL's failure counters from each
replica's page (router/fleet/replicas.py ``PD_TRANSPORT_COUNTERS``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

__all__ = ["PD_COUNTERS", "KVRoutePdStats", "KVRoutePromMetrics"]

# (key in the stats dict, Prometheus name, help)
PD_COUNTERS: tuple[tuple[str, str, str], ...] = (
    (
        "transfers",
        "vllm:kvroute_pd_transfers",
        "Decode requests carrying storage-domain P/D transfer parameters",
    ),
    (
        "ready",
        "vllm:kvroute_pd_ready",
        "Storage-domain P/D decodes that found every named chunk by the deadline",
    ),
    (
        "waited",
        "vllm:kvroute_pd_waited",
        "Storage-domain P/D decodes that loaded their chunks after waiting for them",
    ),
    (
        "timeouts",
        "vllm:kvroute_pd_timeouts",
        "Storage-domain P/D decodes whose chunks were missing at the deadline (recomputed)",
    ),
    (
        "mismatches",
        "vllm:kvroute_pd_mismatches",
        "Storage-domain P/D parameters of another domain, layout or prompt (recomputed)",
    ),
    (
        "prefill_answers",
        "vllm:kvroute_pd_prefill_answers",
        "Prefill legs answered with storage-domain transfer parameters",
    ),
    (
        "named_chunks",
        "vllm:kvroute_pd_named_chunks",
        "Chunks the prefill answers named for their decodes",
    ),
    (
        "wait_s",
        "vllm:kvroute_pd_wait_seconds",
        "Seconds storage-domain P/D decodes waited for their prefill's chunks",
    ),
)


@dataclass
class KVRoutePdStats(KVConnectorStats):
    """The counters' increments since the last report (``data``: key -> increment)."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = {key: 0 for key, _, _ in PD_COUNTERS}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key, value in other.data.items():
            self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return {key: self.data.get(key, 0) for key, _, _ in PD_COUNTERS}

    def is_empty(self) -> bool:
        return not any(self.data.values())


class KVRoutePromMetrics(KVConnectorPromMetrics):
    """One Prometheus counter per ``PD_COUNTERS`` entry, a child per engine."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters: dict[str, dict[int, Any]] = {}
        for key, name, doc in PD_COUNTERS:
            metric = self._counter_cls(name=name, documentation=doc, labelnames=labelnames)
            self.counters[key] = {
                idx: metric.labels(*values) for idx, values in per_engine_labelvalues.items()
            }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, children in self.counters.items():
            value = transfer_stats_data.get(key, 0)
            if value and engine_idx in children:
                children[engine_idx].inc(value)
