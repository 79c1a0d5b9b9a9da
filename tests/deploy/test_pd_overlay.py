"""The P/D overlay (deploy/kubernetes/overlays/pd), rendered with the real ``kubectl
kustomize``: two vLLM pools whose pods carry their role, both found by the routers'
discovery with that role (the router's own ``pod_replicas``), both in the seeds' shape (a
MultiConnector of NIXL and the kvroute connector, whose config the connector accepts), NIXL
reachable between the pools and nowhere else. tests/deploy/test_kubernetes_manifests.py
checks the overlay like every other (schemas, the decode pool's events, ports, images). No
cluster runs here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from kvroute.connector.config import ConnectorConfig
from kvroute.deploy.vllm_server import CONNECTOR_CLASS, CONNECTOR_MODULE
from kvroute.router.fleet.discovery.flags import discovery_from_args
from kvroute.router.fleet.discovery.k8s_pods import pod_replicas
from tests.deploy.test_kubernetes_manifests import (
    KUBE,
    container,
    container_port,
    edited_kube,
    flag,
    one,
    render,
    selects,
    serve_args,
    set_image,
)


def _pools() -> tuple[tuple[dict[str, Any], ...], dict[str, dict[str, Any]]]:
    objects = render("pd")
    return objects, {
        "decode": one(objects, "Deployment", "vllm"),
        "prefill": one(objects, "Deployment", "vllm-prefill"),
    }


def _labels(workload: dict[str, Any]) -> dict[str, str]:
    return workload["spec"]["template"]["metadata"]["labels"]


def _env(workload: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container(workload, "vllm")["env"]}


def test_the_routers_discover_both_pools_with_their_roles() -> None:
    objects, pools = _pools()
    discovery = discovery_from_args(serve_args(objects))
    assert discovery is not None
    for role, workload in pools.items():
        assert selects(discovery.selector, _labels(workload)), role
        template = workload["spec"]["template"]
        pod = {
            "metadata": {**template["metadata"], "name": f"{role}-0", "uid": f"u-{role}"},
            "spec": template["spec"],
            "status": {"podIP": "10.0.0.9", "conditions": [{"type": "Ready", "status": "True"}]},
        }
        (replica,) = pod_replicas(pod)
        assert replica.role == role
        assert replica.events == "tcp://10.0.0.9:5557"
    # Each Deployment owns its own pods only (a pool never adopts or counts the other's).
    decode, prefill = pools["decode"], pools["prefill"]
    assert not selects(decode["spec"]["selector"]["matchLabels"], _labels(prefill))
    assert not selects(prefill["spec"]["selector"]["matchLabels"], _labels(decode))
    for workload in pools.values():
        assert selects(workload["spec"]["selector"]["matchLabels"], _labels(workload))


def test_both_pools_run_nixl_and_the_kvroute_connector_and_differ_only_in_role() -> None:
    _, pools = _pools()
    configs = {}
    for role, workload in pools.items():
        transfer = json.loads(flag(container(workload, "vllm")["args"], "--kv-transfer-config"))
        assert transfer["kv_connector"] == "MultiConnector", role
        assert transfer["kv_load_failure_policy"] == "recompute"  # a failed pull recomputes
        nixl, ours = transfer["kv_connector_extra_config"]["connectors"]
        assert (nixl["kv_connector"], nixl["kv_role"]) == ("NixlConnector", "kv_both")
        assert ours["kv_connector"] == CONNECTOR_CLASS
        assert ours["kv_connector_module_path"] == CONNECTOR_MODULE
        ConnectorConfig.from_extra_config(ours["kv_connector_extra_config"])
        configs[role] = transfer
        env = _env(workload)
        host = env["VLLM_NIXL_SIDE_CHANNEL_HOST"]["valueFrom"]["fieldRef"]["fieldPath"]
        assert host == "status.podIP"  # vLLM's default, localhost, is no address to pull from
        port = int(env["VLLM_NIXL_SIDE_CHANNEL_PORT"]["value"])
        assert container_port(container(workload, "vllm"), "nixl") == port
        assert env["PYTHONHASHSEED"]["value"] == "0"
    assert configs["prefill"] == configs["decode"]
    decode, prefill = (container(pools[r], "vllm") for r in ("decode", "prefill"))
    assert decode["args"] == prefill["args"] and decode["image"] == prefill["image"]
    assert _env(pools["decode"]) == _env(pools["prefill"])


def test_the_transfer_ports_are_open_between_the_pools_only() -> None:
    objects, pools = _pools()
    policy = one(objects, "NetworkPolicy", "vllm-kv-transfer")
    for workload in pools.values():
        assert selects(policy["spec"]["podSelector"]["matchLabels"], _labels(workload))
    (rule,) = policy["spec"]["ingress"]
    (peer,) = rule["from"]
    assert set(peer) == {"podSelector"}
    for workload in pools.values():
        assert selects(peer["podSelector"]["matchLabels"], _labels(workload))
    env = _env(pools["decode"])
    side = int(env["VLLM_NIXL_SIDE_CHANNEL_PORT"]["value"])
    low, high = (int(p) for p in env["UCX_TCP_PORT_RANGE"]["value"].split("-"))
    opened = {(p["port"], p.get("endPort", p["port"])) for p in rule["ports"]}
    assert opened == {(side, side), (low, high)}
    assert not {5557, 5558} & {n for a, b in opened for n in range(a, b + 1)}  # routers' only


def test_both_pools_run_the_image_one_images_entry_names(tmp_path: Path) -> None:
    """The prefill pool's image is the decode pool's (kustomize replacements): the base
    overlay's one ``images:`` entry for kvroute-vllm names both, so a registry set there
    reaches both pools, and the overlay keeps no entry of its own that could drift from it
    (over ../gpu it would have put the CPU image on the prefill pool)."""
    _, pools = _pools()
    images = {role: container(w, "vllm")["image"] for role, w in pools.items()}
    assert images["prefill"] == images["decode"]
    overlay = yaml.safe_load((KUBE / "overlays" / "pd" / "kustomization.yaml").read_text())
    assert not [i for i in overlay.get("images", []) if i["name"] == "kvroute-vllm"]

    copy = edited_kube(
        tmp_path,
        "overlays/cpu/kustomization.yaml",
        lambda d: set_image(d, "kvroute-vllm", "registry.internal:5000/team/vllm-cpu"),
    )
    edited = render("pd", copy)
    for name in ("vllm", "vllm-prefill"):
        workload = one(edited, "Deployment", name)
        assert container(workload, "vllm")["image"] == "registry.internal:5000/team/vllm-cpu:9.9.9"
