"""Forward one request to a replica and stream its answer back, at the ASGI level.

Why raw ASGI and not a framework response: the proxy must (1) forward the client's bytes
unchanged (no re-serialization), (2) notice a client disconnect while the replica is still
prefilling, before any byte flows, and cancel the upstream request, and (3) keep per-request
overhead well under a millisecond. A watcher task on ``receive`` does (2): it cancels the
request's task, whose cleanup closes the upstream response, which closes the connection
and makes vLLM abort the request.

Retries: an attempt that fails before the response headers (connection refused, reset,
timeout) or answers 502/503/504 moves to the next replica of the ranking. Once bytes flowed
to the client nothing is retried; a broken stream ends with an SSE error event and
``data: [DONE]`` so no client hangs.

A 500 is retried only when the replica's engine is dead. vLLM answers 500 to the requests of
an engine that died (``EngineDeadError``), which another replica could serve; but a 500 is
also a request's own failure, and a request that crashes engines must not be tried across
the fleet. So on a 500, before any byte went to the client, the proxy asks that replica's
``GET /health`` (with the router's replica key, ``probe_timeout_s``; concurrent 500s of one
server share one probe): 200 means the engine lives and the 500 is the request's own, relayed
as is; anything else (non-200, refused, reset, no answer in time) means the engine is dead:
the replica is ejected at once (with its data-parallel siblings, as for a refused
connection), the retry is counted, and the next replica of another server is tried. At most
one 500 per request is retried this way: a second dead replica's 500 is the client's answer,
so one poison request takes down two engines at most. A 500 from the last candidate is
relayed without a probe (the health checker ejects that replica on its own schedule).
Targets of a server this request already found dead (refused, or a dead engine) are skipped
without costing an attempt.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

from kvroute.router.errors import RouterError, sse_error
from kvroute.router.fleet.replicas import Replica, ReplicaRegistry
from kvroute.router.serving.auth import ReplicaAuth
from kvroute.router.serving.upstream import (
    Response,
    UpstreamClient,
    UpstreamConnectError,
    UpstreamError,
    UpstreamUnreachable,
)

__all__ = [
    "DP_RANK_HEADER",
    "REPLICA_HEADER",
    "DisconnectWatch",
    "Forwarder",
    "Upstream",
    "downstream_headers",
    "rank_headers",
    "read_body",
    "request_id_of",
    "send_body",
    "send_stream",
    "upstream_headers",
]

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

# Hop-by-hop headers (RFC 9110 7.6.1) and the ones the proxy sets itself. Accept-Encoding is
# dropped so replicas answer uncompressed: the router reads usage from the body.
_DROP_UP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
        b"host",
        b"content-length",
        b"accept-encoding",
        b"x-request-id",
        b"expect",
    }
)
REPLICA_HEADER = b"x-kvroute-replica"
DP_RANK_HEADER = b"x-data-parallel-rank"
_DROP_DOWN = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
        b"content-length",
        b"x-request-id",
        b"date",
        b"server",
    }
)
_RETRY_STATUS = frozenset({502, 503, 504})
log = logging.getLogger(__name__)
_REFUSED = "the replica refused the router's API key (HTTP 401): check --replica-api-key"


class ClientGone(Exception):
    """The client disconnected, or stopped reading the answer for longer than allowed."""


def request_id_of(scope: Scope) -> str:
    for name, value in scope["headers"]:
        if name == b"x-request-id" and value:
            return value.decode("latin-1")
    return uuid.uuid4().hex


def upstream_headers(scope: Scope, request_id: str) -> list[tuple[bytes, bytes]]:
    headers = [(k, v) for k, v in scope["headers"] if k not in _DROP_UP]
    headers.append((b"x-request-id", request_id.encode("latin-1")))
    return headers


def rank_headers(headers: list[tuple[bytes, bytes]], replica: Replica) -> list[tuple[bytes, bytes]]:
    """The headers for one target: a data-parallel rank's (router/fleet/dp.py) pin the request to
    its engine with ``X-data-parallel-rank`` (read by vLLM's OpenAI server), replacing any the
    client sent; other replicas get the headers unchanged."""
    rank = replica.config.dp_rank
    if rank is None:
        return headers
    pinned = [(k, v) for k, v in headers if k != DP_RANK_HEADER]
    pinned.append((DP_RANK_HEADER, str(rank).encode()))
    return pinned


def downstream_headers(
    raw: list[tuple[bytes, bytes]],
    request_id: str,
    replica: str,
    content_length: int | None = None,
) -> list[tuple[bytes, bytes]]:
    """The replica's response headers for the client, less hop-by-hop ones, plus the request
    id and ``x-kvroute-replica`` (which replica answered: what an operator correlates with
    that replica's logs, and what the routing benchmark attributes each request to)."""
    headers = [
        (k.lower(), v)
        for k, v in raw
        if k.lower() not in _DROP_DOWN and k.lower() != REPLICA_HEADER
    ]
    headers.append((b"x-request-id", request_id.encode("latin-1")))
    headers.append((REPLICA_HEADER, replica.encode("latin-1", errors="replace")))
    if content_length is not None:
        headers.append((b"content-length", str(content_length).encode()))
    return headers


async def read_body(
    scope: Scope, receive: Receive, limit: int, timeout_s: float | None = None
) -> bytes:
    """The whole request body, or 413 as soon as it is known to exceed ``limit``, or 408 when
    it has not fully arrived ``timeout_s`` after the request began (a trickling client must
    not hold a connection and its buffer for ever)."""
    if timeout_s is None:
        return await _read_body(scope, receive, limit)
    try:
        async with asyncio.timeout(timeout_s):
            return await _read_body(scope, receive, limit)
    except TimeoutError:
        raise RouterError(408, f"request body not received within {timeout_s:g} s") from None


async def _read_body(scope: Scope, receive: Receive, limit: int) -> bytes:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                declared = int(value)
            except ValueError:
                raise RouterError(400, "invalid Content-Length header") from None
            if declared > limit:
                raise RouterError(413, f"request body of {declared} bytes exceeds {limit} bytes")
            break
    chunks: list[bytes] = []
    total = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone()
        chunk = message.get("body", b"")
        if chunk:
            total += len(chunk)
            if total > limit:
                raise RouterError(413, f"request body exceeds {limit} bytes")
            chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


class DisconnectWatch:
    """Cancel the current task when the client disconnects; swallow that cancellation.

    The watcher task starts only after ``delay_s``: most requests finish sooner, and a task
    per request (cancelled, with its CancelledError and traceback cycle) costs more than the
    proxying itself. A client gone within ``delay_s`` is noticed ``delay_s`` late at most.
    """

    __slots__ = ("delay_s", "disconnected", "finished", "receive", "task", "timer", "watcher")

    def __init__(self, receive: Receive, delay_s: float = 0.05) -> None:
        self.receive = receive
        self.delay_s = delay_s
        self.disconnected = False
        self.finished = False
        self.task: asyncio.Task[Any] | None = None
        self.watcher: asyncio.Task[None] | None = None
        self.timer: asyncio.TimerHandle | None = None

    async def _watch(self) -> None:
        while True:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                if not self.finished and self.task is not None:
                    self.disconnected = True
                    self.task.cancel()
                return

    def _start(self) -> None:
        if not self.finished:
            self.watcher = asyncio.get_running_loop().create_task(self._watch())

    async def __aenter__(self) -> DisconnectWatch:
        self.task = asyncio.current_task()
        self.timer = asyncio.get_running_loop().call_later(self.delay_s, self._start)
        return self

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        self.finished = True
        if self.timer is not None:
            self.timer.cancel()
        if self.watcher is not None:
            self.watcher.cancel()
        if self.disconnected and exc_type is asyncio.CancelledError:
            assert self.task is not None
            self.task.uncancel()
            return True
        return False


@dataclass(slots=True)
class Upstream:
    """An opened upstream response (headers received, body not yet read)."""

    replica: Replica
    response: Response
    started: float
    attempts: int
    epoch: int = 0  # the replica's scrape epoch when sent (Replica.end_request)

    @property
    def status(self) -> int:
        return self.response.status

    @property
    def raw_headers(self) -> list[tuple[bytes, bytes]]:
        return self.response.headers


class Forwarder:
    def __init__(
        self,
        client: UpstreamClient,
        registry: ReplicaRegistry,
        *,
        max_attempts: int = 3,
        on_retry: Callable[[], None] | None = None,
        auth: ReplicaAuth | None = None,
        probe_timeout_s: float = 1.0,
    ) -> None:
        self.client = client
        self.registry = registry
        self.max_attempts = max_attempts
        self.on_retry = on_retry
        self.auth = auth or ReplicaAuth()
        self.probe_timeout_s = probe_timeout_s
        # The /health probe in flight per server URL (``_engine_down``).
        self._probes: dict[str, asyncio.Task[str | None]] = {}

    async def open(
        self,
        ranked: list[Replica],
        path: str,
        body: bytes,
        headers: list[tuple[bytes, bytes]],
        on_attempt: Callable[[Replica], None] | None = None,
        *,
        method: bytes = b"POST",
    ) -> Upstream:
        """Send to the first replica that answers; its in-flight count stays raised until
        ``close``. Raises RouterError 503 when every attempt failed before the first byte,
        502 when every replica refused the router's credentials (a configuration error: the
        client's key is not what they refused, so their 401 is not passed on). A 500 moves on
        only when the replica's engine is dead, once per request (module docstring)."""
        errors: list[str] = []
        refusals = 0
        attempt = 0
        retried_500 = False
        dead: set[str] = set()  # servers (Replica.group) found dead during this request
        headers = self.auth.apply(headers)
        for index, replica in enumerate(ranked):
            if attempt >= self.max_attempts:
                break
            if replica.group in dead:
                continue
            attempt += 1
            if attempt > 1 and self.on_retry is not None:
                self.on_retry()
            if on_attempt is not None:
                on_attempt(replica)
            epoch = replica.begin_request()
            started = time.perf_counter()
            try:
                response = await self.client.request(
                    replica.url, path, body, rank_headers(headers, replica), method
                )
            except UpstreamConnectError as exc:
                replica.end_request(epoch)
                refused = isinstance(exc, UpstreamUnreachable)
                self.registry.record_failure(replica, f"proxy: {exc!r}", eject_now=refused)
                errors.append(f"{replica.name}: {type(exc).__name__}")
                if refused:
                    dead.add(replica.group)
                continue
            except BaseException:
                replica.end_request(epoch)
                raise
            if response.status == 401 and self.auth.speaks_for_router:
                response.close()
                replica.end_request(epoch)
                self.registry.record_failure(replica, _REFUSED)
                log.warning("replica %s: %s", replica.name, _REFUSED)
                errors.append(f"{replica.name}: {_REFUSED}")
                refusals += 1
                continue
            if response.status in _RETRY_STATUS and self._has_next(ranked, index, attempt, dead):
                response.close()
                replica.end_request(epoch)
                errors.append(f"{replica.name}: HTTP {response.status}")
                continue
            if (
                response.status == 500
                and not retried_500
                and self._has_next(ranked, index, attempt, dead | {replica.group})
            ):
                try:
                    reason = await self._engine_down(replica)
                except BaseException:  # cancelled (the client left) during the probe
                    response.close()
                    replica.end_request(epoch)
                    raise
                if reason is not None:
                    response.close()
                    replica.end_request(epoch)
                    self._eject_dead(replica, reason)
                    errors.append(f"{replica.name}: HTTP 500, engine down ({reason})")
                    dead.add(replica.group)
                    retried_500 = True
                    continue
            return Upstream(replica, response, started, attempt, epoch)
        if refusals and refusals == len(errors):
            raise RouterError(502, "no replica accepted the router's request: " + "; ".join(errors))
        raise RouterError(
            503,
            "no replica could take the request: " + "; ".join(errors),
            headers={"retry-after": "1"},
        )

    def _has_next(self, ranked: list[Replica], index: int, attempt: int, dead: set[str]) -> bool:
        """Whether another attempt would follow the one at ``ranked[index]``."""
        if attempt >= self.max_attempts:
            return False
        return any(r.group not in dead for r in ranked[index + 1 :])

    async def _engine_down(self, replica: Replica) -> str | None:
        """Why the replica's server is not healthy now (its ``/health`` fails), or None when
        it answers 200. Concurrent callers for one server share one probe: when an engine
        dies under load, its hundred failing requests cost it one ``/health``."""
        task = self._probes.get(replica.url)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._probe(replica.url))
            self._probes[replica.url] = task
            task.add_done_callback(lambda done: self._forget_probe(replica.url, done))
        # Shielded: a caller whose client left does not cancel the others' answer.
        return await asyncio.shield(task)

    def _forget_probe(self, url: str, task: asyncio.Task[str | None]) -> None:
        if self._probes.get(url) is task:
            del self._probes[url]

    async def _probe(self, url: str) -> str | None:
        # A client (and connection) of its own, closed after it: a probe never waits for a
        # pool slot behind proxied requests (a probe that waits is one that times out, and a
        # false "dead"), and nothing stays open per replica. Probes are rare and shared.
        client = UpstreamClient(
            max_connections_per_replica=1,
            connect_timeout_s=self.probe_timeout_s,
            read_timeout_s=self.probe_timeout_s,
        )
        try:
            async with asyncio.timeout(self.probe_timeout_s):
                response = await client.request(url, "/health", b"", self.auth.apply([]), b"GET")
                response.close()
        except TimeoutError:
            return f"/health did not answer within {self.probe_timeout_s:g} s"
        except (UpstreamError, OSError) as exc:
            return f"/health failed: {exc!r}"
        finally:
            client.close()
        if response.status != 200:
            return f"/health answered {response.status}"
        return None

    def _eject_dead(self, replica: Replica, reason: str) -> None:
        was_healthy = replica.healthy
        self.registry.record_failure(replica, f"proxy: HTTP 500 and {reason}", eject_now=True)
        if was_healthy and not replica.healthy:
            log.warning(
                "replica %s ejected: it answered 500 and %s; retrying on the next replica",
                replica.name,
                reason,
            )

    async def discard(self, upstream: Upstream) -> None:
        """Read an answer nobody will relay to its end (its connection stays reusable when
        that works), then close it."""
        complete = False
        try:
            await upstream.response.read()
            complete = True
        except UpstreamError:
            pass
        finally:
            self.close(upstream, complete=complete)

    @staticmethod
    def close(upstream: Upstream, *, complete: bool) -> None:
        """Return the connection to the pool after a complete answer; otherwise close it,
        which is how vLLM learns that the request was abandoned."""
        try:
            if complete:
                upstream.response.release()
            else:
                upstream.response.close()
        finally:
            upstream.replica.end_request(upstream.epoch)


async def send_body(send: Send, data: bytes, client_timeout_s: float | None) -> None:
    """One piece of a streamed answer to the client. The server's ``send`` waits while the
    client's socket buffer is full; a client that reads nothing for ``client_timeout_s`` is
    given up (``ClientGone``), so it cannot hold a replica's slot."""
    message = {"type": "http.response.body", "body": data, "more_body": True}
    if client_timeout_s is None:
        await send(message)
        return
    try:
        async with asyncio.timeout(client_timeout_s):
            await send(message)
    except TimeoutError:
        raise ClientGone() from None


async def send_stream(
    send: Send,
    upstream: Upstream,
    request_id: str,
    on_first_byte: Callable[[float], None],
    tail_bytes: int = 8192,
    client_timeout_s: float | None = None,
    watch: Callable[[bytes], bool] | None = None,
) -> tuple[bytes, str | None]:
    """Relay an SSE body chunk by chunk. Returns (last bytes of the stream, error or None).
    ``watch`` sees the chunks in order, before they are sent, until it returns True (the
    Responses endpoint reads the response id from the first event).

    The server's ``send`` waits while the client's socket buffer is full, which also stops
    reading upstream: memory stays bounded. A client that reads nothing for
    ``client_timeout_s`` is given up (``ClientGone``), so it cannot hold a replica's slot."""
    await send(
        {
            "type": "http.response.start",
            "status": upstream.status,
            "headers": downstream_headers(upstream.raw_headers, request_id, upstream.replica.name),
        }
    )
    tail = b""
    first = True
    error: str | None = None
    try:
        async for chunk in upstream.response.chunks():
            if not chunk:
                continue
            if first:
                on_first_byte(time.perf_counter() - upstream.started)
                first = False
            if watch is not None and watch(chunk):
                watch = None
            await send_body(send, chunk, client_timeout_s)
            tail = (tail + chunk)[-tail_bytes:]
    except UpstreamError as exc:
        error = f"upstream stream from {upstream.replica.name} failed: {exc!r}"
        await send({"type": "http.response.body", "body": sse_error(502, error), "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})
    return tail, error
