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


def test_up_refuses_half_a_pd_fleet_and_real_vllm_pools(tmp_path: Path) -> None:
    for extra, message in (
        (["--engine", "sim", "--prefill", "1"], "--prefill and --decode go together"),
        (["--engine", "vllm", "--prefill", "1", "--decode", "1"], "NixlConnector"),
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
