"""Active health checks: eject a replica that stops answering, return it when it answers again.

Every ``interval_s`` each replica gets ``GET /health`` and ``GET /metrics`` (the load gauges),
and ``GET /v1/models`` when its model list is older than ``models_refresh_s``. A replica is
routable only once its models are known, so a request is never sent to a replica that does
not serve its model. Passive failures (refused connections while proxying) are reported to
the same registry by the proxy, so a dead replica is ejected before the next check.

The ranks of a data-parallel server (router/fleet/dp.py) are checked as one: one ``/health``, one
``/v1/models`` and one metrics page per server, whose verdict every rank shares and whose
``engine``-labelled gauges each rank takes its own part of (``replicas.engine_gauges``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import httpx

from kvroute.router.common.periodic import PeriodicTask
from kvroute.router.fleet.replicas import (
    KV_BLOCKS,
    PD_TRANSPORT_COUNTERS,
    SPEC_DECODE_COUNTER,
    Replica,
    ReplicaRegistry,
    engine_gauges,
    parse_vllm_metrics_by_engine,
)

__all__ = ["HealthChecker"]

log = logging.getLogger(__name__)


class ReplicaRefusedKey(RuntimeError):
    """The replica answered 401/403: it wants an API key the router does not send right."""


def _check_status(resp: httpx.Response, path: str) -> None:
    if resp.status_code in (401, 403):
        raise ReplicaRefusedKey(
            f"the replica refused the router's API key (HTTP {resp.status_code} on {path}): "
            "check --replica-api-key"
        )


class HealthChecker:
    def __init__(
        self,
        registry: ReplicaRegistry,
        client: httpx.AsyncClient,
        *,
        interval_s: float = 2.0,
        timeout_s: float = 2.0,
        models_refresh_s: float = 30.0,
        on_counters: Callable[[Replica, dict[str, float]], None] | None = None,
    ) -> None:
        self.registry = registry
        # Each scrape's figures (gauges and counters) for whom learns from them: the cost
        # model's calibration (router/routing/prefill_evidence.py).
        self.on_counters = on_counters
        self.client = client
        self.interval_s = interval_s
        self.timeout = httpx.Timeout(timeout_s)
        self.models_refresh_s = models_refresh_s
        self._periodic = PeriodicTask("kvroute-health", interval_s, self.check_all)

    async def check(self, replica: Replica) -> bool:
        """Check the replica's server (with every rank of it, for a data-parallel one)."""
        return await self.check_group(self.registry.group(replica.group) or [replica])

    async def check_group(self, members: list[Replica]) -> bool:
        """One server's check, applied to each of its targets (they share its URL)."""
        lead = members[0]
        was_healthy = [m.healthy for m in members]
        try:
            resp = await self.client.get(f"{lead.url}/health", timeout=self.timeout)
            _check_status(resp, "/health")
            if resp.status_code != 200:
                raise RuntimeError(f"/health answered {resp.status_code}")
            now = time.monotonic()
            if any(
                m.models_at is None or now - m.models_at > self.models_refresh_s for m in members
            ):
                resp = await self.client.get(f"{lead.url}/v1/models", timeout=self.timeout)
                _check_status(resp, "/v1/models")
                resp.raise_for_status()
                data = resp.json().get("data")
                if not isinstance(data, list):
                    raise RuntimeError("/v1/models has no data list")
                models = {c["id"]: c for c in data if isinstance(c, dict) and "id" in c}
                for m in members:
                    m.models = dict(models)
                    m.models_at = now
            await self._scrape(members)
        except (httpx.HTTPError, RuntimeError, ValueError, KeyError) as exc:
            for m, was in zip(members, was_healthy, strict=True):
                reason = f"health check: {exc}" if isinstance(exc, ReplicaRefusedKey) else None
                first_refusal = reason is not None and m.last_error != reason
                self.registry.record_failure(m, reason or f"health check: {exc!r}")
                if was and not m.healthy:
                    log.warning("replica %s ejected: %s", m.name, m.last_error)
                elif first_refusal:
                    log.warning("replica %s is not usable: %s", m.name, m.last_error)
            return False
        for m, was in zip(members, was_healthy, strict=True):
            self.registry.record_success(m)
            if not was and m.healthy:
                log.info("replica %s is healthy", m.name)
        return True

    async def _scrape(self, members: list[Replica]) -> None:
        """Load gauges; a replica without /metrics is still healthy (router counts only)."""
        sent = time.monotonic()
        try:
            resp = await self.client.get(f"{members[0].url}/metrics", timeout=self.timeout)
        except httpx.HTTPError:
            return
        if resp.status_code != 200:
            return
        by_engine = parse_vllm_metrics_by_engine(resp.text)
        for m in members:
            gauges = engine_gauges(by_engine, m.config.dp_rank, len(members))
            m.set_gauges(
                gauges.get("running", 0.0),
                gauges.get("waiting", 0.0),
                gauges.get("kv_usage", 0.0),
                gauges.get(KV_BLOCKS),
                sent,
            )
            m.pd_transport = {k: gauges[k] for k in PD_TRANSPORT_COUNTERS if k in gauges}
            self._note_drafts(m, SPEC_DECODE_COUNTER in gauges)
            if self.on_counters is not None:
                self.on_counters(m, gauges)

    @staticmethod
    def _note_drafts(m: Replica, drafting: bool) -> None:
        """Speculative decoding on a replica whose method the router was not given: warn once
        (its metrics cannot tell an EAGLE-style method, whose hits vLLM cuts a block short,
        from ngram, whose it does not)."""
        unknown = drafting and m.config.speculative is None
        if unknown and not m.drafts_unknown:
            log.warning(
                "replica %s runs speculative decoding (vllm:spec_decode_num_drafts) but its "
                "method is not configured: with eagle, eagle3, mtp, dflash or dspark vLLM drops "
                "a block of every prefix-cache hit; set speculative=METHOD on the replica",
                m.name,
            )
        m.drafts_unknown = unknown

    async def check_all(self) -> None:
        groups: dict[str, list[Replica]] = {}
        for r in self.registry:
            groups.setdefault(r.group, []).append(r)
        if groups:
            await asyncio.gather(*(self.check_group(members) for members in groups.values()))

    def start(self) -> None:
        self._periodic.start()

    async def stop(self) -> None:
        await self._periodic.stop()
