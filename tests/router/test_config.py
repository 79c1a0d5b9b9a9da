"""Replica flags, replicas files and settings validation."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kvroute.indexer.cpu_priority import custom_slices_supported, thread_slice_ns
from kvroute.router.config import ConfigError, ReplicaConfig, RouterSettings
from kvroute.router.fleet.replicas import parse_vllm_metrics
from kvroute.router.routing.policies import POLICIES
from kvroute.router.specs import load_replicas_file, parse_replica_flag
from tests.router.sim_fleet import make_fleet


def test_replica_flag() -> None:
    r = parse_replica_flag(
        "http://127.0.0.1:8001/,events=tcp://127.0.0.1:5557,replay=tcp://127.0.0.1:5558,topic=kv"
    )
    assert r == ReplicaConfig(
        "http://127.0.0.1:8001", "tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558", "kv"
    )
    assert r.key == "127.0.0.1:8001"
    assert parse_replica_flag("http://h:1,name=n1").key == "n1"
    for bad in ("127.0.0.1:8001", "http://h:1,event=tcp://x", "ftp://h", "http://h:1,name"):
        with pytest.raises(ConfigError):
            parse_replica_flag(bad)


def test_a_replica_may_publish_on_several_streams(tmp_path: Path) -> None:
    """llm-d's FS backend has a socket of its own beside vLLM's (``aux``, any number)."""
    r = parse_replica_flag("http://h:1,events=tcp://h:5557,aux=tcp://h:5559,aux=tcp://h:5560")
    assert r.aux == ("tcp://h:5559", "tcp://h:5560") and r.events == "tcp://h:5557"
    f = tmp_path / "r.yaml"
    f.write_text("- url: http://a:1\n  aux: [tcp://a:5559]\n- url: http://b:1\n  aux: tcp://b:9\n")
    assert [r.aux for r in load_replicas_file(f)] == [("tcp://a:5559",), ("tcp://b:9",)]
    f.write_text("- url: http://a:1\n  aux: [5]\n")
    with pytest.raises(ConfigError, match="aux"):
        load_replicas_file(f)


def test_replicas_file_forms(tmp_path: Path) -> None:
    f = tmp_path / "r.yaml"
    f.write_text("replicas:\n  - url: http://a:1\n    events: tcp://a:2\n  - http://b:1,name=b\n")
    assert [r.key for r in load_replicas_file(f)] == ["a:1", "b"]
    f.write_text("- http://a:1\n")
    assert [r.url for r in load_replicas_file(f)] == ["http://a:1"]
    f.write_text("")
    assert load_replicas_file(f) == []
    for bad in (
        "replicas: 3",
        "- {url: http://a:1, bogus: 1}",
        "- 5",
        "- {events: tcp://x}",
        "- http://a:1\n- http://a:1\n",
        "[unclosed",
    ):
        f.write_text(bad)
        with pytest.raises(ConfigError):
            load_replicas_file(f)
    with pytest.raises(ConfigError):
        load_replicas_file(tmp_path / "missing.yaml")


def test_settings_validation() -> None:
    with pytest.raises(ConfigError, match="choose from " + ", ".join(POLICIES)):
        RouterSettings(policy="random")
    for name in POLICIES:
        assert RouterSettings(policy=name).policy == name
    with pytest.raises(ConfigError):
        RouterSettings(replicas=[ReplicaConfig("http://a:1"), ReplicaConfig("http://a:1")])
    assert RouterSettings().policy == "kvroute"


def test_parse_vllm_metrics() -> None:
    text = (
        "# HELP vllm:num_requests_running x\n"
        'vllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
        'vllm:num_requests_running{engine="1",model_name="m"} 2.0\n'
        "vllm:num_requests_waiting 4\n"
        'vllm:kv_cache_usage_perc{engine="0"} 0.5\n'
        'vllm:kv_cache_usage_perc{engine="1"} 0.75\n'
        'vllm:prefix_cache_hits_total{engine="0"} 99\n'
        "vllm:num_requests_waiting_garbage x\n"
    )
    assert parse_vllm_metrics(text) == {"running": 5.0, "waiting": 4.0, "kv_usage": 0.75}


@pytest.mark.parametrize("value", [0, -0.001, 2.0])
def test_the_gil_switch_interval_is_checked(value: float) -> None:
    with pytest.raises(ConfigError, match="gil_switch_interval_s"):
        RouterSettings(gil_switch_interval_s=value)


def test_a_router_sets_the_gil_switch_interval_it_is_given(local_tokenizer) -> None:
    """Process-wide: the router's server process waits less for the GIL behind its feeds."""
    before = sys.getswitchinterval()
    try:
        with make_fleet(local_tokenizer, n=1, gil_switch_interval_s=0.0015):
            assert sys.getswitchinterval() == pytest.approx(0.0015)
    finally:
        sys.setswitchinterval(before)
    with make_fleet(local_tokenizer, n=1):  # unset: left as it was
        assert sys.getswitchinterval() == pytest.approx(before)


@pytest.mark.parametrize("value", [0, -0.001, 0.2])
def test_the_loop_slice_is_checked(value: float) -> None:
    with pytest.raises(ConfigError, match="loop_slice_s"):
        RouterSettings(loop_slice_s=value)


@pytest.mark.skipif(
    not custom_slices_supported(), reason="no per-thread time slices before Linux 6.12"
)
def test_a_router_gives_its_event_loop_thread_a_short_slice(local_tokenizer) -> None:
    with make_fleet(local_tokenizer, n=1) as fleet:
        service = fleet.service
        assert service.loop_slice_set and service.loop_thread_id is not None
        assert thread_slice_ns(service.loop_thread_id) == 100_000
    with make_fleet(local_tokenizer, n=1, loop_slice_s=None) as fleet:
        assert not fleet.service.loop_slice_set


def test_an_empty_lmcache_instance_is_refused() -> None:
    """``lmcache_instance=`` with nothing after it names no instance to ask: a clear error, not
    a replica that silently never asks LMCache's controller."""
    with pytest.raises(ConfigError, match="lmcache_instance"):
        parse_replica_flag("http://a:1,lmcache_instance=")
    assert parse_replica_flag("http://a:1,lmcache_instance=i1").lmcache_instance == "i1"
