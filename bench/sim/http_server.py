"""One simulated server's HTTP side: uvicorn on a socket bound before the app starts.

A replica (and a data-parallel server) binds its port first, so it knows its URL before it
serves and keeps the same port across restarts, then runs uvicorn on that very socket inside
the fleet's one event loop. uvicorn's signal capture is off: many servers share the loop and
the fleet process owns the signals.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator
from typing import Any

import uvicorn

__all__ = ["SocketHTTPServer"]


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class SocketHTTPServer:
    """``bind`` a port, ``serve`` an ASGI app on it, ``shutdown`` (graceful or forced)."""

    def __init__(self) -> None:
        self._server: _Server | None = None
        self._task: asyncio.Task[None] | None = None
        self._sock: socket.socket | None = None

    def bind(self, host: str, port: int) -> int:
        """Bind ``host:port`` (0: a free port) and return the port."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        self._sock = sock  # uvicorn serves on this very socket; closed on shutdown
        return int(sock.getsockname()[1])

    async def serve(self, app: Any, name: str) -> None:
        """Serve ``app`` on the bound socket; returns once uvicorn accepts connections."""
        assert self._sock is not None, "bind first"
        config = uvicorn.Config(
            app,
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_keep_alive=30,
            timeout_graceful_shutdown=1,
        )
        self._server = _Server(config)
        self._task = asyncio.get_running_loop().create_task(
            self._server.serve(sockets=[self._sock])
        )
        while not self._server.started:
            if self._task.done():
                self._task.result()
                raise RuntimeError(f"server {name} failed to start")
            await asyncio.sleep(0.01)

    async def shutdown(self, *, force: bool) -> None:
        """Stop serving (``force``: drop open connections at once, as a crash would)."""
        if self._server is not None:
            self._server.should_exit = True
            self._server.force_exit = force
            if force:
                # A crashed process's sockets are reset by the kernel: abort every open
                # connection, or a kept-alive one would still take requests that nothing
                # will ever answer.
                for connection in list(self._server.server_state.connections):
                    transport = getattr(connection, "transport", None)
                    if transport is not None:
                        transport.abort()
            if self._task is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self._task, 5)
        self._server = None
        self._task = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None
