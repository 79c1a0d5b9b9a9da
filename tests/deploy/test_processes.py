"""The process-group helper every child goes through: readiness, failure reports, stopping.

The children are small Python one-liners, so these run in a second or two.
"""

from __future__ import annotations

import socket
import sys
import time
from pathlib import Path

import pytest

from kvroute.deploy.processes import ChildError, ChildProcess, ChildTimeout, free_port, group_alive

# Serves 200 on GET /ok and 503 elsewhere once it has slept ``DELAY`` seconds.
_SERVER = """
import http.server, sys, time
time.sleep(float(sys.argv[2]))
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/ok" else 503)
        self.end_headers()
        self.wfile.write(b"ready")
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""

# Forks a grandchild that ignores SIGTERM, prints its pid, then waits.
_STUBBORN = """
import os, signal, sys, time
pid = os.fork()
if pid == 0:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(600)
    os._exit(0)
print(pid, flush=True)
time.sleep(600)
"""


def test_ready_when_a_get_answers_200(tmp_path: Path) -> None:
    port = free_port()
    child = ChildProcess("server", tmp_path / "logs" / "server.log")
    child.start([sys.executable, "-c", _SERVER, str(port), "0.3"])
    try:
        assert child.wait_http(f"http://127.0.0.1:{port}/ok", 30) == b"ready"
        with pytest.raises(ChildTimeout, match="HTTP 503"):
            child.wait_http(f"http://127.0.0.1:{port}/other", 0.5)
        with pytest.raises(ChildTimeout, match="not ready"):
            child.wait_http(f"http://127.0.0.1:{port}/ok", 0.5, accept=lambda body: False)
    finally:
        child.stop()
    assert not child.is_running()
    assert "==== start" in (tmp_path / "logs" / "server.log").read_text()


def test_a_child_that_exits_is_reported_at_once_with_its_log_tail() -> None:
    child = ChildProcess("doomed")
    child.start([sys.executable, "-c", "import sys; print('bad flag --x'); sys.exit(3)"])
    started = time.monotonic()
    with pytest.raises(ChildError, match=r"doomed exited with 3(.|\n)*bad flag --x"):
        child.wait_http(f"http://127.0.0.1:{free_port()}/", 60)
    assert time.monotonic() - started < 30
    log = child.log_path
    assert log.exists()
    child.stop()
    assert not log.exists()  # a temporary log goes with the child


def test_stop_kills_the_whole_group_after_the_grace_period(tmp_path: Path) -> None:
    child = ChildProcess("stubborn", tmp_path / "stubborn.log")
    child.start([sys.executable, "-c", _STUBBORN])
    pgid = child.pid
    assert pgid is not None
    deadline = time.monotonic() + 30
    while not (tmp_path / "stubborn.log").read_text().strip().split("\n")[-1].isdigit():
        assert time.monotonic() < deadline, child.log_tail()
        time.sleep(0.05)
    assert group_alive(pgid)
    started = time.monotonic()
    child.stop(grace_s=0.5)
    assert time.monotonic() - started < 10
    assert not group_alive(pgid)  # the grandchild ignored SIGTERM: SIGKILL reached it
    assert child.pid is None
    child.stop()  # twice is fine


def test_free_ports_come_from_below_the_kernels_range_and_never_twice() -> None:
    """Ports the kernel hands out by itself (outgoing connections, ``bind(0)``, ZeroMQ's
    random ports) are never what ``free_port`` picks when there is room below that range,
    so a child's port is not taken meanwhile by another test's socket; and one process is
    never given one port twice."""
    from kvroute.deploy import processes

    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    if processes._EPHEMERAL_LOW - processes._PORTS_FROM >= 1024:
        assert all(processes._PORTS_FROM <= p < processes._EPHEMERAL_LOW for p in ports)
    for port in ports[:5]:  # free now: a child could bind it
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", port))
