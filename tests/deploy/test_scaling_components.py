"""The scaling components (deploy/kubernetes/components/deletion-cost, autoscaling-keda),
rendered with the real ``kubectl kustomize`` into the CPU overlay as their comments say to
add them: the routers' flag goes through the real ``kvroute serve`` parser, the Role grants
what the deletion costs write on pods whose controller (a Deployment's ReplicaSet) reads
them, and the ScaledObject scales the replicas on a metric the router really exports."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate

from kvroute.router.cli import settings_from_args
from kvroute.router.ops.metrics import RouterMetrics
from tests.deploy.test_kubernetes_manifests import (
    edited_kube,
    one,
    render,
    router,
    selects,
    serve_args,
    vllm,
)


def _render_cpu_with(tmp_path: Path, *components: str) -> tuple[dict[str, Any], ...]:
    copy = edited_kube(
        tmp_path,
        "overlays/cpu/kustomization.yaml",
        lambda d: d.update(components=[f"../../components/{c}" for c in components]),
    )
    return render("cpu", copy)


def test_deletion_costs_are_off_by_default(tmp_path: Path) -> None:
    from tests.deploy.test_kubernetes_manifests import render

    settings = settings_from_args(serve_args(render("cpu")))
    assert settings.k8s_discovery is not None
    assert settings.k8s_discovery.deletion_cost_interval_s is None


def test_the_deletion_cost_component_turns_it_on_with_patch_on_pods(tmp_path: Path) -> None:
    objects = _render_cpu_with(tmp_path, "deletion-cost")
    settings = settings_from_args(serve_args(objects))
    assert settings.k8s_discovery is not None
    assert settings.k8s_discovery.deletion_cost_interval_s == 30
    account = router(objects)["spec"]["template"]["spec"]["serviceAccountName"]
    binding = one(objects, "RoleBinding", "kvroute-router-deletion-cost")
    namespace = router(objects)["metadata"]["namespace"]
    assert {"kind": "ServiceAccount", "name": account, "namespace": namespace} in binding[
        "subjects"
    ]
    role = one(objects, "Role", binding["roleRef"]["name"])
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["patch"]}]
    for obj in (role, binding):
        kubernetes_validate.validate(obj, "1.35.0", strict=True)
    # The pods it patches are the replicas the routers discover, in the Role's namespace,
    # and their controller reads the annotation: a Deployment's ReplicaSet does, a
    # StatefulSet would ignore it (it removes its highest ordinal).
    replicas = vllm(objects)
    assert (replicas["apiVersion"], replicas["kind"]) == ("apps/v1", "Deployment")
    assert replicas["metadata"]["namespace"] == role["metadata"]["namespace"] == namespace
    assert settings.k8s_discovery.namespace == namespace
    assert selects(
        settings.k8s_discovery.selector, replicas["spec"]["template"]["metadata"]["labels"]
    )


def test_the_keda_component_scales_the_replicas_on_the_exported_saturation(
    tmp_path: Path,
) -> None:
    objects = _render_cpu_with(tmp_path, "autoscaling-keda")
    scaled = one(objects, "ScaledObject", "vllm")
    target = scaled["spec"]["scaleTargetRef"]
    replicas = vllm(objects)
    assert target == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "vllm"}
    assert (target["kind"], target["name"]) == (replicas["kind"], replicas["metadata"]["name"])
    assert 1 <= scaled["spec"]["minReplicaCount"] < scaled["spec"]["maxReplicaCount"]
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "prometheus" and float(trigger["metadata"]["threshold"]) > 0
    exported = (
        RouterMetrics(
            lambda: {"replicas": {}, "tokenizer_modes": {}, "index_bytes": 0, "hint_keys": 0}
        )
        .render()
        .decode()
    )
    assert "kvroute_fleet_saturation " in exported
    assert "kvroute_fleet_saturation" in trigger["metadata"]["query"]
    behavior = scaled["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    # Scale-down slower than scale-up: each removal takes a cache with it.
    assert (
        behavior["scaleDown"]["stabilizationWindowSeconds"]
        > behavior["scaleUp"]["stabilizationWindowSeconds"]
    )
