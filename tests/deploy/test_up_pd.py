"""``kvroute up --prefill N --decode M --engine sim``: simulated P/D pools behind the router,
used through the official ``openai`` client; bad pool flags refused before anything starts."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import httpx
from openai import OpenAI

from tests.deploy.helpers import leftovers
from tests.deploy.test_up_cli import kvroute_up, stop

PROMPT = "A long new prompt for the prefill pool to compute and the decode pool to pull. " * 12


def test_up_sim_with_prefill_and_decode_pools_splits_requests(tmp_path: Path) -> None:
    state = tmp_path / "state"
    args = ("--engine", "sim", "--prefill", "1", "--decode", "2", "--router-arg=--pd-mode=always")
    with kvroute_up(state, *args) as (proc, manifest):
        groups = manifest["process_groups"]
        assert len(manifest["replicas"]) == 3
        router = manifest["routers"]["router"]
        client = OpenAI(base_url=router["url"] + "/v1", api_key="x", max_retries=0, timeout=30)
        raw = client.completions.with_raw_response.create(
            model=manifest["served_model_name"], prompt=PROMPT, max_tokens=4
        )
        assert raw.parse().choices[0].text
        names = [r["name"] for r in manifest["replicas"]]
        assert raw.headers["x-kvroute-prefill-replica"] == names[0]
        assert raw.headers["x-kvroute-replica"] in names[1:]
        stats = httpx.get(router["url"] + "/index/stats", timeout=10).json()
        roles = [stats["replicas"][n]["health"]["role"] for n in names]
        assert roles == ["prefill", "decode", "decode"]
        pd = stats["disaggregation"]
        assert pd["pools"]["prefill"]["replicas"] == 1 and pd["pools"]["decode"]["replicas"] == 2
        assert pd["decode_legs"] == 1
        code, output = stop(proc, signal.SIGINT)
    assert code == 0, output
    assert leftovers(state, groups) == []


def test_up_refuses_half_a_pd_fleet_and_real_vllm_pools_without_the_connector(
    tmp_path: Path,
) -> None:
    for extra, message in (
        (["--engine", "sim", "--prefill", "1"], "--prefill and --decode go together"),
        (["--engine", "vllm", "--prefill", "1", "--decode", "1", "--no-connector"], "storage"),
    ):
        state = tmp_path / "state"
        done = subprocess.run(
            [sys.executable, "-m", "kvroute.deploy.cli", "up", "--state-dir", str(state), *extra],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 1 and message in done.stderr
        assert not (state / "fleet.json").exists()


def test_real_vllm_pools_share_one_storage_domain_as_their_transport(tmp_path: Path) -> None:
    """``--engine vllm --prefill 1 --decode 1``: every replica's connector on one storage
    domain under the state dir with ``pd_via_storage`` (docs/connector.md, "P/D through a
    storage domain"), and the router told each replica's role. The specs only: starting two
    real replicas is tests/e2e/test_pd_storage_e2e.py's (the same connector settings)."""
    from kvroute.deploy.fleet_config import FleetConfig
    from kvroute.deploy.local_fleet import PD_DOMAIN, LocalFleet
    from kvroute.deploy.vllm_server import VllmReplica

    state = tmp_path / "state"
    config = FleetConfig(state_dir=str(state), engine="vllm", prefill=1, decode=1)
    fleet = LocalFleet(config)
    fleet.model, fleet.served_model_name = str(tmp_path / "model"), "m"
    specs = [fleet.replica_spec(i, [0, 1], False) for i in range(config.replicas)]
    for spec in specs:
        assert spec.kv_transfer_config is not None
        extra = spec.kv_transfer_config["kv_connector_extra_config"]
        assert extra["disk_dir"] == str(state.resolve() / "disk" / PD_DOMAIN)
        assert extra["storage_domain"] == PD_DOMAIN and extra["pd_via_storage"] is True
        assert spec.kv_transfer_config["kv_load_failure_policy"] == "recompute"
    fleet.replicas = [VllmReplica(spec) for spec in specs]
    assert [e.role for e in fleet.endpoints()] == ["prefill", "decode"]
    assert [
        e.flag().endswith(f"role={r}")
        for e, r in zip(fleet.endpoints(), ("prefill", "decode"), strict=True)
    ] == [True, True]
    # Without P/D each replica keeps its own private directory.
    plain = LocalFleet(FleetConfig(state_dir=str(state), engine="vllm", replicas=2))
    plain.model = str(tmp_path / "model")
    extra = plain.replica_spec(1, [0, 1], False).kv_transfer_config["kv_connector_extra_config"]
    assert "storage_domain" not in extra and extra["disk_dir"].endswith("replica-1")
