"""Kubernetes pods -> replicas (router/fleet/discovery/k8s_pods.py): annotations, readiness,
data-parallel ranks, InferencePool ports, bad annotations, peers. Pure functions on the API's
pod JSON."""

from __future__ import annotations

import logging

import pytest

from kvroute.router.config import ConfigError, ReplicaConfig
from kvroute.router.fleet.discovery.k8s import pool_spec
from kvroute.router.fleet.discovery.k8s_pods import (
    PodPorts,
    fleet_from_pods,
    parse_selector,
    peer_urls,
    pod_replicas,
)
from kvroute.router.fleet.dp import static_targets
from tests.router.k8s_apiserver import make_pod


def test_defaults_are_vllms_ports_and_the_pod_uid_is_the_incarnation() -> None:
    pod = make_pod("vllm-0", "10.1.2.3", uid="u-1")
    assert pod_replicas(pod) == [
        ReplicaConfig(
            url="http://10.1.2.3:8000",
            events="tcp://10.1.2.3:5557",
            replay="tcp://10.1.2.3:5558",
            topic="",
            name="vllm-0",
            incarnation="u-1",
        )
    ]


def test_annotations_set_ports_topic_and_storage_domain() -> None:
    pod = make_pod(
        "vllm-1",
        "10.0.0.9",
        annotations={
            "kvroute.io/http-port": "9000",
            "kvroute.io/events-port": "6000",
            "kvroute.io/replay-port": "none",
            "kvroute.io/topic": "kv@vllm-1",
            "kvroute.io/storage-domain": "nfs-a",
            "kvroute.io/layout": "9a1b2c3d4e5f6a7b",
        },
    )
    (r,) = pod_replicas(pod)
    assert (r.url, r.events, r.replay, r.topic) == (
        "http://10.0.0.9:9000",
        "tcp://10.0.0.9:6000",
        None,
        "kv@vllm-1",
    )
    assert (r.storage_domain, r.layout) == ("nfs-a", "9a1b2c3d4e5f6a7b")
    no_feed = make_pod("x", "10.0.0.1", annotations={"kvroute.io/events-port": "none"})
    assert pod_replicas(no_feed)[0].events is None and pod_replicas(no_feed)[0].replay is None


def test_http_port_falls_back_to_pool_then_named_container_port() -> None:
    named = make_pod("a", "10.0.0.1", http_port_name=8081)
    assert pod_replicas(named)[0].url == "http://10.0.0.1:8081"
    assert pod_replicas(named, target_ports=[8200])[0].url == "http://10.0.0.1:8200"
    annotated = make_pod("b", "10.0.0.2", annotations={"kvroute.io/http-port": "7000"})
    assert pod_replicas(annotated)[0].url == "http://10.0.0.2:7000"
    # With a pool, the pool's ports decide: the gateway sends traffic there.
    assert pod_replicas(annotated, target_ports=[8200])[0].url == "http://10.0.0.2:8200"
    fleet = fleet_from_pods([annotated], target_ports=[8200])
    assert "kvroute.io/http-port=7000 ignored" in fleet.notes["b"]
    assert fleet_from_pods([annotated]).notes == {}


def test_several_pool_target_ports_are_one_replica_each_and_no_port_is_used_twice() -> None:
    """Server i: events 5557 + i; the default replay block (5558 + i) would overlap the
    events block (server 1's events port is server 0's replay port), so it moves after it."""
    reps = pod_replicas(make_pod("p", "10.0.0.1"), target_ports=[8000, 8001])
    assert [(r.key, r.url, r.events, r.replay) for r in reps] == [
        ("p:8000", "http://10.0.0.1:8000", "tcp://10.0.0.1:5557", "tcp://10.0.0.1:5559"),
        ("p:8001", "http://10.0.0.1:8001", "tcp://10.0.0.1:5558", "tcp://10.0.0.1:5560"),
    ]
    four = pod_replicas(make_pod("q", "10.0.0.1"), target_ports=[8000, 8001, 8002, 8003])
    used = [r.events for r in four] + [r.replay for r in four]
    assert len(set(used)) == 8
    apart = make_pod("r", "10.0.0.1", annotations={"kvroute.io/replay-port": "6000"})
    assert [r.replay for r in pod_replicas(apart, target_ports=[8000, 8001])] == [
        "tcp://10.0.0.1:6000",
        "tcp://10.0.0.1:6001",
    ]


def test_an_annotated_replay_block_that_overlaps_is_refused() -> None:
    pod = make_pod("s", "10.0.0.1", annotations={"kvroute.io/replay-port": "5558"})
    with pytest.raises(ConfigError, match=r"overlap.*replay-port 5559"):
        pod_replicas(pod, target_ports=[8000, 8001])
    assert pod_replicas(pod)[0].replay == "tcp://10.0.0.1:5558"  # one server: no overlap


def test_the_routers_pod_port_defaults_apply_without_annotations() -> None:
    """An llm-d pool's pods: events on 5556, no replay socket."""
    llm_d = PodPorts(events=5556, replay=None)
    (one,) = pod_replicas(make_pod("d", "10.0.0.3"), defaults=llm_d)
    assert (one.events, one.replay) == ("tcp://10.0.0.3:5556", None)
    two = pod_replicas(make_pod("e", "10.0.0.4"), target_ports=[8000, 8001], defaults=llm_d)
    assert [(r.events, r.replay) for r in two] == [
        ("tcp://10.0.0.4:5556", None),
        ("tcp://10.0.0.4:5557", None),
    ]
    annotated = make_pod("f", "10.0.0.5", annotations={"kvroute.io/events-port": "7000"})
    assert pod_replicas(annotated, defaults=llm_d)[0].events == "tcp://10.0.0.5:7000"


def test_dp_annotation_makes_rank_targets_as_router_dp_names_them() -> None:
    (r,) = pod_replicas(make_pod("vllm-dp", "10.0.0.5", annotations={"kvroute.io/dp": "2"}))
    assert r.dp == 2
    targets = static_targets(r)
    assert [(t.key, t.events, t.replay) for t in targets] == [
        ("vllm-dp#dp0", "tcp://10.0.0.5:5557", "tcp://10.0.0.5:5558"),
        ("vllm-dp#dp1", "tcp://10.0.0.5:5558", "tcp://10.0.0.5:5559"),
    ]
    auto = make_pod("a", "10.0.0.6", annotations={"kvroute.io/dp": "auto"})
    assert pod_replicas(auto)[0].dp == "auto"


def test_not_ready_no_ip_or_terminating_pods_are_not_replicas() -> None:
    assert pod_replicas(make_pod("a", "10.0.0.1", ready=False)) == []
    assert pod_replicas(make_pod("b", None)) == []
    terminating = make_pod("c", "10.0.0.3")
    terminating["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert pod_replicas(terminating) == []


def test_ipv6_pod_ip_is_bracketed() -> None:
    (r,) = pod_replicas(make_pod("v6", "fd00::5"))
    assert r.url == "http://[fd00::5]:8000" and r.events == "tcp://[fd00::5]:5557"


@pytest.mark.parametrize(
    ("annotation", "value", "says"),
    [
        ("events-port", "http", "a port 1-65535"),
        ("http-port", "70000", "a port 1-65535"),
        ("dp", "0", "an integer >= 1 or auto"),
        ("storage-domain", "bad/name", "storage domain name"),
    ],
)
def test_bad_annotation_skips_that_pod_with_a_clear_error(
    annotation: str, value: str, says: str
) -> None:
    bad = make_pod("bad-pod", "10.0.0.7", annotations={f"kvroute.io/{annotation}": value})
    with pytest.raises(ConfigError, match=f"pod bad-pod: .*{says}"):
        pod_replicas(bad)
    fleet = fleet_from_pods([bad, make_pod("good", "10.0.0.8")])
    assert [r.key for r in fleet.replicas] == ["good"]
    assert says in fleet.errors["bad-pod"]
    assert (fleet.pods_seen, fleet.pods_ready) == (2, 2)


def test_dp_with_several_target_ports_is_refused() -> None:
    pod = make_pod("p", "10.0.0.1", annotations={"kvroute.io/dp": "2"})
    with pytest.raises(ConfigError, match="collide"):
        pod_replicas(pod, target_ports=[8000, 8001])


def test_fleet_is_sorted_and_counts_ready_pods() -> None:
    pods = [make_pod("b", "10.0.0.2"), make_pod("a", "10.0.0.1"), make_pod("c", None)]
    fleet = fleet_from_pods(pods)
    assert [r.key for r in fleet.replicas] == ["a", "b"]
    assert (fleet.pods_seen, fleet.pods_ready, fleet.errors) == (3, 2, {})


def test_selector_parsing() -> None:
    assert parse_selector("app=vllm, tier==serve") == {"app": "vllm", "tier": "serve"}
    for bad in ("", "app", "app!=vllm", "app in (a,b)"):
        with pytest.raises(ConfigError):
            parse_selector(bad)


def test_pool_spec_is_v1_only() -> None:
    v1 = {"spec": {"selector": {"matchLabels": {"app": "vllm"}}, "targetPorts": [{"number": 8000}]}}
    assert pool_spec(v1) == ({"app": "vllm"}, [8000])
    alpha = {"spec": {"selector": {"app": "vllm"}, "targetPortNumber": 8080}}
    with pytest.raises(ConfigError, match="matchLabels"):
        pool_spec(alpha)
    with pytest.raises(ConfigError, match="targetPorts"):
        pool_spec({"spec": {"selector": {"matchLabels": {"app": "vllm"}}, "targetPortNumber": 1}})
    twice = {"spec": {"selector": {"matchLabels": {"a": "b"}}, "targetPorts": [{"number": 1}] * 2}}
    with pytest.raises(ConfigError, match="repeats"):
        pool_spec(twice)


def test_peer_urls_exclude_this_pod_and_unready_ones(caplog: pytest.LogCaptureFixture) -> None:
    pods = [
        make_pod("router-0", "10.0.1.1", labels={"app": "kvroute"}),
        make_pod(
            "router-1",
            "10.0.1.2",
            labels={"app": "kvroute"},
            annotations={"kvroute.io/router-port": "9100"},
        ),
        make_pod("router-2", "10.0.1.3", labels={"app": "kvroute"}, ready=False),
        make_pod(
            "router-3",
            "10.0.1.4",
            labels={"app": "kvroute"},
            annotations={"kvroute.io/router-port": "x"},
        ),
        make_pod("router-4", "10.0.1.5", labels={"app": "kvroute"}),
    ]
    with caplog.at_level(logging.ERROR):
        urls = peer_urls(pods, default_port=8080, self_name="router-0")
    assert urls == ["http://10.0.1.2:9100", "http://10.0.1.5:8080"]
    assert "router-3" in caplog.text
