"""Routing policies: rank the candidate replicas of one request, best first.

The ranking (not just a winner) is what the proxy walks when an attempt fails before the first
byte. ``kvroute`` is the default; the others exist for comparison and for fleets without KV
events. Reasons are a small fixed vocabulary (they are a Prometheus label).

One module per policy family: ``base.py`` (what a policy sees and returns), ``kvroute.py``
(the cost model), ``baselines.py`` (round robin, least loaded, session, approximate prefix).
This module is the registry (``POLICIES``) and ``make_policy``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvroute.router.routing.policies.base import (
    POLICY_REASONS,
    CostEstimate,
    Policy,
    Ranking,
    ReplicaView,
    RouteContext,
)
from kvroute.router.routing.policies.baselines import (
    ApproxPrefixPolicy,
    LeastLoadedPolicy,
    RoundRobinPolicy,
    SessionPolicy,
)
from kvroute.router.routing.policies.kvroute import KvroutePolicy

if TYPE_CHECKING:
    from kvroute.router.config import RouterSettings

__all__ = [
    "POLICIES",
    "POLICY_REASONS",
    "ApproxPrefixPolicy",
    "CostEstimate",
    "KvroutePolicy",
    "LeastLoadedPolicy",
    "Policy",
    "Ranking",
    "ReplicaView",
    "RoundRobinPolicy",
    "RouteContext",
    "SessionPolicy",
    "make_policy",
]

# Every policy, by the name --policy, the settings file and the benchmarks accept: the one
# list of them. The order is the routing benchmark's default run order (the baselines first).
POLICIES: dict[str, type[Policy]] = {
    cls.name: cls
    for cls in (
        RoundRobinPolicy,
        LeastLoadedPolicy,
        SessionPolicy,
        ApproxPrefixPolicy,
        KvroutePolicy,
    )
}


def make_policy(name: str, settings: RouterSettings) -> Policy:
    cls = POLICIES.get(name)
    if cls is None:
        raise ValueError(f"unknown policy {name!r}")
    return cls.from_settings(settings)
