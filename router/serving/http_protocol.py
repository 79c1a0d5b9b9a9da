"""uvicorn's HTTP protocol with a deadline on request headers (slowloris).

uvicorn times out a keep-alive connection that is idle between requests, but not one that is
opened and never sends, or that trickles its request line and headers a byte at a time: each
such connection holds a socket and a parser for as long as the client likes, and a few
thousand of them exhaust the router's file descriptors. Here a connection must deliver a
request's complete headers within ``header_timeout_s`` of opening (or of the first byte of
its next request), or it is closed. The body has its own deadline (``body_timeout_s``,
kvroute.router.serving.proxy.read_body, answered 408) and a streamed answer its write timeout.

A peer router's load stream (``GET /peer/load?stream=1``, router/peers/load.py) never ends by
itself: at shutdown uvicorn would wait out its graceful timeout for it. Its connection is
closed at once instead; the peer reconnects to another router.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

__all__ = ["header_deadline_protocol"]

log = logging.getLogger(__name__)


class _HeaderDeadlineProtocol(HttpToolsProtocol):
    header_timeout_s: float = 10.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None

    def _arm_header_deadline(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_expired)

    def _disarm_header_deadline(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_expired(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            log.info(
                "closing a connection from %s: no complete request headers within %.0f s",
                self.client,
                self.header_timeout_s,
            )
            self.transport.close()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_deadline()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm_header_deadline()  # the next request on a kept-alive connection

    def on_headers_complete(self) -> None:
        self._disarm_header_deadline()
        super().on_headers_complete()

    def shutdown(self) -> None:
        cycle = self.cycle
        if (
            cycle is not None
            and not cycle.response_complete
            and cycle.scope.get("path") == "/peer/load"
        ):
            self.transport.close()
            return
        super().shutdown()


def header_deadline_protocol(header_timeout_s: float) -> type[HttpToolsProtocol]:
    """The protocol class to give ``uvicorn.Config(http=...)``."""
    if header_timeout_s <= 0:
        raise ValueError("header_timeout_s must be positive")
    return type(
        "HeaderDeadlineProtocol", (_HeaderDeadlineProtocol,), {"header_timeout_s": header_timeout_s}
    )
