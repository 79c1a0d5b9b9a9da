"""From a parsed request to a ranked list of replicas: tokens, index matches, hints, policy.

Everything a policy needs is gathered into ``ReplicaView``s here, for every policy, so that
the predicted cached tokens of the chosen replica are recorded whatever the policy (that is
what makes predicted-vs-delivered comparable across policies) and ``/debug/route`` shows the
same numbers the decision used.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from kvroute.indexer.index import PrefixIndex, domain_key
from kvroute.indexer.keys import RequestKeys
from kvroute.indexer.subscriber import FeedHealth
from kvroute.indexer.tiers import Tier
from kvroute.router.common.lru import LRU
from kvroute.router.config import CostSettings, RouterSettings
from kvroute.router.fleet.replicas import Replica
from kvroute.router.routing.approx import RoutingHistory
from kvroute.router.routing.calibration import CalibrationSample, LearnedRates, Rates
from kvroute.router.routing.cpu_audit import audit_cpu, skips_prefix_cache
from kvroute.router.routing.decision import Decision, home_affinity
from kvroute.router.routing.decision_log import DecisionLog
from kvroute.router.routing.hints import BurstHints
from kvroute.router.routing.kv_room import KvRoom, waits_to_price
from kvroute.router.routing.lmcache import LMCacheController
from kvroute.router.routing.match_tiers import (
    TIER_DROP_ORDER,
    match_tiers,
    predicted_cached_tokens,
)
from kvroute.router.routing.placement import StoredRate, UnstoredBlocks
from kvroute.router.routing.policies import Policy, ReplicaView, RouteContext
from kvroute.router.routing.prefill_backlog import PrefillBacklog
from kvroute.router.routing.prefill_evidence import PrefillEvidence
from kvroute.router.routing.queue_model import LearnedQueueDelay
from kvroute.router.tokens.requests import ParsedRequest
from kvroute.router.tokens.tokenization import TokenizerBase

_GPU = Tier.GPU.label()
_CPU, _CPU_U = Tier.CPU.label(), Tier.CPU.label(confirmed=False)
_STORAGE, _STORAGE_U = Tier.STORAGE.label(), Tier.STORAGE.label(confirmed=False)

__all__ = ["Decision", "Router", "home_affinity", "match_tiers", "predicted_cached_tokens"]

# LMCache's tier (lmcache.py): what its events say, and what its controller says
_CPU, _CPU_UNCONFIRMED = Tier.CPU.label(), Tier.CPU.label(confirmed=False)


class Router:
    def __init__(
        self,
        settings: RouterSettings,
        index: PrefixIndex,
        subscriber: FeedHealth | None,
        tokenizer: TokenizerBase | None,
        policy: Policy,
    ) -> None:
        self.settings = settings
        self.index = index
        self.subscriber = subscriber
        self.tokenizer = tokenizer
        self.policy = policy
        self.hints = BurstHints(settings.hint_ttl_s, settings.hint_max_keys)
        # LMCache's controller, for replicas that name their LMCache instance (lmcache.py)
        self.lmcache = (
            LMCacheController(settings.lmcache_controller, settings.lmcache_lookup_timeout_s)
            if settings.lmcache_controller
            else None
        )
        self.history = RoutingHistory(settings.approx_max_keys)
        self.recent = DecisionLog()  # the last decisions sent, for GET /dashboard/data
        # The prefill work sent to each replica and not yet done (the P/D decider's waits).
        self.backlog = PrefillBacklog()
        # Where each prefix (its home_affinity) was first placed: where it goes back to once
        # evicted everywhere (KvroutePolicy). Peer routers share the homes they give
        # (``observe_shared_home``); a prefix no router placed yet is placed by a rule every
        # router computes alike (placement.py).
        self.homes: LRU[bytes, str] = LRU(settings.home_max_keys)
        self.homes_from_peers = 0  # homes taken from peer routers (observe_shared_home)
        # Blocks each replica stored lately, from the event feeds every router reads, and
        # those this router sent it to compute that its feed has not announced yet.
        self.stored_rate = StoredRate(settings.cost.placement_half_life_s)
        self.unstored = UnstoredBlocks(settings.cost.placement_unstored_max_age_s)
        c = settings.cost
        self.queue_delay = (
            LearnedQueueDelay(
                c.queue_s_per_request,
                weight=c.queue_learn_weight,
                half_life_s=c.queue_learn_half_life_s,
                max_s=c.queue_s_per_request_max,
            )
            if c.learn_queue_delay
            else None
        )
        self.rates = (
            LearnedRates(
                Rates(c.prefill_s_per_token, c.load_s_per_token_cpu, c.load_s_per_token_storage),
                half_life_s=c.rates_half_life_s,
                prior_samples=c.rates_prior_samples,
            )
            if c.learn_rates
            else None
        )
        # The replicas' own prefill counters, as further samples (prefill_evidence.py)
        self.prefill_evidence = PrefillEvidence()
        # The device blocks this router's requests hold on each replica (kv_room.py)
        self.kv_room = KvRoom(decode_s_per_token=c.decode_s_per_token) if c.kv_room else None

    async def tokens(
        self, req: ParsedRequest, candidates: list[Replica] | None = None
    ) -> list[int] | None:
        if self.tokenizer is None:
            return None
        # The ids carry a rendered prompt's multimodal items (PromptIds.mm) to the keys.
        prompt = await self.tokenizer.prompt(req, _max_model_len(req.model, candidates or []))
        return prompt.tokens

    async def batch_tokens(
        self, req: ParsedRequest, candidates: list[Replica]
    ) -> list[list[int]] | None:
        """Every prompt's ids: one list, or one per prompt of a batch (vLLM serves a batch
        on one replica, so the router weighs all of its prompts)."""
        if self.tokenizer is None:
            return None
        if not req.batch:
            return [await self.tokens(req, candidates)]  # type: ignore[list-item]
        return [
            await self.tokens(replace(req, prompt=prompt, batch=None), candidates)  # type: ignore[misc]
            for prompt in req.batch
        ]

    def sample_stored_blocks(self) -> None:
        """Sample every feed's cumulative stored-block count (all streams of a replica), and
        settle the blocks in progress they announce. Before each decision, and before this
        router reports its blocks in progress (``GET /peer/load``, ``/index/stats``)."""
        if not self.policy.uses_homes or self.subscriber is None:
            return
        counts: dict[str, int] = {}
        resets: dict[str, int] = {}
        for (replica, _), stats in self.subscriber.all_feed_stats().items():
            counts[replica] = counts.get(replica, 0) + stats.blocks_stored
            resets[replica] = resets.get(replica, 0) + stats.device_clears
        self.unstored.settle(self.stored_rate.update(counts, resets))

    def _placement_rate(self, replica: Replica) -> float:
        """``StoredRate`` with the blocks in progress on ``replica`` (sent by this router or,
        as of their last answer, by its peers) counted as stored now."""
        unstored = self.unstored.blocks(replica.name) + replica.peer_unstored_blocks
        return self.stored_rate.rate(replica.name, unstored)

    def _freshness(self, replica: Replica) -> tuple[str | None, str | None]:
        if replica.config.events is None or self.subscriber is None:
            return None, "no event feed configured"
        state, reason = self.subscriber.freshness(replica.name)
        return str(state), reason

    def _domain_freshness(self, replica: Replica) -> str | None:
        """The freshness of the evictor feed of the replica's storage domain (None: not
        attached, or the domain has no feed configured)."""
        domain = replica.config.storage_domain
        if domain is None or self.subscriber is None:
            return None
        if all(d.name != domain for d in self.settings.storage_domains):
            return None
        return str(self.subscriber.freshness(domain_key(domain))[0])

    async def decide(
        self, req: ParsedRequest, candidates: list[Replica], session_id: str | None = None
    ) -> Decision:
        prompts = await self.batch_tokens(req, candidates)
        tokens = prompts[0] if prompts else None
        lora = req.model if any(r.is_lora(req.model) for r in candidates) else None
        views: dict[str, ReplicaView] = {}
        self.sample_stored_blocks()
        for r in candidates:
            name = r.name  # a property: read once per replica, a decision reads every one
            fresh, why = self._freshness(r)
            rates = None if self.rates is None else self.rates.rates(name, r.rate_pool)
            views[name] = ReplicaView(
                name=name,
                pending=r.pending,
                pending_now=r.pending_fresh,
                in_flight=r.in_flight,
                running=r.running,
                waiting=r.waiting,
                kv_usage=r.kv_usage,
                queue_s_per_request=None
                if self.queue_delay is None
                else self.queue_delay.per_request_s(name),
                stored_rate=self._placement_rate(r) if self.policy.uses_homes else 0.0,
                prefill_s_per_token=None if rates is None else rates.prefill_s_per_token,
                load_s_per_token_cpu=None if rates is None else rates.load_s_per_token_cpu,
                load_s_per_token_storage=None if rates is None else rates.load_s_per_token_storage,
                rate_samples=0 if rates is None else rates.samples,
                block_size=self.index.block_size(name),
                freshness=fresh,
                freshness_reason=why,
                storage_domain=r.config.storage_domain,
                storage_domain_freshness=self._domain_freshness(r),
            )
        total = None if prompts is None else sum(len(p) for p in prompts)
        decision = Decision(self.policy.name, "", [], [], total)
        decision.lora_name = lora
        decision.skips_cache = skips_prefix_cache(req.body)
        decision.output_budget = _output_budget(req.body, self.settings.cost)
        if prompts is not None and len(prompts) == 1:
            decision.tokens = prompts[0]
        affinity = req.model.encode()
        if tokens:
            assert prompts is not None
            batch = [
                RequestKeys(p, lora_name=lora, cache_salt=req.cache_salt, mm=getattr(p, "mm", None))
                for p in prompts
            ]
            request = batch[0]
            if len(batch) > 1:
                decision.batch_sizes = [len(p) for p in prompts]
            self._match(decision, views, batch)
            if self.lmcache is not None and len(prompts) == 1:
                await self._ask_lmcache(prompts[0], candidates, views)
            bs = next(iter(decision.keys))
            held = [
                v.predicted_cached_tokens // bs
                for v in views.values()
                if (v.block_size or self.settings.default_block_size) == bs
            ]
            # A prompt shorter than one block has no keys: its (few) tokens are its affinity.
            affinity = home_affinity(decision.keys[bs], held, request.packed[: 4 * bs])
        if self.kv_room is not None and decision.prompt_tokens:
            self._kv_waits(decision, views, candidates)
        home = self.homes.get(affinity) if self.policy.uses_homes else None
        decision.affinity = affinity
        decision.home = home if home in views else None
        ctx = RouteContext(
            list(views.values()), decision.prompt_tokens, affinity, session_id, decision.home
        )
        ranking = self.policy.rank(ctx)
        for view in ranking.views:
            if (estimate := ranking.estimates.get(view.name)) is not None:
                view.record(estimate)
        by_name = {r.name: r for r in candidates}
        decision.reason = ranking.reason
        decision.views = ranking.views
        decision.ranked = [by_name[v.name] for v in ranking.views]
        return decision

    def _match(
        self, decision: Decision, views: dict[str, ReplicaView], requests: list[RequestKeys]
    ) -> None:
        """Each replica's match per prompt, summed over a batch's prompts. A prompt of a
        batch may also hit the blocks an earlier prompt of the same batch computes (vLLM
        caches a block as soon as it is scheduled): that share counts like a burst hint."""
        groups: dict[int, list[str]] = {}
        for view in views.values():
            groups.setdefault(view.block_size or self.settings.default_block_size, []).append(
                view.name
            )
        batch = len(requests) > 1
        for bs, names in groups.items():
            indexed = [name for name in names if views[name].block_size is not None]
            earlier: set[int] = set()
            for i, request in enumerate(requests):
                n = request.n_tokens
                keys = request.keys(bs)
                if i == 0:
                    decision.keys[bs] = keys
                else:
                    decision.batch_keys.setdefault(bs, []).append(keys)
                matches = self.index.lookup(request, replicas=indexed) if indexed else {}
                hints = self.hints.match(names, keys)
                shared = 0
                if batch:
                    while shared < len(keys) and keys[shared] in earlier:
                        shared += 1
                    earlier.update(keys)
                for name in names:
                    m = matches.get(name)
                    if not batch and (m is None or not m.tokens) and not hints.get(name):
                        continue  # nothing cached, nothing hinted: the view stays at zero
                    view = views[name]
                    cap, tiers = 0, {}
                    if m is not None and m.tokens:
                        unit = m.partial_unit if m.partial_tokens else bs
                        cap = predicted_cached_tokens(m.tokens, n, unit or bs)
                        tiers = match_tiers(m)
                        excess = m.tokens - cap
                        for tier in TIER_DROP_ORDER:
                            if excess <= 0:
                                break
                            take = min(excess, tiers.get(tier, 0))
                            if take:
                                tiers[tier] -= take
                                excess -= take
                    hint = predicted_cached_tokens(max(hints.get(name, 0), shared) * bs, n, bs)
                    view.match_tokens += cap
                    for tier, count in tiers.items():
                        if count:
                            view.tokens_by_tier[tier] = view.tokens_by_tier.get(tier, 0) + count
                    view.hint_tokens += hint
                    view.predicted_cached_tokens += max(cap, hint)
                    if batch:
                        decision.batch_predicted.setdefault(name, []).append(max(cap, hint))
        if self.policy.uses_routing_history:
            request = requests[0]
            n = request.n_tokens
            abs_ = self.settings.approx_block_size
            decision.approx_keys = request.keys(abs_)
            approx = self.history.match(list(views), decision.approx_keys)
            for name, blocks in approx.items():
                views[name].approx_tokens = predicted_cached_tokens(blocks * abs_, n, abs_)
                views[name].predicted_cached_tokens = max(
                    views[name].predicted_cached_tokens, views[name].approx_tokens
                )

    def _kv_waits(
        self, decision: Decision, views: dict[str, ReplicaView], candidates: list[Replica]
    ) -> None:
        """Each view's wait for room in its device cache (kv_room.py), where the replica's
        metrics say the cache's size, when some replica has room now (``waits_to_price``)."""
        assert self.kv_room is not None
        waits: dict[str, float] = {}
        for r in candidates:
            capacity = r.kv_blocks
            if not capacity:
                continue
            keys, own = self._kv_blocks(decision, views[r.name])
            waits[r.name] = self.kv_room.wait_s(
                r.name,
                self.kv_room.need(r.name, keys, own),
                capacity,
                r.kv_usage * capacity,
                r.scraped_at,
                decision.output_budget,
                r.peer_kv_held,
                0
                if r.scraped_at is None
                else r.peer_kv_held_at(r.scrape_sent_at or r.scraped_at, r.scraped_at),
                r.peer_kv_frees,
                r.scrape_sent_at,
            )
        for name, wait in waits_to_price(waits).items():
            views[name].kv_wait_s = wait

    def _kv_blocks(self, decision: Decision, view: ReplicaView) -> tuple[list[int], int]:
        """The request's device blocks on ``view``'s replica: its (first) prompt's full
        blocks by key, shared with whoever holds them, and its own (the rest of its
        prompts, and its output budget)."""
        bs = view.block_size or self.settings.default_block_size
        keys = decision.keys.get(bs) or []
        rest = max(0, (decision.prompt_tokens or 0) - len(keys) * bs) + decision.output_budget
        return keys, -(-rest // bs)

    async def _ask_lmcache(
        self, tokens: Sequence[int], candidates: list[Replica], views: dict[str, ReplicaView]
    ) -> None:
        """What LMCache's controller says each replica naming its instance holds replaces
        the index's unconfirmed CPU tokens of that replica (lmcache.py)."""
        assert self.lmcache is not None
        instances = {r.name: r.config.lmcache_instance for r in candidates}
        instances = {name: i for name, i in instances.items() if i}
        if not instances:
            return
        counts = await self.lmcache.lookup(tokens)
        if counts is None:
            return
        for name, instance in instances.items():
            view = views[name]
            base = view.match_tokens - view.tokens_by_tier.pop(_CPU_UNCONFIRMED, 0)
            held = min(counts.get(instance, 0), max(0, len(tokens) - 1))
            if held > base:
                view.tokens_by_tier[_CPU] = view.tokens_by_tier.get(_CPU, 0) + held - base
            view.match_tokens = max(base, held)
            view.predicted_cached_tokens = max(
                view.match_tokens, view.hint_tokens, view.approx_tokens
            )

    async def aclose(self) -> None:
        if self.lmcache is not None:
            await self.lmcache.aclose()

    def commit(self, decision: Decision, replica: Replica, *, home: bool = True) -> None:
        """The request went to ``replica``: remember it for siblings and routing history, and
        as the prefix's home if it has none (or its home is no longer a candidate). A
        prefill leg (``home=False``) is no home: the prefix lives on where it is decoded."""
        view = decision.view(replica.name)
        if view is None:
            return
        self.recent.record(decision, replica.name)
        self.backlog.add(replica.name, id(decision), _prefill_work_s(decision, view, self))
        # A prefill leg (no home) holds its blocks only until its decode leg pulls them.
        if self.kv_room is not None and home and decision.prompt_tokens and replica.kv_blocks:
            keys, own = self._kv_blocks(decision, view)
            self.kv_room.add(
                replica.name,
                id(decision),
                keys,
                own,
                decision.output_budget,
                view.est_ttft_s or 0.0,
            )
        if home and self.policy.uses_homes and decision.home is None and decision.affinity:
            self.homes.put(decision.affinity, replica.name)
            if self.queue_delay is not None:  # for the peers, numbered with the samples
                self.queue_delay.log_home(replica.name, decision.affinity)
        bs = view.block_size or self.settings.default_block_size
        if self.policy.uses_homes and decision.prompt_tokens:
            self.unstored.add(
                replica.name, (decision.prompt_tokens - view.predicted_cached_tokens) // bs
            )
        keys = decision.keys.get(bs)
        if keys:
            self.hints.record(replica.name, keys)
        for more in decision.batch_keys.get(bs, ()):
            self.hints.record(replica.name, more)
        if decision.approx_keys:
            self.history.insert(replica.name, decision.approx_keys)

    def first_byte(self, decision: Decision, replica: Replica, seconds: float) -> None:
        """A streamed response's first byte came ``seconds`` after it was sent to
        ``replica``: what the cost model did not explain is queueing, learned per replica."""
        view = decision.view(replica.name)
        if view is not None and decision.ranked and decision.ranked[0] is replica:
            decision.first_byte_s = seconds
        self.backlog.done(replica.name, id(decision))
        if self.kv_room is not None:
            self.kv_room.first_byte(replica.name, id(decision))
        if self.queue_delay is None or view is None:
            return
        explained = (view.compute_s or 0.0) + (view.load_s or 0.0) + (view.kv_wait_s or 0.0)
        if view.compute_s is None:  # a policy that does not estimate: price it like kvroute
            uncached = max(0, (decision.prompt_tokens or 0) - view.predicted_cached_tokens)
            explained = self.settings.cost.prefill_s_per_token * uncached
        self.queue_delay.observe(replica.name, view.pending, explained, seconds)

    def answered_whole(self, decision: Decision, replica: Replica) -> None:
        """An unstreamed answer's headers came from ``replica``: the answer is ready, so its
        prefill, and every prefill sent there before it, is done. Not a queue sample: the
        time includes the decode."""
        self.backlog.done(replica.name, id(decision))

    def ended(self, decision: Decision, replica: Replica, *, complete: bool) -> None:
        """The request's answer from ``replica`` ended (``complete``: read to its end, a
        sample of the replica's decode pace) or failed: the blocks it held are free."""
        if self.kv_room is not None:
            self.kv_room.ended(replica.name, id(decision), learn=complete)

    def answered(self, decision: Decision, replica: Replica, delivered: int | None) -> None:
        """A streamed answer ended, reporting ``delivered`` cached tokens (None: not
        reported): with its first byte's time, one sample of the replica's prefill and load
        rates (router/routing/calibration.py). Only the replica chosen first, priced by the
        kvroute cost model, and a single prompt (a batch's time is its prompts' together).
        Any answer may also prove the replica's CPU tier lacks chunks the index holds
        (router/routing/cpu_audit.py)."""
        audit_cpu(self.index, decision, replica.name, delivered)
        view = decision.view(replica.name)
        seconds = decision.first_byte_s
        if self.rates is None or view is None or seconds is None or view.queue_s is None:
            return
        if len(decision.batch_sizes) > 1 or not decision.prompt_tokens or decision.remote_prefill:
            return
        tiers = view.tokens_by_tier
        gpu = tiers.get(_GPU, 0) + max(0, view.hint_tokens - view.match_tokens)
        sample = CalibrationSample.from_request(
            prompt_tokens=decision.prompt_tokens,
            gpu=gpu,
            cpu=tiers.get(_CPU, 0) + tiers.get(_CPU_U, 0),
            storage=tiers.get(_STORAGE, 0) + tiers.get(_STORAGE_U, 0),
            delivered=delivered,
            first_byte_s=seconds,
            queue_s=view.queue_s,
            pending=view.pending,
        )
        if sample is None:
            return
        self.rates.observe(replica.name, sample, replica.rate_pool)
        if self.queue_delay is not None:  # numbered with the queue samples, for the peers
            self.queue_delay.log_rates(
                replica.name,
                (
                    sample.uncached,
                    sample.cpu,
                    sample.storage,
                    sample.seconds,
                    sample.weight,
                    sample.queue_s,
                ),
            )

    def observe_shared_home(self, replica: str, affinity: bytes) -> None:
        """A peer router gave a new prefix its home: this router sends the prefix's next
        requests there too, unless it has given the prefix a home itself (the first one
        each router knows stays: homes are never moved by a peer). Homes are router-local
        otherwise, and two routers each honouring the home it gave sent one conversation's
        turns back and forth between two replicas (docs/benchmarks.md, "Several routers on
        this preset")."""
        if self.policy.uses_homes and affinity and affinity not in self.homes:
            self.homes.put(affinity, replica)
            self.homes_from_peers += 1

    def observe_shared_rates(self, replica: Replica, values: tuple[float, ...]) -> None:
        """A peer router's sample of ``replica``'s rates (``answered`` there): learned like an
        own one, never passed on."""
        if self.rates is not None:
            self.rates.observe(replica.name, CalibrationSample(*values), replica.rate_pool)
            self.rates.shared_applied += 1

    def observe_counters(self, replica: Replica, scraped: dict[str, float]) -> None:
        """A scrape of ``replica``'s /metrics (its gauges and counters): the difference in
        its prefill counters since the last sample is one more sample of its rates. Not
        shared with peers: each router scrapes every replica itself."""
        if self.rates is None:
            return
        sample = self.prefill_evidence.sample(replica.name, scraped)
        if sample is not None:
            self.rates.observe(replica.name, sample, replica.rate_pool)

    def forget(self, replica: str) -> None:
        self.prefill_evidence.forget(replica)
        if self.rates is not None:
            self.rates.forget(replica)
        self.hints.forget(replica)
        self.history.forget(replica)
        self.stored_rate.forget(replica)
        self.unstored.forget(replica)
        if self.queue_delay is not None:
            self.queue_delay.forget(replica)
        if self.kv_room is not None:
            self.kv_room.forget(replica)


def _output_budget(body: dict[str, Any], cost: CostSettings) -> int:
    """The output tokens a request may generate, all its sequences: ``max_completion_tokens``
    (or ``max_tokens``) x ``n`` (validated ints, router/tokens/requests.py), else the
    configured budget per sequence."""
    per = body.get("max_completion_tokens")
    if per is None:
        per = body.get("max_tokens")
    if not isinstance(per, int) or isinstance(per, bool):
        per = cost.kv_default_output_tokens
    n = body.get("n")
    n = n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1
    return max(0, per) * n


def _prefill_work_s(decision: Decision, view: ReplicaView, router: Router) -> float:
    """The prefill ``decision`` asks of the replica of ``view``: its uncached tokens at the
    configured rate, as the P/D decider prices work (router/routing/disagg.py, ``_work``);
    none for a decode leg, whose prompt is pulled beside the engine."""
    if decision.remote_prefill:
        return 0.0
    uncached = max(0, (decision.prompt_tokens or 0) - view.predicted_cached_tokens)
    return router.settings.cost.prefill_s_per_token * uncached


def _max_model_len(model: str, candidates: list[Replica]) -> int | None:
    """The largest context length the candidates' model cards give (vLLM's ``/v1/models``
    reports ``max_model_len``): a prompt past it fits no candidate."""
    lens = [
        card["max_model_len"]
        for r in candidates
        if isinstance(card := r.models.get(model), dict)
        and isinstance(card.get("max_model_len"), int)
    ]
    return max(lens) if lens and len(lens) == len(candidates) else None
