"""The endpoint-picker overlay (deploy/kubernetes/overlays/epp) and its cert-manager
component, rendered with the real ``kubectl kustomize``: the InferencePool against the
constraints of its CRD's schema (Gateway API Inference Extension v1.6,
``config/crd/bases/inference.networking.k8s.io_inferencepools.yaml``, written out below as a
JSON schema, with the CRD's one CEL rule as a check), and every reference between the pool,
the picker's Service, the routers' flags and ports, the HTTPRoute and the NetworkPolicy
followed to its target. No cluster and no gateway run here.
"""

from __future__ import annotations

import copy
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from kvroute.router.cli import settings_from_args
from kvroute.router.fleet.discovery.k8s import pool_spec
from kvroute.router.fleet.discovery.k8s_pods import pod_replicas
from tests.deploy.test_kubernetes_manifests import (
    KUBE,
    container,
    container_port,
    flag,
    one,
    render,
    router,
    selects,
    serve_args,
    vllm,
)

_NAME = {"type": "string", "minLength": 1, "maxLength": 253}
_PORT = {"type": "integer", "minimum": 1, "maximum": 65535}
_LABEL_VALUE = {
    "type": "string",
    "maxLength": 63,
    "pattern": r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$",
}
# InferencePool v1's spec as its CRD (GIE v1.6) constrains it. additionalProperties false:
# the API server would prune an unknown (misspelt) field silently, which is worse.
INFERENCE_POOL_V1: dict[str, Any] = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "inference.networking.k8s.io/v1"},
        "kind": {"const": "InferencePool"},
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["selector", "targetPorts", "endpointPickerRef"],
            "properties": {
                "appProtocol": {"enum": ["http", "kubernetes.io/h2c"]},
                "selector": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["matchLabels"],
                    "properties": {
                        "matchLabels": {
                            "type": "object",
                            "minProperties": 1,
                            "maxProperties": 64,
                            "additionalProperties": _LABEL_VALUE,
                        }
                    },
                },
                "targetPorts": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 8,
                    "uniqueItems": True,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["number"],
                        "properties": {"number": _PORT},
                    },
                },
                "endpointPickerRef": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["name"],
                    "properties": {
                        "group": {"type": "string", "maxLength": 253},
                        "kind": {"type": "string", "minLength": 1, "maxLength": 63},
                        "name": _NAME,
                        "port": {
                            "type": "object",
                            "additionalProperties": False,
                            "required": ["number"],
                            "properties": {"number": _PORT},
                        },
                        "failureMode": {"enum": ["FailOpen", "FailClose"]},
                    },
                },
            },
        },
    },
}


def validate_inference_pool(pool: dict[str, Any]) -> None:
    """The schema, then the CRD's CEL rule: ``self.kind != 'Service' || has(self.port)``."""
    jsonschema.validate(pool, INFERENCE_POOL_V1)
    ref = pool["spec"]["endpointPickerRef"]
    if ref.get("kind", "Service") == "Service" and "port" not in ref:
        raise jsonschema.ValidationError("port is required when kind is 'Service' or unspecified")


def test_the_inference_pool_validates_against_its_crd() -> None:
    pool = one(render("epp"), "InferencePool", "vllm")
    validate_inference_pool(pool)


@pytest.mark.parametrize(
    "break_it",
    [
        lambda s: s["endpointPickerRef"].pop("port"),
        lambda s: s.update(targetPorts=[]),
        lambda s: s["endpointPickerRef"].update(failureMode="Sometimes"),
        lambda s: s.update(targetPortNumber=8000),  # the retired v1alpha2 field
        lambda s: s.update(selector={"app": "vllm"}),  # v1alpha2's plain map
    ],
)
def test_the_schema_check_refuses_what_the_crd_refuses(break_it: Any) -> None:
    pool = copy.deepcopy(one(render("epp"), "InferencePool", "vllm"))
    break_it(pool["spec"])
    with pytest.raises(jsonschema.ValidationError):
        validate_inference_pool(pool)


def test_the_pool_the_picker_and_the_routers_name_each_other() -> None:
    objects = render("epp")
    pool = one(objects, "InferencePool", "vllm")
    ref = pool["spec"]["endpointPickerRef"]
    service = one(objects, "Service", ref["name"])
    (port,) = [p for p in service["spec"]["ports"] if p["port"] == ref["port"]["number"]]
    assert port["appProtocol"] == "http2"  # gRPC: the gateway must speak HTTP/2 to it
    deploy = router(objects)
    assert selects(service["spec"]["selector"], deploy["spec"]["template"]["metadata"]["labels"])
    c = container(deploy, "router")
    args = serve_args(objects)
    assert container_port(c, port["targetPort"]) == args.epp_port
    settings = settings_from_args(args)
    assert settings.epp_port == 9002 and not settings.epp_plaintext  # TLS by default
    # The routers' replica list is the pool: a pick is an address the gateway serves.
    assert args.inference_pool == pool["metadata"]["name"] and args.selector is None
    selector, target_ports = pool_spec(pool)
    sts = vllm(objects)
    template = sts["spec"]["template"]
    assert selects(selector, template["metadata"]["labels"])
    http = int(flag(container(sts, "vllm")["args"], "--port"))
    assert target_ports == [http]
    ready_pod = {
        "metadata": {**template["metadata"], "name": "vllm-0", "uid": "u"},
        "spec": template["spec"],
        "status": {"podIP": "10.0.0.7", "conditions": [{"type": "Ready", "status": "True"}]},
    }
    (replica,) = pod_replicas(ready_pod, target_ports)
    assert replica.url == f"http://10.0.0.7:{http}"


def test_the_route_sends_every_path_to_the_pool() -> None:
    objects = render("epp")
    route = one(objects, "HTTPRoute", "kvroute")
    (parent,) = route["spec"]["parentRefs"]
    assert parent["kind"] == "Gateway" and parent["name"]
    (rule,) = route["spec"]["rules"]
    assert rule["matches"] == [{"path": {"type": "PathPrefix", "value": "/"}}]
    (backend,) = rule["backendRefs"]
    assert backend["group"] == "inference.networking.k8s.io"
    assert backend["kind"] == "InferencePool"
    one(objects, "InferencePool", backend["name"])


def test_only_the_gateway_reaches_the_picker_and_http_stays_open() -> None:
    objects = render("epp")
    labels = router(objects)["spec"]["template"]["metadata"]["labels"]
    route = one(objects, "HTTPRoute", "kvroute")
    gateway = route["spec"]["parentRefs"][0]["name"]
    policies = [
        p
        for p in objects
        if p["kind"] == "NetworkPolicy" and selects(p["spec"]["podSelector"]["matchLabels"], labels)
    ]
    assert policies
    rules = [r for p in policies for r in p["spec"]["ingress"]]
    to_picker = [r for r in rules if 9002 in [p["port"] for p in r.get("ports", [])]]
    assert to_picker and all(r.get("from") for r in to_picker)  # never open to all
    for rule in to_picker:
        for peer in rule["from"]:
            assert peer["podSelector"]["matchLabels"] == {
                "gateway.networking.k8s.io/gateway-name": gateway
            }
    http = [r for r in rules if 8080 in [p["port"] for p in r.get("ports", [])]]
    assert http and not http[0].get("from")  # clients and peer routers


def _render_with_cert_manager(tmp_path: Path) -> tuple[dict[str, Any], ...]:
    """The epp overlay with components/epp-cert-manager, as its comment says to add it."""
    work = tmp_path / "kubernetes"
    shutil.copytree(KUBE, work)
    kustomization = work / "overlays" / "epp" / "kustomization.yaml"
    data = yaml.safe_load(kustomization.read_text())
    data["components"] = ["../../components/epp-cert-manager"]
    kustomization.write_text(yaml.safe_dump(data))
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl is needed to render the manifests (kubectl kustomize)"
    out = subprocess.run(
        [kubectl, "kustomize", str(work / "overlays" / "epp")],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return tuple(d for d in yaml.safe_load_all(out.stdout) if d)


def test_the_cert_manager_component_gives_the_routers_its_certificate(tmp_path: Path) -> None:
    objects = _render_with_cert_manager(tmp_path)
    certificate = one(objects, "Certificate", "kvroute-epp")
    issuer = one(objects, "Issuer", certificate["spec"]["issuerRef"]["name"])
    assert "selfSigned" in issuer["spec"]
    service = one(objects, "Service", "kvroute-epp")
    namespace = service["metadata"]["namespace"]
    assert {"kvroute-epp", f"kvroute-epp.{namespace}.svc"} <= set(certificate["spec"]["dnsNames"])
    deploy = router(objects)
    settings = settings_from_args(serve_args(objects))
    assert settings.epp_tls_cert and settings.epp_tls_key
    volumes = {
        v["name"]: v["secret"]["secretName"]
        for v in deploy["spec"]["template"]["spec"]["volumes"]
        if "secret" in v
    }
    mounts = {m["mountPath"]: m["name"] for m in container(deploy, "router")["volumeMounts"]}
    for path in (settings.epp_tls_cert, settings.epp_tls_key):
        directory, _, _ = path.rpartition("/")
        assert volumes[mounts[directory]] == certificate["spec"]["secretName"]
    assert {Path(settings.epp_tls_cert).name, Path(settings.epp_tls_key).name} == {
        "tls.crt",
        "tls.key",
    }  # the keys cert-manager writes into the Secret
