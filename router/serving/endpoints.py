"""The proxied endpoints as raw ASGI apps (see kvroute.router.serving.proxy for why not framework
handlers).

``ProxyEndpoint(service, kind, path)`` serves every path the router forwards: read the body
(413 past the limit), find what routing needs, pick the candidates (404/503), rank them,
forward the original bytes with the original method and query string, relay the answer
(streamed when it is SSE), and record the outcome, latency and predicted vs delivered cached
tokens. How a kind is ranked:

- ``completion``, ``chat``: by the prompt's cached prefix (kvroute.router.tokens.requests
  validates).
- ``responses``, ``messages``, ``embeddings``, ``pooling``, ``classify``, ``score``,
  ``rerank``, ``generate``: by the prompt's cached prefix too, read by
  kvroute.router.tokens.prompts; a body without a prompt the router can read goes by load. A
  Responses create that continues a stored response (``previous_response_id``) goes where that
  response is stored.
- ``response`` (``GET``/``DELETE /v1/responses/{id}``, ``POST .../cancel``): to the replica
  that created it (kvroute.router.serving.response_ids), or, for an id the router does not know, to
  each healthy replica in turn until one answers other than 404.
- ``tokenize``, ``detokenize``, ``audio``, ``other`` (any path without a route of its own,
  any method): by load, the least pending healthy replica serving the body's ``model`` when
  the body is JSON naming a known model. Bodies (multipart included) pass untouched. An
  accepted request that resets the replica's KV connector without an event
  (``/reset_prefix_cache?reset_external=true``, ``/pause``, ``/sleep``...:
  kvroute.router.serving.cache_resets) makes the index forget what that reset emptied.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, MutableMapping
from functools import partial
from typing import TYPE_CHECKING, Any

import msgspec

from kvroute.router.errors import RouterError
from kvroute.router.fleet.replicas import Replica
from kvroute.router.routing.accuracy import cached_tokens_from_body, cached_tokens_from_sse
from kvroute.router.routing.router import Decision
from kvroute.router.serving.admission import disconnect_watch, ticket_of
from kvroute.router.serving.cache_resets import (
    resets_connector,
    resets_device,
    resets_device_only,
)
from kvroute.router.serving.disagg import has_prefill_pool, serve_disaggregated
from kvroute.router.serving.proxy import (
    ClientGone,
    DisconnectWatch,
    Receive,
    Scope,
    Send,
    Upstream,
    downstream_headers,
    read_body,
    request_id_of,
    send_stream,
    upstream_headers,
)
from kvroute.router.serving.response_ids import (
    ResponseHomes,
    SseResponseId,
    id_from_body,
    id_in_path,
)
from kvroute.router.serving.resume import StreamResume
from kvroute.router.serving.upstream import UpstreamError
from kvroute.router.tokens.prompts import PROMPT_PARSERS
from kvroute.router.tokens.requests import ParsedRequest, decode_json, parse_body

if TYPE_CHECKING:  # the composition root imports this module
    from kvroute.router.service import RouterService

__all__ = ["ENDPOINT_LABELS", "ProxyEndpoint"]

log = logging.getLogger(__name__)

ENDPOINT_LABELS = {
    "completion": "completions",
    "chat": "chat",
    "tokenize": "tokenize",
    "detokenize": "detokenize",
    "responses": "responses",
    "response": "responses",
    "messages": "messages",
    "embeddings": "embeddings",
    "pooling": "pooling",
    "classify": "classify",
    "score": "score",
    "rerank": "rerank",
    "generate": "generate",
    "audio": "audio",
    "other": "other",
}
_decode = msgspec.json.decode
# A streamed Responses answer ends with response.completed, which repeats the whole
# response (output included) before its usage: keep enough of the tail to read it.
_RESPONSES_TAIL = 1 << 16


def _outcome(status: int) -> str:
    if status < 400:
        return "ok"
    return "upstream_4xx" if status < 500 else "upstream_5xx"


def _target(scope: Scope) -> str:
    """The request's path and query as the client sent them (percent-encoding kept)."""
    raw = scope.get("raw_path") or scope["path"].encode("utf-8")
    query = scope.get("query_string") or b""
    return (raw + b"?" + query if query else raw).decode("latin-1")


def _is_sse(headers: list[tuple[bytes, bytes]]) -> bool:
    return any(k == b"content-type" and v.startswith(b"text/event-stream") for k, v in headers)


class ProxyEndpoint:
    def __init__(
        self,
        service: RouterService,
        kind: str,
        path: str,
        homes: ResponseHomes | None = None,
    ) -> None:
        self.service = service
        self.kind = kind
        self.path = path
        self.label = ENDPOINT_LABELS[kind]
        self.homes = homes

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
                parsed = parse_body(raw, self.kind, service.limits)  # type: ignore[arg-type]
                await self._routed(scope, receive, send, raw, request_id, parsed)
            elif self.kind in ("tokenize", "detokenize"):
                await self._passthrough(scope, receive, send, raw, request_id)
            elif self.kind in PROMPT_PARSERS:
                await self._prompted(scope, receive, send, raw, request_id)
            elif self.kind == "response":
                await self._stored(scope, receive, send, raw, request_id)
            else:
                await self._by_load(scope, receive, send, raw, request_id)
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
            service.admission.pump()  # a replica may have room now: the next waiter goes

    # --- how each kind is ranked ----------------------------------------------------------

    async def _routed(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        raw: bytes,
        request_id: str,
        parsed: ParsedRequest,
    ) -> None:
        service = self.service
        session = _header(scope, service.settings.session_header.encode())
        if has_prefill_pool(service.registry):  # prefill/decode disaggregation
            await serve_disaggregated(
                self, scope, receive, send, raw, request_id, parsed, session, _target(scope)
            )
            return
        headers = scope["headers"]
        watch = disconnect_watch(receive)
        ticket = ticket_of(service.settings.admission, headers, parsed.body, watch)
        decision = await service.decide(parsed, session, ticket=ticket)
        await self._forward(
            scope, receive, send, raw, request_id, decision.ranked, parsed.stream, decision
        )

    async def _passthrough(
        self, scope: Scope, receive: Receive, send: Send, raw: bytes, request_id: str
    ) -> None:
        """/tokenize and /detokenize: any healthy replica serving the model, least loaded."""
        service = self.service
        model = passthrough_model(decode_json(raw, service.limits))
        pool = service.candidates(model) if model else self._healthy()
        ranked = sorted(pool, key=lambda r: r.pending)
        await self._forward(scope, receive, send, raw, request_id, ranked, False, None)

    async def _prompted(
        self, scope: Scope, receive: Receive, send: Send, raw: bytes, request_id: str
    ) -> None:
        """Endpoints whose body holds a prompt (kvroute.router.tokens.prompts): routed by it like a
        completion; without one, by load."""
        service = self.service
        body = decode_json(raw, service.limits)
        stream = bool(body.get("stream") is True)
        previous = body.get("previous_response_id") if self.kind == "responses" else None
        if isinstance(previous, str) and previous:
            PROMPT_PARSERS[self.kind](body, service.limits)  # 400 on a bad body, as always
            ranked, probe = self._holder_first(previous, _str(body.get("model")))
            await self._forward(
                scope, receive, send, raw, request_id, ranked, stream, None, probe_404=probe
            )
            return
        parsed, model = prompted_request(service, self.kind, body)
        if parsed is None:
            ranked = sorted(self._pool(model), key=lambda r: r.pending)
            await self._forward(scope, receive, send, raw, request_id, ranked, stream, None)
            return
        await self._routed(scope, receive, send, raw, request_id, parsed)

    async def _stored(
        self, scope: Scope, receive: Receive, send: Send, raw: bytes, request_id: str
    ) -> None:
        """A stored response's follow-ups: where it was created, or asked around."""
        response_id = id_in_path(scope["path"]) or ""
        ranked, probe = self._holder_first(response_id, None)
        await self._forward(
            scope, receive, send, raw, request_id, ranked, False, None, probe_404=probe
        )

    async def _by_load(
        self, scope: Scope, receive: Receive, send: Send, raw: bytes, request_id: str
    ) -> None:
        """Any other path: the body passes untouched (JSON or not); a JSON body naming a
        model the fleet knows narrows the replicas to those serving it."""
        ranked = sorted(self._pool(json_model(raw)), key=lambda r: r.pending)
        await self._forward(scope, receive, send, raw, request_id, ranked, False, None)

    # --- candidates -----------------------------------------------------------------------

    def _healthy(self) -> list[Replica]:
        return self.service.healthy_or_503()

    def _pool(self, model: str | None) -> list[Replica]:
        return self.service.pool(model)

    def _default_model(self) -> str | None:
        return self.service.default_model()

    def _holder_first(self, response_id: str, model: str | None) -> tuple[list[Replica], bool]:
        """The replica holding ``response_id`` alone when known and healthy; otherwise every
        healthy candidate, least pending first, to be asked in turn (probe)."""
        assert self.homes is not None
        name = self.homes.get(response_id) if response_id else None
        replica = self.service.registry.get(name) if name else None
        if replica is not None and replica.healthy:
            return [replica], False
        return sorted(self._pool(model), key=lambda r: r.pending), True

    # --- forwarding -----------------------------------------------------------------------

    async def _open(
        self,
        ranked: list[Replica],
        target: str,
        method: bytes,
        raw: bytes,
        headers: list[tuple[bytes, bytes]],
        commit: Callable[[Replica], None] | None,
        probe_404: bool,
    ) -> Upstream:
        """The first answer along ``ranked`` (retries as kvroute.router.serving.proxy.Forwarder
        does); with ``probe_404`` a 404 also moves on to the next replica, except the last one's,
        which is the answer."""
        forwarder = self.service.forwarder
        assert forwarder is not None, "the app's lifespan has not started"
        if not probe_404:
            return await forwarder.open(ranked, target, raw, headers, commit, method=method)
        error: RouterError | None = None
        for i, replica in enumerate(ranked):
            try:
                upstream = await forwarder.open(
                    [replica], target, raw, headers, commit, method=method
                )
            except RouterError as exc:
                error = exc
                continue
            if upstream.status != 404 or i == len(ranked) - 1:
                return upstream
            await forwarder.discard(upstream)
        raise error or RouterError(503, "no healthy replica is available")

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
        *,
        probe_404: bool = False,
        opened: Upstream | None = None,
        resume: StreamResume | None = None,
    ) -> None:
        """Send along ``ranked`` (or relay ``opened``, an answer already open: the decode
        leg of a split, router/serving/disagg.py) and record the outcome. A streamed answer
        with ``resume`` is finished on another replica if its own fails mid-answer
        (router/serving/resume.py)."""
        service = self.service
        metrics = service.metrics
        headers = upstream_headers(scope, request_id)
        forwarder = service.forwarder
        assert forwarder is not None, "the app's lifespan has not started"
        method = scope["method"].encode("latin-1")
        outcome = "cancelled"
        async with DisconnectWatch(receive) as watch:
            # Hints are recorded as each attempt is sent, not when it answers: siblings
            # arriving during this request's prefill must already see them.
            commit = None if decision is None else partial(service.router.commit, decision)
            upstream = opened or await self._open(
                ranked, _target(scope), method, raw, headers, commit, probe_404
            )
            complete = resumed = False
            try:
                if upstream.status == 200 and (stream or _is_sse(upstream.raw_headers)):

                    def on_first_byte(seconds: float, replica: Replica = upstream.replica) -> None:
                        metrics.first_byte(self.label, seconds)
                        if decision is not None:
                            service.router.first_byte(decision, replica, seconds)

                    watch_id = (
                        SseResponseId(partial(self._remember, replica=upstream.replica))
                        if self.kind == "responses"
                        else None
                    )
                    if resume is not None:
                        tail, error = await resume.relay(
                            send,
                            upstream,
                            request_id,
                            on_first_byte,
                            client_timeout_s=service.settings.client_write_timeout_s,
                        )
                    else:
                        tail, error = await send_stream(
                            send,
                            upstream,
                            request_id,
                            on_first_byte,
                            tail_bytes=_RESPONSES_TAIL if self.homes is not None else 8192,
                            client_timeout_s=service.settings.client_write_timeout_s,
                            watch=watch_id,
                        )
                    # A resumed answer's usage is its last replica's: nothing to compare.
                    resumed = resume is not None and resume.resumed > 0
                    delivered = cached_tokens_from_sse(tail)
                    outcome = "midstream_error" if error else "ok"
                    complete = error is None and not (resume is not None and resume.broke)
                    if error:
                        log.warning("request %s: %s", request_id, error)
                else:
                    # Without streaming the headers come when the answer is ready: that is
                    # the first byte a client can see.
                    metrics.first_byte(self.label, time.perf_counter() - upstream.started)
                    if decision is not None:
                        service.router.answered_whole(decision, upstream.replica)
                    try:
                        body = await upstream.response.read()
                    except UpstreamError as exc:
                        service.registry.record_failure(upstream.replica, f"proxy: {exc!r}")
                        raise RouterError(
                            502, f"replica {upstream.replica.name} failed mid-response: {exc}"
                        ) from exc
                    complete = True
                    if upstream.status == 200:
                        # Before the client sees the id: it may ask for the response at once.
                        self._learn_id(scope, body, upstream.replica)
                    if self.kind == "other" and 200 <= upstream.status < 300:
                        # Before the client sees the answer: its next request must not be
                        # routed on what the reset emptied.
                        self._after_reset(scope, upstream.replica, body)
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
                if decision is not None and outcome in ("ok", "midstream_error") and not resumed:
                    streamed = stream or _is_sse(upstream.raw_headers)
                    self._record_accuracy(decision, upstream.replica, delivered, streamed)
            finally:
                forwarder.close(upstream, complete=complete)
                if decision is not None:
                    service.router.ended(decision, upstream.replica, complete=complete)
        if watch.disconnected:
            outcome = "cancelled"
        metrics.request(self.label, outcome)

    def _after_reset(self, scope: Scope, replica: Replica, body: bytes) -> None:
        """A request that resets the replica's KV connector, accepted: no event will say what
        it emptied, so the index forgets it now, for every rank of the replica's server, and
        again at the device's clear that came with it (kvroute.router.serving.cache_resets)."""
        query = scope.get("query_string") or b""
        service = self.service
        if resets_device_only(scope["method"], scope["path"], query):
            if resets_device(scope["path"], body):
                for member in service.registry.group(replica.group) or [replica]:
                    service.index.expect_device_reset(member.name)
            return
        if not resets_connector(scope["method"], scope["path"], query):
            return
        device = resets_device(scope["path"], body)
        for member in service.registry.group(replica.group) or [replica]:
            service.index.reset_connector(member.name, device_cleared=device)
        log.info(
            "%s reset its KV connector (%s): its CPU tier is forgotten", replica.name, scope["path"]
        )

    def _remember(self, response_id: str, replica: Replica) -> None:
        if self.homes is not None:
            self.homes.remember(response_id, replica.name)

    def _learn_id(self, scope: Scope, body: bytes, replica: Replica) -> None:
        if self.homes is None:
            return
        if self.kind == "responses":
            found = id_from_body(body)
            if found:
                self._remember(found, replica)
        elif self.kind == "response" and scope["method"] != "DELETE":
            found = id_in_path(scope["path"])
            if found:
                self._remember(found, replica)

    def _record_accuracy(
        self, decision: Decision, replica: Replica, delivered: int | None, streamed: bool
    ) -> None:
        view = decision.view(replica.name)
        predicted = view.predicted_cached_tokens if view is not None else 0
        prompt_tokens = decision.prompt_tokens
        per_prompt = decision.batch_predicted.get(replica.name)
        if per_prompt and len(per_prompt) > 1:
            # vLLM 0.32 reports one prompt's cached tokens for a batch: the last prompt's
            # when not streaming, the first prompt to produce output when streaming (which
            # one is not known here). Compare like with like, or count it unreported.
            if streamed:
                delivered = None
            elif delivered is not None:
                predicted, prompt_tokens = per_prompt[-1], decision.batch_sizes[-1]
        decision.delivered_by, decision.delivered_cached_tokens = replica.name, delivered
        self.service.accuracy.record(replica.name, prompt_tokens, predicted, delivered)
        self.service.metrics.cached_tokens(replica.name, prompt_tokens, predicted, delivered)
        self.service.router.answered(decision, replica, delivered)


class _SendTracker:
    """Remembers whether the response has started (then no error response can follow)."""

    __slots__ = ("send", "started")

    def __init__(self, send: Send) -> None:
        self.send = send
        self.started = False

    async def __call__(self, message: MutableMapping[str, Any]) -> None:
        self.started = True
        await self.send(message)


def routing_input(
    service: RouterService, kind: str, raw: bytes
) -> tuple[ParsedRequest | None, str | None]:
    """What routing reads in a body of ``kind``, exactly as the proxied endpoints read it:
    the request to rank by its prompt (None: it goes by load) and the model that names the
    candidates. A body routing cannot read is a RouterError (400 in OpenAI's schema). The
    endpoint picker (router/epp/) reads bodies through this, so both doors agree."""
    if kind in ("completion", "chat"):
        parsed = parse_body(raw, kind, service.limits)  # type: ignore[arg-type]
        return parsed, parsed.model
    if kind in PROMPT_PARSERS:
        return prompted_request(service, kind, decode_json(raw, service.limits))
    if kind in ("tokenize", "detokenize"):
        return None, passthrough_model(decode_json(raw, service.limits))
    return None, json_model(raw)


def prompted_request(
    service: RouterService, kind: str, body: dict[str, Any]
) -> tuple[ParsedRequest | None, str | None]:
    """A body of a kind kvroute.router.tokens.prompts reads: its prompt as a request to rank (None
    when it holds no prompt the router can read, or no model can be told), and its model
    (vLLM's default, the fleet's one model, when it names none)."""
    parsed = PROMPT_PARSERS[kind](body, service.limits)
    model = (parsed.model if parsed is not None else _str(body.get("model"))) or (
        service.default_model()
    )
    if parsed is None or not model:
        return None, model
    parsed.model = model
    return parsed, model


def passthrough_model(body: dict[str, Any]) -> str | None:
    """/tokenize and /detokenize: the optional ``model`` (400 when it is not a string)."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise RouterError(400, "'model' must be a string", param="model")
    return model or None


def json_model(raw: bytes) -> str | None:
    """The ``model`` a body of a path the router does not parse names, when it is a JSON
    object naming one (anything else, multipart included, passes untouched: None)."""
    if raw[:1] in (b"{", b" ", b"\n", b"\t", b"\r"):
        with contextlib.suppress(msgspec.DecodeError, UnicodeDecodeError, RecursionError):
            body = _decode(raw)
            if isinstance(body, dict):
                return _str(body.get("model"))
    return None


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


def _str(value: object) -> str | None:
    return value if isinstance(value, str) and value else None


def debug_kind(body: dict[str, Any]) -> str:
    return "chat" if "messages" in body else "completion"
