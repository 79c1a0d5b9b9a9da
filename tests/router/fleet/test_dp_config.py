"""Data-parallel replicas: flag and file forms, rank targets, /kv_event_sources, per-engine load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvroute.router.config import ConfigError, RouterSettings
from kvroute.router.fleet.dp import (
    endpoint_for_rank,
    parse_event_sources,
    rank_targets,
    static_targets,
)
from kvroute.router.fleet.replicas import (
    Replica,
    engine_gauges,
    parse_vllm_metrics,
    parse_vllm_metrics_by_engine,
)
from kvroute.router.specs import load_replicas_file, parse_replica_flag

# What vLLM 0.32's GET /kv_event_sources answers for a server started with
# --data-parallel-size 2 --kv-events-config '{"endpoint": "tcp://*:5557",
# "replay_endpoint": "tcp://*:5567", "topic": "kv", ...}' (test_vllm_shapes checks it
# against vLLM's own classes).
VLLM_SOURCES = {
    str(r): {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{5557 + r}",
        "replay_endpoint": f"tcp://*:{5567 + r}",
        "buffer_steps": 10000,
        "hwm": 100000,
        "max_queue_size": 100000,
        "topic": "kv",
    }
    for r in range(2)
}

# vLLM 0.32's gauges for two engines (labelnames ["model_name", "engine"]).
VLLM_PAGE = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.75
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.25
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 99.0
"""


def test_dp_flag_makes_one_target_per_rank_on_vllms_ports() -> None:
    config = parse_replica_flag(
        "http://h:8000,events=tcp://h:5557,replay=tcp://h:5567,topic=kv,dp=2,name=big"
    )
    assert config.dp == 2 and config.key == "big"
    targets = static_targets(config)
    assert [t.key for t in targets] == ["big#dp0", "big#dp1"]
    assert [t.events for t in targets] == ["tcp://h:5557", "tcp://h:5558"]
    assert [t.replay for t in targets] == ["tcp://h:5567", "tcp://h:5568"]
    assert [(t.dp_rank, t.server, t.url, t.topic) for t in targets] == [
        (0, "big", "http://h:8000", "kv"),
        (1, "big", "http://h:8000", "kv"),
    ]
    # Without a name the server is host:port, its ranks host:port#dp<r>.
    unnamed = static_targets(parse_replica_flag("http://h:8000,dp=3"))
    assert [t.key for t in unnamed] == ["h:8000#dp0", "h:8000#dp1", "h:8000#dp2"]
    assert all(t.events is None for t in unnamed)
    # dp=1 is a plain replica: no rank header, its own name.
    plain = parse_replica_flag("http://h:8000,events=tcp://h:5557,dp=1")
    assert static_targets(plain) == [plain]
    # auto: the server itself until discovery answers.
    auto = parse_replica_flag("http://h:8000,dp=auto")
    assert auto.dp == "auto" and static_targets(auto) == [auto]


@pytest.mark.parametrize(
    "bad",
    [
        "http://h:1,dp=0",
        "http://h:1,dp=-2",
        "http://h:1,dp=two",
        "http://h:1,dp=",
        "http://h:1,dp=2,aux=tcp://h:9",
        "http://h:1,name=a#dp0",
        "http://h:1,events=tcp://h,dp=2",  # no port to offset per rank
        "http://h:1,events=udp://h:5,replay=tcp://h:6,dp=2",
        "http://h:1,events=ipc:///run/kv,dp=2",  # vLLM cannot offset it per rank
    ],
)
def test_bad_dp_flags_are_refused(bad: str) -> None:
    with pytest.raises(ConfigError):
        parse_replica_flag(bad)


def test_dp_in_a_replicas_file(tmp_path: Path) -> None:
    f = tmp_path / "r.yaml"
    f.write_text(
        "replicas:\n"
        "  - {url: http://a:1, events: tcp://a:5557, replay: tcp://a:5567, dp: 4}\n"
        "  - {url: http://b:1, dp: auto}\n"
        "  - http://c:1,dp=2\n"
    )
    assert [r.dp for r in load_replicas_file(f)] == [4, "auto", 2]
    for bad in (
        "- {url: http://a:1, dp: 0}",
        "- {url: http://a:1, dp: true}",
        "- {url: http://a:1, dp: [2]}",
    ):
        f.write_text(bad)
        with pytest.raises(ConfigError, match="dp"):
            load_replicas_file(f)


def test_rank_names_may_not_collide_with_configured_names() -> None:
    with pytest.raises(ConfigError):
        RouterSettings(
            replicas=[
                parse_replica_flag("http://a:1,dp=2,name=x"),
                parse_replica_flag("http://a:1,name=x"),
            ]
        )


def test_endpoint_for_rank_follows_vllm() -> None:
    assert endpoint_for_rank("tcp://h:5557", 0) == "tcp://h:5557"
    assert endpoint_for_rank("tcp://h:5557", 3) == "tcp://h:5560"
    assert endpoint_for_rank("tcp://[::1]:5557", 1) == "tcp://[::1]:5558"
    assert endpoint_for_rank("tcp://h:0", 2) == "tcp://h:0"
    assert endpoint_for_rank("inproc://kv", 1) == "inproc://kv_dp1"
    assert endpoint_for_rank("ipc:///tmp/kv", 0) == "ipc:///tmp/kv"
    with pytest.raises(ConfigError, match="tcp"):
        endpoint_for_rank("ipc:///tmp/kv", 1)  # vLLM's engines fail to start with it
    assert endpoint_for_rank(None, 1) is None


def test_kv_event_sources_become_connectable_rank_targets() -> None:
    sources = parse_event_sources(VLLM_SOURCES, "http://10.0.0.7:8000")
    assert sources == {
        0: ("tcp://10.0.0.7:5557", "tcp://10.0.0.7:5567", "kv"),
        1: ("tcp://10.0.0.7:5558", "tcp://10.0.0.7:5568", "kv"),
    }
    server = parse_replica_flag("http://10.0.0.7:8000,dp=auto,name=s")
    targets = rank_targets(server, sources)
    assert [(t.key, t.dp_rank, t.events) for t in targets] == [
        ("s#dp0", 0, "tcp://10.0.0.7:5557"),
        ("s#dp1", 1, "tcp://10.0.0.7:5558"),
    ]
    # One rank: the server itself with that rank's feed, no header.
    one = rank_targets(server, {0: sources[0]})
    assert [(t.key, t.dp_rank, t.events) for t in one] == [("s", None, "tcp://10.0.0.7:5557")]
    # Events off: vLLM answers {}; the server stays one target without a feed.
    assert rank_targets(server, parse_event_sources({}, server.url)) == [server]
    # An IPv6 replica, a concrete bind host, an OS-chosen port (cannot be reached).
    v6 = parse_event_sources({"0": {"endpoint": "tcp://*:7", "topic": ""}}, "http://[::1]:8000")
    assert v6 == {0: ("tcp://[::1]:7", None, "")}
    fixed = parse_event_sources({"0": {"endpoint": "tcp://10.1.1.1:7"}}, "http://h:1")
    assert fixed[0][0] == "tcp://10.1.1.1:7"
    assert parse_event_sources({"0": {"endpoint": "tcp://*:0"}}, "http://h:1")[0][0] is None
    # A socket file is the same for everyone on the host; inproc:// is inside the server.
    local = parse_event_sources(
        {"0": {"endpoint": "ipc:///run/kv", "replay_endpoint": "ipc:///run/kv-replay"}},
        "http://h:1",
    )
    assert local == {0: ("ipc:///run/kv", "ipc:///run/kv-replay", "")}
    assert parse_event_sources({"0": {"endpoint": "inproc://kv"}}, "http://h:1")[0][0] is None
    for bad in ([], {"x": {}}, {"-1": {}}, {"0": "tcp://*:1"}, {"0": {"topic": 5}}):
        with pytest.raises(ValueError):
            parse_event_sources(bad, "http://h:1")


def test_metrics_split_by_engine_label() -> None:
    by_engine = parse_vllm_metrics_by_engine(VLLM_PAGE)
    assert by_engine == {
        "0": {"running": 3.0, "waiting": 2.0, "kv_usage": 0.75},
        "1": {"running": 1.0, "waiting": 0.0, "kv_usage": 0.25},
    }
    # The server as a whole (a replica without ranks): summed, KV usage the fullest engine.
    assert parse_vllm_metrics(VLLM_PAGE) == {"running": 4.0, "waiting": 2.0, "kv_usage": 0.75}
    assert engine_gauges(by_engine, 1, 2) == {"running": 1.0, "waiting": 0.0, "kv_usage": 0.25}
    assert engine_gauges(by_engine, None, 1) == {"running": 4.0, "waiting": 2.0, "kv_usage": 0.75}
    # No engine label (an older vLLM, one engine's page): the load is divided evenly.
    unlabelled = parse_vllm_metrics_by_engine(
        'vllm:num_requests_running{model_name="m"} 4\nvllm:num_requests_waiting 2\n'
        "vllm:kv_cache_usage_perc 0.5\n"
    )
    assert engine_gauges(unlabelled, 1, 2) == {"running": 2.0, "waiting": 1.0, "kv_usage": 0.5}
    # A label value that merely contains "engine" is not the engine label.
    tricky = parse_vllm_metrics_by_engine(
        'vllm:num_requests_running{model_name="xengine=\\"1\\"",engine="0"} 5\n'
    )
    assert tricky == {"0": {"running": 5.0}}


def test_rank_target_pending_uses_its_own_gauges_and_in_flight() -> None:
    targets = static_targets(parse_replica_flag("http://h:1,dp=2"))
    r0, r1 = Replica(targets[0]), Replica(targets[1])
    by_engine = parse_vllm_metrics_by_engine(VLLM_PAGE)
    for r in (r0, r1):
        g = engine_gauges(by_engine, r.config.dp_rank, 2)
        r.set_gauges(g.get("running", 0.0), g.get("waiting", 0.0), g.get("kv_usage", 0.0))
    r1.begin_request()
    assert (r0.pending, r1.pending) == (5.0, 2.0)


@pytest.mark.vllm
def test_vllm_shapes() -> None:
    """The constants above are what vLLM's own classes produce: its port offset per rank and
    the JSON FastAPI makes of ``get_kv_event_sources()`` (a dict of KVEventsConfig)."""
    from fastapi.encoders import jsonable_encoder
    from vllm.config.kv_events import KVEventsConfig
    from vllm.distributed.kv_events import ZmqEventPublisher

    offset = ZmqEventPublisher.offset_endpoint_port
    for endpoint in ("tcp://h:5557", "tcp://*:5557", "tcp://h:0", "inproc://kv"):
        for rank in range(3):
            assert endpoint_for_rank(endpoint, rank) == offset(endpoint, rank)
    with pytest.raises(ValueError):  # what a DP engine dies of with an ipc:// endpoint
        offset("ipc:///tmp/kv", 1)
    with pytest.raises(ConfigError):
        endpoint_for_rank("ipc:///tmp/kv", 1)
    served = {
        r: KVEventsConfig(
            enable_kv_cache_events=True,
            publisher="zmq",
            endpoint=offset("tcp://*:5557", r),
            replay_endpoint=offset("tcp://*:5567", r),
            topic="kv",
        )
        for r in range(2)
    }
    assert json.loads(json.dumps(jsonable_encoder(served))) == VLLM_SOURCES  # as served
