"""``--discover k8s``: the replica list from Kubernetes pods, kept current by list + watch.

A source like the replicas-file watcher (router/fleet/discovery/file.py): it hands the *full*
current list of ReplicaConfig to ``apply`` (RouterService.sync_replicas), which applies the
difference the same way for both. Pods map to replicas by router/fleet/discovery/k8s_pods.py.

The protocol, as client-go's reflector does it: list (remember the list's resourceVersion),
then watch from it with ``allowWatchBookmarks`` (bookmarks advance the version, so a quiet
namespace's watch can resume after the history moves on). We re-list and diff:

* on a 410 Gone (the version fell out of the API server's history): the watch cannot resume;
* on any broken watch: what happened while it was broken is unknown;
* every ``relist_interval_s``: a watch can go silently stale in the field (a proxy or load
  balancer dropping the stream without a FIN), and a re-list is the only cure.

Client: lightkube (an asyncio client, installed with the router; kr8s was the alternative).
Chosen because it is typed, small, loads in-cluster service-account or kubeconfig config with
one call, has generic resources for the InferencePool CRD, and its list exposes the list's
resourceVersion. Its own watch loop hides two things we need: on a 410 it resumes from "now"
(losing every delete in between, with no re-list) and it never asks for bookmarks. So we drive
list/watch ourselves: its public ``list``, and its request builder + watch driver with our own
parameters (``allowWatchBookmarks``) and its default on-error policy (raise), so that every
410 and every broken stream comes back here. lightkube is imported only when discovery runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import Callable
from typing import Any

from kvroute.router.common.periodic import PeriodicTask
from kvroute.router.config import ConfigError, K8sDiscoverySettings, ReplicaConfig
from kvroute.router.fleet.discovery.deletion_cost import ANNOTATION, DeletionCosts
from kvroute.router.fleet.discovery.k8s_pods import (
    PodPorts,
    fleet_from_pods,
    peer_urls,
    pod_is_ready,
)

__all__ = ["KubernetesDiscovery", "load_kube_config"]

log = logging.getLogger(__name__)

# InferencePool (Gateway API Inference Extension): v1 only. The v1alpha2 API
# (inference.networking.x-k8s.io) has not shipped since GIE v1.5; reading it would only hide
# a missing v1 pool behind a second 404.
POOL_GROUP, POOL_VERSION = "inference.networking.k8s.io", "v1"
MAX_BACKOFF_S = 10.0


def load_kube_config(path: str | None) -> Any:
    """lightkube's config: ``path`` (--kubeconfig), else the in-cluster service account when
    running in a pod, else $KUBECONFIG or ~/.kube/config. ConfigError when none can be read."""
    from lightkube import ConfigError as KubeConfigError
    from lightkube import KubeConfig

    try:
        return KubeConfig.from_file(path) if path else KubeConfig.from_env()
    except (KubeConfigError, OSError) as exc:
        raise ConfigError(f"--discover k8s: no Kubernetes config ({exc})") from exc


def pool_spec(pool: dict[str, Any]) -> tuple[dict[str, str], list[int]]:
    """An InferencePool's (selector labels, target ports), v1: ``spec.selector.matchLabels``
    and ``spec.targetPorts[].number``."""
    spec = pool.get("spec") or {}
    labels = (spec.get("selector") or {}).get("matchLabels")
    if not isinstance(labels, dict) or not labels:
        raise ConfigError("InferencePool has no spec.selector.matchLabels")
    if not spec.get("targetPorts"):
        raise ConfigError("InferencePool has no spec.targetPorts")
    ports = [int(p["number"]) for p in spec["targetPorts"]]
    if len(set(ports)) != len(ports):
        raise ConfigError(f"InferencePool spec.targetPorts repeats a port: {ports}")
    return {str(k): str(v) for k, v in labels.items()}, ports


def _status_code(exc: BaseException) -> int | None:
    """The HTTP status of a failed list/watch: an ERROR event's Status (lightkube's
    ApiError) or the response's own code."""
    status = getattr(exc, "status", None)
    code = getattr(status, "code", None)
    if code is None:
        code = getattr(getattr(exc, "response", None), "status_code", None)
    return code if isinstance(code, int) else None


def _describe(exc: BaseException) -> str:
    code = _status_code(exc)
    message = getattr(getattr(exc, "status", None), "message", None)
    if code is not None:
        return f"API answered {code}: {message or exc}"
    return f"{type(exc).__name__}: {exc}"


class KubernetesDiscovery:
    """Lists and watches the selected pods; ``apply`` gets each changed replica list.

    ``on_peers`` (when a peer selector is set) gets the other router pods' URLs at every
    (re)list. Runs on the router's event loop; ``status()`` is what /index/stats shows.
    """

    def __init__(
        self,
        settings: K8sDiscoverySettings,
        apply: Callable[[list[ReplicaConfig]], None],
        *,
        router_port: int = 8000,
        on_peers: Callable[[list[str]], None] | None = None,
        config: Any = None,
        costs: Callable[[list[str]], dict[str, int]] | None = None,
    ) -> None:
        self.settings = settings
        self.apply = apply
        self.on_peers = on_peers
        self.router_port = router_port
        self._config = config
        self.client: Any = None
        self.namespace: str | None = settings.namespace
        self.selector: dict[str, str] = dict(settings.selector)
        self.target_ports: list[int] = []
        self.peers: list[str] = []
        # This router's pod name, and its Ready peer routers' (--peer-selector): the first
        # name in order writes the deletion costs, the others compute them only.
        self.self_name = os.environ.get("POD_NAME") or socket.gethostname()
        self.peer_names: list[str] = []
        self._pods: dict[str, dict[str, Any]] = {}  # name -> pod (the API's JSON)
        self._applied: list[ReplicaConfig] | None = None
        self._bad: dict[str, str] = {}
        self._notes: dict[str, str] = {}
        self._task: asyncio.Task[None] | None = None
        # Deletion costs (deletion_cost.py): ``costs`` gives them, every interval, when on.
        self.deletion_costs: DeletionCosts | None = None
        self._costs_task: PeriodicTask | None = None
        if costs is not None and settings.deletion_cost_interval_s is not None:
            self.deletion_costs = DeletionCosts(costs, self.patch_deletion_cost)
            self._costs_task = PeriodicTask(
                "kvroute-deletion-cost", settings.deletion_cost_interval_s, self.cost_round
            )
        # status
        self.resource_version: str | None = None
        self.last_list_at: float | None = None
        self.lists = 0
        self.watch_restarts = 0
        self.relists_410 = 0
        self.relists_periodic = 0
        self.events = 0
        self.bookmarks = 0
        self.last_error: str | None = None
        self.last_error_at: float | None = None
        self.pods_seen = 0
        self.pods_ready = 0

    # --- lifecycle --------------------------------------------------------------------------

    async def connect(self) -> None:
        """Make the client (once). Raises ConfigError when no config can be loaded."""
        if self.client is not None:
            return
        from lightkube import AsyncClient

        config = self._config or load_kube_config(self.settings.kubeconfig)
        self.client = AsyncClient(config=config, namespace=self.settings.namespace)
        self.namespace = self.settings.namespace or self.client.namespace

    async def refresh_peers(self) -> list[str]:
        """List the peer router pods now (warm start asks before any feed starts); on an
        API error the last list is kept and the error reported."""
        await self.connect()
        if self.settings.peer_selector:
            try:
                await self._list_peers()
            except Exception as exc:
                self._error(f"listing peer routers failed: {_describe(exc)}")
        return list(self.peers)

    async def load_now(self) -> list[ReplicaConfig]:
        """Connect and do the first list (applied). Raises ConfigError when no config can be
        loaded; an unreachable API server is reported and retried by the background loop."""
        await self.connect()
        try:
            await self.relist()
        except Exception as exc:  # the loop retries; the router starts with what it has
            self._error(f"first list failed: {exc!r}")
        return list(self._applied or [])

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="kvroute-k8s-discovery")
        if self._costs_task is not None:
            self._costs_task.start()

    async def stop(self) -> None:
        if self._costs_task is not None:
            await self._costs_task.stop()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self.client is not None:
            await self.client.close()

    # --- list -------------------------------------------------------------------------------

    def _pool_resource(self) -> Any:
        from lightkube.generic_resource import create_namespaced_resource

        return create_namespaced_resource(
            POOL_GROUP, POOL_VERSION, "InferencePool", "inferencepools"
        )

    async def _read_pool(self) -> None:
        from lightkube import ApiError

        name = self.settings.inference_pool
        assert name is not None
        try:
            pool = await self.client.get(self._pool_resource(), name, namespace=self.namespace)
        except ApiError as exc:
            if exc.status.code != 404:
                raise
            raise ConfigError(
                f"InferencePool {self.namespace}/{name} not found in {POOL_GROUP}/{POOL_VERSION} "
                "(the v1alpha2 API, inference.networking.x-k8s.io, is not read: it has not "
                "shipped since the Inference Extension's v1.5)"
            ) from None
        self.selector, self.target_ports = pool_spec(pool.to_dict())

    async def relist(self) -> None:
        """List the pods, replace what we hold with the list (deletes missed by a watch show
        up as absent), and apply the result."""
        from lightkube.resources.core_v1 import Pod

        if self.settings.inference_pool:
            await self._read_pool()
        listing = self.client.list(Pod, namespace=self.namespace, labels=self.selector)
        pods = {}
        async for pod in listing:
            data = pod.to_dict()
            pods[data["metadata"]["name"]] = data
        self._pods = pods
        self.resource_version = listing.resourceVersion
        self.last_list_at = time.time()
        self.lists += 1
        self._apply()
        await self.refresh_peers()

    async def _list_peers(self) -> None:
        from lightkube.resources.core_v1 import Pod

        listing = self.client.list(
            Pod, namespace=self.namespace, labels=self.settings.peer_selector
        )
        pods = [pod.to_dict() async for pod in listing]
        self_name = self.self_name
        peers = peer_urls(pods, default_port=self.router_port, self_name=self_name)
        self.peer_names = sorted(
            str(p["metadata"]["name"])
            for p in pods
            if p["metadata"].get("name") != self_name and pod_is_ready(p)
        )
        if peers != self.peers:
            log.info("discovery: peer routers %s", peers)
        self.peers = peers
        if self.on_peers is not None:
            self.on_peers(peers)

    def _apply(self) -> None:
        defaults = PodPorts(self.settings.pod_events_port, self.settings.pod_replay_port)
        fleet = fleet_from_pods(self._pods.values(), self.target_ports, defaults)
        self.pods_seen, self.pods_ready = fleet.pods_seen, fleet.pods_ready
        for pod, why in fleet.errors.items():
            if self._bad.get(pod) != why:  # once per distinct problem, not at every event
                log.error("discovery: pod skipped: %s", why)
        for pod, what in fleet.notes.items():
            if self._notes.get(pod) != what:
                log.warning("discovery: pod %s: %s", pod, what)
        self._bad, self._notes = fleet.errors, fleet.notes
        if fleet.replicas != self._applied:
            self._applied = fleet.replicas
            self.apply(list(fleet.replicas))

    # --- deletion costs ---------------------------------------------------------------------

    @property
    def cost_writer(self) -> bool:
        """Whether this router writes the deletion costs: the first by pod name among itself
        and its Ready peers (they compute the same costs: one writer is enough, and a
        router that leaves hands the role to the next at the next re-list)."""
        return not self.peer_names or self.self_name < self.peer_names[0]

    async def cost_round(self) -> None:
        """One round of deletion costs over the selected pods not already being deleted,
        written by one router of the peers (``cost_writer``)."""
        if self.deletion_costs is None or not self.cost_writer:
            return
        pods = [
            name
            for name, pod in self._pods.items()
            if not (pod.get("metadata") or {}).get("deletionTimestamp")
        ]
        await self.deletion_costs.round(sorted(pods))

    async def patch_deletion_cost(self, pod: str, value: int) -> None:
        """A merge patch of the one annotation (nothing else of the pod is written)."""
        from lightkube.resources.core_v1 import Pod
        from lightkube.types import PatchType

        body = {"metadata": {"annotations": {ANNOTATION: str(value)}}}
        await self.client.patch(
            Pod, pod, body, namespace=self.namespace, patch_type=PatchType.MERGE
        )

    # --- watch ------------------------------------------------------------------------------

    def _watch_stream(self) -> Any:
        """lightkube's watch driver on a request with bookmarks on (its public watch cannot
        ask for them); errors raise, so every 410 and broken stream reaches ``_run``."""
        from lightkube.resources.core_v1 import Pod

        inner = self.client._client  # the request builder and watch driver behind watch()
        request = inner.prepare_request(
            "list",
            res=Pod,
            namespace=self.namespace,
            watch=True,
            params={
                "labelSelector": ",".join(f"{k}={v}" for k, v in self.selector.items()),
                "resourceVersion": self.resource_version,
                "allowWatchBookmarks": "true",
                "timeoutSeconds": self.settings.watch_timeout_s,
            },
        )
        return inner.watch(request)

    async def _watch(self) -> None:
        """Follow the watch until the next periodic re-list is due."""
        stream = self._watch_stream()
        async with contextlib.aclosing(stream):
            async for kind, pod in stream:
                data = pod.to_dict()
                meta = data.get("metadata") or {}
                self.resource_version = meta.get("resourceVersion") or self.resource_version
                if kind == "BOOKMARK":
                    self.bookmarks += 1
                    continue
                self.events += 1
                if kind == "DELETED":
                    self._pods.pop(meta.get("name"), None)
                else:
                    self._pods[meta.get("name")] = data
                self._apply()

    async def _run(self) -> None:
        backoff = 0.5
        relist = self.last_list_at is None
        while True:
            deadline = None
            try:
                if relist:
                    await self.relist()
                    relist, backoff = False, 0.5
                assert self.last_list_at is not None
                due = self.last_list_at + self.settings.relist_interval_s - time.time()
                deadline = asyncio.timeout(max(due, 0.0))
                async with deadline:
                    await self._watch()
                self.watch_restarts += 1  # lightkube resumes a watch that ends: unusual
                relist = True
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # never dies: the last list stays applied
                relist = True
                if isinstance(exc, TimeoutError) and deadline is not None and deadline.expired():
                    self.relists_periodic += 1
                    continue
                if _status_code(exc) == 410:
                    self.relists_410 += 1
                    log.info("discovery: watch expired (410 Gone); re-listing")
                    continue
                self.watch_restarts += 1
                self._error(_describe(exc))
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF_S)

    def _error(self, message: str) -> None:
        # A warning: watch streams are cut routinely (load balancers, API server restarts)
        # and the re-list repairs it; last_error and the counters keep the record.
        self.last_error, self.last_error_at = message, time.time()
        log.warning("discovery: %s; keeping the last replica list", message)

    def status(self) -> dict[str, Any]:
        return {
            "source": "k8s",
            "namespace": self.namespace,
            "selector": self.selector,
            "inference_pool": self.settings.inference_pool,
            "target_ports": self.target_ports,
            "last_list_at": self.last_list_at,
            "resource_version": self.resource_version,
            "lists": self.lists,
            "watch_restarts": self.watch_restarts,
            "relists_410": self.relists_410,
            "relists_periodic": self.relists_periodic,
            "watch_events": self.events,
            "bookmarks": self.bookmarks,
            "pods_seen": self.pods_seen,
            "pods_ready": self.pods_ready,
            "replicas": [r.key for r in self._applied or []],
            "bad_pods": dict(self._bad),
            "pod_notes": dict(self._notes),
            "peers": list(self.peers),
            "last_error": self.last_error,
            "last_error_at": self.last_error_at,
            "deletion_costs": None
            if self.deletion_costs is None
            else {**self.deletion_costs.status(), "writer": self.cost_writer},
        }
