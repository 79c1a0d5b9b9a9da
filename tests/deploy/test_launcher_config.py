"""The launcher's wiring, checked without starting vLLM: what each replica is told, and the
refusals that must come before any process starts."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest

from kvroute.deploy.fleet_config import FleetConfig
from kvroute.deploy.local_fleet import FleetError, LocalFleet
from kvroute.deploy.router_process import ReplicaEndpoint
from kvroute.router.specs import parse_replica_flag


def fleet_at(path: Path, **overrides: object) -> LocalFleet:
    fleet = LocalFleet(FleetConfig(state_dir=path, **overrides))  # type: ignore[arg-type]
    fleet.model, fleet.served_model_name = str(path / "model"), "tiny"
    return fleet


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"replicas": 0}, "--replicas"),
        ({"engine": "tgi"}, "--engine"),
        ({"policy": "random"}, "--policy"),
        ({"chunk_tokens": 48}, "multiple of --block-size"),
        ({"num_gpu_blocks": 64, "max_model_len": 2048}, "2016 tokens"),
    ],
)
def test_bad_settings_are_refused_before_anything_starts(
    overrides: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        FleetConfig(**overrides).validate()  # type: ignore[arg-type]


def test_the_smallest_device_cache_for_a_max_length_request_is_accepted() -> None:
    FleetConfig(num_gpu_blocks=65, max_model_len=2048).validate()


def test_each_replica_gets_its_own_core_endpoints_and_disk_tier(tmp_path: Path) -> None:
    fleet = fleet_at(tmp_path, replicas=3, num_gpu_blocks=65, max_model_len=2048)
    specs = [fleet.replica_spec(i, cores=[0, 1], gpu=False) for i in range(3)]

    assert [s.cpu_bind for s in specs] == ["0", "1", "0"]  # round-robin over usable cores
    assert len({s.name for s in specs}) == 3
    for spec in specs:
        assert spec.kv_events_endpoint and spec.kv_events_endpoint.startswith("ipc://")
        assert spec.kv_events_replay_endpoint and spec.kv_events_replay_endpoint.startswith(
            "ipc://"
        )
        assert spec.num_gpu_blocks_override == 65
        assert spec.enable_prefix_caching
        extra = spec.kv_transfer_config["kv_connector_extra_config"]  # type: ignore[index]
        assert Path(extra["disk_dir"]) == tmp_path.resolve() / "disk" / spec.name
        assert Path(extra["disk_dir"]).is_dir()
        assert extra["chunk_tokens"] % spec.block_size == 0
    endpoints = {s.kv_events_endpoint for s in specs} | {s.kv_events_replay_endpoint for s in specs}
    assert len(endpoints) == 6  # nothing shared between replicas


def test_the_connector_can_be_left_out(tmp_path: Path) -> None:
    spec = fleet_at(tmp_path, connector=False).replica_spec(0, cores=[0], gpu=False)
    assert spec.kv_transfer_config is None


def test_gpu_replicas_get_a_device_each_and_no_core_pinning(tmp_path: Path) -> None:
    spec = fleet_at(tmp_path).replica_spec(1, cores=[0, 1], gpu=True)
    assert spec.cpu_bind is None
    assert spec.extra_env["CUDA_VISIBLE_DEVICES"] == "1"


def test_fresh_disk_empties_the_tier_directory(tmp_path: Path) -> None:
    old = tmp_path / "disk" / "replica-0" / "chunk.bin"
    old.parent.mkdir(parents=True)
    old.write_bytes(b"x")
    fleet_at(tmp_path).replica_spec(0, cores=[0], gpu=False)
    assert old.exists()  # kept by default: a restarted fleet finds its cache
    fleet_at(tmp_path, fresh_disk=True).replica_spec(0, cores=[0], gpu=False)
    assert not old.exists()


def test_ipc_sockets_fall_back_to_a_short_directory_when_the_state_dir_is_deep(
    tmp_path: Path,
) -> None:
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    fleet = fleet_at(deep)
    endpoint = fleet.ipc_endpoint("replica-0.events")
    path = Path(endpoint.removeprefix("ipc://"))
    assert len(str(path)) < 108  # sockaddr_un.sun_path
    assert path.parent.is_dir()
    fleet.stop()
    assert not path.parent.exists()  # the temporary directory goes with the fleet

    # A short state dir keeps its sockets in its own run/ (not tmp_path: under pytest-xdist
    # it is one folder deeper, and already too deep).
    short = Path(tempfile.mkdtemp(prefix="kvr-"))
    try:
        shallow = fleet_at(short)
        assert shallow.ipc_endpoint("x.events") == f"ipc://{short.resolve() / 'run' / 'x.events'}"
    finally:
        shutil.rmtree(short, ignore_errors=True)


def test_two_fleets_cannot_share_a_state_dir(tmp_path: Path) -> None:
    first = fleet_at(tmp_path)
    first.lock_state_dir()
    try:
        with pytest.raises(FleetError, match="another fleet"):
            fleet_at(tmp_path).lock_state_dir()
    finally:
        first.stop()
    second = fleet_at(tmp_path)
    second.lock_state_dir()  # free again once the first fleet stopped
    second.stop()


def test_replica_flag_is_what_kvroute_serve_parses() -> None:
    ep = ReplicaEndpoint(
        name="replica-0",
        url="http://127.0.0.1:8001",
        events="ipc:///tmp/k/replica-0.events",
        replay="ipc:///tmp/k/replica-0.replay",
        topic="kv@replica-0",
    )
    parsed = parse_replica_flag(ep.flag())
    assert (parsed.url, parsed.events, parsed.replay, parsed.topic, parsed.key) == (
        ep.url,
        ep.events,
        ep.replay,
        ep.topic,
        ep.name,
    )


@pytest.mark.parametrize(("dp", "parsed"), [(None, None), ("2", 2), ("auto", "auto")])
def test_a_data_parallel_replica_flag_carries_its_rank_count(
    dp: str | None, parsed: int | str | None
) -> None:
    ep = ReplicaEndpoint(name="dp", url="http://127.0.0.1:8001", dp=dp)
    assert parse_replica_flag(ep.flag()).dp == parsed
