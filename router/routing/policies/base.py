"""What a policy sees (``RouteContext``: one ``ReplicaView`` per candidate) and returns (a
``Ranking`` with a reason and a ``CostEstimate`` per replica), and the ``Policy`` interface.
Reasons are a small fixed vocabulary (they are a Prometheus label).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvroute.router.routing.placement import rendezvous

if TYPE_CHECKING:  # router/config.py imports the policies when it validates a name
    from kvroute.router.config import RouterSettings

__all__ = ["POLICY_REASONS", "CostEstimate", "Policy", "Ranking", "ReplicaView", "RouteContext"]

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
    # compute + load priced at the configured rates, not the learned ones: how much work the
    # request is there, which a few noisy samples of a replica's rates cannot change
    work_s: float | None = None


@dataclass(slots=True)
class ReplicaView:
    """One candidate as a policy sees it; also what /debug/route shows (with the estimate
    the policy returned for it, once the router ``record``s it)."""

    name: str
    pending: float = 0.0
    # ``pending`` less what this router saw end since the last scrape (Replica.pending_fresh):
    # the requests there now, which the P/D decider counts decodes by (None: not known).
    pending_now: float | None = None
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
    # Seconds until its device cache has room for the request (router/routing/kv_room.py);
    # None: its size is not known (the cost's KV-pressure term stands in)
    kv_wait_s: float | None = None
    # learned (router/routing/calibration.py); None: the configured rates
    prefill_s_per_token: float | None = None
    load_s_per_token_cpu: float | None = None
    load_s_per_token_storage: float | None = None
    rate_samples: int = 0
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
        for key in ("prefill_s_per_token", "load_s_per_token_cpu", "load_s_per_token_storage"):
            if out[key] is not None:
                out[key] = float(f"{out[key]:.4g}")
        for key in (
            "queue_s_per_request",
            "kv_wait_s",
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
    affinity: (
        bytes  # what the consistent hash keys on (kvroute.router.routing.router.home_affinity)
    )
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
    # against where it sent earlier ones (router/routing/approx.py) and records where this one went.
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
