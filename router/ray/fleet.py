"""One Ray Serve request router's kvroute: index, event feeds, tokenizer and policy.

``KVRouteRequestRouter`` (request_router.py) runs in every process that holds a handle to the
deployment (the ``OpenAiIngress`` replicas on the classic path, the ``LLMRouter`` on the
direct-streaming path); each builds one ``RayFleet``, which subscribes to every replica's
event stream, as ``kvroute serve`` does. Nothing here imports Ray: replicas are named by their
replica id and described by what they advertise (endpoints.py), so the tests drive it with
fake replicas.

- ``sync`` makes the advertised replicas the fleet: a new one is added and subscribed to, a
  gone one forgotten (its feed stopped, its index entries, hints and homes dropped), one whose
  stream moved (a restarted replica) is re-subscribed from nothing.
- ``decide`` parses a request body (the OpenAI request Ray hands the router, as a dict),
  tokenizes it as the engine will, and ranks the candidates with kvroute's cost model over
  every tier (``router/routing/router.py``, the same path ``kvroute serve`` decides on).
- ``routed``/``completed`` keep each replica's in-flight count (the queue term) and commit
  the decision (hints, homes); ``stats`` and the decision log show what was decided.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections import deque
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from kvroute.indexer.stats import collect_stats
from kvroute.indexer.subscriber import EventSource
from kvroute.router.config import ReplicaConfig, RouterSettings
from kvroute.router.errors import RouterError
from kvroute.router.fleet.replicas import Replica
from kvroute.router.ray.endpoints import ReplicaEvents
from kvroute.router.routing.feeds import index_and_feeds
from kvroute.router.routing.policies import make_policy
from kvroute.router.routing.router import Decision, Router
from kvroute.router.tokens.requests import ParsedRequest, parse_body
from kvroute.router.tokens.tokenization import LocalTokenizer, TokenizerBase

__all__ = ["RayFleet", "RayReplica", "body_of", "router_stats"]

log = logging.getLogger("ray.serve.kvroute")  # in the replica's Serve log

# Every open fleet of this process (one per request router, so per deployment handle). Here,
# not in request_router.py: Ray Serve ships a router's own module to the handle's process by
# value (cloudpickle), so a registry there would be a copy no caller could reach.
_OPEN: list[RayFleet] = []


def router_stats() -> list[dict[str, Any]]:
    """The stats of every kvroute request router in this process (``RayFleet.stats``)."""
    return [f.stats() for f in list(_OPEN)]


# ReplicaConfig wants a URL; a Ray replica is reached through its actor, never by HTTP.
_NO_URL = "http://ray-serve-replica.invalid"


@dataclass(frozen=True, slots=True)
class RayReplica:
    """A Serve replica as the router sees it: its id and what it advertises."""

    name: str  # the replica id's unique_id
    events: ReplicaEvents | None = None
    model_source: str | None = None  # where its engine loads the model (and tokenizer) from


def body_of(request: Any) -> dict[str, Any] | None:
    """The OpenAI body of what Ray hands a router: a pydantic request model on the classic
    path (``ChatCompletionRequest``/``CompletionRequest``: the fields the client set), a
    namespace of the body's fields on the direct-streaming path (``LLMRouter``), a dict, or
    the JSON text itself."""
    if isinstance(request, dict):
        return request
    if isinstance(request, bytes | str):
        try:
            body = json.loads(request)
        except ValueError:
            return None
        return body if isinstance(body, dict) else None
    if isinstance(request, SimpleNamespace):
        return dict(vars(request))
    dump = getattr(request, "model_dump", None)
    if dump is None:
        return None
    try:
        body = dump(mode="json", exclude_unset=True)
    except Exception:  # a model that cannot dump itself is routed by load
        return None
    return body if isinstance(body, dict) else None


def _kind(body: dict[str, Any]) -> str | None:
    if "messages" in body:
        return "chat"
    if "prompt" in body:
        return "completion"
    return None


class RayFleet:
    """The replicas of one deployment, their index, and the decisions over them."""

    def __init__(
        self,
        settings: RouterSettings,
        *,
        deployment: str = "",
        tokenizer: TokenizerBase | str | None = None,
        decision_log: str | None = None,
        keep_decisions: int = 1000,
    ) -> None:
        self.settings = settings
        self.deployment = deployment
        self.index, self.subscriber = index_and_feeds(settings)
        self.router = Router(
            settings, self.index, self.subscriber, None, make_policy(settings.policy, settings)
        )
        self.replicas: dict[str, Replica] = {}
        self._advertised: dict[str, RayReplica] = {}
        self._tokenizer_path = tokenizer if isinstance(tokenizer, str) else None
        if isinstance(tokenizer, TokenizerBase):
            self.router.tokenizer = tokenizer
        self._tokenizer_lock = asyncio.Lock()
        # Feed threads start and stop off the event loop, in order (as RouterService does).
        self._feed_ops = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvroute-ray-feeds")
        self.decisions = 0
        self.unparsed = 0  # requests routed by load: no body, or one the router cannot parse
        self.by_reason: dict[str, int] = {}
        # Totals over the routed decisions (what the router's Ray metrics count too).
        self.prompt_tokens = 0
        self.predicted_cached_tokens = 0
        self.recent: deque[dict[str, Any]] = deque(maxlen=keep_decisions)
        self._log_path = decision_log
        self._log_lock = threading.Lock()
        self.closed = False
        _OPEN.append(self)

    # --- replicas -------------------------------------------------------------------------

    def sync(self, replicas: Iterable[RayReplica]) -> None:
        """Make ``replicas`` the fleet: add the new, forget the gone, re-subscribe the moved."""
        wanted = {r.name: r for r in replicas}
        for name in [n for n in self._advertised if n not in wanted]:
            self.forget(name, "left the deployment")
        for name, replica in wanted.items():
            old = self._advertised.get(name)
            if old == replica:
                continue
            if old is not None and old.events is not None and old.events != replica.events:
                # Another stream is another engine: what the old one held is no longer there.
                self.forget(name, "its event stream changed")
            self._add(replica)

    def _add(self, replica: RayReplica) -> None:
        ev = replica.events
        config = ReplicaConfig(
            _NO_URL,
            events=ev.endpoint if ev else None,
            replay=ev.replay if ev else None,
            topic=ev.topic if ev else "",
            name=replica.name,
        )
        known = self.replicas.get(replica.name)
        self.replicas[replica.name] = Replica(config, healthy=True)
        if known is not None:
            self.replicas[replica.name].in_flight = known.in_flight
        self._advertised[replica.name] = replica
        if replica.model_source and self._tokenizer_path is None:
            self._tokenizer_path = replica.model_source
        if ev is not None and (known is None or known.config != config):
            source = EventSource(replica.name, ev.endpoint, ev.replay, ev.topic)
            self._feed_ops.submit(self.subscriber.set_sources, replica.name, [source])
            log.info(
                "kvroute: replica %s: subscribing to %s (replay %s, topic %r, from %s)",
                replica.name,
                ev.endpoint,
                ev.replay,
                ev.topic,
                ev.source,
            )
        elif ev is None:
            log.info("kvroute: replica %s advertises no KV events: routed by load", replica.name)

    def forget(self, name: str, why: str = "died") -> None:
        """A replica left or died: stop its feed, drop its index entries and what the router
        learned of it (hints, homes, queue delay)."""
        if self.replicas.pop(name, None) is None:
            return
        self._advertised.pop(name, None)
        self._feed_ops.submit(self.subscriber.remove_source, name)
        self.router.forget(name)
        log.info("kvroute: replica %s forgotten (%s)", name, why)

    # --- decisions ------------------------------------------------------------------------

    async def _tokenizer(self) -> TokenizerBase | None:
        if self.router.tokenizer is None and self._tokenizer_path:
            async with self._tokenizer_lock:
                if self.router.tokenizer is None:
                    path = self._tokenizer_path
                    try:
                        self.router.tokenizer = await asyncio.to_thread(
                            LocalTokenizer,
                            path,
                            cache_entries=self.settings.tokenizer_cache_entries,
                        )
                        log.info("kvroute: tokenizing as the engines do, from %s", path)
                    except Exception as exc:
                        log.warning("kvroute: no tokenizer from %s (%r): load only", path, exc)
                        self._tokenizer_path = None
        return self.router.tokenizer

    def parse(self, request: Any, token_ids: Any = None) -> ParsedRequest | None:
        """The request as the router reads it; None when it cannot be (routed by load).
        ``token_ids``: the prompt's ids when the caller already has them (Ray's
        ``LLMRouter`` passes ``request_token_ids`` when its tokenizer ran): routed on as is."""
        body = body_of(request)
        if (
            body is not None
            and isinstance(token_ids, list)
            and token_ids
            and all(isinstance(t, int) for t in token_ids)
        ):
            keep = ("model", "cache_salt", "max_tokens", "max_completion_tokens")
            body = {k: body[k] for k in keep if k in body} | {"prompt": token_ids}
        kind = None if body is None else _kind(body)
        if body is None or kind is None:
            return None
        try:
            return parse_body(json.dumps(body).encode(), kind)  # type: ignore[arg-type]
        except (RouterError, TypeError, ValueError):
            return None

    async def decide(
        self,
        request: Any,
        candidates: list[str],
        session: str | None = None,
        token_ids: Any = None,
    ) -> Decision | None:
        """Rank ``candidates`` (replica names) for ``request``; None when the request cannot
        be parsed or tokenized (the caller routes it by load)."""
        parsed = self.parse(request, token_ids)
        known = [self.replicas[n] for n in candidates if n in self.replicas]
        if parsed is None or not known:
            self.unparsed += 1
            return None
        await self._tokenizer()
        try:
            decision = await self.router.decide(parsed, known, session)
        except RouterError as exc:  # the tokenizer refused it (too long...): the engine will say
            log.debug("kvroute: not ranked (%s): routed by load", exc)
            self.unparsed += 1
            return None
        self.decisions += 1
        self.by_reason[decision.reason] = self.by_reason.get(decision.reason, 0) + 1
        return decision

    def routed(self, decision: Decision | None, name: str, request_id: str = "") -> None:
        """The request went to ``name``: count it in flight, commit and log the decision."""
        replica = self.replicas.get(name)
        if replica is None:
            return
        replica.begin_request()
        if decision is None:
            return
        self.router.commit(decision, replica)
        view = decision.view(name)
        self.prompt_tokens += decision.prompt_tokens or 0
        self.predicted_cached_tokens += 0 if view is None else view.predicted_cached_tokens
        entry = {
            "at": round(time.time(), 3),
            "request_id": request_id,
            "chosen": name,
            "first_choice": decision.ranked[0].name if decision.ranked else None,
            "reason": decision.reason,
            "prompt_tokens": decision.prompt_tokens,
            "predicted_cached_tokens": None if view is None else view.predicted_cached_tokens,
            "tokens_by_tier": {} if view is None else dict(view.tokens_by_tier),
            "candidates": {
                v.name: {
                    "predicted_cached_tokens": v.predicted_cached_tokens,
                    "est_ttft_s": None if v.est_ttft_s is None else round(v.est_ttft_s, 6),
                    "pending": v.pending,
                    "freshness": v.freshness,
                }
                for v in decision.views
            },
        }
        self.recent.append(entry)
        log.info(
            "kvroute: %s -> %s (%s; %s of %s prompt tokens predicted cached)",
            request_id or "request",
            name,
            decision.reason,
            entry["predicted_cached_tokens"],
            decision.prompt_tokens,
        )
        if self._log_path:
            line = json.dumps(entry) + "\n"
            with self._log_lock, open(self._log_path, "a", encoding="utf-8") as fh:
                fh.write(line)

    def completed(self, name: str) -> None:
        replica = self.replicas.get(name)
        if replica is not None and replica.in_flight > 0:
            replica.in_flight -= 1

    def set_queue_len(self, name: str, queue_len: int | None) -> None:
        """What the replica last said it has ongoing (Ray's queue-length cache: every
        router's requests), the other term of its pending count."""
        replica = self.replicas.get(name)
        if replica is not None and queue_len is not None:
            replica.running = float(queue_len)
            replica.sent_since_scrape = replica.ended_since_scrape = 0

    # --- views ----------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        index = collect_stats(self.index, self.subscriber).to_dict()
        replicas = {}
        for name, r in self.replicas.items():
            state, reason = self.subscriber.freshness(name)
            ev = self._advertised[name].events if name in self._advertised else None
            replicas[name] = {
                "events": None if ev is None else {**ev.to_dict(), "from": ev.source},
                "freshness": str(state) if ev else None,
                "freshness_reason": reason if ev else "no event stream advertised",
                "in_flight": r.in_flight,
                "pending": r.pending,
                "index": index["replicas"].get(name),
            }
        return {
            "deployment": self.deployment,
            "policy": self.router.policy.name,
            "tokenizer": getattr(self.router.tokenizer, "name", None),
            "decisions": self.decisions,
            "routed_by_load": self.unparsed,
            "prompt_tokens": self.prompt_tokens,
            "predicted_cached_tokens": self.predicted_cached_tokens,
            "reasons": dict(self.by_reason),
            "replicas": replicas,
            "fleet": index["fleet"],
            "recent": list(self.recent)[-20:],
        }

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self in _OPEN:
            _OPEN.remove(self)
        self._feed_ops.shutdown(wait=True)
        self.subscriber.close()
