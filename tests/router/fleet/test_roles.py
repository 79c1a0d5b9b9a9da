"""Replica roles under prefill/decode disaggregation (``role=``, ``zone=``): the flag, the
replicas file, Kubernetes labels and annotations, and the refusals of a bad role."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvroute.router.config import ConfigError, ReplicaConfig
from kvroute.router.fleet.discovery.k8s_pods import pod_replicas
from kvroute.router.fleet.dp import static_targets
from kvroute.router.specs import load_replicas_file, parse_replica_flag
from tests.router.k8s_apiserver import make_pod


def test_role_defaults_to_both_and_the_flag_sets_role_and_zone() -> None:
    assert parse_replica_flag("http://h:1").role == "both"
    config = parse_replica_flag("http://h:1,name=p0,role=prefill,zone=node-a")
    assert (config.role, config.zone, config.name) == ("prefill", "node-a", "p0")
    assert parse_replica_flag("http://h:2,role=decode").role == "decode"


@pytest.mark.parametrize(
    "spec", ["http://h:1,role=prefil", "http://h:1,role=", "http://h:1,role=P"]
)
def test_a_bad_role_is_refused_with_the_choices(spec: str) -> None:
    with pytest.raises(ConfigError, match="role must be one of both, prefill, decode"):
        parse_replica_flag(spec)


def test_a_replicas_file_mixes_pools_with_aggregated_replicas(tmp_path: Path) -> None:
    path = tmp_path / "replicas.yaml"
    path.write_text(
        "replicas:\n"
        "  - {url: 'http://a:1', name: p0, role: prefill, zone: z1}\n"
        "  - {url: 'http://b:1', name: d0, role: decode}\n"
        "  - http://c:1,name=agg\n"
    )
    roles = {r.name: (r.role, r.zone) for r in load_replicas_file(path)}
    assert roles == {"p0": ("prefill", "z1"), "d0": ("decode", None), "agg": ("both", None)}
    path.write_text("replicas:\n  - {url: 'http://a:1', role: 3}\n")
    with pytest.raises(ConfigError, match="'role' must be a string"):
        load_replicas_file(path)


def test_data_parallel_ranks_keep_their_servers_role() -> None:
    server = ReplicaConfig(url="http://h:1", name="d", dp=2, events="tcp://h:5557", role="decode")
    assert [t.role for t in static_targets(server)] == ["decode", "decode"]


def test_kubernetes_role_from_a_label_or_an_annotation_and_zone_from_the_node() -> None:
    labelled = make_pod("p-0", "10.0.0.1", labels={"app": "vllm", "kvroute.io/role": "prefill"})
    labelled["spec"]["nodeName"] = "node-7"
    (replica,) = pod_replicas(labelled)
    assert (replica.role, replica.zone) == ("prefill", "node-7")
    annotated = make_pod(
        "d-0",
        "10.0.0.2",
        labels={"kvroute.io/role": "prefill"},
        annotations={"kvroute.io/role": "decode", "kvroute.io/zone": "eu-1a"},
    )
    (replica,) = pod_replicas(annotated)
    assert (replica.role, replica.zone) == ("decode", "eu-1a")
    assert pod_replicas(make_pod("a-0", "10.0.0.3"))[0].role == "both"
    with pytest.raises(ConfigError, match="pod bad-0: replica role must be one of"):
        pod_replicas(make_pod("bad-0", "10.0.0.4", annotations={"kvroute.io/role": "x"}))
