"""The endpoint-picker overlay (deploy/kubernetes/overlays/epp) and its cert-manager
component, rendered with the real ``kubectl kustomize``: the InferencePool against the
constraints of its CRD's v1 schema, and every reference between the pool, the picker's
Service, the routers' flags and ports, the HTTPRoute and the NetworkPolicy followed to its
target. No cluster and no gateway run here.

The schema below is transcribed field by field (our JSON-schema spelling, not the CRD's
text) from kubernetes-sigs/gateway-api-inference-extension
``config/crd/bases/inference.networking.k8s.io_inferencepools.yaml``, version v1, at tag
v1.6.0 (commit 992e5c292afb248801ce8d9234eb5b9d28eea231; the file unchanged since commit
80e21c3c7c602f6d73cb619a1a6348ce844de23d, "Make endpointPickerRef optional", and identical on
main at 84436a96b9e6ce2b59ddacd3d04c31b4fbd442de). Its two CEL rules are checked in code.
The oldest v1 release, v1.0.0 (commit ffea26329a16922bb3b2cf37a383417c511227d5), differs in
three ways that the overlay must also satisfy (``INFERENCE_POOL_V1_0``): ``endpointPickerRef``
is required, ``targetPorts`` holds at most one port, and there is no ``appProtocol`` (nor the
1..64 bound on ``matchLabels``).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from kvroute.router.cli import settings_from_args
from kvroute.router.fleet.discovery.k8s import pool_spec
from kvroute.router.fleet.discovery.k8s_pods import pod_replicas
from tests.deploy.test_kubernetes_manifests import (
    container,
    container_port,
    edited_kube,
    flag,
    one,
    render,
    router,
    selects,
    serve_args,
    vllm,
)

# A port as the CRD has it (``Port``: targetPorts[] and endpointPickerRef.port): an object
# whose one field ``number`` is required, an int32 in 1..65535.
_PORT = {
    "type": "object",
    "additionalProperties": False,
    "required": ["number"],
    "properties": {"number": {"type": "integer", "minimum": 1, "maximum": 65535}},
}
# InferencePool v1's spec as its CRD (GIE v1.6.0, module docstring) constrains it.
# additionalProperties false: the API server would prune an unknown (misspelt) field
# silently, which is worse than a refusal.
INFERENCE_POOL_V1: dict[str, Any] = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],  # the CRD: spec; k8s: the rest
    "properties": {
        "apiVersion": {"const": "inference.networking.k8s.io/v1"},
        "kind": {"const": "InferencePool"},
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["selector", "targetPorts"],  # endpointPickerRef optional since v1.6.0
            "properties": {
                "appProtocol": {"type": "string", "enum": ["http", "kubernetes.io/h2c"]},
                "selector": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["matchLabels"],
                    "properties": {
                        "matchLabels": {
                            "type": "object",
                            "minProperties": 1,
                            "maxProperties": 64,
                            # Keys unconstrained by the CRD; values as label values.
                            "additionalProperties": {
                                "type": "string",
                                "minLength": 0,
                                "maxLength": 63,
                                "pattern": r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$",
                            },
                        }
                    },
                },
                # CEL (in code): "port number must be unique"; x-kubernetes-list-type atomic.
                "targetPorts": {"type": "array", "minItems": 1, "maxItems": 8, "items": _PORT},
                "endpointPickerRef": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["name"],
                    "properties": {
                        "group": {  # default ""
                            "type": "string",
                            "minLength": 0,
                            "maxLength": 253,
                            "pattern": r"^$|^[a-z0-9]([-a-z0-9]*[a-z0-9])?"
                            r"(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$",
                        },
                        "kind": {  # default Service
                            "type": "string",
                            "minLength": 1,
                            "maxLength": 63,
                            "pattern": r"^[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?$",
                        },
                        "name": {"type": "string", "minLength": 1, "maxLength": 253},
                        # CEL (in code): required when kind is Service or unspecified.
                        "port": _PORT,
                        "failureMode": {"type": "string", "enum": ["FailOpen", "FailClose"]},
                    },
                },
            },
        },
    },
}


def _v1_0(schema: dict[str, Any]) -> dict[str, Any]:
    """The v1.0.0 CRD's v1 schema: the differences the module docstring lists."""
    old = copy.deepcopy(schema)
    spec = old["properties"]["spec"]
    spec["required"] = ["endpointPickerRef", "selector", "targetPorts"]
    del spec["properties"]["appProtocol"]
    spec["properties"]["targetPorts"]["maxItems"] = 1
    labels = spec["properties"]["selector"]["properties"]["matchLabels"]
    del labels["minProperties"], labels["maxProperties"]
    return old


INFERENCE_POOL_V1_0 = _v1_0(INFERENCE_POOL_V1)


def validate_inference_pool(
    pool: dict[str, Any], schema: dict[str, Any] = INFERENCE_POOL_V1
) -> None:
    """The schema, then the CRD's CEL rules: ``self.all(p1, self.exists_one(p2,
    p1.number==p2.number))`` on targetPorts, ``self.kind != 'Service' || has(self.port)`` on
    endpointPickerRef (kind defaults to Service before the rule runs)."""
    jsonschema.validate(pool, schema)
    numbers = [p["number"] for p in pool["spec"]["targetPorts"]]
    if len(set(numbers)) != len(numbers):
        raise jsonschema.ValidationError("port number must be unique")
    ref = pool["spec"].get("endpointPickerRef")
    if ref is not None and ref.get("kind", "Service") == "Service" and "port" not in ref:
        raise jsonschema.ValidationError("port is required when kind is 'Service' or unspecified")


def test_the_inference_pool_validates_against_its_crd() -> None:
    """Against v1.6.0's schema and v1.0.0's: the overlay works with every v1 release. The
    picker reference is kvroute's whole point here, so the overlay always names it (v1.0.0
    requires it; without it, since v1.6.0, the gateway would not call kvroute)."""
    pool = one(render("epp"), "InferencePool", "vllm")
    validate_inference_pool(pool)
    validate_inference_pool(pool, INFERENCE_POOL_V1_0)
    assert pool["spec"]["endpointPickerRef"]["name"]


def _set_port(s: dict[str, Any], number: int) -> None:
    s["endpointPickerRef"]["port"]["number"] = number


@pytest.mark.parametrize(
    "break_it",
    [
        lambda s: s["endpointPickerRef"].pop("port"),  # CEL: kind defaults to Service
        lambda s: (
            s["endpointPickerRef"].update(kind="Service") or s["endpointPickerRef"].pop("port")
        ),
        lambda s: s.update(targetPorts=[]),
        lambda s: s.update(targetPorts=[{"number": 8000}, {"number": 8000}]),  # CEL: unique
        lambda s: s.update(targetPorts=[{"number": p} for p in range(8000, 8009)]),  # > 8
        lambda s: s.update(targetPorts=[{"number": 0}]),
        lambda s: s.update(targetPorts=[8000]),  # a Port is an object
        lambda s: _set_port(s, 65536),
        lambda s: s["endpointPickerRef"].update(port=9002),  # a Port is an object
        lambda s: s["endpointPickerRef"].update(failureMode="Sometimes"),
        lambda s: s["endpointPickerRef"].update(group="Inference.Example"),  # DNS subdomain
        lambda s: s["endpointPickerRef"].update(kind="9Service"),
        lambda s: s["endpointPickerRef"].update(name=""),
        lambda s: s["endpointPickerRef"].pop("name"),
        lambda s: s["endpointPickerRef"].update(portNumber=9002),  # v1alpha2's extensionRef
        lambda s: s.update(appProtocol="grpc"),
        lambda s: s.update(targetPortNumber=8000),  # the retired v1alpha2 field
        lambda s: s.update(selector={"app": "vllm"}),  # v1alpha2's plain map
        lambda s: s.update(selector={"matchLabels": {}}),  # minProperties 1
        lambda s: s.update(selector={"matchLabels": {"app": "-vllm"}}),  # a label value
        lambda s: s.update(selector={"matchLabels": {"app": "vllm"}, "matchExpressions": []}),
        lambda s: s.pop("selector"),
        lambda s: s.pop("targetPorts"),
    ],
)
def test_the_schema_check_refuses_what_the_crd_refuses(break_it: Any) -> None:
    pool = copy.deepcopy(one(render("epp"), "InferencePool", "vllm"))
    break_it(pool["spec"])
    with pytest.raises(jsonschema.ValidationError):
        validate_inference_pool(pool)


def test_what_v1_6_allows_and_v1_0_refused() -> None:
    """The releases' differences (module docstring), each way: the check is not stricter or
    looser than the CRD it names."""
    base = one(render("epp"), "InferencePool", "vllm")
    for change in (
        lambda s: s.pop("endpointPickerRef"),
        lambda s: s.update(targetPorts=[{"number": 8000}, {"number": 8001}]),
        lambda s: s.update(appProtocol="kubernetes.io/h2c"),
    ):
        pool = copy.deepcopy(base)
        change(pool["spec"])
        validate_inference_pool(pool)
        with pytest.raises(jsonschema.ValidationError):
            validate_inference_pool(pool, INFERENCE_POOL_V1_0)
    # Defaults written out, and a non-Service picker without a port, are valid in both.
    for ref in (
        {"group": "", "kind": "Service", "name": "p", "port": {"number": 9002}},
        {"group": "example.com", "kind": "Picker", "name": "p", "failureMode": "FailOpen"},
    ):
        pool = copy.deepcopy(base)
        pool["spec"]["endpointPickerRef"] = ref
        validate_inference_pool(pool)
        validate_inference_pool(pool, INFERENCE_POOL_V1_0)


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
    replicas = vllm(objects)
    template = replicas["spec"]["template"]
    assert selects(selector, template["metadata"]["labels"])
    http = int(flag(container(replicas, "vllm")["args"], "--port"))
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
    copy = edited_kube(
        tmp_path,
        "overlays/epp/kustomization.yaml",
        lambda d: d.update(components=["../../components/epp-cert-manager"]),
    )
    return render("epp", copy)


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
