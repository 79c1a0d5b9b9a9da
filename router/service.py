"""The router's running parts and their lifecycle, in one object the HTTP layer calls.

Owns: the in-process index and its event subscriber (one thread per replica feed, off the
event loop), the replica registry with its health checker, the tokenizer, the policy, the
pooled upstream client, metrics and accuracy counters, and the replicas-file watcher.
Replicas from flags are fixed; replicas from the file come and go with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from kvroute.indexer.cpu_priority import as_latency_sensitive, custom_slices_supported
from kvroute.indexer.index import PrefixIndex, domain_key
from kvroute.indexer.subscriber import EventSource, Freshness, ReplicaSnapshot
from kvroute.router.common import gc_policy
from kvroute.router.common.periodic import PeriodicTask
from kvroute.router.config import ReplicaConfig, RouterSettings
from kvroute.router.errors import RouterError
from kvroute.router.fleet.discovery.deletion_cost import costs_from_index
from kvroute.router.fleet.discovery.file import ReplicasFileWatcher
from kvroute.router.fleet.discovery.k8s import KubernetesDiscovery
from kvroute.router.fleet.dp import DataParallelDiscovery, static_targets
from kvroute.router.fleet.health import HealthChecker
from kvroute.router.fleet.replicas import Replica, ReplicaRegistry
from kvroute.router.ops.metrics import RouterMetrics
from kvroute.router.ops.stats import metrics_state, router_stats
from kvroute.router.peers.followers import PeerFollowers
from kvroute.router.peers.load import PeerLoad
from kvroute.router.peers.warm_start import SEED_TTL_S, PeerUrls, WarmStart, peer_list
from kvroute.router.routing.accuracy import AccuracyTracker
from kvroute.router.routing.disagg import Disaggregation, pools
from kvroute.router.routing.feeds import index_and_feeds
from kvroute.router.routing.policies import make_policy
from kvroute.router.routing.router import Decision, Router
from kvroute.router.serving.admission import Admission, AdmissionMetrics, Ticket
from kvroute.router.serving.auth import ReplicaAuth
from kvroute.router.serving.proxy import Forwarder
from kvroute.router.serving.upstream import UpstreamClient
from kvroute.router.tokens.model_tokenizers import (
    FleetTokenizer,
    build_tokenizer,
    check_against_replicas,
    log_startup_check,
)
from kvroute.router.tokens.requests import ParsedRequest, RequestLimits
from kvroute.router.tokens.tokenization import (
    LocalTokenizer,
    TokenizerBase,
)

__all__ = ["RouterService"]

log = logging.getLogger(__name__)


class RouterService:
    def __init__(self, settings: RouterSettings, *, tokenizer: TokenizerBase | None = None) -> None:
        # The event loop's thread, and whether the kernel gave it its short slice (start()).
        self.loop_thread_id: int | None = None
        self.loop_slice_set = False
        self.settings = settings
        self.in_flight = 0  # requests the proxied endpoints are handling (max_in_flight)
        self.limits = RequestLimits(
            max_json_depth=settings.max_json_depth,
            max_messages=settings.max_messages,
            max_n=settings.max_n,
        )
        self.index: PrefixIndex
        self.index, self.subscriber = index_and_feeds(settings)
        self.registry = ReplicaRegistry(
            unhealthy_after=settings.unhealthy_after, healthy_after=settings.healthy_after
        )
        # What replicas are shown: the replica key on every request (router/serving/auth.py).
        self.replica_auth = ReplicaAuth.of(settings.api_keys, settings.replica_api_key)
        # Off the request path (remote tokenization, self-checks): httpx.
        self.client = httpx.AsyncClient(
            headers=self.replica_auth.httpx_headers(),
            timeout=httpx.Timeout(
                connect=settings.connect_timeout_s,
                read=settings.read_timeout_s,
                write=settings.write_timeout_s,
                pool=settings.pool_timeout_s,
            ),
            limits=httpx.Limits(max_connections=64),
            trust_env=False,
        )
        # Health checks get their own small pool so they never queue behind proxied traffic.
        self.health_client = httpx.AsyncClient(
            headers=self.replica_auth.httpx_headers(),
            timeout=settings.health_timeout_s,
            trust_env=False,
            limits=httpx.Limits(max_connections=32),
        )
        self.health = HealthChecker(
            self.registry,
            self.health_client,
            interval_s=settings.health_interval_s,
            timeout_s=settings.health_timeout_s,
            models_refresh_s=settings.models_refresh_s,
            on_counters=lambda replica, scraped: self.router.observe_counters(replica, scraped),
        )
        self.metrics = RouterMetrics(self._metrics_state)
        self.admission = Admission(
            settings.admission,
            settings.max_pending_per_replica,
            settings.retry_after_s,
            settings.cost.prefill_s_per_token,
            AdmissionMetrics(self.metrics.registry),
        )
        self.accuracy = AccuracyTracker()
        self.disagg = Disaggregation(settings.disagg, settings.cost)  # P/D decider, counters
        self.upstream: UpstreamClient | None = None
        self.forwarder: Forwarder | None = None
        self._given_tokenizer = tokenizer
        self.tokenizer: TokenizerBase | None = None
        self.router = Router(
            settings, self.index, self.subscriber, None, make_policy(settings.policy, settings)
        )
        self.disagg.backlog = self.router.backlog  # the decider's waits: the work sent
        self.watcher = (
            ReplicasFileWatcher(
                settings.replicas_file,
                self.sync_replicas,
                interval_s=settings.watch_interval_s,
            )
            if settings.replicas_file
            else None
        )
        self.discovery: KubernetesDiscovery | None = None  # --discover k8s, like the file
        self._discovered_peers: list[str] = []
        if settings.k8s_discovery is not None:
            self.discovery = KubernetesDiscovery(
                settings.k8s_discovery,
                self.sync_replicas,
                router_port=settings.port,
                on_peers=self._set_discovered_peers,
                costs=lambda pods: costs_from_index(self.index, settings.cost, pods),
            )
        self._flag_names = {r.key for r in settings.replicas}
        # A configured replica's routing targets: itself, or its data-parallel ranks.
        self._targets: dict[str, list[str]] = {}
        self.dp_discovery = DataParallelDiscovery(
            self.health_client,
            self._apply_dp_targets,
            interval_s=settings.health_interval_s,
            refresh_s=settings.models_refresh_s,
            timeout_s=settings.health_timeout_s,
        )
        # Replicas from the replicas file or discovery (sync_replicas), as last applied.
        self._sourced_replicas: dict[str, ReplicaConfig] = {}
        # Feed threads start and stop (join) off the event loop, one at a time, in order.
        self._feed_ops = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvroute-feeds")
        self.tokenizer_check: dict[str, Any] | None = None
        self._check_task: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[Any]] = set()
        self._models_refreshed_at = 0.0
        self.started_at = time.time()
        # Warm start (peers/warm_start.py): the peers to seed the index from, asked once at
        # start before any feed starts; may be async. Discovery may replace it.
        self.peer_urls: PeerUrls = self._default_peer_urls
        self.warm = WarmStart()
        self.feeds_started = False  # /index/snapshot answers 503 until then
        # Shared load (router/peers/load.py): the same peers' in-flight counts, polled.
        self.peer_load = PeerLoad(
            interval_s=settings.peer_load_interval_s,
            timeout_s=max(0.05, min(1.0, 5 * settings.peer_load_interval_s)),
            api_key=settings.peer_credential,
            on_samples=None if self.router.queue_delay is None else self._apply_peer_samples,
            on_rate_samples=None if self.router.rates is None else self._apply_peer_rates,
            on_homes=self._apply_peer_homes,
        )
        if self.router.queue_delay is not None:  # a held /peer/load answers a new sample
            self.router.queue_delay.on_sample = self.registry.load_signal.changed
        self._peer_load_task: PeriodicTask | None = None
        self.peer_followers = PeerFollowers(
            self.peer_load, lambda: self.peer_load.apply(self.registry)
        )
        self._peer_client: httpx.AsyncClient | None = None

    @property
    def peer_load_on(self) -> bool:
        """Whether shared load runs (``--peer-load-interval-s`` above 0, after start)."""
        return self._peer_load_task is not None

    # --- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        # The upstream pool belongs to the loop that creates it: the app's loop.
        s = self.settings
        self.upstream = UpstreamClient(
            max_connections_per_replica=s.max_connections,
            connect_timeout_s=s.connect_timeout_s,
            read_timeout_s=s.read_timeout_s,
        )
        self.forwarder = Forwarder(
            self.upstream,
            self.registry,
            max_attempts=s.max_attempts,
            on_retry=self.metrics.retries.inc,
            auth=self.replica_auth,
            probe_timeout_s=min(1.0, s.health_timeout_s),
        )
        if self.discovery is not None:
            await self.discovery.refresh_peers()  # before warm start, which asks them
        await self.warm.fetch(
            await peer_list(self.peer_urls),
            api_key=s.peer_credential,
            timeout_s=s.peer_timeout_s,
            max_bytes=s.peer_snapshot_max_mib * 2**20,
        )
        for domain in self.settings.storage_domains:
            # A domain's evictor stream, keyed like a replica's (docs/indexer.md)
            source = EventSource(
                domain_key(domain.name), domain.events, domain.replay, domain.topic
            )
            self._feed_ops.submit(self.subscriber.add_source, source)
        for config in self.settings.replicas:
            self.add_replica(config)
        if self.watcher is not None:
            self.watcher.load_now()
        if self.discovery is not None:
            await self.discovery.load_now()
        self.tokenizer = await asyncio.to_thread(self._make_tokenizer)
        self.router.tokenizer = self.tokenizer
        await self.dp_discovery.run_once()
        await self.health.check_all()
        self.health.start()
        self.feeds_started = True
        if self.warm.seeds:  # replicas configured later may use them a while; then freed
            asyncio.get_running_loop().call_later(SEED_TTL_S + 1, self.warm.drop_stale_seeds)
        self.dp_discovery.start()
        if self.settings.peer_load_interval_s > 0:
            # Its own pool (one stream per followed peer): a peer's answer never waits
            # behind proxied traffic or health checks.
            self._peer_client = httpx.AsyncClient(
                trust_env=False, limits=httpx.Limits(max_connections=256)
            )
            step = (
                self.follow_peer_load
                if self.settings.peer_load_mode == "follow"
                else self.poll_peer_load
            )
            self._peer_load_task = PeriodicTask(
                "kvroute-peer-load", self.settings.peer_load_interval_s, step
            )
            self._peer_load_task.start()
        if self.watcher is not None:
            self.watcher.start()
        if self.discovery is not None:
            self.discovery.start()
        if self._has_local_tokenizer() and self.settings.tokenizer_check_on_start:
            self._check_task = asyncio.create_task(self._startup_check())
        if self.settings.gc_freeze:
            gc_policy.apply()  # startup's heap frozen, young collections less often
        if self.settings.gil_switch_interval_s is not None:
            sys.setswitchinterval(self.settings.gil_switch_interval_s)
        self.loop_thread_id = threading.get_native_id()
        if self.settings.loop_slice_s is not None:
            # An older kernel accepts the call and ignores it: only a kernel that honours it
            # counts as set.
            self.loop_slice_set = (
                as_latency_sensitive(self.settings.loop_slice_s) and custom_slices_supported()
            )
            if not self.loop_slice_set:
                log.info("the event loop keeps the kernel's time slice (needs Linux 6.12+)")

    async def stop(self) -> None:
        await self.admission.close()
        if self._check_task is not None:
            self._check_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._check_task
        if isinstance(self.tokenizer, FleetTokenizer):
            await self.tokenizer.close()
        await self.dp_discovery.stop()
        await self.health.stop()
        if self._peer_load_task is not None:
            await self._peer_load_task.stop()
        await self.peer_followers.stop()
        if self._peer_client is not None:
            await self._peer_client.aclose()
        if self.watcher is not None:
            await self.watcher.stop()
        if self.discovery is not None:
            await self.discovery.stop()
        await asyncio.to_thread(self._feed_ops.shutdown, wait=True)
        await asyncio.to_thread(self.subscriber.close)
        await self.client.aclose()
        await self.health_client.aclose()
        await self.router.aclose()
        if self.upstream is not None:
            self.upstream.close()

    def _make_tokenizer(self) -> TokenizerBase | None:
        return build_tokenizer(
            self.settings,
            given=self._given_tokenizer,
            needs_tokens=self.router.policy.needs_tokens,
            client=self.client,
            tokenize_url=self.tokenize_url,
            on_check=self.metrics.tokenizer_check,
            base_model=self.base_model,
        )

    def _has_local_tokenizer(self) -> bool:
        tok = self.tokenizer
        return isinstance(tok, LocalTokenizer) or (
            isinstance(tok, FleetTokenizer) and tok.has_local
        )

    def base_model(self, model: str) -> str:
        """A LoRA adapter's base model (vLLM lists adapters with a ``parent``), else the
        model itself: adapters are tokenized by their base model's tokenizer."""
        for replica in self.registry:
            card = replica.models.get(model)
            if isinstance(card, dict) and card.get("parent"):
                return str(card["parent"])
        return model

    async def _startup_check(self) -> None:
        await log_startup_check(self.check_tokenizer)

    async def check_tokenizer(
        self, samples: list[dict[str, Any]] | None = None
    ) -> list[dict[str, Any]]:
        """Compare the router's ids with each healthy replica's /tokenize (one per model)."""
        if self.tokenizer is None:
            raise RouterError(409, "the router runs without a tokenizer (policy needs none)")
        results = await check_against_replicas(
            self.tokenizer, self.registry.healthy(), self.health_client, samples
        )
        self.tokenizer_check = {"checked_at": time.time(), "results": results}
        return results

    # --- replicas -------------------------------------------------------------------------

    def add_replica(self, config: ReplicaConfig) -> Replica:
        """Register a configured replica: one routing target, or one per data-parallel rank
        (``dp=N``; ``dp=auto`` starts as one and is expanded by discovery). Returns the
        first target."""
        targets = static_targets(config)
        self._targets[config.key] = [t.key for t in targets]
        if config.dp == "auto":
            self.dp_discovery.watch(config)
        added = [self._add_target(t) for t in targets]
        return added[0]

    def _add_target(self, config: ReplicaConfig) -> Replica:
        replica = self.registry.add(config)
        # In feed order: after the removal of the replica's previous entry, if any
        self._feed_ops.submit(self.index.attach, config.key, config.storage_domain, config.layout)
        self._feed_ops.submit(self.index.set_speculative, config.key, config.speculative)
        sources = []
        if config.events:
            sources.append(EventSource(config.key, config.events, config.replay, config.topic))
        # Other engines' own sockets (llm-d's FS backend): every topic, no replay.
        sources += [EventSource(config.key, ep, None, "", stream=ep) for ep in config.aux]
        seed = self.warm.take(sources) if config.replay else None
        if seed is not None:
            self._feed_ops.submit(self._seed_feed, config.key, sources, seed)
        elif sources:
            self._feed_ops.submit(self.subscriber.set_sources, config.key, sources)
        return replica

    def _seed_feed(self, name: str, sources: list[EventSource], seed: ReplicaSnapshot) -> None:
        """Start a replica's feed from the peer's snapshot, else the normal way (feed worker)."""
        if self.subscriber.seed_replica(name, sources[0], seed):
            self.warm.imported(seed)
        else:
            self.subscriber.set_sources(name, sources)

    def _default_peer_urls(self) -> list[str]:
        """``--peer`` URLs, then those discovery found (``discovered_peers``)."""
        return [*self.settings.peers, *self.discovered_peers()]

    def snapshot_refusal(self) -> str | None:
        """Why this router's index is not worth copying now (None: it is): a peer must not
        seed itself from a router that is itself still catching up."""
        if not self.feeds_started:
            return "the router is starting"
        feeds = self.subscriber.feed_stats()
        if any(f.freshness is Freshness.SYNCING for f in feeds.values()):
            return "the router is replaying its replicas' events"
        if not any(f.freshness is Freshness.LIVE for f in feeds.values()):
            return "no replica's event feed is live"
        return None

    def _apply_dp_targets(self, server: ReplicaConfig, targets: list[ReplicaConfig]) -> None:
        """A ``dp=auto`` server advertised (other) ranks: replace the targets that changed,
        keep the feeds, counters and learned state of those that did not."""
        wanted = {t.key: t for t in targets}
        current = self._targets.get(server.key, [])
        keep = set()
        for name in current:
            replica = self.registry.get(name)
            if replica is not None and wanted.get(name) == replica.config:
                keep.add(name)
            else:
                self._remove_target(name)
        added = [self._add_target(t) for name, t in wanted.items() if name not in keep]
        self._targets[server.key] = list(wanted)
        with contextlib.suppress(RuntimeError):
            loop = asyncio.get_running_loop()
            for replica in added[:1]:  # one check covers the server's every rank
                task = loop.create_task(self.health.check(replica))
                self._background.add(task)
                task.add_done_callback(self._background.discard)

    def remove_replica(self, name: str) -> None:
        """Remove a configured replica (all its data-parallel ranks)."""
        self.dp_discovery.forget(name)
        for target in self._targets.pop(name, [name]):
            self._remove_target(target)

    def _remove_target(self, name: str) -> None:
        replica = self.registry.remove(name)
        if replica is None:
            return
        if replica.config.events or replica.config.aux:
            self._feed_ops.submit(self.subscriber.remove_source, name)
        else:
            self.index.remove_replica(name)
        self.router.forget(name)
        self.accuracy.forget(name)
        self.metrics.forget(name)

    def sync_replicas(self, replicas: list[ReplicaConfig]) -> None:
        """Make a source's full list (the replicas file's, or discovery's) the registered
        replicas: a changed entry (URL, ports, or incarnation: a new pod behind the name) is
        removed, its index entries with it, and added again. Flag replicas are never touched."""
        wanted = {r.key: r for r in replicas if r.key not in self._flag_names}
        for name, old in list(self._sourced_replicas.items()):
            if wanted.get(name) != old:
                self.remove_replica(name)
                del self._sourced_replicas[name]
                log.info("replica %s removed (%s)", name, self._source_name)
        added = []
        for name, config in wanted.items():
            if name not in self._sourced_replicas:
                self._sourced_replicas[name] = config
                added.append(self.add_replica(config))
                log.info("replica %s added (%s)", name, self._source_name)
        if added:
            # Check new replicas now rather than after a full interval.
            with contextlib.suppress(RuntimeError):
                loop = asyncio.get_running_loop()
                for replica in added:
                    task = loop.create_task(self.health.check(replica))
                    self._background.add(task)
                    task.add_done_callback(self._background.discard)

    @property
    def _source_name(self) -> str:
        return "discovery" if self.discovery is not None else "replicas file"

    def _apply_peer_samples(self, samples: list[tuple[str, float]]) -> None:
        """A peer's queue samples of the replicas this router knows (queue_model.py)."""
        if (learned := self.router.queue_delay) is not None:
            for name, seconds in samples:
                if self.registry.get(name) is not None:
                    learned.observe_shared(name, seconds)

    def _apply_peer_rates(self, samples: list[tuple[str, tuple[float, ...]]]) -> None:
        """A peer's samples of the rates of replicas this router knows (calibration.py)."""
        for name, values in samples:
            if (replica := self.registry.get(name)) is not None:
                self.router.observe_shared_rates(replica, values)

    def _apply_peer_homes(self, homes: list[tuple[str, bytes]]) -> None:
        """The homes a peer gave new prefixes, on replicas this router knows."""
        for name, affinity in (h for h in homes if self.registry.get(h[0]) is not None):
            self.router.observe_shared_home(name, affinity)

    async def poll_peer_load(self) -> None:
        """One round of shared load: ask the peers, then set every replica's share."""
        assert self._peer_client is not None
        await self.peer_load.poll(self._peer_client, await peer_list(self.peer_urls))
        self.peer_load.apply(self.registry)

    async def follow_peer_load(self) -> None:
        """Keep one follower per listed peer (router/peers/followers.py), and apply the sums
        here too, so a peer gone silent stops counting once stale."""
        assert self._peer_client is not None
        await self.peer_followers.follow(self._peer_client, await peer_list(self.peer_urls))
        self.peer_load.apply(self.registry)

    def _set_discovered_peers(self, peers: list[str]) -> None:
        self._discovered_peers = list(peers)

    def discovered_peers(self) -> list[str]:
        """Peer routers found by ``--peer-selector`` (http://IP:PORT), for warm start."""
        return list(self._discovered_peers)

    def candidates(self, model: str) -> list[Replica]:
        """Healthy replicas serving ``model``; 503 or 404 in OpenAI's schema when none."""
        found = self.registry.candidates(model)
        if found:
            return found
        self.healthy_or_503()
        retry = {"retry-after": str(self.settings.retry_after_s)}
        if model not in self.registry.known_models():
            self._refresh_models_soon()
            raise RouterError(404, f"The model `{model}` does not exist.", param="model")
        raise RouterError(503, f"no healthy replica serves model `{model}`", headers=retry)

    def _refresh_models_soon(self) -> None:
        """An unknown model may be a LoRA adapter loaded since the replicas' last
        ``/v1/models`` read: read them again now (at most once a second), so the adapter is
        routable as soon as a replica lists it rather than a refresh interval later."""
        now = time.monotonic()
        if now - self._models_refreshed_at < 1.0:
            return
        self._models_refreshed_at = now
        with contextlib.suppress(RuntimeError):
            loop = asyncio.get_running_loop()
            for replica in self.registry.healthy():
                replica.models_at = None
                task = loop.create_task(self.health.check(replica))
                self._background.add(task)
                task.add_done_callback(self._background.discard)

    def healthy_or_503(self) -> list[Replica]:
        """Every healthy replica; 503 with Retry-After in OpenAI's schema when none is."""
        healthy = self.registry.healthy()
        if not healthy:
            raise RouterError(
                503,
                "no healthy replica is available",
                headers={"retry-after": str(self.settings.retry_after_s)},
            )
        return healthy

    def pool(self, model: str | None) -> list[Replica]:
        """Where a request routed by load may go: the replicas serving ``model`` when the
        fleet knows it; else every healthy one (the replica is the judge of a model the
        router has not seen)."""
        if model and model in self.registry.known_models():
            return self.candidates(model)
        return self.healthy_or_503()

    def default_model(self) -> str | None:
        """vLLM's default when a body names no model: the one model the fleet serves."""
        known = self.registry.known_models(self.registry.healthy())
        bases = [m for m, card in known.items() if not card.get("parent")]
        return bases[0] if len(bases) == 1 else None

    async def decide(
        self,
        parsed: ParsedRequest,
        session: str | None,
        narrow: Callable[[list[Replica]], list[Replica]] | None = None,
        ticket: Ticket | None = None,
    ) -> Decision:
        """Rank the replicas for a parsed request: the one decision path of the proxied
        endpoints and the endpoint picker (router/epp/), so both pick alike. ``narrow``
        keeps the replicas a caller may use (the gateway's subset hint; raises when none is
        left); 404/503 when none remains; never a P/D fleet's prefill pool (``pools``).
        When every replica is saturated the request waits its turn (serving/admission.py)."""
        candidates = pools(self.candidates(parsed.model))[0]
        if narrow is not None:
            candidates = narrow(candidates)

        async def rank(among: list[Replica]) -> Decision:
            started = time.perf_counter()
            decision = await self.router.decide(parsed, among, session)
            self.metrics.decision_time.observe(time.perf_counter() - started)
            return decision

        decision = await self.admission.decide(parsed.model, candidates, ticket or Ticket(), rank)
        self.metrics.decisions.labels(decision.policy, decision.reason).inc()
        return decision

    def tokenize_url(self, model: str) -> str | None:
        pool = self.registry.candidates(model) or self.registry.healthy()
        if not pool:
            return None
        return min(pool, key=lambda r: r.pending).url

    # --- views ----------------------------------------------------------------------------

    def _metrics_state(self) -> dict[str, Any]:
        return metrics_state(self)

    def stats(self) -> dict[str, Any]:
        """What ``GET /index/stats`` answers (router/ops/stats.py)."""
        return router_stats(self)
