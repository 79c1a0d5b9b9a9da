"""Kubernetes pods -> replicas and peer routers: the pure mapping behind ``--discover k8s``.

Kept apart from the list/watch loop (router/fleet/discovery/k8s.py) so the rules can be tested on
plain pod dicts (the API's JSON, as ``lightkube``'s ``to_dict()`` gives it) without a client.

A pod is a replica when it is Ready, has an IP and is not terminating. Its annotations say
where it publishes (the defaults are the router's ``PodPorts``: vLLM's events on 5557 and
replay on 5558 unless ``--pod-events-port``/``--pod-replay-port`` say otherwise, as for an
llm-d pool's pods: events on 5556, no replay; topic "": every topic):

* ``kvroute.io/http-port``: default the container port named ``http``, else 8000. With an
  InferencePool the pool's target ports decide and the annotation is ignored (noted in
  ``PodFleet.notes``): the gateway sends traffic to the pool's ports, so a pick elsewhere
  would name an endpoint the gateway does not serve.
* Several pool target ports (one vLLM server per port) make one replica per port,
  ``<pod>:<port>``; server i of n publishes events on the events port + i and replay on the
  replay port + i, except that a replay block overlapping the events block (vLLM's defaults,
  5557/5558, would make server 1's events port server 0's replay port) starts after it:
  events + n + i. An annotated replay port that overlaps is refused with the ports named.
* ``kvroute.io/events-port``, ``kvroute.io/replay-port``: ``none`` for no feed / no replay.
* ``kvroute.io/topic``, ``kvroute.io/dp`` (ranks N, or ``auto``: router/fleet/dp.py),
  ``kvroute.io/storage-domain``, ``kvroute.io/layout`` (which of the domain's chunks it
  reads: docs/indexer.md, storage domains).
* ``kvroute.io/role`` (a label or an annotation; the annotation wins): ``prefill``,
  ``decode`` or ``both`` (the default), its pool under prefill/decode disaggregation; a label
  lets one Deployment's selector and the router read the same fact.
* ``kvroute.io/speculative``: vLLM's ``speculative_config.method`` when it drafts with one
  (``eagle``, ``mtp``...: vLLM drops a block of every prefix-cache hit; docs/indexer.md).
* ``kvroute.io/zone``: where it runs, for preferring a prefill replica near the decode one;
  default the pod's node (``spec.nodeName``).

The pod's UID is the replica's incarnation: a pod recreated under the same name (a
StatefulSet) is a new replica whose index entries are cleared, as is one with a new IP.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvroute.router.config import ConfigError, ReplicaConfig

__all__ = [
    "ANNOTATIONS",
    "PodFleet",
    "PodPorts",
    "fleet_from_pods",
    "parse_selector",
    "peer_urls",
    "pod_is_ready",
    "pod_replicas",
]

log = logging.getLogger(__name__)

PREFIX = "kvroute.io/"
ANNOTATIONS = (
    "http-port",
    "events-port",
    "replay-port",
    "topic",
    "dp",
    "storage-domain",
    "layout",
    "speculative",
    "router-port",
)
DEFAULT_HTTP_PORT = 8000
DEFAULT_EVENTS_PORT = 5557
DEFAULT_REPLAY_PORT = 5558


@dataclass(frozen=True, slots=True)
class PodPorts:
    """Where a pod without port annotations publishes: vLLM's defaults, or the router's
    ``--pod-events-port``/``--pod-replay-port`` (None: no feed / no replay)."""

    events: int | None = DEFAULT_EVENTS_PORT
    replay: int | None = DEFAULT_REPLAY_PORT


def feed_ports(
    events: int | None, replay: int | None, servers: int, *, replay_annotated: bool
) -> list[tuple[int | None, int | None]]:
    """(events, replay) of each of ``servers`` servers in a pod (module docstring): + i each,
    the replay block moved after the events block when a default one overlaps it; an
    annotated one that overlaps is a ConfigError."""
    if events is None:
        return [(None, None)] * servers
    if (
        replay is not None
        and servers > 1
        and replay < events + servers
        and events < replay + servers
    ):
        if replay_annotated:
            raise ConfigError(
                f"{servers} servers publish events on {events}-{events + servers - 1} and "
                f"replay on {replay}-{replay + servers - 1}: the blocks overlap; give "
                f"{PREFIX}replay-port {events + servers} or more"
            )
        replay = events + servers
    return [(events + i, None if replay is None else replay + i) for i in range(servers)]


def parse_selector(value: str) -> dict[str, str]:
    """``app=vllm,tier=serve`` -> ``{"app": "vllm", "tier": "serve"}``. Equality terms only:
    an InferencePool's selector is matchLabels, and one form keeps --selector and pools alike."""
    labels: dict[str, str] = {}
    for term in (t.strip() for t in value.split(",")):
        if not term:
            continue
        key, sep, val = term.replace("==", "=").partition("=")
        key, val = key.strip(), val.strip()
        if not sep or not key or any(c in key + val for c in "!()= "):
            raise ConfigError(f"selector term {term!r}: use key=value (comma-separated)")
        labels[key] = val
    if not labels:
        raise ConfigError(f"selector {value!r} selects nothing: give key=value")
    return labels


def _meta(pod: dict[str, Any]) -> dict[str, Any]:
    return pod.get("metadata") or {}


def pod_is_ready(pod: dict[str, Any]) -> bool:
    """Ready condition True, an IP, and no deletion under way (a terminating pod takes no
    new requests even while its readiness probe still passes)."""
    if _meta(pod).get("deletionTimestamp"):
        return False
    status = pod.get("status") or {}
    if not status.get("podIP"):
        return False
    return any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in status.get("conditions") or []
    )


def _port(annotations: dict[str, str], name: str, default: int | None) -> int | None:
    raw = annotations.get(PREFIX + name)
    if raw is None:
        return default
    text = str(raw).strip()
    if text.lower() == "none":
        return None
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise ConfigError(f"annotation {PREFIX}{name}={raw!r}: a port 1-65535 (or none)")
    return int(text)


def _named_http_port(pod: dict[str, Any]) -> int | None:
    for container in (pod.get("spec") or {}).get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") == "http" and isinstance(port.get("containerPort"), int):
                return int(port["containerPort"])
    return None


def _dp(annotations: dict[str, str]) -> int | str | None:
    raw = annotations.get(PREFIX + "dp")
    if raw is None:
        return None
    text = str(raw).strip()
    if text == "auto":
        return "auto"
    if not text.isdigit() or int(text) < 1:
        raise ConfigError(f"annotation {PREFIX}dp={raw!r}: an integer >= 1 or auto")
    return int(text)


def _host(ip: str) -> str:
    return f"[{ip}]" if ":" in ip else ip


def pod_replicas(
    pod: dict[str, Any], target_ports: Sequence[int] = (), defaults: PodPorts = PodPorts()
) -> list[ReplicaConfig]:
    """The pod's replicas: none when it is not Ready (or has no IP), one per HTTP port
    otherwise. Raises ConfigError naming the pod when an annotation cannot be used."""
    if not pod_is_ready(pod):
        return []
    meta = _meta(pod)
    name = str(meta.get("name") or "")
    annotations = {k: str(v) for k, v in (meta.get("annotations") or {}).items()}
    try:
        host = _host(str((pod.get("status") or {})["podIP"]))
        if target_ports:
            ports = list(target_ports)  # the pool's: an http-port annotation is ignored
        else:
            http = _port(annotations, "http-port", None)
            ports = [http or _named_http_port(pod) or DEFAULT_HTTP_PORT]
        events = _port(annotations, "events-port", defaults.events)
        replay = _port(annotations, "replay-port", defaults.replay)
        dp = _dp(annotations)
        labels = {k: str(v) for k, v in (meta.get("labels") or {}).items()}
        role = annotations.get(PREFIX + "role") or labels.get(PREFIX + "role") or "both"
        zone = annotations.get(PREFIX + "zone") or (pod.get("spec") or {}).get("nodeName")
        if len(ports) > 1 and dp not in (None, 1):
            raise ConfigError(
                f"{PREFIX}dp with several target ports: server i publishes on the event "
                "ports + i, rank r on + r; they would collide (give one port per pod)"
            )
        plan = feed_ports(
            events, replay, len(ports), replay_annotated=PREFIX + "replay-port" in annotations
        )
        out = []
        for port, (events_i, replay_i) in zip(ports, plan, strict=True):
            out.append(
                ReplicaConfig(
                    url=f"http://{host}:{port}",
                    events=None if events_i is None else f"tcp://{host}:{events_i}",
                    replay=None if replay_i is None else f"tcp://{host}:{replay_i}",
                    topic=annotations.get(PREFIX + "topic", ""),
                    name=name if len(ports) == 1 else f"{name}:{port}",
                    dp=dp,
                    storage_domain=annotations.get(PREFIX + "storage-domain") or None,
                    layout=annotations.get(PREFIX + "layout") or None,
                    speculative=annotations.get(PREFIX + "speculative") or None,
                    incarnation=meta.get("uid"),
                    role=role,
                    zone=str(zone) if zone else None,
                )
            )
        return out
    except ConfigError as exc:
        raise ConfigError(f"pod {name}: {exc}") from None


@dataclass
class PodFleet:
    """The replicas of a pod list, and what was left out and why."""

    replicas: list[ReplicaConfig] = field(default_factory=list)
    pods_seen: int = 0
    pods_ready: int = 0
    errors: dict[str, str] = field(default_factory=dict)  # pod name -> why it was skipped
    notes: dict[str, str] = field(default_factory=dict)  # pod name -> what was ignored


def fleet_from_pods(
    pods: Iterable[dict[str, Any]],
    target_ports: Sequence[int] = (),
    defaults: PodPorts = PodPorts(),
) -> PodFleet:
    """Every pod's replicas, sorted by name; a pod with bad annotations is skipped (and
    named in ``errors``), never the whole list; an annotation the pool overrides is named
    in ``notes``."""
    fleet = PodFleet()
    for pod in pods:
        fleet.pods_seen += 1
        ready = pod_is_ready(pod)
        fleet.pods_ready += ready
        name = str(_meta(pod).get("name"))
        annotations = _meta(pod).get("annotations") or {}
        if target_ports and PREFIX + "http-port" in annotations:
            fleet.notes[name] = (
                f"{PREFIX}http-port={annotations[PREFIX + 'http-port']} ignored: the "
                f"InferencePool's target ports {list(target_ports)} decide"
            )
        try:
            fleet.replicas += pod_replicas(pod, target_ports, defaults)
        except ConfigError as exc:
            fleet.errors[name] = str(exc)
    fleet.replicas.sort(key=lambda r: r.key)
    return fleet


def peer_urls(pods: Iterable[dict[str, Any]], *, default_port: int, self_name: str) -> list[str]:
    """Ready router pods other than this one, as ``http://IP:PORT`` (``kvroute.io/router-port``,
    else this router's own port); a bad port annotation skips that pod (logged)."""
    urls = []
    for pod in pods:
        meta = _meta(pod)
        if meta.get("name") == self_name or not pod_is_ready(pod):
            continue
        annotations = {k: str(v) for k, v in (meta.get("annotations") or {}).items()}
        try:
            port = _port(annotations, "router-port", default_port)
        except ConfigError as exc:
            log.error("peer pod %s skipped: %s", meta.get("name"), exc)
            continue
        if port is not None:
            urls.append(f"http://{_host(pod['status']['podIP'])}:{port}")
    return sorted(urls)
