"""The policies kvroute is compared with, and the ones for fleets without KV events: round robin,
least loaded, session affinity, and an approximate prefix tree of where text was sent.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

from kvroute.router.routing.placement import rendezvous
from kvroute.router.routing.policies.base import Policy, Ranking, RouteContext

if TYPE_CHECKING:  # router/config.py imports the policies when it validates a name
    from kvroute.router.config import RouterSettings

__all__ = ["ApproxPrefixPolicy", "LeastLoadedPolicy", "RoundRobinPolicy", "SessionPolicy"]


class RoundRobinPolicy(Policy):
    name = "round_robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def rank(self, ctx: RouteContext) -> Ranking:
        views = sorted(ctx.views, key=lambda v: v.name)
        start = next(self._counter) % len(views)
        return Ranking(views[start:] + views[:start], "round_robin")


class LeastLoadedPolicy(Policy):
    name = "least_loaded"

    def rank(self, ctx: RouteContext) -> Ranking:
        return Ranking(self._by_load(ctx, ctx.views), "load")


class SessionPolicy(Policy):
    """Sticky by session id (consistent hash: survives replicas coming and going)."""

    name = "session"

    def rank(self, ctx: RouteContext) -> Ranking:
        if not ctx.session_id:
            return Ranking(self._by_load(ctx, ctx.views), "session_new")
        key = ctx.session_id.encode()
        return Ranking(sorted(ctx.views, key=lambda v: -rendezvous(key, v.name)), "session")


class ApproxPrefixPolicy(Policy):
    """SGLang gateway's rule: balance when load is skewed, else follow the best match above a
    threshold, else the least loaded (``approx_tokens`` comes from RoutingHistory)."""

    name = "approx_prefix"
    needs_tokens = True
    uses_routing_history = True

    def __init__(self, match_threshold: float, balance_abs: int, balance_rel: float) -> None:
        self.match_threshold = match_threshold
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel

    @classmethod
    def from_settings(cls, settings: RouterSettings) -> Policy:
        return cls(
            settings.approx_match_threshold,
            settings.approx_balance_abs,
            settings.approx_balance_rel,
        )

    def rank(self, ctx: RouteContext) -> Ranking:
        by_load = self._by_load(ctx, ctx.views)
        lo, hi = by_load[0].pending, by_load[-1].pending
        if hi - lo > self.balance_abs and hi > self.balance_rel * lo:
            return Ranking(by_load, "approx_balance")
        prompt = max(1, ctx.prompt_tokens or 0)
        best = max(ctx.views, key=lambda v: (v.approx_tokens, -v.pending))
        if best.approx_tokens / prompt >= self.match_threshold:
            return Ranking([best] + [v for v in by_load if v is not best], "approx_match")
        return Ranking(by_load, "approx_load")
