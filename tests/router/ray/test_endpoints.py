"""What a ``KVRouteLLMServer`` replica gives its engine and advertises: its own event ports
(base + node-local rank, free ones when those are held), replay on, a topic naming it; and
what the router reads back, kvroute's entry or Ray's ``kv_event_metadata``."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from kvroute.router.ray.endpoints import (
    METADATA_KEY,
    RAY_METADATA_KEY,
    REPLAY_PORT_OFFSET,
    pick_ports,
    replica_events,
)


def _free_base() -> int:
    """A base port whose first few ports and replay ports are all free."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("", 0))
            base = int(s.getsockname()[1])
        if base + REPLAY_PORT_OFFSET + 4 < 65535 and all(
            pick_ports(r, base) == (base + r, base + REPLAY_PORT_OFFSET + r) for r in range(3)
        ):
            return base
    pytest.skip("no free port range")


def test_ports_follow_the_node_local_rank_and_dodge_held_ones() -> None:
    base = _free_base()
    assert pick_ports(0, base) == (base, base + REPLAY_PORT_OFFSET)
    assert pick_ports(2, base) == (base + 2, base + REPLAY_PORT_OFFSET + 2)
    with socket.socket() as held:  # another deployment's replica of rank 1 on this node
        held.bind(("", base + 1))
        pub, replay = pick_ports(1, base)
        assert pub != base + 1 and replay != pub
    pub, replay = pick_ports(0, 0)  # base 0: always free ports
    assert pub > 0 and replay > 0 and pub != replay


def test_the_router_reads_kvroutes_entry_first_then_rays() -> None:
    ours = {
        "endpoint": "tcp://10.0.0.1:5557",
        "replay_endpoint": "tcp://10.0.0.1:6557",
        "topic": "kv@abc@tiny",
        "block_size": 32,
    }
    rays = {
        "endpoint": "tcp://10.0.0.1:5560",
        "replay_endpoint": "tcp://10.0.0.1:6560",
        "block_size": 16,
        "dp_rank": 0,
        "max_num_batched_tokens": 2048,
    }
    got = replica_events({METADATA_KEY: ours}, {RAY_METADATA_KEY: rays})
    assert got is not None and got.endpoint == ours["endpoint"] and got.topic == "kv@abc@tiny"
    assert got.source == METADATA_KEY and got.block_size == 32
    got = replica_events({}, {RAY_METADATA_KEY: rays})
    assert got is not None and got.source == RAY_METADATA_KEY
    assert (got.endpoint, got.replay, got.topic) == (rays["endpoint"], rays["replay_endpoint"], "")
    assert replica_events({}, {METADATA_KEY: ours}).endpoint == ours["endpoint"]  # type: ignore[union-attr]
    assert replica_events(None, None) is None
    assert replica_events({METADATA_KEY: {"endpoint": ""}}, {RAY_METADATA_KEY: "junk"}) is None


def test_the_server_gives_its_engine_its_own_events_config() -> None:
    pytest.importorskip("ray.serve.llm")
    from ray.serve.llm import LLMConfig

    from kvroute.router.ray.server import PORT_BASE_KEY, configure_events

    base = _free_base()
    config = LLMConfig(
        model_loading_config={"model_id": "tiny", "model_source": "/models/tiny"},
        accelerator_config={"kind": "cpu"},
        engine_kwargs={"block_size": 32, "kv_events_config": {"buffer_steps": 500}},
        experimental_configs={PORT_BASE_KEY: base},
    )
    advertised = configure_events(config, "abc123", 1, "10.1.2.3")
    events = config.engine_kwargs["kv_events_config"]
    assert events == {
        "buffer_steps": 500,  # what the configuration asked is kept
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{base + 1}",
        "replay_endpoint": f"tcp://*:{base + REPLAY_PORT_OFFSET + 1}",
        "topic": "kv@abc123@tiny",
    }
    assert advertised == {
        "endpoint": f"tcp://10.1.2.3:{base + 1}",
        "replay_endpoint": f"tcp://10.1.2.3:{base + REPLAY_PORT_OFFSET + 1}",
        "topic": "kv@abc123@tiny",
        "block_size": 32,
    }
    got = replica_events({METADATA_KEY: advertised}, {})
    assert got is not None and got.replay == advertised["replay_endpoint"]


def test_the_core_and_the_ray_free_modules_import_without_ray() -> None:
    """Ray is an extra: the router, the simulator and router/ray's Ray-free half load in a
    process where ``import ray`` fails."""
    code = (
        "import sys; sys.modules['ray'] = None\n"
        "import kvroute.router.app, kvroute.deploy.cli, kvroute.bench.sim.fleet\n"
        "import kvroute.router.ray.fleet, kvroute.router.ray.endpoints\n"
        "try:\n    import kvroute.router.ray.request_router\nexcept ImportError:\n    pass\n"
        "else:\n    raise SystemExit('request_router imported without ray')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
