"""``--discover k8s`` and its flags, as ``kvroute serve`` reads them (router/cli.py): the
flags beside the discovery they configure (k8s.py, k8s_pods.py; docs/router.md)."""

from __future__ import annotations

import argparse

from kvroute.router.config import ConfigError, K8sDiscoverySettings
from kvroute.router.fleet.discovery.k8s_pods import parse_selector

__all__ = ["add_discovery_arguments", "discovery_from_args"]


def add_discovery_arguments(parser: argparse.ArgumentParser) -> None:
    """``--discover k8s`` and its flags (router/fleet/discovery/k8s.py, docs/router.md)."""
    k8s = parser.add_argument_group("discovery (replicas from Kubernetes pods)")
    k8s.add_argument(
        "--discover",
        choices=("k8s",),
        default=None,
        help="k8s: the replicas are the Ready pods matching --selector or --inference-pool",
    )
    k8s.add_argument("--selector", metavar="KEY=VALUE[,...]", help="the vLLM pods' labels")
    k8s.add_argument(
        "--inference-pool",
        metavar="NAME",
        help="read the selector and target port(s) from this InferencePool (Gateway API "
        "Inference Extension, inference.networking.k8s.io/v1); its target ports decide the "
        "replicas' HTTP ports (a kvroute.io/http-port annotation is ignored)",
    )
    k8s.add_argument(
        "--pod-events-port",
        type=_port_or_none,
        default=5557,
        metavar="PORT|none",
        help="KV events of pods without kvroute.io/events-port (default 5557; llm-d: 5556)",
    )
    k8s.add_argument(
        "--pod-replay-port",
        type=_port_or_none,
        default=5558,
        metavar="PORT|none",
        help="their replay, without kvroute.io/replay-port (default 5558; llm-d: none)",
    )
    k8s.add_argument("--namespace", help="default: the kubeconfig's, or this pod's own")
    k8s.add_argument("--kubeconfig", help="default: in-cluster service account, else $KUBECONFIG")
    k8s.add_argument(
        "--relist-interval-s",
        type=float,
        default=60.0,
        help="re-list the pods this often even when the watch looks healthy (stale watches)",
    )
    k8s.add_argument(
        "--deletion-cost-interval-s",
        type=float,
        default=None,
        metavar="S",
        help="every S seconds, set controller.kubernetes.io/pod-deletion-cost on each replica "
        "pod to what losing it would cost (recompute of the prefixes only it holds), so a "
        "scale-down removes the cheapest; needs patch on pods (RBAC). Default: off",
    )
    k8s.add_argument(
        "--peer-selector",
        metavar="KEY=VALUE[,...]",
        help="labels of this router's peer router pods (warm start from their index)",
    )


def discovery_from_args(args: argparse.Namespace) -> K8sDiscoverySettings | None:
    """The discovery settings the flags ask for; ConfigError when they do not add up."""
    given = [f for f in ("selector", "inference_pool", "peer_selector") if getattr(args, f)]
    if args.discover is None:
        if given:
            flag = "--" + given[0].replace("_", "-")
            raise ConfigError(f"{flag} needs --discover k8s")
        return None
    if args.replicas_file:
        raise ConfigError("--discover k8s and --replicas-file both give the replica list: pick one")
    return K8sDiscoverySettings(
        selector=parse_selector(args.selector) if args.selector else {},
        inference_pool=args.inference_pool,
        namespace=args.namespace,
        kubeconfig=args.kubeconfig,
        relist_interval_s=args.relist_interval_s,
        peer_selector=parse_selector(args.peer_selector) if args.peer_selector else {},
        pod_events_port=args.pod_events_port,
        deletion_cost_interval_s=args.deletion_cost_interval_s,
        pod_replay_port=args.pod_replay_port,
    )


def _port_or_none(value: str) -> int | None:
    """``--pod-events-port``/``--pod-replay-port``: a port, or ``none``."""
    if value.strip().lower() == "none":
        return None
    if not value.strip().isdigit() or not 1 <= int(value) <= 65535:
        raise argparse.ArgumentTypeError(f"{value!r}: a port 1-65535 or none")
    return int(value)
