"""The proxied endpoints as raw ASGI apps (see router.proxy for why not framework handlers).

``ProxyEndpoint(service, kind)`` serves /v1/completions, /v1/chat/completions, /tokenize and
/detokenize: read the body (413 past the limit), validate what routing needs (400), pick the
candidates (404/503), rank them, forward the original bytes, relay the answer, and record
the outcome, latency and predicted vs delivered cached tokens.
"""

from __future__ import annotations

import logging
import time
from collections.abc import MutableMapping
from functools import partial
from typing import Any

from router.accuracy import cached_tokens_from_body, cached_tokens_from_sse
from router.errors import RouterError
from router.proxy import (
    ClientGone,
    DisconnectWatch,
    Receive,
    Scope,
    Send,
    downstream_headers,
    read_body,
    request_id_of,
    send_stream,
    upstream_headers,
)
from router.replicas import Replica
from router.requests import decode_json, parse_body
from router.routing import Decision
from router.service import RouterService
from router.upstream import UpstreamError

__all__ = ["ProxyEndpoint"]

log = logging.getLogger(__name__)

_ENDPOINT_LABEL = {
    "completion": "completions",
    "chat": "chat",
    "tokenize": "tokenize",
    "detokenize": "detokenize",
}


def _outcome(status: int) -> str:
    if status < 400:
        return "ok"
    return "upstream_4xx" if status < 500 else "upstream_5xx"


class ProxyEndpoint:
    def __init__(self, service: RouterService, kind: str, path: str) -> None:
        self.service = service
        self.kind = kind
        self.path = path
        self.label = _ENDPOINT_LABEL[kind]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        service = self.service
        request_id = request_id_of(scope)
        sent = _SendTracker(send)
        send = sent
        settings = service.settings
        service.in_flight += 1
        try:
            if service.in_flight > settings.max_in_flight:
                raise RouterError(
                    429,
                    f"the router is proxying its limit of {settings.max_in_flight} requests; "
                    "retry later",
                    headers={"retry-after": str(settings.retry_after_s)},
                )
            raw = await read_body(scope, receive, settings.max_body_bytes, settings.body_timeout_s)
            if self.kind in ("completion", "chat"):
                await self._routed(scope, receive, send, raw, request_id)
            else:
                await self._passthrough(scope, receive, send, raw, request_id)
        except RouterError as exc:
            outcome = "client_error" if exc.status < 500 and exc.status != 429 else "unavailable"
            service.metrics.request(self.label, outcome)
            await exc.response(request_id)(scope, receive, send)
        except ClientGone:
            service.metrics.request(self.label, "cancelled")
        except Exception:
            # A router bug, not the client's fault: say so in OpenAI's schema if we still can.
            log.exception("request %s failed inside the router", request_id)
            service.metrics.request(self.label, "router_error")
            if not sent.started:
                await RouterError(500, "internal router error").response(request_id)(
                    scope, receive, send
                )
        finally:
            service.in_flight -= 1

    async def _routed(
        self, scope: Scope, receive: Receive, send: Send, raw: bytes, request_id: str
    ) -> None:
        service = self.service
        parsed = parse_body(raw, self.kind, service.limits)  # type: ignore[arg-type]
        candidates = service.candidates(parsed.model)
        started = time.perf_counter()
        session = _header(scope, service.settings.session_header.encode())
        decision = await service.router.decide(parsed, candidates, session)
        service.metrics.decision_time.observe(time.perf_counter() - started)
        service.metrics.decisions.labels(decision.policy, decision.reason).inc()
        await self._forward(
            scope, receive, send, raw, request_id, decision.ranked, parsed.stream, decision
        )

    async def _passthrough(
        self, scope: Scope, receive: Receive, send: Send, raw: bytes, request_id: str
    ) -> None:
        """/tokenize and /detokenize: any healthy replica serving the model, least loaded."""
        service = self.service
        body = decode_json(raw, service.limits)
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise RouterError(400, "'model' must be a string", param="model")
        pool = service.candidates(model) if model else service.registry.healthy()
        if not pool:
            raise RouterError(
                503,
                "no healthy replica is available",
                headers={"retry-after": str(service.settings.retry_after_s)},
            )
        ranked = sorted(pool, key=lambda r: r.pending)
        await self._forward(scope, receive, send, raw, request_id, ranked, False, None)

    async def _forward(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        raw: bytes,
        request_id: str,
        ranked: list[Replica],
        stream: bool,
        decision: Decision | None,
    ) -> None:
        service = self.service
        metrics = service.metrics
        headers = upstream_headers(scope, request_id)
        forwarder = service.forwarder
        assert forwarder is not None, "the app's lifespan has not started"
        outcome = "cancelled"
        async with DisconnectWatch(receive) as watch:
            # Hints are recorded as each attempt is sent, not when it answers: siblings
            # arriving during this request's prefill must already see them.
            commit = None if decision is None else partial(service.router.commit, decision)
            upstream = await forwarder.open(ranked, self.path, raw, headers, commit)
            complete = False
            try:
                if stream and upstream.status == 200:

                    def on_first_byte(seconds: float, replica: Replica = upstream.replica) -> None:
                        metrics.first_byte(self.label, seconds)
                        if decision is not None:
                            service.router.first_byte(decision, replica, seconds)

                    tail, error = await send_stream(
                        send,
                        upstream,
                        request_id,
                        on_first_byte,
                        client_timeout_s=service.settings.client_write_timeout_s,
                    )
                    delivered = cached_tokens_from_sse(tail)
                    outcome = "midstream_error" if error else "ok"
                    complete = error is None
                    if error:
                        log.warning("request %s: %s", request_id, error)
                else:
                    # Without streaming the headers come when the answer is ready: that is
                    # the first byte a client can see.
                    metrics.first_byte(self.label, time.perf_counter() - upstream.started)
                    try:
                        body = await upstream.response.read()
                    except UpstreamError as exc:
                        service.registry.record_failure(upstream.replica, f"proxy: {exc!r}")
                        raise RouterError(
                            502, f"replica {upstream.replica.name} failed mid-response: {exc}"
                        ) from exc
                    complete = True
                    await send(
                        {
                            "type": "http.response.start",
                            "status": upstream.status,
                            "headers": downstream_headers(
                                upstream.raw_headers,
                                request_id,
                                upstream.replica.name,
                                len(body),
                            ),
                        }
                    )
                    await send({"type": "http.response.body", "body": body})
                    delivered = cached_tokens_from_body(body) if decision is not None else None
                    outcome = _outcome(upstream.status)
                metrics.latency(self.label, time.perf_counter() - upstream.started)
                if decision is not None and outcome in ("ok", "midstream_error"):
                    self._record_accuracy(decision, upstream.replica, delivered)
            finally:
                forwarder.close(upstream, complete=complete)
        if watch.disconnected:
            outcome = "cancelled"
        metrics.request(self.label, outcome)

    def _record_accuracy(self, decision: Decision, replica: Replica, delivered: int | None) -> None:
        view = decision.view(replica.name)
        predicted = view.predicted_cached_tokens if view is not None else 0
        self.service.accuracy.record(replica.name, decision.prompt_tokens, predicted, delivered)
        self.service.metrics.cached_tokens(
            replica.name, decision.prompt_tokens, predicted, delivered
        )


class _SendTracker:
    """Remembers whether the response has started (then no error response can follow)."""

    __slots__ = ("send", "started")

    def __init__(self, send: Send) -> None:
        self.send = send
        self.started = False

    async def __call__(self, message: MutableMapping[str, Any]) -> None:
        self.started = True
        await self.send(message)


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


def debug_kind(body: dict[str, Any]) -> str:
    return "chat" if "messages" in body else "completion"
