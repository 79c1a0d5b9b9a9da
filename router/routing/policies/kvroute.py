"""The ``kvroute`` policy: each replica's estimated time to first token, and bounded-load affinity.

kvroute cost, in seconds (est. time to first token; see docs/router.md):
    est_ttft = queue_delay + prefill_s_per_token * uncached
               + load_s_per_token_cpu * cpu_tokens + load_s_per_token_storage * storage_tokens
    queue_delay = q * pending * (1 + pending / queue_knee)
                  + waiting_s_per_request * waiting
                  + kv_wait (the wait for room in its device cache: router/routing/kv_room.py),
                    or where its size is not known
                    kv_pressure_s * max(0, kv_usage - kv_pressure_start) / (1 - kv_pressure_start)
``q`` is the replica's learned seconds per pending request (router/routing/queue_model.py), or
``queue_s_per_request`` when learning is off; the three rates are the replica's learned ones
(router/routing/calibration.py), or the configured ones when learning is off. The queue term
is superlinear in ``pending`` so that the benefit of a cached prefix (linear in its length)
is always overtaken by a growing queue: a hot prefix spills to other replicas instead of
piling onto one.
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
(router/routing/placement.py): a function of the prefix and of what every router sees alike, so
several routers put it on the same replica.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvroute.indexer.tiers import Tier
from kvroute.router.routing.placement import pick_new, rendezvous
from kvroute.router.routing.policies.base import (
    CostEstimate,
    Policy,
    Ranking,
    ReplicaView,
    RouteContext,
)

if TYPE_CHECKING:  # router/config.py imports the policies when it validates a name
    from kvroute.router.config import CostSettings, RouterSettings

__all__ = ["KvroutePolicy"]

# The keys of ReplicaView.tokens_by_tier that the cost reads per candidate, computed once.
_GPU = Tier.GPU.label()
_CPU, _CPU_UNCONFIRMED = Tier.CPU.label(), Tier.CPU.label(confirmed=False)
_STORAGE, _STORAGE_UNCONFIRMED = Tier.STORAGE.label(), Tier.STORAGE.label(confirmed=False)


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
        if view.kv_wait_s is not None:  # the cache's room, counted (kv_room.py)
            delay += view.kv_wait_s
        elif view.kv_usage > c.kv_pressure_start:
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
        prefill = view.prefill_s_per_token
        if prefill is None:
            prefill = c.prefill_s_per_token
        load_cpu = view.load_s_per_token_cpu
        if load_cpu is None:
            load_cpu = c.load_s_per_token_cpu
        load_storage = view.load_s_per_token_storage
        if load_storage is None:
            load_storage = c.load_s_per_token_storage
        compute_s = prefill * uncached
        load_s = load_cpu * cpu + load_storage * storage
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
            c.prefill_s_per_token * uncached
            + c.load_s_per_token_cpu * cpu
            + c.load_s_per_token_storage * storage,
        )

    def near_equals(
        self, by_cost: list[ReplicaView], estimates: dict[str, CostEstimate]
    ) -> list[ReplicaView]:
        """The replicas the home order may pick from: as much work for this request as the
        cheapest (its prefill plus loads: a cache hit is never given up for a home) and a
        cost within ``home_slack`` of it (the load bound).

        Work is compared at the configured rates (``CostEstimate.work_s``): what differs is
        what each replica holds, and the learned rates of replicas of one kind differ by
        their noise alone, which must not undo the home order. A replica that is truly
        faster still ranks first by its cost, and a slower one stays out by the cost bound."""
        best = estimates[by_cost[0].name]
        eps = self.cost.tie_epsilon_s
        cost_bound = best.cost_s * (1.0 + self.cost.home_slack) + eps
        work_bound = _work(best) + eps
        return [
            v
            for v in by_cost
            if (e := estimates[v.name]).cost_s <= cost_bound and _work(e) <= work_bound
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


def _work(e: CostEstimate) -> float:
    return e.compute_s + e.load_s if e.work_s is None else e.work_s
