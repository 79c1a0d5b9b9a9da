"""Run the real router (``kvroute.router.app.create_app``) under uvicorn in a child process.

The routing benchmark must measure the router users run, not a re-implementation of its
policies, and must not let the load generator's event loop share a GIL with it. This module
is that child: ``python -m kvroute.bench.sim.router_proc SETTINGS.json`` serves the router on a free
loopback port and prints one ``{"ready": true, "url": ...}`` line; ``RouterProcess`` starts it,
waits until the router reports healthy replicas, and stops it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

__all__ = ["RouterProcess", "settings_from_dict"]


def settings_from_dict(data: dict[str, Any]) -> Any:
    """RouterSettings from JSON-able data (``replicas``: dicts; ``cost``: a dict of knobs)."""
    from kvroute.router.config import CostSettings, ReplicaConfig, RouterSettings

    data = dict(data)
    replicas = [ReplicaConfig(**r) for r in data.pop("replicas", [])]
    cost = CostSettings(**data.pop("cost", {}))
    return RouterSettings(replicas=replicas, cost=cost, **data)


async def _serve(settings_path: Path) -> None:
    import uvicorn
    from kvroute.router.app import create_app
    from kvroute.router.http_protocol import header_deadline_protocol

    settings = settings_from_dict(json.loads(settings_path.read_text()))
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((settings.host, 0))
    config = uvicorn.Config(
        create_app(settings),
        log_level="warning",
        access_log=False,
        lifespan="on",
        http=header_deadline_protocol(settings.header_timeout_s),
        timeout_keep_alive=60,
        timeout_graceful_shutdown=2,
    )
    server = uvicorn.Server(config)
    task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            task.result()
            raise RuntimeError("router exited before it started")
        await asyncio.sleep(0.02)
    print(
        json.dumps({"ready": True, "url": f"http://{settings.host}:{sock.getsockname()[1]}"}),
        flush=True,
    )
    await task
    sock.close()


class RouterProcess:
    """A router child process for one benchmark run (a context manager)."""

    def __init__(self, settings: dict[str, Any], *, start_timeout_s: float = 90.0) -> None:
        self.settings = settings
        self.start_timeout_s = start_timeout_s
        self.url = ""
        self._proc: subprocess.Popen[str] | None = None
        self._tmp = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)  # noqa: SIM115

    def start(self) -> RouterProcess:
        json.dump(self.settings, self._tmp)
        self._tmp.close()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "kvroute.bench.sim.router_proc", self._tmp.name],
            stdout=subprocess.PIPE,
            text=True,
        )
        deadline = time.monotonic() + self.start_timeout_s
        assert self._proc.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(self._proc.stdout, selectors.EVENT_READ)
            while not self.url:
                if time.monotonic() > deadline:
                    self.stop()
                    raise TimeoutError("router did not start in time")
                if not sel.select(timeout=0.5):
                    if self._proc.poll() is not None:
                        raise RuntimeError(f"router exited with {self._proc.returncode}")
                    continue
                line = self._proc.stdout.readline()
                if not line:
                    raise RuntimeError(f"router exited with {self._proc.wait()}")
                if line.startswith("{") and '"ready"' in line:
                    self.url = json.loads(line)["url"]
        self._wait_healthy(deadline)
        return self

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def _poll(
        self, path: str, done: Callable[[dict[str, Any]], bool], deadline: float, every_s: float
    ) -> bool:
        """GET ``path`` until ``done(body)`` or ``deadline``; whether it got there."""
        with httpx.Client(timeout=5.0) as client:
            while time.monotonic() < deadline:
                with contextlib.suppress(httpx.HTTPError, ValueError):
                    if done(client.get(self.url + path).json()):
                        return True
                time.sleep(every_s)
        return False

    def _wait_healthy(self, deadline: float) -> None:
        """Until every replica is healthy in the router's eyes (its /health counts them)."""
        want = len(self.settings.get("replicas", []))
        if not self._poll("/health", lambda b: b.get("healthy_replicas", 0) >= want, deadline, 0.1):
            self.stop()
            raise TimeoutError("router never saw every replica healthy")

    def wait_feeds_settled(self, timeout_s: float = 60.0) -> bool:
        """Until no event feed is still joining or replaying (``/index/stats`` freshness): a
        run timed while the router catches up on the fleet's history would time that, not its
        routing. False when ``timeout_s`` passed first."""
        unsettled = ("connecting", "syncing")

        def settled(stats: dict[str, Any]) -> bool:
            states = [e.get("freshness") for e in stats.get("replicas", {}).values()]
            return not any(s in unsettled for s in states)

        return self._poll("/index/stats", settled, time.monotonic() + timeout_s, 0.2)

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=5)
            if proc.stdout is not None:
                proc.stdout.close()
        Path(self._tmp.name).unlink(missing_ok=True)

    def __enter__(self) -> RouterProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve(Path(sys.argv[1])))
