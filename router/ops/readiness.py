"""``GET /ready``: whether this router should take traffic (a Kubernetes readiness probe).

``/health`` answers "can requests be forwarded at all" (some replica is healthy). A router
that has just started can forward, but its index is still empty or replaying: until every
healthy replica's KV event feed is in sync, its cache-aware choices are guesses, and during
a rolling update a new router pod would take traffic from an old one that routes well.
``/ready`` therefore also waits for the feeds.

A feed that never comes up (a replica started without ``--kv-events-config``, a firewall)
must not keep the router out of service forever: after ``ready_grace_s`` since the router
started, the feeds no longer count and the router routes by load where it has no index.
Replicas configured without an event feed are never waited for. A healthy replica is
always required: with none, the router can only answer 503.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvroute.indexer.subscriber import Freshness

if TYPE_CHECKING:  # the composition root imports this module
    from kvroute.router.service import RouterService

__all__ = ["FEEDING", "Readiness"]

# Feed states in which the index follows the replica: LIVE, and REBUILDING (history was lost
# with a restart or a slow-down; the feed is connected and live events are refilling it,
# which is as true as the index can get). The others wait for a connection or a replay.
FEEDING = frozenset({Freshness.LIVE, Freshness.REBUILDING})


class Readiness:
    """The ``/ready`` verdict for one router; ``start()`` begins the grace period."""

    def __init__(
        self,
        service: RouterService,
        grace_s: float,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.service = service
        self.grace_s = grace_s
        self.clock = clock
        self.started_at: float | None = None

    def start(self) -> None:
        self.started_at = self.clock()

    def _since_start(self) -> float:
        return 0.0 if self.started_at is None else self.clock() - self.started_at

    def check(self) -> tuple[bool, dict[str, Any]]:
        """(ready, the JSON body): which feeds are not live, and whether the grace is over."""
        service = self.service
        healthy = service.registry.healthy()
        waiting: dict[str, dict[str, str]] = {}
        for replica in healthy:
            if not replica.config.events:
                continue
            state, reason = service.subscriber.freshness(replica.name)
            if state not in FEEDING:
                waiting[replica.name] = {"freshness": str(state), "reason": reason}
        since = self._since_start()
        grace_over = since >= self.grace_s
        ready = bool(healthy) and (not waiting or grace_over)
        if not healthy:
            why = "no healthy replica"
        elif not waiting:
            why = "every healthy replica's event feed is live"
        elif grace_over:
            why = f"serving without the feeds below: the {self.grace_s:g} s grace has passed"
        else:
            why = "waiting for the event feeds below to be live"
        body = {
            "status": "ready" if ready else "not_ready",
            "reason": why,
            "healthy_replicas": len(healthy),
            "replicas": len(service.registry),
            "feeds_not_live": waiting,
            "seconds_since_start": round(since, 3),
            "grace_s": self.grace_s,
        }
        return ready, body
