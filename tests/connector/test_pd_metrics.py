"""The storage-domain P/D transport's counters on vLLM's metrics page
(connector/pd_metrics.py): the scheduler-side connector hands vLLM each step's increments,
vLLM's Prometheus logger adds them to ``vllm:kvroute_pd_*`` counters, and the router's
scrape reads the pull failures back (router/fleet/replicas.py)."""

from __future__ import annotations

import functools
from types import SimpleNamespace as types_namespace

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvroute.connector.keys import chunk_key
from kvroute.connector.kvroute_connector import KVRouteConnector
from kvroute.connector.pd_metrics import PD_COUNTERS, KVRoutePdStats
from kvroute.connector.pd_store import PARAMS_KEY, PdStats, PdWaits, StoreTransfer
from kvroute.router.fleet.replicas import parse_vllm_metrics


def _prom(registry: CollectorRegistry) -> object:
    """The connector class's Prometheus object, as vLLM's logger builds it (one engine),
    registered in ``registry`` rather than the process-wide one."""
    types = {cls: functools.partial(cls, registry=registry) for cls in (Counter, Gauge, Histogram)}
    config = types_namespace(kv_transfer_config=None)  # all the base class reads of it
    return KVRouteConnector.build_prom_metrics(
        config, types, ["model_name", "engine"], {0: ["tiny", "0"]}
    )


def test_increments_are_handed_over_once() -> None:
    stats = PdStats()
    assert stats.take_increments() is None
    stats.transfers, stats.ready, stats.timeouts, stats.wait_s_total = 3, 2, 1, 1.5
    first = stats.take_increments()
    assert first is not None
    assert (first["transfers"], first["ready"], first["timeouts"], first["wait_s"]) == (
        3,
        2,
        1,
        1.5,
    )
    assert stats.take_increments() is None  # nothing new since
    stats.timeouts += 2
    assert stats.take_increments() == {**dict.fromkeys(first, 0), "timeouts": 2}


def test_the_scheduler_side_connector_reports_its_waits_through_vllms_stats_path() -> None:
    """``get_kv_connector_stats`` (what vLLM's scheduler calls after each step): a decode
    that waited and loaded, one whose chunks never came (timeout), then nothing new."""
    clock = {"t": 0.0}
    present: set[bytes] = set()
    waits = PdWaits(
        domain="d",
        layout="L",
        chunk_tokens=16,
        blocks_per_chunk=1,
        wait_s=2.0,
        probe=lambda key: key in present,
        clock=lambda: clock["t"],
    )
    connector = object.__new__(KVRouteConnector)  # the scheduler side's state only
    connector._pd = waits
    assert connector.get_kv_connector_stats() is None

    hashes = [bytes([i]) * 8 for i in range(2)]
    key = chunk_key(hashes, 1, 0)
    params = {
        "do_remote_prefill": True,
        PARAMS_KEY: StoreTransfer("d", "L", 16, (key,)).as_params(),
    }
    assert waits.should_wait("a", params, hashes)  # not there yet
    clock["t"] = 0.5
    present.add(key)
    assert not waits.should_wait("a", params, hashes)  # loaded after waiting
    present.clear()
    assert waits.should_wait("b", params, hashes)
    clock["t"] = 3.0
    assert not waits.should_wait("b", params, hashes)  # deadline passed: recomputed

    got = connector.get_kv_connector_stats()
    assert isinstance(got, KVRoutePdStats)
    assert {k: got.data[k] for k in ("transfers", "ready", "waited", "timeouts")} == {
        "transfers": 2,
        "ready": 1,
        "waited": 1,
        "timeouts": 1,
    }
    assert got.data["wait_s"] == 0.5 + 2.5
    assert connector.get_kv_connector_stats() is None


def test_stats_aggregate_and_reduce_as_vllms_logger_uses_them() -> None:
    a = KVRouteConnector.build_kv_connector_stats({"transfers": 2, "timeouts": 1})
    b = KVRoutePdStats(data={"transfers": 1, "ready": 1})
    assert KVRouteConnector.build_kv_connector_stats(None).is_empty()
    merged = a.aggregate(b)
    assert merged.reduce()["transfers"] == 3 and merged.reduce()["timeouts"] == 1
    assert set(merged.reduce()) == {key for key, _, _ in PD_COUNTERS}
    assert not merged.is_empty()


def test_the_prometheus_counters_add_up_the_increments_and_the_router_reads_them() -> None:
    registry = CollectorRegistry()
    prom = _prom(registry)
    prom.observe({"transfers": 4, "ready": 3, "waited": 2, "timeouts": 1, "wait_s": 0.25})
    prom.observe({"transfers": 1, "mismatches": 1})
    prom.observe({"transfers": 1}, engine_idx=7)  # an engine this page does not serve
    labels = {"model_name": "tiny", "engine": "0"}

    def value(name: str) -> float | None:
        return registry.get_sample_value(f"{name}_total", labels)

    assert value("vllm:kvroute_pd_transfers") == 5
    assert value("vllm:kvroute_pd_ready") == 3
    assert value("vllm:kvroute_pd_waited") == 2
    assert value("vllm:kvroute_pd_timeouts") == 1
    assert value("vllm:kvroute_pd_mismatches") == 1
    assert value("vllm:kvroute_pd_wait_seconds") == 0.25
    # The page as vLLM serves it, parsed by the router's scrape.
    scraped = parse_vllm_metrics(generate_latest(registry).decode())
    assert scraped["storage_transfers"] == 5
    assert scraped["storage_waited"] == 2
    assert scraped["storage_timeouts"] == 1
    assert scraped["storage_mismatches"] == 1


def test_vllms_own_prometheus_and_log_paths_take_the_connector_by_its_module_path() -> None:
    """What vLLM's API server builds at start (``KVConnectorProm``: a crash there would stop
    every replica running the connector) and feeds each scheduler-stats dict, and its
    periodic "KV Transfer metrics" log line (``KVConnectorLogging``)."""
    from prometheus_client import REGISTRY
    from vllm.config import KVTransferConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorLogging,
        KVConnectorProm,
    )

    transfer = KVTransferConfig(
        kv_connector="KVRouteConnector",
        kv_connector_module_path="kvroute.connector.kvroute_connector",
        kv_role="kv_both",
    )
    prom = KVConnectorProm(
        VllmConfig(kv_transfer_config=transfer), ["model_name", "engine"], {0: ["tiny", "0"]}
    )
    try:
        prom.observe({"transfers": 2, "timeouts": 1}, 0)
        labels = {"model_name": "tiny", "engine": "0"}
        assert REGISTRY.get_sample_value("vllm:kvroute_pd_transfers_total", labels) == 2
        assert REGISTRY.get_sample_value("vllm:kvroute_pd_timeouts_total", labels) == 1
        logging = KVConnectorLogging(transfer)
        logging.observe({"transfers": 2, "timeouts": 1})
        logging.observe({"transfers": 1})
        lines: list[str] = []
        logging.log(lambda fmt, text: lines.append(fmt % text))
        assert lines and "transfers=3" in lines[0] and "timeouts=1" in lines[0]
    finally:  # the process-wide registry: leave it as it was
        for _, name, _ in PD_COUNTERS:
            collector = REGISTRY._names_to_collectors.get(name)
            if collector is not None:
                REGISTRY.unregister(collector)
