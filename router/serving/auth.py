"""Who may talk to the router, and what the router shows the replicas: API keys.

Clients: with ``RouterSettings.api_keys`` set, a request must carry ``Authorization: Bearer
<key>`` with one of them, checked the way vLLM checks its own ``--api-key`` (SHA-256 of each
side, every key compared in constant time, OPTIONS exempt for CORS preflights). Unlike vLLM,
which guards only ``/v1``, ``/v2``, ``/inference`` and ``/cohere``, the router guards every
path except a few that hold no data: ``/health``, ``/ready`` and ``/metrics`` (what load
balancers, readiness probes and Prometheus poll; guarded too with
``api_key_protects_metrics``), the dashboard's page and assets (the page asks for the key,
its data is guarded), and ``/openapi.json`` (open on vLLM too). A refusal is a 401 in
OpenAI's error schema, which the ``openai`` client raises as ``AuthenticationError``.

Replicas: ``ReplicaAuth`` decides the ``Authorization`` header the router sends upstream. The
replicas' key (``replica_api_key``) goes on every request the router makes; a client's own
header is the router's key when the router checks keys, so it is never forwarded then.
Neither key is ever part of a message, a log line or a settings repr.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from dataclasses import dataclass
from typing import Any

from kvroute.router.errors import error_response

__all__ = [
    "OPEN_PATHS",
    "PEER_PATHS",
    "ApiKeyMiddleware",
    "ReplicaAuth",
    "bearer_matches",
    "key_digests",
]

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# Paths that hold no data a key protects. /health, /ready and /metrics are added unless
# ``protect_metrics``.
OPEN_PATHS = frozenset(
    {"/dashboard", "/dashboard/dashboard.js", "/dashboard/dashboard.css", "/openapi.json"}
)
_MONITORING_PATHS = frozenset({"/health", "/ready", "/metrics"})
# What routers ask each other: with a peer key, these take it and only it (a client key
# must not read the whole index, nor a peer key serve as a client's).
PEER_PATHS = frozenset({"/index/snapshot", "/peer/load"})
REFUSED_MESSAGE = (
    "missing or invalid API key: send the router's key as 'Authorization: Bearer <key>'"
)


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


def key_digests(keys: Iterable[str]) -> tuple[bytes, ...]:
    """What ``bearer_matches`` compares against: the keys' digests, computed once."""
    return tuple(_digest(k) for k in keys)


def bearer_matches(authorization: bytes | None, digests: Iterable[bytes]) -> bool:
    """Whether an ``Authorization`` header value is ``Bearer <one of the keys>``. Every key
    is compared (no early exit) and the digests have one length, so the time taken says
    nothing about which key nearly matched."""
    if not authorization:
        return False
    scheme, _, token = authorization.decode("latin-1").partition(" ")
    if scheme.lower() != "bearer":
        return False
    given = _digest(token)
    matched = False
    for digest in digests:
        matched |= hmac.compare_digest(given, digest)
    return matched


class ApiKeyMiddleware:
    """Refuse, with OpenAI's 401, any request to a guarded path without a valid key: the
    clients' keys, or on ``PEER_PATHS`` the routers' peer key when one is set. Without client
    keys the other paths are open."""

    def __init__(
        self,
        app: ASGIApp,
        keys: Iterable[str],
        *,
        protect_metrics: bool = False,
        peer_key: str | None = None,
    ) -> None:
        self.app = app
        self.digests = key_digests(keys)
        self.peer_digests = key_digests([peer_key]) if peer_key else None
        self.open_paths = OPEN_PATHS if protect_metrics else OPEN_PATHS | _MONITORING_PATHS

    def allows(self, scope: Scope) -> bool:
        if scope.get("method") == "OPTIONS":
            return True
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        if path in self.open_paths:
            return True
        digests = self.digests
        if self.peer_digests is not None and path in PEER_PATHS:
            digests = self.peer_digests
        elif not digests:
            return True  # a peer key alone guards only the peer paths
        authorization = next((v for k, v in scope["headers"] if k == b"authorization"), None)
        return bearer_matches(authorization, digests)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or self.allows(scope):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        response = error_response(401, REFUSED_MESSAGE, type_="AuthenticationError")
        await response(scope, receive, send)


@dataclass(frozen=True, slots=True)
class ReplicaAuth:
    """The ``Authorization`` the router sends replicas.

    ``header``: ``Bearer <replica key>``, on every request (None: no key of its own).
    ``drop_client``: the client's ``Authorization`` is not forwarded (it is the router's key,
    or a replica key replaces it); otherwise it passes through as it did before keys.
    """

    header: bytes | None = None
    drop_client: bool = False

    @classmethod
    def of(cls, router_keys: Iterable[str], replica_key: str | None) -> ReplicaAuth:
        header = None if replica_key is None else f"Bearer {replica_key}".encode("latin-1")
        return cls(header, drop_client=bool(tuple(router_keys)) or header is not None)

    @property
    def speaks_for_router(self) -> bool:
        """A 401 from a replica is then about the router's credentials, not the client's."""
        return self.drop_client

    def apply(self, headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
        """Proxied request headers with the router's ``Authorization`` in place."""
        if not self.drop_client:
            return headers
        out = [(k, v) for k, v in headers if k != b"authorization"]
        if self.header is not None:
            out.append((b"authorization", self.header))
        return out

    def httpx_headers(self) -> dict[str, str]:
        """Default headers for the router's own httpx clients (health, tokenize, render,
        discovery)."""
        return {} if self.header is None else {"authorization": self.header.decode("latin-1")}

    def __repr__(self) -> str:  # the key never reaches a log line
        return f"ReplicaAuth(header={'<set>' if self.header else None}, drop={self.drop_client})"
