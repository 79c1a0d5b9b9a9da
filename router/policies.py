"""Routing policies: rank the candidate replicas of one request, best first.

The ranking (not just a winner) is what the proxy walks when an attempt fails before the first
byte. ``kvroute`` is the default; the others exist for comparison and for fleets without KV
events. Reasons are a small fixed vocabulary (they are a Prometheus label).

kvroute cost, in seconds (est. time to first token; see docs/router.md):
    est_ttft = queue_delay + prefill_s_per_token * uncached
               + load_s_per_token_cpu * cpu_tokens + load_s_per_token_storage * storage_tokens
    queue_delay = q * pending * (1 + pending / queue_knee)
                  + waiting_s_per_request * waiting
                  + kv_pressure_s * max(0, kv_usage - kv_pressure_start) / (1 - kv_pressure_start)
``q`` is the replica's learned seconds per pending request (router/queue_model.py), or
``queue_s_per_request`` when learning is off. The queue term is superlinear in ``pending`` so
that the benefit of a cached prefix (linear in its length) is always overtaken by a growing
queue: a hot prefix spills to other replicas instead of piling onto one.
Matches of replicas whose event feed is not live are discounted by
``freshness_weight``, tiers whose publisher never announces removals (LMCache, llm-d's FS
backend: ``*_UNCONFIRMED``) by ``unconfirmed_weight`` as well; burst hints count as GPU blocks
at full weight.

Choice (bounded-load affinity): a request whose prefix has a *home* (``RouteContext.home``:
the replica it was first placed on) goes there when the home is a near-equal of the cheapest
replica: as little work for this request (a cache hit is never given up for a home) and a
cost within ``(1 + home_slack)`` x the cheapest. When the working set outgrows the caches and
a prefix is evicted everywhere, it is sent back home instead of to whichever replica is least
loaded at that moment, so each replica's cache keeps its share of the working set rather than
a random sample of all of it. A home too busy for the bound, and a hot prefix that must
spill, go to the first near-equal in the rendezvous order of ``RouteContext.affinity``, the
same second choice each time. A new prefix (no home, no cache) is placed by bounded-load
rendezvous over the near-equals, balanced by the blocks each replica stored lately
(router/placement.py): a function of the prefix and of what every router sees alike, so
several routers put it on the same replica.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvroute.indexer.tiers import Tier
from kvroute.router.placement import pick_new, rendezvous

if TYPE_CHECKING:  # router/config.py validates policy names against POLICIES (no cycle)
    from kvroute.router.config import CostSettings, RouterSettings

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

POLICY_REASONS = (
    "prefix",  # the chosen replica's cached prefix made it the cheapest
    "hint",  # chosen for a burst hint (siblings before events arrive)
    "spill",  # a replica with a longer match was skipped for its queue
    "load",  # no usable match, no home yet: a new prefix, placed within the load bound
    "home",  # no usable match anywhere: back to its home (or its second choice)
    "round_robin",
    "session",
    "session_new",
    "approx_match",
    "approx_balance",
    "approx_load",
)


@dataclass(slots=True)
class CostEstimate:
    """kvroute's estimate for one candidate, in seconds (the formula: the module docstring).
    ``est_ttft_s`` is queue + compute + load; ``cost_s``, what kvroute ranks by, adds
    ``delay_to_others_s``. Both are stored, not derived: rank() reads them many times."""

    queue_s: float
    compute_s: float
    load_s: float
    est_ttft_s: float
    delay_to_others_s: float  # what its uncached prefill costs the queue it joins
    cost_s: float


@dataclass(slots=True)
class ReplicaView:
    """One candidate as a policy sees it; also what /debug/route shows (with the estimate
    the policy returned for it, once the router ``record``s it)."""

    name: str
    pending: float = 0.0
    in_flight: int = 0
    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    block_size: int | None = None
    freshness: str | None = None
    freshness_reason: str | None = None
    # The shared storage it is attached to: its STORAGE tokens are the domain's, believed by
    # the freshness of the domain's evictor feed (None: no feed, nothing evicts unseen).
    storage_domain: str | None = None
    storage_domain_freshness: str | None = None
    match_tokens: int = 0  # from the index, capped by vLLM's last-token rule
    tokens_by_tier: dict[str, int] = field(default_factory=dict)
    hint_tokens: int = 0
    approx_tokens: int = 0
    predicted_cached_tokens: int = 0
    queue_s_per_request: float | None = None  # learned; None: the configured constant
    stored_rate: float = 0.0  # blocks it stored lately, per second, from its event feed
    est_ttft_s: float | None = None
    delay_to_others_s: float | None = None  # what its uncached prefill costs the queue it joins
    cost_s: float | None = None  # what kvroute ranks by: est_ttft_s + delay_to_others_s
    queue_s: float | None = None
    compute_s: float | None = None
    load_s: float | None = None

    def record(self, estimate: CostEstimate) -> None:
        """Keep the estimate a policy returned for this candidate, for the decision's record
        (/debug/route, the decision log) and the queue model's observation."""
        self.est_ttft_s = estimate.est_ttft_s
        self.delay_to_others_s = estimate.delay_to_others_s
        self.cost_s = estimate.cost_s
        self.queue_s = estimate.queue_s
        self.compute_s = estimate.compute_s
        self.load_s = estimate.load_s

    def to_dict(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in self.__slots__}
        for key in (
            "queue_s_per_request",
            "stored_rate",
            "est_ttft_s",
            "delay_to_others_s",
            "cost_s",
            "queue_s",
            "compute_s",
            "load_s",
        ):
            if out[key] is not None:
                out[key] = round(out[key], 6)
        return out


@dataclass(slots=True)
class RouteContext:
    views: list[ReplicaView]
    prompt_tokens: int | None
    affinity: bytes  # what the consistent hash keys on (kvroute.router.routing.home_affinity)
    session_id: str | None = None
    home: str | None = None  # the replica this prefix was first placed on, if remembered


@dataclass(slots=True)
class Ranking:
    """What a policy returns: the candidates best first, the reason for the first, and its
    cost estimate of each candidate by name (empty for policies that do not estimate). The
    views it was given are left as they were."""

    views: list[ReplicaView]
    reason: str
    estimates: dict[str, CostEstimate] = field(default_factory=dict)

    @property
    def first(self) -> ReplicaView:
        return self.views[0]


# The keys of ReplicaView.tokens_by_tier that the cost reads per candidate, computed once.
_GPU = Tier.GPU.label()
_CPU, _CPU_UNCONFIRMED = Tier.CPU.label(), Tier.CPU.label(confirmed=False)
_STORAGE, _STORAGE_UNCONFIRMED = Tier.STORAGE.label(), Tier.STORAGE.label(confirmed=False)


class Policy(ABC):
    """A routing policy. The class attributes say what the router must gather for it, so that
    no code outside this module tells policies apart by name."""

    name: str
    # Whether rank() reads RouteContext.home; the router keeps homes only for such policies.
    uses_homes: bool = False
    # Whether rank() reads what a prompt's tokens give (index matches, routing history): the
    # router then tokenizes every request, with the replicas when no tokenizer is configured.
    needs_tokens: bool = False
    # Whether rank() reads ReplicaView.approx_tokens: the router then matches each prompt
    # against where it sent earlier ones (router/approx.py) and records where this one went.
    uses_routing_history: bool = False

    @classmethod
    def from_settings(cls, settings: RouterSettings) -> Policy:
        """The policy as configured by the router's settings."""
        return cls()

    @abstractmethod
    def rank(self, ctx: RouteContext) -> Ranking:
        """Candidates best first, the reason for the first, and any cost estimates; the views
        in ``ctx`` are read, never written."""

    def _by_load(self, ctx: RouteContext, views: list[ReplicaView]) -> list[ReplicaView]:
        return sorted(views, key=lambda v: (v.pending, -rendezvous(ctx.affinity, v.name)))


class KvroutePolicy(Policy):
    name = "kvroute"
    uses_homes = True
    needs_tokens = True

    def __init__(self, cost: CostSettings) -> None:
        self.cost = cost

    @classmethod
    def from_settings(cls, settings: RouterSettings) -> Policy:
        return cls(settings.cost)

    def queue_delay(self, view: ReplicaView) -> float:
        c = self.cost
        pending = view.pending
        per_request = (
            c.queue_s_per_request if view.queue_s_per_request is None else view.queue_s_per_request
        )
        delay = per_request * pending * (1.0 + pending / c.queue_knee)
        delay += c.waiting_s_per_request * view.waiting
        if view.kv_usage > c.kv_pressure_start:
            over = (view.kv_usage - c.kv_pressure_start) / max(1e-9, 1.0 - c.kv_pressure_start)
            delay += c.kv_pressure_s * min(1.0, over)
        return delay

    def estimate(self, view: ReplicaView, prompt_tokens: int) -> CostEstimate:
        """The view's est_ttft_s, its parts, and what it costs the others."""
        c = self.cost
        weight = 1.0 if view.freshness is None else c.freshness_weight.get(view.freshness, 0.0)
        tiers = view.tokens_by_tier
        gpu = tiers.get(_GPU, 0) * weight
        # Tiers whose publisher never announces removals are believed in part.
        unconfirmed = weight * c.unconfirmed_weight
        cpu = tiers.get(_CPU, 0) * weight + tiers.get(_CPU_UNCONFIRMED, 0) * unconfirmed
        shared = view.storage_domain_freshness
        storage_weight = (
            weight
            if view.storage_domain is None
            else 1.0
            if shared is None
            else c.freshness_weight.get(shared, 0.0)
        )
        storage = (
            tiers.get(_STORAGE, 0) * storage_weight
            + tiers.get(_STORAGE_UNCONFIRMED, 0) * unconfirmed
        )
        # Hinted blocks beyond the index match: the replica is computing them right now.
        gpu += max(0, view.hint_tokens - view.match_tokens)
        uncached = max(0.0, prompt_tokens - gpu - cpu - storage)
        queue_s = self.queue_delay(view)
        compute_s = c.prefill_s_per_token * uncached
        load_s = c.load_s_per_token_cpu * cpu + c.load_s_per_token_storage * storage
        est_ttft_s = queue_s + compute_s + load_s
        # Prefill shares the engine (chunked prefill batches it with the others' steps): the
        # requests already pending there are slowed by about this request's prefill. A spill
        # recomputes a prefix the holder would have served from cache; charging that to the
        # fleet keeps a passing queue difference from scattering a returning user's history.
        delay_to_others_s = (
            c.delay_to_others_weight * (compute_s + load_s) * min(view.pending, c.queue_knee)
        )
        return CostEstimate(
            queue_s,
            compute_s,
            load_s,
            est_ttft_s,
            delay_to_others_s,
            est_ttft_s + delay_to_others_s,
        )

    def near_equals(
        self, by_cost: list[ReplicaView], estimates: dict[str, CostEstimate]
    ) -> list[ReplicaView]:
        """The replicas the home order may pick from: as much work for this request as the
        cheapest (its prefill plus loads: a cache hit is never given up for a home) and a
        cost within ``home_slack`` of it (the load bound)."""
        best = estimates[by_cost[0].name]
        eps = self.cost.tie_epsilon_s
        cost_bound = best.cost_s * (1.0 + self.cost.home_slack) + eps
        work_bound = best.compute_s + best.load_s + eps
        return [
            v
            for v in by_cost
            if (e := estimates[v.name]).cost_s <= cost_bound
            and e.compute_s + e.load_s <= work_bound
        ]

    def rank(self, ctx: RouteContext) -> Ranking:
        prompt = ctx.prompt_tokens or 0
        estimates = {view.name: self.estimate(view, prompt) for view in ctx.views}
        by_cost = sorted(ctx.views, key=lambda v: estimates[v.name].cost_s)
        near = self.near_equals(by_cost, estimates)
        home = next((v for v in near if v.name == ctx.home), None)
        if home is not None:
            chosen = home
        elif ctx.home is None:  # a new prefix: the same replica from every router
            chosen = pick_new(near, ctx.affinity, self.cost.placement_slack)
        else:  # home too busy, or a hot prefix spilling: a stable second choice
            chosen = min(near, key=lambda v: -rendezvous(ctx.affinity, v.name))
        ranked = [chosen] + [v for v in by_cost if v is not chosen]
        longest = max(v.predicted_cached_tokens for v in ranked)
        if chosen.predicted_cached_tokens < longest:
            reason = "spill"
        elif chosen.predicted_cached_tokens == 0:
            reason = "load" if ctx.home is None else "home"
        elif chosen.hint_tokens > chosen.match_tokens:
            reason = "hint"
        else:
            reason = "prefix"
        return Ranking(ranked, reason, estimates)


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
