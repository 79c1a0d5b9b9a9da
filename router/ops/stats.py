"""The router's state as numbers: what ``GET /index/stats`` answers (the index's figures per
replica and fleet, joined with each replica's health, load, freshness and accuracy) and what
the Prometheus collector reads at each scrape. Read-only views over a running
``RouterService``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvroute.indexer.stats import collect_stats
from kvroute.router.fleet.replicas import PD_PULL_FAILURES

if TYPE_CHECKING:
    from kvroute.router.service import RouterService

__all__ = ["metrics_state", "pd_pools", "pull_failures", "router_stats"]


def metrics_state(service: RouterService) -> dict[str, Any]:
    """Per replica health, load, freshness and index entries, read at each scrape."""
    entries = {s.replica: s.entries_by_tier for s in service.index.summary()}
    throttled: dict[str, int] = {}
    lost: dict[str, int] = {}
    for (replica, _), stats in service.subscriber.all_feed_stats().items():
        throttled[replica] = throttled.get(replica, 0) + stats.throttled_bytes
        lost[replica] = lost.get(replica, 0) + stats.lost_batches
    replicas = {}
    unstored, default_size = service.router.unstored, service.settings.default_block_size
    for r in service.registry:
        fresh = None
        if r.config.events:
            fresh = str(service.subscriber.freshness(r.name)[0])
        replicas[r.name] = {
            "healthy": r.healthy,
            "in_flight": r.in_flight,
            "pending": r.pending,
            "freshness": fresh,
            "entries_by_tier": entries.get(r.name),
            "throttled_bytes": throttled.get(r.name, 0),
            "lost_batches": lost.get(r.name, 0),
            # Prefill sent (by this router and its peers) that the feed has not announced
            # stored: the queued work an autoscaler reads (docs/router.md, "Saturation").
            "queued_prefill_tokens": (unstored.blocks(r.name) + r.peer_unstored_blocks)
            * (service.index.block_size(r.name) or default_size),
            "pd_transport": dict(r.pd_transport),
        }
    check = getattr(service.tokenizer, "check", None)
    return {
        "replicas": replicas,
        "tokenizer_modes": {m: st.mode for m, st in check.models.items()} if check else {},
        "index_bytes": service.index.stats().estimated_bytes,
        "hint_keys": len(service.router.hints),
        "pd": {
            **service.disagg.counters.to_dict(),
            "pools": pd_pools(service),
            "pull_failures": pull_failures(service),
        },
    }


def router_stats(service: RouterService) -> dict[str, Any]:
    """``GET /index/stats``: the fleet, each replica, the domains and the router's parts."""
    index = collect_stats(service.index, service.subscriber).to_dict()
    service.router.sample_stored_blocks()
    accuracy = service.accuracy.to_dict()
    replicas: dict[str, Any] = {}
    for r in service.registry:
        entry = dict(
            index["replicas"].get(r.name)
            or {"block_size": None, "entries": 0, "entries_by_tier": {}, "feed": None}
        )
        if r.config.events:
            state, reason = service.subscriber.freshness(r.name)
            entry["freshness"], entry["freshness_reason"] = str(state), reason
        else:
            entry["freshness"], entry["freshness_reason"] = None, "no event feed configured"
        acc = service.accuracy.replica(r.name)
        entry["storage_domain"] = r.config.storage_domain
        entry["role"], entry["zone"] = r.role, r.config.zone
        # its P/D transport's counters from its metrics page (NIXL's, the storage domain's)
        entry["pd_transport"] = dict(r.pd_transport) or None
        entry["health"] = r.snapshot()
        entry["load"] = {
            "in_flight": r.in_flight,
            "peer_in_flight": r.peer_in_flight,
            # Blocks sent to it to compute, not announced yet: new prefixes are
            # balanced on them (router/routing/placement.py).
            "unstored_blocks": service.router.unstored.blocks(r.name),
            "peer_unstored_blocks": r.peer_unstored_blocks,
            "running": r.running,
            "waiting": r.waiting,
            "kv_cache_usage": r.kv_usage,
            # its device cache's size (vLLM's cache-config gauge), and what this router's
            # requests hold there and its decode pace (router/routing/kv_room.py)
            "kv_cache_blocks": r.kv_blocks,
            "peer_kv_held_blocks": r.peer_kv_held,
            "kv_room": None
            if service.router.kv_room is None
            else service.router.kv_room.snapshot(r.name),
            "pending": r.pending,
            "queue_s_per_request": None
            if service.router.queue_delay is None
            else round(service.router.queue_delay.per_request_s(r.name), 6),
        }
        entry["cost_rates"] = _rates(service, r.name)
        entry["accuracy"] = acc
        entry["predicted_cached_tokens"] = acc["predicted_cached_tokens"]
        entry["delivered_cached_tokens"] = acc["delivered_cached_tokens"]
        replicas[r.name] = entry
    fleet = index["fleet"]
    fleet["healthy_replicas"] = len(service.registry.healthy())
    fleet["in_flight"] = sum(r.in_flight for r in service.registry)
    fleet["accuracy"] = accuracy["fleet"]
    fleet["predicted_cached_tokens"] = accuracy["fleet"]["predicted_cached_tokens"]
    fleet["delivered_cached_tokens"] = accuracy["fleet"]["delivered_cached_tokens"]
    return {
        "taken_at": index["taken_at"],
        "policy": service.settings.policy,
        "fleet": fleet,
        "replicas": replicas,
        "storage_domains": index["storage_domains"],
        "burst_hints": len(service.router.hints),
        "routing_history": len(service.router.history),
        "tokenizer": None if service.tokenizer is None else service.tokenizer.stats(),
        "tokenizer_check": service.tokenizer_check,
        "replicas_file": None if service.watcher is None else service.watcher.status(),
        "start": service.warm.to_dict(service.subscriber.warm_outcomes()),
        "discovery": None if service.discovery is None else service.discovery.status(),
        "peer_load": service.peer_load.to_dict() if service.peer_load_on else None,
        "lmcache_controller": _lmcache(service),
        "cost_rates_outliers": None
        if service.router.rates is None
        else service.router.rates.outliers,
        # samples from the replicas' own prefill counters (router/routing/prefill_evidence.py)
        "cost_rates_from_counters": None
        if service.router.rates is None
        else service.router.prefill_evidence.samples,
        "disaggregation": _disaggregation(service),
        "admission": service.admission.stats(),
        "queue_samples": None
        if service.router.queue_delay is None
        else {
            "taken": service.router.queue_delay.next_sample,
            # queue and rate samples alike (both are numbered in one log)
            "from_peers": service.router.queue_delay.shared_applied
            + (0 if service.router.rates is None else service.router.rates.shared_applied),
            # new prefixes' homes, numbered in the same log (router/routing/router.py)
            "homes_from_peers": service.router.homes_from_peers,
        },
    }


def pd_pools(service: RouterService) -> dict[str, dict[str, Any]]:
    """Each role's pool (prefill, decode, both) with its load."""
    pools: dict[str, dict[str, Any]] = {}
    for r in service.registry:
        pool = pools.setdefault(
            r.role, {"replicas": 0, "healthy": 0, "in_flight": 0, "pending": 0.0}
        )
        pool["replicas"] += 1
        pool["healthy"] += r.healthy
        pool["in_flight"] += r.in_flight
        pool["pending"] = round(pool["pending"] + r.pending, 3)
    return pools


def pull_failures(service: RouterService) -> int:
    """Decodes that could not pull their prefill's KV, as the replicas count them."""
    return int(sum(r.pd_transport.get(k, 0.0) for r in service.registry for k in PD_PULL_FAILURES))


def _disaggregation(service: RouterService) -> dict[str, Any]:
    """Prefill/decode disaggregation (router/routing/disagg.py): the pools with their load,
    the decider's choices and every failure kind, the router's and the replicas' own: a
    decode that could not pull its prefill's KV (``pull_failures``: NIXL's failed
    transfers, the storage domain's timeouts and mismatches; the decode recomputed) and
    prefills whose held blocks expired unread (``expired_leases``)."""
    replicas = list(service.registry)
    return {
        "mode": service.settings.disagg.mode,
        "pools": pd_pools(service),
        **service.disagg.counters.to_dict(),
        "pull_failures": pull_failures(service),
        "expired_leases": int(
            sum(r.pd_transport.get("nixl_expired_leases", 0.0) for r in replicas)
        ),
    }


def _lmcache(service: RouterService) -> dict[str, Any] | None:
    """LMCache's controller as the router asks it (router/routing/lmcache.py)."""
    c = service.router.lmcache
    if c is None:
        return None
    return {
        "url": c.url,
        "lookups": c.lookups,
        "failures": c.failures,
        "last_error": c.last_error,
        "last_latency_s": c.last_latency_s,
    }


def _rates(service: RouterService, name: str) -> dict[str, Any]:
    """The prefill and load rates the cost model prices the replica with, learned or the
    configured ones (``learned`` False), and the samples behind them."""
    rates = service.router.rates
    if rates is None:
        c = service.settings.cost
        return {
            "learned": False,
            "prefill_s_per_token": c.prefill_s_per_token,
            "load_s_per_token_cpu": c.load_s_per_token_cpu,
            "load_s_per_token_storage": c.load_s_per_token_storage,
            "samples": 0,
        }
    r = rates.rates(name)
    return {
        "learned": True,
        "prefill_s_per_token": float(f"{r.prefill_s_per_token:.4g}"),
        "load_s_per_token_cpu": float(f"{r.load_s_per_token_cpu:.4g}"),
        "load_s_per_token_storage": float(f"{r.load_s_per_token_storage:.4g}"),
        "overhead_s": round(r.overhead_s, 6),
        "samples": r.samples,
    }
