"""Prefill/decode disaggregation: which decode replica, whether to split, which prefill replica.

vLLM's P/D (NixlConnector) serves one request in two legs: a prefill replica computes the
prompt's KV and holds it, the decode replica pulls it and generates. Splitting is not free:
a second request, a pull of every token the decode replica lacks, and a prefill replica's
queue. It pays when the prompt's compute would otherwise stall the decode replica's running
batch (the cost model's ``delay_to_others_s``) or wait behind its queue; it does not pay
for a short prompt, nor for a returning user whose history the decode replica already
holds in some tier. So the decode replica is chosen first, as llm-d and Dynamo do, by the
same policy and index matches as an aggregated request (its cached prefix in every tier,
its load): that is where the conversation's KV will live. Then:

1. ``never``, a request that must stay on one replica (``n > 1``, prompt logprobs, echo, a
   batch of prompts, the client's own ``kv_transfer_params``), or no prefill pool: decode
   only.
2. ``auto``: decode only when what the decode replica must compute is at most
   ``skip_tokens`` or at most ``skip_fraction`` of the prompt (``small_uncached``,
   ``small_fraction``): too little to pay for a split. With ``whole_on_prefill``, such a
   request whose decode replica has prefills queued (``PrefillBacklog.wait_s``) is still
   priced against the whole request on a prefill replica (5.), never against a split.
3. The prefill pool is ranked by its time to answer: the prefill work this router sent each
   replica and has not seen done (``PrefillBacklog``: vLLM prefills in order, so the wait
   is the work ahead, seconds behind a long prompt, not a count of requests), its gauges'
   other requests at the cost model's seconds per request, and this prompt's work (its
   cached prefix counts); a replica in the decode replica's zone first while within
   ``zone_slack`` of the cheapest (the pull stays on one node or zone).
4. ``auto``: decode only when that is no dearer (``cheaper_on_decode``). Decode only: the
   decode replica's prefill backlog plus the prompt's work, plus the stall it gives every
   request decoding there (vLLM's scheduler runs the new prompt at once beside them, so
   each of their next tokens waits for it: the work times the decoding requests, priced at
   ``decode_stall_weight``), plus the delay to the first token of each split request whose
   decode leg lands there while the prompt computes (its prefill leg in flight: not yet in
   the replica's pending), one for one. Split: the prefill replica's time to answer plus the pull
   (``transfer_s_per_token`` per uncached token) and ``split_overhead_s``. Running decodes
   are no queue for a new prompt.
5. ``auto`` with ``whole_on_prefill``: the whole request on a prefill replica when that is
   cheaper than both (``whole_on_prefill``). vLLM's P/D instances serve a request without
   ``kv_transfer_params`` as an ordinary one, so a long prompt can use the prefill pool's
   engines without a pull, a second leg and the decode leg's own step. Priced as decode-only
   is: that replica's prefill backlog and untracked queue, the prompt's work there (its
   cached prefix counts), and the stall it gives the whole requests decoding there
   (``PrefillBacklog.decoding``). Such requests make the prefill replica decode, and each
   prefill leg sent there stalls them too: a split's prefill replica carries the same
   stall price, and the pool is ranked by time to answer plus it. On any prefill replica
   the whole request costs less than a split through it (no pull, no second leg, the same
   wait, work and stall), so with the choice on ``auto`` never splits: it picks the
   cheaper of whole on decode and whole on prefill, and the decode pool keeps its shorter
   time per output token only while the prefill pool's queue or decodes price it dearer.
   What this does not price is the request's own decodes being stalled by the prefills
   sent to that replica later (each is priced when it comes): docs/benchmarks.md measures
   the time per output token it costs.

Counters (``PdCounters``) are the P/D section of ``/index/stats`` and the ``kvroute_pd_*``
metrics; the two-leg driver (router/serving/disagg.py) counts failures into them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from kvroute.router.config import CostSettings, DisaggSettings
from kvroute.router.fleet.replicas import Replica
from kvroute.router.routing.policies import ReplicaView
from kvroute.router.routing.policies.kvroute import KvroutePolicy
from kvroute.router.routing.prefill_backlog import PrefillBacklog
from kvroute.router.routing.router import Decision
from kvroute.router.tokens.requests import ParsedRequest

__all__ = ["PD_REASONS", "Disaggregation", "PdCounters", "PdPlan", "decode_only_reason", "pools"]

PD_REASONS = (
    "split",  # the prefill leg pays: prefill replica, then the decode replica pulls
    "split_always",  # mode always
    "split_unmeasured",  # no token ids (no tokenizer): split, as configured fleets expect
    "small_uncached",  # decode must compute at most skip_tokens
    "small_fraction",  # decode must compute at most skip_fraction of the prompt
    "cheaper_on_decode",  # the cost model: recomputing on decode is no slower
    "whole_on_prefill",  # the cost model: the whole request on a prefill replica is cheapest
    "mode_never",
    "no_prefill_pool",
    "single_replica_request",  # n > 1, prompt logprobs, echo, a batch, client's own params
)


def pools(candidates: list[Replica]) -> tuple[list[Replica], list[Replica]]:
    """(decode pool, prefill pool) of the candidates. Aggregated replicas (``both``) serve
    the decode leg and whole requests; with no decode-capable replica healthy, the prefill
    replicas serve whole requests (vLLM's P/D instances run aggregated requests too), so a
    client is never refused while a healthy replica can answer."""
    decode = [r for r in candidates if r.role != "prefill"]
    prefill = [r for r in candidates if r.role == "prefill"]
    return (decode, prefill) if decode else (prefill, [])


def decode_only_reason(req: ParsedRequest) -> str | None:
    """Why a request cannot be split (None: it can). vLLM's P/D pulls into one sequence, so
    ``n > 1`` stays whole; prompt logprobs and echo need the prompt computed where it is
    answered; a batch is many prompts; a client that sends its own ``kv_transfer_params``
    drives its own transfer."""
    body = req.body
    n = body.get("n")
    if (isinstance(n, int) and n > 1) or body.get("best_of") not in (None, 1):
        return "single_replica_request"
    if body.get("prompt_logprobs") not in (None, 0) or body.get("echo") is True:
        return "single_replica_request"
    if req.batch is not None and len(req.batch) > 1:
        return "single_replica_request"
    if body.get("kv_transfer_params") is not None:
        return "single_replica_request"
    return None


@dataclass(slots=True)
class PdPlan:
    """One request's P/D decision: the decode ranking (also the decode-only fallback), the
    prefill ranking (empty when the prefill leg is skipped; with ``on_prefill``, the
    replica that serves the whole request first), why, and the figures compared."""

    decode: Decision
    split: bool
    reason: str
    prefill: list[Replica] = field(default_factory=list)
    on_prefill: bool = False  # the whole request on prefill[0]: one ordinary leg
    on_prefill_s: float | None = None  # its estimate (None: not priced)
    decoding_on_prefill: dict[str, int] = field(default_factory=dict)
    prefill_decision: Decision | None = None
    uncached_on_decode: int | None = None
    decode_only_s: float | None = None
    split_s: float | None = None
    prefill_views: list[ReplicaView] = field(default_factory=list)
    decoding: float | None = None  # requests decoding on the decode replica
    decode_stall_s: float | None = None  # the price of stalling them (decode_stall_weight)
    incoming_legs: int | None = None  # split requests' decode legs on their way there

    def to_dict(self) -> dict[str, Any]:
        """What ``/debug/route`` shows under ``disaggregation``."""
        return {
            "split": self.split,
            "on_prefill": self.on_prefill,
            "reason": self.reason,
            "decode": self.decode.ranked[0].name if self.decode.ranked else None,
            "prefill": self.prefill[0].name if self.prefill else None,
            "prefill_ranked": [r.name for r in self.prefill],
            "uncached_on_decode": self.uncached_on_decode,
            "decode_only_s": _round(self.decode_only_s),
            "split_s": _round(self.split_s),
            "on_prefill_s": _round(self.on_prefill_s),
            "decoding_on_prefill": dict(self.decoding_on_prefill),
            "decoding_on_decode": self.decoding,
            "decode_stall_s": _round(self.decode_stall_s),
            "incoming_decode_legs": self.incoming_legs,
            "prefill_replicas": [v.to_dict() for v in self.prefill_views],
        }


@dataclass(slots=True)
class PdCounters:
    """What P/D did since start: per decision reason, per leg, and every failure kind."""

    decisions: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PD_REASONS, 0))
    prefill_legs: int = 0  # prefill requests sent (retries included)
    decode_legs: int = 0  # decode requests that carried transfer parameters
    prefill_failures: int = 0  # a prefill leg that failed (then the next, or decode only)
    prefill_fallbacks: int = 0  # split requests served decode-only after prefill failed
    on_prefill_fallbacks: int = 0  # whole_on_prefill requests its replica did not serve
    resumed_streams: int = 0  # whole streamed answers finished elsewhere after a failure
    resume_failures: int = 0  # ... that could not be finished (the client saw an error)
    missing_transfer_params: int = 0  # prefill answered without kv_transfer_params
    transfer_failures: int = 0  # decode answered an error after a split (pull failed)
    loopback_hosts_replaced: int = 0

    def decided(self, reason: str) -> None:
        self.decisions[reason] = self.decisions.get(reason, 0) + 1

    def to_dict(self) -> dict[str, Any]:
        split = sum(n for r, n in self.decisions.items() if r.startswith("split"))
        total = sum(self.decisions.values())
        # Decode only: neither split nor whole on a prefill replica.
        bypassed = total - split - self.decisions.get("whole_on_prefill", 0)
        return {
            "decisions": dict(self.decisions),
            "split": split,
            "bypassed": bypassed,
            "bypass_rate": round(bypassed / total, 4) if total else None,
            "prefill_legs": self.prefill_legs,
            "decode_legs": self.decode_legs,
            "prefill_failures": self.prefill_failures,
            "prefill_fallbacks": self.prefill_fallbacks,
            "on_prefill": self.decisions.get("whole_on_prefill", 0),
            "on_prefill_fallbacks": self.on_prefill_fallbacks,
            "resumed_streams": self.resumed_streams,
            "resume_failures": self.resume_failures,
            "missing_transfer_params": self.missing_transfer_params,
            "transfer_failures": self.transfer_failures,
            "loopback_hosts_replaced": self.loopback_hosts_replaced,
        }


class Disaggregation:
    """The decider (module docstring). ``decide`` is given the decode pool's decision (made
    by the router's policy, like any request's) and ranks the prefill pool with the same
    router; it writes nothing but its counters."""

    def __init__(
        self,
        settings: DisaggSettings,
        cost: CostSettings,
        backlog: PrefillBacklog | None = None,
    ) -> None:
        self.settings = settings
        self.cost = KvroutePolicy(cost)  # the estimates, whatever policy ranks
        self.counters = PdCounters()
        # The router's (Router.backlog): the prefill work it sent each replica, not yet done.
        self.backlog = PrefillBacklog() if backlog is None else backlog

    def decode_only(self, decode: Decision, reason: str, **figures: Any) -> PdPlan:
        self.counters.decided(reason)
        return PdPlan(decode, False, reason, **figures)

    async def decide(
        self,
        decode: Decision,
        req: ParsedRequest,
        prefill_pool: list[Replica],
        rank_prefill: Any,
        *,
        record: bool = True,
        on_prefill: bool = True,
    ) -> PdPlan:
        """The plan for ``req``, whose decode ranking is ``decode``. ``rank_prefill`` is the
        router's ``decide`` over a pool (``await rank_prefill(pool) -> Decision``), called
        only when the prefill leg is still in question. ``record=False`` (``/debug/route``)
        leaves the counters alone; ``on_prefill=False`` withholds the whole-on-prefill
        choice from a caller that cannot send the request there (the endpoint picker, whose
        destination is its decode pick)."""
        counters = self.counters
        if not record:
            self.counters = PdCounters()
        try:
            return await self._decide(decode, req, prefill_pool, rank_prefill, on_prefill)
        finally:
            self.counters = counters

    async def _decide(
        self,
        decode: Decision,
        req: ParsedRequest,
        prefill_pool: list[Replica],
        rank_prefill: Any,
        on_prefill: bool,
    ) -> PdPlan:
        s = self.settings
        whole = s.whole_on_prefill and on_prefill
        if s.mode == "never":
            return self.decode_only(decode, "mode_never")
        if not prefill_pool or not decode.ranked:
            return self.decode_only(decode, "no_prefill_pool")
        if (why := decode_only_reason(req)) is not None:
            return self.decode_only(decode, why)
        chosen = decode.ranked[0]
        view = decode.view(chosen.name)
        prompt = decode.prompt_tokens
        uncached = None
        if prompt is not None and view is not None:
            uncached = max(0, prompt - view.predicted_cached_tokens)
        small = None
        if s.mode == "auto" and uncached is not None and prompt is not None:
            if uncached <= s.skip_tokens:
                small = "small_uncached"
            elif uncached <= s.skip_fraction * prompt:
                small = "small_fraction"
        # Too small to split; but not to serve whole on a prefill replica while prefills
        # are queued ahead of it on the decode replica (nothing to gain otherwise).
        queued = whole and view is not None and self.backlog.wait_s(view.name) > 0
        if small is not None and not queued:
            return self.decode_only(decode, small, uncached_on_decode=uncached)
        prefill = await rank_prefill(prefill_pool)
        prompt_n = prompt or 0
        ttfts = {v.name: self._prefill_ttft(v, prompt_n) for v in prefill.views}
        decoding_p = {v.name: self.backlog.decoding(v.name) for v in prefill.views}
        # A prefill there (a split's leg or a whole request) stalls the whole requests
        # decoding there, priced as on a decode replica.
        costs = {
            v.name: ttfts[v.name]
            + s.decode_stall_weight * self._work(v, prompt_n) * decoding_p[v.name]
            for v in prefill.views
        }
        ranked = self._rank_prefill(prefill, costs, chosen)
        plan = PdPlan(
            decode,
            True,
            "split_always" if s.mode == "always" else "split",
            prefill=ranked,
            prefill_decision=prefill,
            uncached_on_decode=uncached,
            prefill_views=prefill.views,
            decoding_on_prefill={k: n for k, n in decoding_p.items() if n},
        )
        if uncached is None or prompt is None or view is None:
            if s.mode == "auto":
                plan.reason = "split_unmeasured"
            self.counters.decided(plan.reason)
            return plan
        work = self._work(view, prompt)
        decode_wait = self.backlog.wait_s(view.name)
        # Decoding there now: a scrape's gauges still count the short decodes that ended
        # since (up to one scrape interval of them), which are stalled no more.
        now = view.pending if view.pending_now is None else view.pending_now
        plan.decoding = max(0.0, now - self.backlog.count(view.name))
        plan.decode_stall_s = s.decode_stall_weight * work * plan.decoding
        # Decode legs on their way there (prefill legs in flight) that land while this
        # prompt computes wait for what is left of it: their time to first token, one for
        # one. A leg due after it is done is not delayed.
        incoming = self.backlog.incoming(view.name)
        plan.incoming_legs = len(incoming)
        delayed_s = sum(max(0.0, decode_wait + work - due) for due in incoming)
        plan.decode_only_s = decode_wait + work + plan.decode_stall_s + delayed_s
        first = ranked[0].name
        answer = ttfts[first] + s.transfer_s_per_token * uncached
        # The decode leg's few tokens wait for the decode replica's prefills ahead, which
        # drain while the prefill leg runs; its pull runs beside the engine.
        stall = costs[first] - ttfts[first]
        plan.split_s = answer + stall + s.split_overhead_s + max(0.0, decode_wait - answer)
        if s.mode != "auto":
            self.counters.decided(plan.reason)
            return plan
        # Whole on the cheapest prefill replica: no pull, no second leg; its wait, work and
        # stall are the cost above (decode legs land on decode replicas: none delayed).
        cheapest = min(ranked, key=lambda r: costs[r.name]) if whole else None
        if cheapest is not None:
            plan.on_prefill_s = costs[cheapest.name]
        # A small one is never split: decode only or whole on a prefill replica.
        rivals = (plan.decode_only_s,) if small else (plan.decode_only_s, plan.split_s)
        if plan.on_prefill_s is not None and plan.on_prefill_s < min(rivals):
            assert cheapest is not None
            plan.split, plan.on_prefill, plan.reason = False, True, "whole_on_prefill"
            plan.prefill = [cheapest]
        elif small is not None:
            plan.split, plan.reason, plan.prefill = False, small, []
        elif plan.decode_only_s <= plan.split_s:
            plan.split, plan.reason, plan.prefill = False, "cheaper_on_decode", []
        self.counters.decided(plan.reason)
        return plan

    def _work(self, view: ReplicaView, prompt: int) -> float:
        """Seconds of prefill and loads ``prompt`` asks of the replica of ``view``, at the
        configured rates (``CostEstimate.work_s``): what differs between a decode and a
        prefill replica is what each holds. Their learned rates differ by the noise of
        their samples (a prefill replica learns none: its legs answer unstreamed) and must
        not decide: measured on the pd scenario, 0.56 s and 0.76 s for one 2,700-token
        prompt on two decode replicas of one model, more than a split's whole overhead."""
        estimate = self.cost.estimate(view, prompt)
        return estimate.compute_s + estimate.load_s if estimate.work_s is None else estimate.work_s

    def _prefill_ttft(self, view: ReplicaView, prompt: int) -> float:
        """A prefill replica's time to answer: the prefill work this router sent it and has
        not seen done (``PrefillBacklog``), the requests its gauges count beyond those and
        beyond the whole requests decoding there (a peer router's) at the cost model's
        seconds per request, then this prompt's work. Not the policy's
        ``delay_to_others_s``: the prefills ahead of this one in vLLM's order are not
        delayed by it, and the decodes it stalls are priced by the caller."""
        known = self.backlog.count(view.name) + self.backlog.decoding(view.name)
        untracked = max(0.0, view.pending - known)
        queue = self.cost.queue_delay(replace(view, pending=untracked))
        return self.backlog.wait_s(view.name) + queue + self._work(view, prompt)

    def _rank_prefill(
        self, prefill: Decision, costs: dict[str, float], decode: Replica
    ) -> list[Replica]:
        """The prefill pool cheapest first; a replica in the decode replica's zone first
        while within ``zone_slack`` of the cheapest (ties keep the policy's order)."""
        order = {r.name: i for i, r in enumerate(prefill.ranked)}
        by_cost = sorted(prefill.ranked, key=lambda r: (costs.get(r.name, 0.0), order[r.name]))
        zone = decode.config.zone
        if zone is None or not by_cost:
            return by_cost
        bound = costs.get(by_cost[0].name, 0.0) * (1.0 + self.settings.zone_slack) + 1e-9
        near = [r for r in by_cost if r.config.zone == zone and costs.get(r.name, 0.0) <= bound]
        return near[:1] + [r for r in by_cost if r not in near[:1]]


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 6)
