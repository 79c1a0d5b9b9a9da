"""``KVRouteRequestRouter``: kvroute as a Ray Serve deployment's request router.

Configured by name on the deployment (an ``LLMConfig``'s ``deployment_config``)::

    "request_router_config": {
        "request_router_class": "kvroute.router.ray.request_router:KVRouteRequestRouter",
        "request_router_kwargs": {"tokenizer": "/models/tiny", "policy": "kvroute"},
    }

Ray builds one per deployment handle, in the process that holds it, and calls
``choose_replicas`` for every request: the router parses the OpenAI request Ray hands it
(``pending_request.args[0]``: a ``ChatCompletionRequest``/``CompletionRequest``, or a dict),
tokenizes it as the engine will, looks every replica's cached prefix up per tier in its
index (fed by the replicas' KV events: endpoints.py), ranks them with kvroute's cost model
and returns one group per replica, best first; Serve takes the first group whose replica has
room and falls through the others. A request it cannot parse goes to all candidates as one
group (Serve's power of two by queue length).

``request_router_kwargs`` (all optional): ``tokenizer`` (the model directory; default: what
the replicas advertise as their ``model_source``), ``policy`` (a kvroute policy name),
``decision_log`` (a file each decision is appended to as a JSON line), ``settings`` (more
``RouterSettings`` fields by name, such as ``{"default_block_size": 32}``).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from ray.serve.request_router import (
    PendingRequest,
    ReplicaID,
    ReplicaResult,
    RequestRouter,
    RunningReplica,
)
from ray.util import metrics

from kvroute.router.config import RouterSettings
from kvroute.router.ray.endpoints import replica_events
from kvroute.router.ray.fleet import RayFleet, RayReplica
from kvroute.router.routing.router import Decision

__all__ = ["KVRouteRequestRouter"]

log = logging.getLogger("ray.serve.kvroute")  # in the replica's Serve log


def _settings(kwargs: dict[str, Any]) -> RouterSettings:
    extra = dict(kwargs.get("settings") or {})
    if "policy" in kwargs:
        extra["policy"] = kwargs["policy"]
    # The router never reaches a replica over HTTP: no live tokenizer check against them.
    extra.setdefault("tokenizer_check_every", 0)
    extra.setdefault("tokenizer_check_on_start", False)
    return RouterSettings(**extra)


class KVRouteRequestRouter(RequestRouter):
    """Ranks a deployment's replicas by kvroute's index and cost model (module doc)."""

    def initialize_state(self, **kwargs: Any) -> None:
        self.fleet = RayFleet(
            _settings(kwargs),
            deployment=str(self._deployment_id),
            tokenizer=kwargs.get("tokenizer"),
            decision_log=kwargs.get("decision_log"),
        )
        # Per internal request id: the decision until the request is routed, then where it
        # went until it completes (Serve calls on_request_completed for rejected sends too).
        self._pending: dict[str, Decision | None] = {}
        self._routed: dict[str, str] = {}
        tags = {"deployment": self._deployment_id.name, "application": self.app_name}
        self._decisions = metrics.Counter(
            "kvroute_ray_decisions",
            description="Requests kvroute ranked the replicas for, by reason.",
            tag_keys=("deployment", "application", "reason"),
        ).set_default_tags(tags)
        self._predicted = metrics.Counter(
            "kvroute_ray_predicted_cached_tokens",
            description="Prompt tokens predicted cached on the replica each request went to.",
            tag_keys=("deployment", "application"),
        ).set_default_tags(tags)
        self._prompt = metrics.Counter(
            "kvroute_ray_prompt_tokens",
            description="Prompt tokens of the requests kvroute ranked.",
            tag_keys=("deployment", "application"),
        ).set_default_tags(tags)
        self._decision_time = metrics.Histogram(
            "kvroute_ray_decision_seconds",
            description="Time to tokenize, look up and rank one request.",
            boundaries=[0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5],
            tag_keys=("deployment", "application"),
        ).set_default_tags(tags)
        log.info("kvroute request router for %s: %s", self._deployment_id, kwargs)

    # --- replica set ----------------------------------------------------------------------

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self.fleet.sync(self._describe(r) for r in replicas)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.fleet.forget(replica_id.unique_id, "actor died")

    @staticmethod
    def _describe(replica: RunningReplica) -> RayReplica:
        metadata = replica.replica_metadata or {}
        stats = replica.routing_stats or {}
        source = metadata.get("model_source") or stats.get("model_source")
        return RayReplica(
            name=replica.replica_id.unique_id,
            events=replica_events(metadata, stats),
            model_source=source if isinstance(source, str) else None,
        )

    # --- routing --------------------------------------------------------------------------

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        if pending_request is None or not pending_request.args:
            return [candidate_replicas]
        # Routing stats change (every 10 s) without update_replicas: a replica may start
        # advertising its events only once its engine is up.
        self.fleet.sync(self._describe(r) for r in self._replicas.values())
        cache = self._replica_queue_len_cache
        by_name = {r.replica_id.unique_id: r for r in candidate_replicas}
        for name, r in by_name.items():
            self.fleet.set_queue_len(name, cache.get(r.replica_id))
        started = time.perf_counter()
        session = getattr(pending_request.metadata, "session_id", None) or None
        decision = await self.fleet.decide(
            pending_request.args[0],
            list(by_name),
            session,
            pending_request.kwargs.get("request_token_ids"),
        )
        self._decision_time.observe(time.perf_counter() - started)
        key = pending_request.metadata.internal_request_id
        if len(self._pending) > 100_000:  # requests cancelled before they were routed
            self._pending.clear()
        self._pending[key] = decision
        if decision is None:
            return [candidate_replicas]
        ranked = [[by_name[r.name]] for r in decision.ranked if r.name in by_name]
        left = [r for name, r in by_name.items() if all(name != d.name for d in decision.ranked)]
        return [*ranked, left] if left else ranked

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult
    ) -> None:
        key = pending_request.metadata.internal_request_id
        decision = self._pending.pop(key, None)
        name = replica_id.unique_id
        self._routed[key] = name
        self.fleet.routed(decision, name, pending_request.metadata.request_id)
        if decision is not None:
            self._decisions.inc(tags={"reason": decision.reason})
            view = decision.view(name)
            if view is not None and view.predicted_cached_tokens > 0:
                self._predicted.inc(view.predicted_cached_tokens)
            if decision.prompt_tokens:
                self._prompt.inc(decision.prompt_tokens)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._pending.pop(internal_request_id, None)
        if self._routed.pop(internal_request_id, None) is not None:
            self.fleet.completed(replica_id.unique_id)

    # --- views ----------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """What this router knows and decided: feeds, index, in-flight counts, decisions
        (``kvroute.router.ray.fleet.router_stats()`` gives every router's of a process: Serve
        loads this module by value, so it holds no registry of its own)."""
        return self.fleet.stats()
