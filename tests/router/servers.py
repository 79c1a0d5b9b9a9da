"""Real HTTP servers on 127.0.0.1 for the router tests: uvicorn in a thread, one port each.

``ServerThread`` binds its socket before starting so the port is known at once and can be
reused after ``stop`` (to bring an ejected replica back on the same address).
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from typing import Any

import uvicorn

from kvroute.router.serving.http_protocol import header_deadline_protocol
from tests.waiting import wait_until

__all__ = ["ServerThread", "listening_socket", "wait_until"]


def listening_socket(port: int = 0) -> socket.socket:
    """A socket already listening on 127.0.0.1 (``port=0``: a free port) for a server in this
    process: bound here, it cannot be taken between choosing the port and serving on it, which
    ``kvroute.deploy.processes.free_port`` (for children) cannot promise."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(512)
    sock.setblocking(False)
    return sock


class ServerThread:
    def __init__(
        self,
        app: Any,
        port: int = 0,
        *,
        startup_timeout_s: float = 30.0,
        http: Any = None,
    ) -> None:
        self.app = app
        self.sock = listening_socket(port)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            app,
            log_level="warning",
            lifespan="on",
            # The router's own protocol, as `kvroute serve` runs it (a peer's load stream is
            # closed at shutdown rather than waited for).
            http=header_deadline_protocol(10.0) if http is None else http,
            loop="asyncio",
            timeout_graceful_shutdown=2,
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self._run, daemon=True, name=f"uvicorn-{self.port}")
        self.startup_timeout_s = startup_timeout_s
        self.loop: asyncio.AbstractEventLoop | None = None

    def _run(self) -> None:
        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self.server.serve(sockets=[self.sock]))

    def start(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + self.startup_timeout_s
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError(f"server on {self.url} failed to start")
            if time.monotonic() > deadline:
                raise TimeoutError(f"server on {self.url} did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
