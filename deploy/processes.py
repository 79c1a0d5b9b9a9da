"""Child processes that start, become ready and stop the same way everywhere.

Every child kvroute starts (vLLM replicas, routers, the simulated fleet, the proxy benchmark's
upstream) goes through ``ChildProcess``:

* it runs in its own session, hence its own process group: one ``killpg`` reaches the child
  and whatever it forked (vLLM's engine core and workers), and a Ctrl-C in the terminal
  reaches only the parent, which then stops its children in order;
* its stdout and stderr go to a log file, whose tail ends every error about it;
* it is ready when an HTTP GET answers 200 (``wait_http``), and a child that exits while
  the parent waits is reported at once rather than at the timeout;
* ``stop`` sends SIGTERM to the group, waits for the whole group (not only its leader) to
  exit, sends SIGKILL to whatever is left after the grace period, and reaps the leader.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Collection
from pathlib import Path

__all__ = [
    "ChildError",
    "ChildProcess",
    "ChildTimeout",
    "RunsChild",
    "child_env",
    "free_port",
    "group_alive",
    "stop_group",
]


class ChildError(RuntimeError):
    """A child exited or never became ready; the message ends with its log tail."""


class ChildTimeout(ChildError, TimeoutError):
    """A child still runs but did not become ready in time."""


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out by itself (Linux's ``ip_local_port_range``)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default; other systems' ranges start higher (49152)


_EPHEMERAL_LOW = _ephemeral_low()
_PORTS_FROM = 20000
_given: set[int] = set()  # handed out by this process: never twice


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free right now, for a child to bind. Another process may take it
    before the child binds it. Chosen below the kernel's ephemeral range when there is room
    there: ports from that range are what every outgoing connection and every ``bind(0)``
    (ZeroMQ's random ports included) takes meanwhile, which made tests running side by side
    find one child's port already bound by another's socket. Never the same port twice in
    one process."""
    rng = random.Random()
    for _ in range(64 if _EPHEMERAL_LOW - _PORTS_FROM >= 1024 else 0):
        port = rng.randrange(_PORTS_FROM, _EPHEMERAL_LOW)
        if port in _given:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _given.add(port)
        return port
    for _ in range(1000):  # no room below the kernel's range: what it hands out, if new
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        if port not in _given:
            break
    _given.add(port)
    return port


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def group_alive(pgid: int) -> bool:
    """Whether process group ``pgid`` has a member that is not a zombie."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A group of only zombies still "exists"; check /proc for live members.
    try:
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                with open(f"/proc/{pid}/stat") as f:
                    parts = f.read().rsplit(")", 1)[1].split()
                if int(parts[2]) == pgid and parts[0] != "Z":
                    return True
            except (OSError, IndexError, ValueError):
                continue
    except OSError:
        return True
    return False


def stop_group(proc: subprocess.Popen[bytes], grace_s: float) -> None:
    """SIGTERM ``proc``'s process group, wait up to ``grace_s`` for every member to exit,
    SIGKILL what is left, reap ``proc``, and wait (at most 5 s) until the group is gone.
    Members (vLLM's engine core, its workers) may outlive the leader, so waiting for the
    leader alone is not enough."""
    pgid = proc.pid
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(max(0.0, deadline - time.monotonic()))
    while group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(5)
    # SIGKILL is delivered asynchronously: return once the group is really gone, so a caller
    # that starts a replacement on the same ports or files never meets the old one.
    deadline = time.monotonic() + 5.0
    while group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.02)


class ChildProcess:
    """One child process group with its log file.

    ``log_path=None`` logs to a file in the temporary directory that ``stop`` removes (callers
    that keep no state dir still get the log tail in errors).
    """

    def __init__(self, name: str, log_path: Path | None = None) -> None:
        self.name = name
        self._temp_log = log_path is None
        slug = name.replace(" ", "-")
        self.log_path = log_path or Path(tempfile.gettempdir()) / (
            f"kvroute-{slug}-{os.getpid()}-{uuid.uuid4().hex[:12]}.log"
        )
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        """The child's pid, which is also its process-group id."""
        return None if self.proc is None else self.proc.pid

    def is_running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(
        self,
        cmd: list[str],
        *,
        env: dict[str, str] | None = None,
        cpus: Collection[int] | None = None,
    ) -> None:
        """Start ``cmd`` (``cpus``: the cores it may run on, set before it execs)."""
        if self.is_running():
            raise ChildError(f"{self.name} already runs")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
        with open(self.log_path, "ab") as log:
            log.write(f"\n==== start {time.ctime()}: {cmd}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                cmd,
                env=child_env() if env is None else env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=pin,
            )

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def check_alive(self) -> None:
        """Raise ``ChildError`` (with the log tail) if the child has exited."""
        if self.proc is not None and self.proc.poll() is not None:
            raise ChildError(
                f"{self.name} exited with {self.proc.returncode}; log {self.log_path}:\n"
                + self.log_tail()
            )

    def wait_http(
        self,
        url: str,
        timeout_s: float,
        *,
        accept: Callable[[bytes], bool] | None = None,
        every_s: float = 0.2,
        headers: dict[str, str] | None = None,
    ) -> bytes:
        """GET ``url`` until it answers 200 (and ``accept(body)`` holds, when given); the
        body. Raises ``ChildError`` when the child exits first, ``ChildTimeout`` after
        ``timeout_s``; both carry the log tail."""
        deadline = time.monotonic() + timeout_s
        last = "no answer yet"
        while True:
            self.check_alive()
            try:
                request = urllib.request.Request(url, headers=headers or {})
                with urllib.request.urlopen(request, timeout=5) as resp:
                    body = resp.read()
                if accept is None or accept(body):
                    return body
                last = f"not ready: {body[:200]!r}"
            except urllib.error.HTTPError as exc:
                last = f"HTTP {exc.code}"
            except (urllib.error.URLError, OSError, ValueError) as exc:
                last = repr(exc)
            if time.monotonic() >= deadline:
                break
            time.sleep(every_s)
        raise ChildTimeout(
            f"{self.name} not ready after {timeout_s:.0f}s ({last}); log {self.log_path}:\n"
            + self.log_tail()
        )

    def stop(self, grace_s: float = 20.0) -> None:
        """Stop the whole group (see ``stop_group``). Safe to call twice."""
        proc, self.proc = self.proc, None
        if proc is not None:
            stop_group(proc, grace_s)
        if self._temp_log:
            self.log_path.unlink(missing_ok=True)

    def kill(self) -> None:
        """SIGKILL the whole group at once (a crash, not a clean stop) and reap the leader."""
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.stop(grace_s=5)


class RunsChild:
    """A handle that owns one ``ChildProcess`` (a replica, a router, a simulated fleet) and
    shows its pid, log and liveness the same way as every other."""

    process: ChildProcess

    @property
    def pid(self) -> int | None:
        """The child's pid, which is also its process-group id."""
        return self.process.pid

    @property
    def log_path(self) -> Path:
        return self.process.log_path

    def is_running(self) -> bool:
        return self.process.is_running()
