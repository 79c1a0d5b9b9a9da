"""Active health checks: eject a replica that stops answering, return it when it answers again.

Every ``interval_s`` each replica gets ``GET /health`` and ``GET /metrics`` (the load gauges),
and ``GET /v1/models`` when its model list is older than ``models_refresh_s``. A replica is
routable only once its models are known, so a request is never sent to a replica that does
not serve its model. Passive failures (refused connections while proxying) are reported to
the same registry by the proxy, so a dead replica is ejected before the next check.
"""

from __future__ import annotations

import asyncio
import logging
import time

import httpx

from router.periodic import PeriodicTask
from router.replicas import Replica, ReplicaRegistry, parse_vllm_metrics

__all__ = ["HealthChecker"]

log = logging.getLogger(__name__)


class HealthChecker:
    def __init__(
        self,
        registry: ReplicaRegistry,
        client: httpx.AsyncClient,
        *,
        interval_s: float = 2.0,
        timeout_s: float = 2.0,
        models_refresh_s: float = 30.0,
    ) -> None:
        self.registry = registry
        self.client = client
        self.interval_s = interval_s
        self.timeout = httpx.Timeout(timeout_s)
        self.models_refresh_s = models_refresh_s
        self._periodic = PeriodicTask("kvroute-health", interval_s, self.check_all)

    async def check(self, replica: Replica) -> bool:
        was_healthy = replica.healthy
        try:
            resp = await self.client.get(f"{replica.url}/health", timeout=self.timeout)
            if resp.status_code != 200:
                raise RuntimeError(f"/health answered {resp.status_code}")
            now = time.monotonic()
            if replica.models_at is None or now - replica.models_at > self.models_refresh_s:
                resp = await self.client.get(f"{replica.url}/v1/models", timeout=self.timeout)
                resp.raise_for_status()
                data = resp.json().get("data")
                if not isinstance(data, list):
                    raise RuntimeError("/v1/models has no data list")
                replica.models = {c["id"]: c for c in data if isinstance(c, dict) and "id" in c}
                replica.models_at = now
            await self._scrape(replica)
        except (httpx.HTTPError, RuntimeError, ValueError, KeyError) as exc:
            self.registry.record_failure(replica, f"health check: {exc!r}")
            if was_healthy and not replica.healthy:
                log.warning("replica %s ejected: %s", replica.name, replica.last_error)
            return False
        self.registry.record_success(replica)
        if not was_healthy and replica.healthy:
            log.info("replica %s is healthy", replica.name)
        return True

    async def _scrape(self, replica: Replica) -> None:
        """Load gauges; a replica without /metrics is still healthy (router counts only)."""
        try:
            resp = await self.client.get(f"{replica.url}/metrics", timeout=self.timeout)
        except httpx.HTTPError:
            return
        if resp.status_code != 200:
            return
        gauges = parse_vllm_metrics(resp.text)
        replica.set_gauges(
            gauges.get("running", 0.0), gauges.get("waiting", 0.0), gauges.get("kv_usage", 0.0)
        )

    async def check_all(self) -> None:
        replicas = list(self.registry)
        if replicas:
            await asyncio.gather(*(self.check(r) for r in replicas))

    def start(self) -> None:
        self._periodic.start()

    async def stop(self) -> None:
        await self._periodic.stop()
