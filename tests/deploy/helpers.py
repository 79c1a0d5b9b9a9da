"""Process checks shared by the launcher and demo tests."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

# What ``kvroute up`` prints once every replica and the router answer.
READY_LINE = "Ctrl-C stops everything."


def pgrep(*args: str) -> list[int]:
    out = subprocess.run(["pgrep", *args], capture_output=True, text=True, check=False)
    return [int(pid) for pid in out.stdout.split()]


def is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True  # already gone


def leftovers(state_dir: Path, groups: list[int]) -> list[int]:
    """Live processes of the fleet. vLLM's engine core and worker are reparented to init
    when the API server exits first; until init reaps them they show as zombies (no code,
    no memory, no sockets), which are not leftovers."""
    found = set(pgrep("-f", str(state_dir)))
    for group in groups:
        found |= set(pgrep("-g", str(group)))
    return sorted(pid for pid in found if not is_zombie(pid))


def wait_until_up(proc: subprocess.Popen[str], timeout: float = 120) -> str:
    """Read ``kvroute up``'s output until its ready line; fail the test with what it printed
    (killing it) when it exits or the timeout passes first."""
    assert proc.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if READY_LINE in line:
            return "".join(lines)
    # SIGTERM first: kvroute up then stops the fleet it started (its children run in
    # sessions of their own, so a SIGKILL to it alone would leave them running).
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
    pytest.fail("kvroute up never became ready:\n" + "".join(lines))
