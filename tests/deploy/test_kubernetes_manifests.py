"""The Kubernetes manifests in deploy/kubernetes: every overlay renders with the real
``kubectl kustomize``, every object validates against Kubernetes' own schemas (strict), and
the pieces are wired to each other and to the code that reads them.

No cluster here: what a cluster would check at apply time (schemas) is checked with
kubernetes-validate, and what only our code gives meaning to (annotations, flags, JSON
configs) is fed to that code itself: the router's CLI parser, its pod discovery
(kvroute.router.fleet.discovery.k8s_pods), the connector's config, and vLLM's own ``serve`` parser.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from kvroute.connector.config import ConnectorConfig
from kvroute.deploy.cli import build_parser
from kvroute.deploy.vllm_server import CONNECTOR_CLASS, CONNECTOR_MODULE
from kvroute.router.cli import add_arguments, settings_from_args
from kvroute.router.fleet.discovery.flags import discovery_from_args
from kvroute.router.fleet.discovery.k8s import pool_spec
from kvroute.router.fleet.discovery.k8s_pods import pod_replicas
from tests.paths import REPO_ROOT

KUBE = REPO_ROOT / "deploy" / "kubernetes"
OVERLAYS = ["cpu", "gpu", "shared-storage", "epp", "pd"]
# The oldest Kubernetes still commonly run and a recent one: a field too new for the first
# or removed by the second fails.
K8S_VERSIONS = ["1.30.0", "1.35.0"]
# Kinds of CRDs kubernetes-validate has no schema for: their required fields, checked here.
CRD_REQUIRED = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): ["spec.selector", "spec.endpoints"],
    ("monitoring.coreos.com/v1", "PodMonitor"): ["spec.selector", "spec.podMetricsEndpoints"],
    # The InferencePool is also checked against its CRD's schema (tests/deploy/test_epp_overlay.py).
    ("inference.networking.k8s.io/v1", "InferencePool"): [
        "spec.selector.matchLabels",
        "spec.targetPorts",
        "spec.endpointPickerRef.name",
    ],
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): ["spec.parentRefs", "spec.rules"],
}
# The CRD kinds each overlay must contain (none elsewhere: their CRDs are not assumed).
OVERLAY_CRDS = {
    "gpu": {
        ("monitoring.coreos.com/v1", "ServiceMonitor"),
        ("monitoring.coreos.com/v1", "PodMonitor"),
    },
    "epp": {
        ("inference.networking.k8s.io/v1", "InferencePool"),
        ("gateway.networking.k8s.io/v1", "HTTPRoute"),
    },
}
EVENT_PORTS = {5557, 5558}
STORAGE_EVENT_PORTS = {5600, 5601}


@functools.cache
def render(overlay: str, kube: Path = KUBE) -> tuple[dict[str, Any], ...]:
    """``kubectl kustomize`` of ``overlay`` in ``kube`` (the tree, or an edited copy)."""
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl is needed to render the manifests (kubectl kustomize)"
    out = subprocess.run(
        [kubectl, "kustomize", str(kube / "overlays" / overlay)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    return tuple(d for d in yaml.safe_load_all(out.stdout) if d)


def edited_kube(tmp_path: Path, path: str, edit: Callable[[Any], Any]) -> Path:
    """A copy of deploy/kubernetes whose YAML file ``path`` is replaced by ``edit`` of its
    parsed content (the value ``edit`` returns, else the content it changed in place): what
    an operator's change there renders to, the tree itself untouched."""
    work = tmp_path / "kubernetes"
    shutil.copytree(KUBE, work)
    target = work / path
    data = yaml.safe_load(target.read_text())
    changed = edit(data)
    target.write_text(yaml.safe_dump(data if changed is None else changed))
    return work


def set_image(kustomization: dict[str, Any], name: str, new_name: str) -> None:
    """Point the ``images:`` entry ``name`` of a parsed kustomization at ``new_name``:9.9.9."""
    (entry,) = [i for i in kustomization["images"] if i["name"] == name]
    entry.update(newName=new_name, newTag="9.9.9")


def one(objects: tuple[dict[str, Any], ...], kind: str, name: str) -> dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, (kind, name, [(o["kind"], o["metadata"]["name"]) for o in objects])
    return found[0]


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def container(workload: dict[str, Any], name: str) -> dict[str, Any]:
    (c,) = [c for c in workload["spec"]["template"]["spec"]["containers"] if c["name"] == name]
    return c


def container_port(c: dict[str, Any], port: int | str) -> int:
    """A probe's or Service's target port (a number or a port name) as a number."""
    if isinstance(port, int):
        assert port in [p["containerPort"] for p in c["ports"]], port
        return port
    (number,) = [p["containerPort"] for p in c["ports"] if p.get("name") == port]
    return int(number)


def expand(arg: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in command and args."""
    return re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], arg)


def router(objects: tuple[dict[str, Any], ...]) -> dict[str, Any]:
    return one(objects, "Deployment", "kvroute-router")


def vllm(objects: tuple[dict[str, Any], ...]) -> dict[str, Any]:
    return one(objects, "Deployment", "vllm")


def flag(args: list[str], name: str) -> str:
    """The value of ``name VALUE`` or ``name=VALUE`` in an argument list."""
    for i, arg in enumerate(args):
        if arg == name:
            return args[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    raise AssertionError(f"{name} not in {args}")


def serve_args(objects: tuple[dict[str, Any], ...]) -> argparse.Namespace:
    """The router container's arguments through the real ``kvroute serve`` parser
    (argparse exits on an unknown flag: SystemExit fails the test)."""
    args = container(router(objects), "router")["args"]
    assert args[0] == "serve"
    env = {"POD_NAMESPACE": "kvroute", "MODEL": "Qwen/Qwen2.5-0.5B-Instruct"}
    parser = argparse.ArgumentParser(prog="kvroute serve", exit_on_error=False)
    add_arguments(parser)
    return parser.parse_args([expand(a, env) for a in args[1:]])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_validates_against_kubernetes_schemas(overlay: str) -> None:
    objects = render(overlay)
    seen_crds = set()
    for obj in objects:
        key = (obj["apiVersion"], obj["kind"])
        if key in CRD_REQUIRED:
            seen_crds.add(key)
            for path in CRD_REQUIRED[key]:
                node: Any = obj
                for part in path.split("."):
                    assert isinstance(node, dict) and part in node, (obj["kind"], path)
                    node = node[part]
                assert node, (obj["kind"], path)
            continue
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(obj, version, strict=True)
    assert seen_crds == OVERLAY_CRDS.get(overlay, set())


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_router_deployment_service_pdb_and_rbac_are_wired(overlay: str) -> None:
    objects = render(overlay)
    deploy = router(objects)
    spec = deploy["spec"]
    assert spec["replicas"] >= 2
    assert spec["strategy"]["rollingUpdate"]["maxUnavailable"] == 0  # ready before removed
    labels = spec["template"]["metadata"]["labels"]
    assert selects(spec["selector"]["matchLabels"], labels)
    c = container(deploy, "router")
    port = container_port(c, "http")
    args = serve_args(objects)
    assert port == args.port and args.host == "0.0.0.0"

    probe = c["readinessProbe"]["httpGet"]
    assert probe["path"] == "/ready" and container_port(c, probe["port"]) == port
    assert "httpGet" not in c["livenessProbe"]  # a fleet outage must not restart routers

    service = one(objects, "Service", "kvroute")
    assert selects(service["spec"]["selector"], labels)
    (svc_port,) = service["spec"]["ports"]
    assert container_port(c, svc_port["targetPort"]) == port

    pdb = one(objects, "PodDisruptionBudget", "kvroute-router")
    assert selects(pdb["spec"]["selector"]["matchLabels"], labels)
    assert 1 <= pdb["spec"]["minAvailable"] < spec["replicas"]

    account = spec["template"]["spec"]["serviceAccountName"]
    one(objects, "ServiceAccount", account)
    namespace = deploy["metadata"]["namespace"]
    bindings = [
        b
        for b in objects
        if b["kind"] == "RoleBinding"
        and {"kind": "ServiceAccount", "name": account, "namespace": namespace} in b["subjects"]
    ]
    assert bindings
    granted: set[tuple[str, str, str]] = set()
    for binding in bindings:
        assert binding["roleRef"]["kind"] == "Role"
        role = one(objects, "Role", binding["roleRef"]["name"])
        for rule in role["rules"]:
            granted |= {
                (g, r, v)
                for g in rule["apiGroups"]
                for r in rule["resources"]
                for v in rule["verbs"]
            }
    for verb in ("get", "list", "watch"):
        assert ("", "pods", verb) in granted
        assert ("inference.networking.k8s.io", "inferencepools", verb) in granted
    assert {v for _, _, v in granted} == {"get", "list", "watch"}  # read-only


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_router_flags_are_accepted_by_the_real_cli(overlay: str) -> None:
    objects = render(overlay)
    args = serve_args(objects)
    settings = settings_from_args(args)  # every value accepted, not only every flag name
    argv = container(router(objects), "router")["args"]
    top = build_parser(argv).parse_args(
        [expand(a, {"POD_NAMESPACE": "ns", "MODEL": "m"}) for a in argv]
    )
    assert top.command == "serve" and top.selector == args.selector
    discovery = discovery_from_args(args)
    assert discovery is not None
    assert discovery.namespace == "kvroute"
    vllm_labels = vllm(objects)["spec"]["template"]["metadata"]["labels"]
    router_labels = router(objects)["spec"]["template"]["metadata"]["labels"]
    selector = discovery.selector
    if discovery.inference_pool:  # the pool's selector and ports, as discovery reads them
        selector, ports = pool_spec(one(objects, "InferencePool", discovery.inference_pool))
        assert int(flag(container(vllm(objects), "vllm")["args"], "--port")) in ports
    assert selects(selector, vllm_labels)
    assert selects(discovery.peer_selector, router_labels)
    assert not selects(selector, router_labels)
    assert settings.policy == "kvroute" and settings.ready_grace_s > 0
    env = {e["name"]: e for e in container(router(objects), "router")["env"]}
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_vllm_pods_publish_where_their_annotations_say(overlay: str) -> None:
    """The router's own discovery, fed a Ready pod made from the template, connects to the
    ports vLLM binds; the connector accepts its config."""
    objects = render(overlay)
    replicas = vllm(objects)
    template = replicas["spec"]["template"]
    c = container(replicas, "vllm")
    args = c["args"]
    events = json.loads(flag(args, "--kv-events-config"))
    transfer = json.loads(flag(args, "--kv-transfer-config"))
    assert events["enable_kv_cache_events"] is True and events["publisher"] == "zmq"
    bound = {k: int(events[k].removeprefix("tcp://*:")) for k in ("endpoint", "replay_endpoint")}
    assert set(bound.values()) == EVENT_PORTS
    assert {p["containerPort"] for p in c["ports"]} >= EVENT_PORTS
    http = int(flag(args, "--port"))
    assert container_port(c, "http") == http
    assert template["spec"]["containers"][0]["readinessProbe"]["httpGet"]["path"] == "/health"

    pod = {
        "metadata": {**template["metadata"], "name": "vllm-0", "uid": "u-0"},
        "spec": template["spec"],
        "status": {"podIP": "10.0.0.7", "conditions": [{"type": "Ready", "status": "True"}]},
    }
    (replica,) = pod_replicas(pod)
    assert replica.url == f"http://10.0.0.7:{http}"
    assert replica.events == f"tcp://10.0.0.7:{bound['endpoint']}"
    assert replica.replay == f"tcp://10.0.0.7:{bound['replay_endpoint']}"
    # The topic llm-d's pods use, kv@<pod IP>@<model>, made by Kubernetes from the pod's own
    # IP (downward API) and the model; the router subscribes by its fixed prefix.
    env_from = {e["name"]: e.get("valueFrom", {}) for e in c["env"]}
    assert env_from["POD_IP"]["fieldRef"]["fieldPath"] == "status.podIP"
    model = "Qwen/Qwen2.5-0.5B-Instruct"
    topic = expand(events["topic"], {"POD_IP": "10.0.0.7", "MODEL": model})
    assert topic == f"kv@10.0.0.7@{model}"
    assert replica.topic == "kv@" and topic.startswith(replica.topic)

    if transfer["kv_connector"] == "MultiConnector":  # P/D: NIXL, then kvroute (overlays/pd)
        assert overlay == "pd"
        assert transfer["kv_load_failure_policy"] == "recompute"  # the scheduler reads the top's
        nixl, transfer = transfer["kv_connector_extra_config"]["connectors"]
        assert nixl["kv_connector"] == "NixlConnector"
    elif transfer["kv_connector"] == CONNECTOR_CLASS:
        assert transfer["kv_load_failure_policy"] == "recompute"
    if transfer["kv_connector"] == CONNECTOR_CLASS:
        assert transfer["kv_connector_module_path"] == CONNECTOR_MODULE
        config = ConnectorConfig.from_extra_config(transfer["kv_connector_extra_config"])
        assert replica.storage_domain == config.storage_domain
        mounts = {m["mountPath"] for m in c["volumeMounts"]}
        assert config.disk_dir in mounts
    else:
        assert overlay == "gpu" and transfer["kv_connector"] == "OffloadingConnector"
        assert transfer["kv_connector_extra_config"]["self_describing_kv_events"] is True
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["PYTHONHASHSEED"] == "0"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_vllm_replicas_are_a_deployment_so_the_deletion_cost_applies(overlay: str) -> None:
    """The replicas' controller reads controller.kubernetes.io/pod-deletion-cost (the
    routers' components/deletion-cost): a Deployment's ReplicaSet does, a StatefulSet
    ignores it and removes its highest ordinal. Nothing may need a StatefulSet's identity:
    no per-pod claim (a volume is an emptyDir or one ReadWriteMany claim all pods share),
    and discovery finds the pods by label, not by a governing Service's names."""
    objects = render(overlay)
    assert not [o for o in objects if o["kind"] == "StatefulSet"]
    replicas = vllm(objects)
    assert (replicas["apiVersion"], replicas["kind"]) == ("apps/v1", "Deployment")
    spec = replicas["spec"]
    assert not {"serviceName", "podManagementPolicy", "volumeClaimTemplates"} & set(spec)
    labels = spec["template"]["metadata"]["labels"]
    assert selects(spec["selector"]["matchLabels"], labels)
    # One replica at a time, as the StatefulSet rolled: a surge pod would need a spare GPU.
    rolling = spec["strategy"]["rollingUpdate"]
    assert spec["strategy"]["type"] == "RollingUpdate"
    assert (rolling["maxSurge"], rolling["maxUnavailable"]) == (0, 1)
    claims = {o["metadata"]["name"]: o for o in objects if o["kind"] == "PersistentVolumeClaim"}
    for volume in spec["template"]["spec"]["volumes"]:
        if "persistentVolumeClaim" in volume:
            claim = claims[volume["persistentVolumeClaim"]["claimName"]]
            assert claim["spec"]["accessModes"] == ["ReadWriteMany"], volume["name"]
        else:
            assert set(volume) == {"name", "emptyDir"}, volume
    pdb = one(objects, "PodDisruptionBudget", "vllm")
    assert selects(pdb["spec"]["selector"]["matchLabels"], labels)
    discovery = discovery_from_args(serve_args(objects))
    assert discovery is not None
    if not discovery.inference_pool:
        assert selects(discovery.selector, labels)


@pytest.mark.vllm
def test_vllm_args_parse_in_vllm_serve() -> None:
    """Every overlay's vLLM arguments through vLLM's own ``serve`` parser and EngineArgs."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    root = FlexibleArgumentParser()
    ServeSubcommand().subparser_init(root.add_subparsers(dest="subcommand"))
    for overlay in OVERLAYS:
        c = container(vllm(render(overlay)), "vllm")
        assert c["command"][-1] == "serve"  # `vllm serve` or kvroute's launcher `--serve serve`
        env = {"MODEL": "Qwen/Qwen2.5-0.5B-Instruct", "POD_IP": "10.0.0.7"}
        argv = [expand(a, env) for a in c["args"]]
        parsed = root.parse_args(["serve", *argv])
        engine = AsyncEngineArgs.from_cli_args(parsed)
        assert engine.enable_prefix_caching, overlay  # events need the prefix cache
        assert engine.kv_events_config.endpoint == "tcp://*:5557", overlay
        assert engine.kv_transfer_config.kv_role == "kv_both", overlay


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_only_routers_reach_the_event_sockets(overlay: str) -> None:
    objects = render(overlay)
    router_labels = router(objects)["spec"]["template"]["metadata"]["labels"]
    guarded = [(vllm(objects), EVENT_PORTS)]
    if overlay == "shared-storage":
        guarded.append((one(objects, "Deployment", "kvroute-storage-gc"), STORAGE_EVENT_PORTS))
    policies = [o for o in objects if o["kind"] == "NetworkPolicy"]
    for workload, ports in guarded:
        labels = workload["spec"]["template"]["metadata"]["labels"]
        mine = [p for p in policies if selects(p["spec"]["podSelector"]["matchLabels"], labels)]
        assert mine and all("Ingress" in p["spec"]["policyTypes"] for p in mine)
        for port in ports:
            sources = []
            for policy in mine:
                for rule in policy["spec"].get("ingress", []):
                    rule_ports = rule.get("ports")
                    if rule_ports is None or port in [p.get("port") for p in rule_ports]:
                        sources.append(rule.get("from"))
            assert sources, port  # reachable at all (by the routers)
            for peers in sources:
                assert peers, f"port {port} open to every source"
                for peer in peers:
                    assert set(peer) == {"podSelector"}, peer  # same namespace, pods only
                    assert selects(peer["podSelector"]["matchLabels"], router_labels)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_prometheus_scrapes_every_metrics_page(overlay: str) -> None:
    objects = render(overlay)
    for workload, name in ((router(objects), "router"), (vllm(objects), "vllm")):
        annotations = workload["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        assert annotations["prometheus.io/path"] == "/metrics"
        c = container(workload, name)
        assert container_port(c, int(annotations["prometheus.io/port"])) == container_port(
            c, "http"
        )
    monitors = [o for o in objects if o["kind"] in ("ServiceMonitor", "PodMonitor")]
    if overlay != "gpu":
        assert not monitors  # the Operator's CRDs are not assumed there
        return
    service = one(objects, "Service", "kvroute")
    monitor = one(objects, "ServiceMonitor", "kvroute-router")
    assert selects(monitor["spec"]["selector"]["matchLabels"], service["metadata"]["labels"])
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == [
        service["spec"]["ports"][0]["name"]
    ]
    pods = one(objects, "PodMonitor", "vllm")
    assert selects(
        pods["spec"]["selector"]["matchLabels"],
        vllm(objects)["spec"]["template"]["metadata"]["labels"],
    )
    (endpoint,) = pods["spec"]["podMetricsEndpoints"]
    assert endpoint["path"] == "/metrics"
    container_port(container(vllm(objects), "vllm"), endpoint["port"])


def test_prometheus_scrape_config_reads_the_annotations_the_pods_carry() -> None:
    config = yaml.safe_load((KUBE / "prometheus" / "scrape-configs.yaml").read_text())
    (job,) = config["scrape_configs"]
    sources = {s for r in job["relabel_configs"] for s in r.get("source_labels", [])}
    for key in ("scrape", "port", "path"):
        meta = f"__meta_kubernetes_pod_annotation_prometheus_io_{key}"
        assert meta in sources
    address = next(r for r in job["relabel_configs"] if r.get("target_label") == "__address__")
    assert re.fullmatch(address["regex"], "10.0.0.7:5557;8000")
    assert (
        re.sub(address["regex"], address["replacement"].replace("$", "\\"), "10.0.0.7:5557;8000")
        == "10.0.0.7:8000"
    )


def test_api_keys_come_from_one_secret() -> None:
    """The key vLLM is started with (VLLM_API_KEY) is the one the router sends to it."""
    objects = render("cpu")
    env_router = {e["name"]: e for e in container(router(objects), "router")["env"]}
    env_vllm = {e["name"]: e for e in container(vllm(objects), "vllm")["env"]}
    replica_key = env_router["KVROUTE_REPLICA_API_KEY"]["valueFrom"]["secretKeyRef"]
    assert env_vllm["VLLM_API_KEY"]["valueFrom"]["secretKeyRef"] == replica_key
    router_key = env_router["KVROUTE_API_KEY"]["valueFrom"]["secretKeyRef"]
    assert router_key["name"] == replica_key["name"] and router_key["key"] != replica_key["key"]
    # The routers' own credential to each other: the same Secret, a key of its own.
    peer_key = env_router["KVROUTE_PEER_KEY"]["valueFrom"]["secretKeyRef"]
    assert peer_key["name"] == router_key["name"] and peer_key["optional"] is True
    assert peer_key["key"] not in (router_key["key"], replica_key["key"])


def test_shared_storage_overlay_wires_replicas_evictor_and_router() -> None:
    objects = render("shared-storage")
    claim = one(objects, "PersistentVolumeClaim", "kvroute-shared-kv")
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    replicas = vllm(objects)
    annotations = replicas["spec"]["template"]["metadata"]["annotations"]
    domain = annotations["kvroute.io/storage-domain"]
    transfer = json.loads(flag(container(replicas, "vllm")["args"], "--kv-transfer-config"))
    extra = transfer["kv_connector_extra_config"]
    assert extra["storage_domain"] == domain
    gc = one(objects, "Deployment", "kvroute-storage-gc")
    assert gc["spec"]["replicas"] == 1 and gc["spec"]["strategy"]["type"] == "Recreate"
    gc_c = container(gc, "gc")
    assert flag(gc_c["args"], "--dir") == extra["disk_dir"]

    def claim_mounts(workload: dict[str, Any], name: str) -> set[str]:
        volumes = {
            v["name"]
            for v in workload["spec"]["template"]["spec"]["volumes"]
            if v.get("persistentVolumeClaim", {}).get("claimName") == "kvroute-shared-kv"
        }
        c = container(workload, name)
        return {m["mountPath"] for m in c["volumeMounts"] if m["name"] in volumes}

    assert claim_mounts(replicas, "vllm") == {extra["disk_dir"]} == claim_mounts(gc, "gc")

    (storage,) = settings_from_args(serve_args(objects)).storage_domains
    assert storage.name == domain
    service = one(objects, "Service", "kvroute-storage-gc")
    assert selects(service["spec"]["selector"], gc["spec"]["template"]["metadata"]["labels"])
    ports = {p["port"]: container_port(gc_c, p["targetPort"]) for p in service["spec"]["ports"]}
    assert ports == {5600: 5600, 5601: 5601}
    assert storage.events == "tcp://kvroute-storage-gc:5600"
    assert storage.replay == "tcp://kvroute-storage-gc:5601"
    # The evictor's command line through the real `kvroute` command (its image's entrypoint).
    gc_args = build_parser(gc_c["args"]).parse_args(gc_c["args"])
    assert gc_args.dir == extra["disk_dir"] and gc_args.max_gib > 0
    assert {gc_args.events, gc_args.replay} == {"tcp://*:5600", "tcp://*:5601"}
    assert gc_c["args"][:2] == ["storage", "gc"]


# --- images -----------------------------------------------------------------------------


def dockerfile(name: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile: continuations joined, comments dropped."""
    text = (KUBE / name).read_text()
    joined = re.sub(
        r"\\\n", " ", "\n".join(ln for ln in text.splitlines() if not ln.lstrip().startswith("#"))
    )
    out = []
    for line in joined.splitlines():
        if line.strip():
            instruction, _, rest = line.strip().partition(" ")
            assert instruction.isupper(), line
            out.append((instruction, rest.strip()))
    return out


KNOWN_INSTRUCTIONS = {
    "FROM",
    "ARG",
    "ENV",
    "WORKDIR",
    "COPY",
    "RUN",
    "USER",
    "EXPOSE",
    "ENTRYPOINT",
    "CMD",
}


@pytest.mark.parametrize(
    ("name", "runs"),
    [
        ("Dockerfile", ["kvroute", "serve"]),
        ("Dockerfile.vllm", ["vllm", "serve"]),
        ("Dockerfile.vllm-cpu", ["python", "-m", "kvroute.deploy.vllm_server", "--serve", "serve"]),
    ],
)
def test_dockerfiles_install_this_package_and_run_it(name: str, runs: list[str]) -> None:
    steps = dockerfile(name)
    kinds = [k for k, _ in steps]
    assert set(kinds) <= KNOWN_INSTRUCTIONS, kinds
    assert next(k for k in kinds if k != "ARG") == "FROM"  # only ARGs may precede FROM
    copied = [a.split() for k, a in steps if k == "COPY"]
    assert copied and copied[0][0] == "."  # the repository root: pyproject.toml and sources
    dest = copied[0][1]
    installs = [a for k, a in steps if k == "RUN" and "pip install" in a]
    assert installs and dest.rstrip("/") in installs[0]
    entry = json.loads(dict(steps)["ENTRYPOINT"])
    cmd = json.loads(dict(steps).get("CMD", "[]"))
    assert [*entry, *cmd][: len(runs)] == runs
    if name == "Dockerfile":
        user = dict(steps)["USER"]
        deploy = router(render("cpu"))
        assert int(user) == deploy["spec"]["template"]["spec"]["securityContext"]["runAsUser"]
        # The manifests pass ``serve ...`` as args: the image's entrypoint is kvroute.
        assert container(deploy, "router")["args"][0] == "serve" and entry == ["kvroute"]


def test_docker_context_leaves_out_the_virtualenv() -> None:
    lines = (REPO_ROOT / ".dockerignore").read_text().splitlines()
    ignored = [ln.strip() for ln in lines if ln.strip() and not ln.startswith("#")]
    assert {".venv", ".git", ".kvroute", "build"} <= set(ignored)
    assert not {"pyproject.toml", "router", "connector"} & set(ignored)


def test_docs_walk_through_apply_the_overlays_that_exist() -> None:
    text = (REPO_ROOT / "docs" / "deploy.md").read_text()
    named = set(re.findall(r"kubectl apply -k deploy/kubernetes/overlays/([\w-]+)", text))
    assert named and named <= set(OVERLAYS)
    assert {p.name for p in (KUBE / "overlays").iterdir()} == set(OVERLAYS)


# --- overlays that deploy as written --------------------------------------------------------


def _images(objects: tuple[dict[str, Any], ...]) -> list[str]:
    out = []
    for obj in objects:
        pod = obj.get("spec", {}).get("template", {}).get("spec", {})
        for c in [*pod.get("containers", []), *pod.get("initContainers", [])]:
            out.append(c["image"])
    return out


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_image_is_pulled_from_the_overlays_registry(overlay: str) -> None:
    """No container keeps a placeholder (kvroute-router, kvroute-vllm): an overlay's
    ``images:`` rewrites only its own objects, so each overlay that adds a workload must
    rewrite its image too (the shared-storage evictor did not)."""
    images = _images(render(overlay))
    assert images
    for image in images:
        name, _, tag = image.rpartition(":")
        assert "/" in name and tag, f"{overlay}: image {image!r} names no registry and tag"


def _effective(workload: dict[str, Any], name: str, field: str) -> Any:
    """A security setting as the kubelet applies it: the container's, else the pod's."""
    pod = workload["spec"]["template"]["spec"].get("securityContext", {})
    return container(workload, name).get("securityContext", {}).get(field, pod.get(field))


def test_shared_storage_evictor_deletes_as_the_uid_that_writes() -> None:
    """vLLM writes the chunks (root in its images, directories 0755): the evictor can
    delete them only as the same uid. NFS and most ReadWriteMany volumes ignore fsGroup,
    so a shared group is no answer; the evictor keeps no capability beyond that."""
    objects = render("shared-storage")
    gc = one(objects, "Deployment", "kvroute-storage-gc")
    writer = _effective(vllm(objects), "vllm", "runAsUser")
    assert writer is not None, "vLLM's uid must be pinned for the evictor to match it"
    assert _effective(gc, "gc", "runAsUser") == writer
    security = container(gc, "gc")["securityContext"]
    assert security["capabilities"]["drop"] == ["ALL"] and "add" not in security["capabilities"]
    assert security["allowPrivilegeEscalation"] is False
    assert security["readOnlyRootFilesystem"] is True


def test_shared_storage_class_is_the_overlays_parameter(tmp_path: Any) -> None:
    """The claim's storageClassName comes from params.yaml (kustomize replacements), which
    is not applied itself; a changed parameter changes the rendered claim."""
    objects = render("shared-storage")
    claim = one(objects, "PersistentVolumeClaim", "kvroute-shared-kv")
    params = yaml.safe_load((KUBE / "overlays" / "shared-storage" / "params.yaml").read_text())
    assert claim["spec"]["storageClassName"] == params["data"]["storageClassName"]
    assert not [o for o in objects if o["metadata"]["name"] == params["metadata"]["name"]]

    assert params["data"]["storageClassName"] != "cephfs"
    copy = edited_kube(
        tmp_path,
        "overlays/shared-storage/params.yaml",
        lambda d: d["data"].update(storageClassName="cephfs"),
    )
    claims = [d for d in render("shared-storage", copy) if d["kind"] == "PersistentVolumeClaim"]
    assert [c["spec"]["storageClassName"] for c in claims] == ["cephfs"]


def test_shared_storage_evictor_runs_the_router_image_named_once(tmp_path: Any) -> None:
    """The evictor runs from the router image, and one ``images:`` entry names it: the base
    overlay's (../cpu), whose rewrite of the routers' Deployment the shared-storage overlay
    copies into the evictor (kustomize replacements). A new registry or tag set there, and
    nowhere else, reaches both; the overlay keeps no entry of its own that could drift."""
    objects = render("shared-storage")
    gc = one(objects, "Deployment", "kvroute-storage-gc")
    assert container(gc, "gc")["image"] == container(router(objects), "router")["image"]
    overlay = yaml.safe_load(
        (KUBE / "overlays" / "shared-storage" / "kustomization.yaml").read_text()
    )
    assert not [i for i in overlay.get("images", []) if i["name"] == "kvroute-router"]

    copy = edited_kube(
        tmp_path,
        "overlays/cpu/kustomization.yaml",
        lambda d: set_image(d, "kvroute-router", "registry.internal:5000/team/kvroute-router"),
    )
    edited = render("shared-storage", copy)
    want = "registry.internal:5000/team/kvroute-router:9.9.9"
    assert container(one(edited, "Deployment", "kvroute-storage-gc"), "gc")["image"] == want
    assert container(router(edited), "router")["image"] == want
