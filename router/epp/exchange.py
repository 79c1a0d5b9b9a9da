"""One ext_proc stream, one request: what the picker answers at each message.

Why in the router process: the pick is the router's own decision (kvroute.router.routing.router),
made from the same index, load and homes as a proxied request, so the request is read the
way the HTTP endpoints read it (``routing_input``, the same parsers and tokenizer), ranked by
``RouterService.decide`` and committed (burst hints, homes, blocks in progress) as if kvroute
forwarded it. Since Envoy forwards it, the router counts the request in flight on the picked
replica from the pick until the stream reports the response's end (or closes), which keeps
``pending`` and shared load (``GET /peer/load``) true when no byte passes through kvroute.

Every refusal is an ``ImmediateResponse`` whose body is OpenAI's error JSON with the status
the HTTP endpoints would answer (400, 401, 404, 413, 503 with ``retry-after``); a bug in
here answers 500 the same way. Neither ends the server or another stream.

Modes, each handled explicitly (``_RequestMode``): Envoy announces its body modes in the
first message (``protocol_config``).

* ``FULL_DUPLEX_STREAMED`` (what the Inference Extension configures, and what agentgateway
  announces for inference routing), or no announcement (an older Envoy; NGINX Gateway
  Fabric's shim, which sends the whole body in one message and reads only the headers
  answer): the headers answer waits for the whole body, then the body is handed back as
  streamed chunks, as the reference picker does.
* ``BUFFERED``: Envoy waits for an answer to the headers before it sends the body, so the
  headers pass unchanged and the pick rides on the body's answer (header mutation and
  metadata: Envoy still holds the headers).
* ``NONE``: no body ever comes; the request goes by load at its headers.
* ``STREAMED`` and ``BUFFERED_PARTIAL``: the headers may leave for the upstream before the
  body is whole, so a pick made from the body could be ignored; the request goes by load
  at its headers and the picker logs once that the gateway should be configured otherwise.

The response's body is handed back chunk by chunk in ``FULL_DUPLEX_STREAMED`` (or without an
announcement) and simply acknowledged otherwise.

The endpoint kind (which parser reads the body) comes from ``:path``, else ``x-original-path``,
else ``x-forwarded-path`` (the reference picker's order), else the body's shape
(``messages.kind_from_body``: NGINX Gateway Fabric's shim sends no path at all); a body whose
kind was only guessed from its shape and that the guessed parser cannot read goes by load
instead of being refused, since the replica may well accept it at the path the client used.

The destination is the primary, then up to ``--epp-fallbacks`` further-ranked replicas
(protocol v0.4: the gateway retries down the list; default 0, since agentgateway and NGINX
Gateway Fabric take the value as one address); the request is counted in flight on
whichever one the gateway reports it served (``x-gateway-destination-endpoint-served``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as modes
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from kvroute.router.epp.disagg import PREFILL_ENDPOINT_HEADER, plan_prefill
from kvroute.router.epp.messages import (
    body_chunks,
    destination_metadata,
    destination_mutation,
    destination_value,
    endpoint_kind,
    header_map,
    immediate_response,
    kind_from_body,
    replica_endpoint,
    request_path,
    served_endpoint,
    subset_hint,
)
from kvroute.router.errors import RouterError
from kvroute.router.fleet.replicas import Replica
from kvroute.router.routing.accuracy import cached_tokens_from_body, cached_tokens_from_sse
from kvroute.router.routing.router import Decision
from kvroute.router.serving.auth import REFUSED_MESSAGE, ReplicaAuth, bearer_matches, key_digests
from kvroute.router.serving.endpoints import ENDPOINT_LABELS, routing_input

if TYPE_CHECKING:  # the composition root imports this module
    from kvroute.router.service import RouterService

__all__ = ["EndpointPicker"]

log = logging.getLogger(__name__)

_TAIL = 1 << 16  # the end of a response body kept to read its usage (accuracy)

_FULL_BODY_MAX = 1 << 20  # a non-streamed response body read whole for its usage, up to this

_MODE = modes.ProcessingMode

# How the picker treats each request body mode Envoy may announce (module docstring).
_DUPLEX, _BUFFERED, _NO_BODY, _BY_LOAD = "duplex", "buffered", "no_body", "by_load"
_REQUEST_MODES = {
    _MODE.FULL_DUPLEX_STREAMED: _DUPLEX,
    _MODE.BUFFERED: _BUFFERED,
    _MODE.NONE: _NO_BODY,
    _MODE.STREAMED: _BY_LOAD,
    _MODE.BUFFERED_PARTIAL: _BY_LOAD,
}

_warned_modes: set[int] = set()


def _mode_name(mode: int) -> str:
    try:
        return _MODE.BodySendMode.Name(mode)  # type: ignore[arg-type]
    except ValueError:
        return str(mode)


def _request_mode(mode: int) -> str:
    """The picker's handling of an announced request body mode; an unknown (newer) mode is
    treated as one whose headers may leave early: by load."""
    handling = _REQUEST_MODES.get(mode, _BY_LOAD)  # type: ignore[call-overload]
    if handling == _BY_LOAD and mode not in _warned_modes:
        _warned_modes.add(mode)
        log.warning(
            "endpoint picker: the gateway sends request bodies in mode %s, in which the "
            "headers may be forwarded before the body is read; these requests go by load. "
            "Configure request_body_mode FULL_DUPLEX_STREAMED or BUFFERED to route by cache.",
            _mode_name(mode),
        )
    return handling


@dataclass(slots=True)
class _Pick:
    """One request's pick and what its accounting needs until the response ends."""

    replica: Replica
    endpoint: str
    epoch: int
    decision: Decision | None
    fallbacks: list[Replica] = field(default_factory=list)
    sent_at: float = field(default_factory=time.perf_counter)
    first_byte: bool = False
    streamed: bool = False
    status: int | None = None
    tail: bytes = b""
    body: bytearray | None = field(default_factory=bytearray)
    ended: bool = False
    # A P/D split (router/epp/disagg.py): the prefill replica the decode's sidecar pulls from.
    prefill: Replica | None = None
    prefill_decision: Decision | None = None


class _Exchange:
    """One ext_proc stream: one HTTP request through the gateway, from its headers to its
    response's end. Answers each message in the order Envoy expects (headers, body,
    trailers; request phase, then response phase)."""

    def __init__(self, picker: EndpointPicker) -> None:
        self.picker = picker
        self.service = picker.service
        # Until Envoy says otherwise (module docstring): the Inference Extension's modes.
        self.request_mode = _DUPLEX
        self.duplex_response = True
        self.headers: dict[str, str] = {}
        self.subset: set[str] | None = None
        self.body = bytearray()
        self.pick: _Pick | None = None
        self.request_id: str | None = None
        self.kind: str | None = None  # the endpoint kind, once the pick has read it
        self.done = False  # an ImmediateResponse went out: nothing more to answer

    # --- messages -------------------------------------------------------------------------

    async def on(self, request: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        if request.HasField("protocol_config"):
            config = request.protocol_config
            self.request_mode = _request_mode(config.request_body_mode)
            self.duplex_response = config.response_body_mode == _MODE.FULL_DUPLEX_STREAMED
        which = request.WhichOneof("request")
        try:
            if which == "request_headers":
                return await self._request_headers(request)
            if which == "request_body":
                return await self._request_body(request.request_body)
            if which == "request_trailers":
                return await self._request_trailers()
            if which == "response_headers":
                self._served(served_endpoint(request))
                return self._response_headers(request.response_headers)
            if which == "response_body":
                return self._response_body(request.response_body)
            if which == "response_trailers":
                self._end()
                return [pb.ProcessingResponse(response_trailers=pb.TrailersResponse())]
        except RouterError as exc:
            return [self.refuse(exc)]
        return []

    async def _request_headers(self, request: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        message = request.request_headers
        self.headers = header_map(message)
        self.request_id = self.headers.get("x-request-id")
        self.subset = subset_hint(request)
        self._check_key()
        if message.end_of_stream or self.request_mode in (_NO_BODY, _BY_LOAD):
            # No body (a GET), none will come, or the headers may leave before it is read:
            # decided now, by load when nothing says more.
            header_response = await self._decide(b"")
            return [pb.ProcessingResponse(request_headers=header_response, **self._metadata())]
        if self.request_mode == _DUPLEX:
            return []  # the body streams in without waiting: answer once it is whole
        return [pb.ProcessingResponse(request_headers=pb.HeadersResponse())]

    async def _request_body(self, message: pb.HttpBody) -> list[pb.ProcessingResponse]:
        if self.pick is not None:  # decided already (Envoy's body mode NONE): pass it on
            if self.request_mode == _DUPLEX:
                return body_chunks(message.body, message.end_of_stream)
            return [pb.ProcessingResponse(request_body=pb.BodyResponse())]
        self.body += message.body
        limit = self.service.settings.max_body_bytes
        if len(self.body) > limit:
            raise RouterError(413, f"request body exceeds {limit} bytes")
        if not message.end_of_stream:
            if self.request_mode == _DUPLEX:
                return []
            return [pb.ProcessingResponse(request_body=pb.BodyResponse())]
        return await self._answer_whole_body(end_of_stream=True)

    async def _request_trailers(self) -> list[pb.ProcessingResponse]:
        """Trailers end a body whose last chunk did not say ``end_of_stream``."""
        out: list[pb.ProcessingResponse] = []
        if self.pick is None:
            out = await self._answer_whole_body(end_of_stream=False)
        return [*out, pb.ProcessingResponse(request_trailers=pb.TrailersResponse())]

    async def _answer_whole_body(self, *, end_of_stream: bool) -> list[pb.ProcessingResponse]:
        raw = bytes(self.body)
        self.body = bytearray()
        common = await self._decide(
            raw, content_length=len(raw) if self.request_mode == _DUPLEX else None
        )
        if self.request_mode == _DUPLEX:
            first = pb.ProcessingResponse(request_headers=common, **self._metadata())
            return [first, *body_chunks(raw, end_of_stream)]
        # Buffered: Envoy holds the headers until the body's answer, which may mutate them.
        body_response = pb.BodyResponse(response=common.response)
        return [pb.ProcessingResponse(request_body=body_response, **self._metadata())]

    def _response_headers(self, message: pb.HttpHeaders) -> list[pb.ProcessingResponse]:
        pick = self.pick
        if pick is not None:
            headers = header_map(message)
            status = headers.get(":status", "")
            pick.status = int(status) if status.isdigit() else None
            pick.streamed = headers.get("content-type", "").startswith("text/event-stream")
            if not pick.streamed:
                self._first_byte()  # a whole answer: its headers come when it is ready
            if message.end_of_stream:
                self._end()
        return [pb.ProcessingResponse(response_headers=pb.HeadersResponse())]

    def _response_body(self, message: pb.HttpBody) -> list[pb.ProcessingResponse]:
        pick = self.pick
        if pick is not None and not pick.ended:
            if message.body:
                self._first_byte()
                pick.tail = (pick.tail + message.body)[-_TAIL:]
                if pick.body is not None:
                    pick.body += message.body
                    if len(pick.body) > _FULL_BODY_MAX:
                        pick.body = None
            if message.end_of_stream:
                self._end()
        if self.duplex_response:
            chunk = pb.StreamedBodyResponse(body=message.body, end_of_stream=message.end_of_stream)
            common = pb.CommonResponse(body_mutation=pb.BodyMutation(streamed_response=chunk))
            return [pb.ProcessingResponse(response_body=pb.BodyResponse(response=common))]
        return [pb.ProcessingResponse(response_body=pb.BodyResponse())]

    # --- the pick -------------------------------------------------------------------------

    def _check_key(self) -> None:
        """With API keys, the request's own ``Authorization`` must hold one, as on HTTP: the
        gateway forwards whatever the picker accepts, so skipping the check here would open
        the fleet to anyone who can reach the gateway."""
        digests = self.picker.key_digests
        if not digests:
            return
        given = self.headers.get("authorization")
        if not bearer_matches(given.encode("latin-1") if given else None, digests):
            raise RouterError(401, REFUSED_MESSAGE, type_="AuthenticationError")

    def _narrow(self, replicas: list[Replica]) -> list[Replica]:
        """The replicas the gateway's subset hint allows (all without a hint); 503 when it
        allows none of them, as the protocol says."""
        if self.subset is None:
            return replicas
        allowed = [r for r in replicas if replica_endpoint(r) in self.subset]
        if not allowed:
            raise RouterError(
                503,
                "none of the endpoints the gateway allows (subset hint) can serve the request",
                headers={"retry-after": str(self.service.settings.retry_after_s)},
            )
        return allowed

    def _kind(self, raw: bytes) -> tuple[str, bool]:
        """The endpoint kind and whether it was only guessed from the body's shape (no
        header named the path: module docstring)."""
        path = request_path(self.headers)
        if path is not None:
            return endpoint_kind(self.headers.get(":method", "POST"), path), False
        if not raw:
            return "other", False
        return kind_from_body(raw), True

    def _read(self, kind: str, guessed: bool, raw: bytes) -> tuple[Any, str | None]:
        """``routing_input`` for the body; a guessed kind that cannot read it goes by load."""
        if self.request_mode in (_NO_BODY, _BY_LOAD):
            return None, None  # the body is not read before the pick
        try:
            return routing_input(self.service, kind, raw)
        except RouterError as exc:
            if not guessed or exc.status != 400:
                raise
            log.debug("endpoint picker: body not a %s request (%s): by load", kind, exc.message)
            return None, None

    def _fallbacks(self, ranked: list[Replica], primary: Replica, endpoint: str) -> list[Replica]:
        """Up to ``--epp-fallbacks`` further-ranked replicas at other addresses. None when the
        primary is a data-parallel rank: its rank header would go to the fallback too, and a
        header cannot differ per endpoint; ranks are skipped as fallbacks for the same reason."""
        count = self.service.settings.epp_fallbacks
        if count <= 0 or primary.config.dp_rank is not None:
            return []
        out: list[Replica] = []
        seen = {endpoint}
        for replica in ranked:
            address = replica_endpoint(replica)
            if replica.config.dp_rank is not None or address in seen:
                continue
            seen.add(address)
            out.append(replica)
            if len(out) == count:
                break
        return out

    async def _decide(self, raw: bytes, content_length: int | None = None) -> pb.HeadersResponse:
        """Read the body as the HTTP endpoints do, rank and commit as a proxied request, and
        count it in flight on the pick; the headers answer that carries the pick (the
        primary, then the fallbacks)."""
        service = self.service
        kind, guessed = self._kind(raw)
        self.kind = kind
        parsed, model = self._read(kind, guessed, raw)
        decision: Decision | None = None
        plan = None
        if parsed is not None:
            session = self.headers.get(service.settings.session_header.lower())
            decision = await service.decide(parsed, session, self._narrow)
            ranked = decision.ranked
            replica = ranked[0]
            service.router.commit(decision, replica)
            plan = await plan_prefill(service, kind, parsed, decision, session, self.subset)
        else:
            ranked = sorted(self._narrow(service.pool(model)), key=lambda r: r.pending)
            replica = ranked[0]
        endpoint = replica_endpoint(replica)
        fallbacks = self._fallbacks(ranked[1:], replica, endpoint)
        self.pick = _Pick(replica, endpoint, replica.begin_request(), decision, fallbacks)
        prefill = None
        if plan is not None and plan.split:
            self.pick.prefill, self.pick.prefill_decision = plan.prefill[0], plan.prefill_decision
            prefill = replica_endpoint(plan.prefill[0])
        service.metrics.epp_request(ENDPOINT_LABELS[kind], "picked")
        value = destination_value([endpoint, *(replica_endpoint(r) for r in fallbacks)])
        return pb.HeadersResponse(
            response=pb.CommonResponse(
                header_mutation=destination_mutation(
                    replica,
                    value,
                    self.picker.replica_auth,
                    content_length,
                    (PREFILL_ENDPOINT_HEADER, prefill),
                ),
                clear_route_cache=True,
            )
        )

    def _served(self, endpoint: str | None) -> None:
        """The gateway retried on a fallback: the in-flight count moves to the replica that
        serves the request, so the replicas' load stays true."""
        pick = self.pick
        if pick is None or pick.ended or endpoint is None or endpoint == pick.endpoint:
            return
        for replica in pick.fallbacks:
            if replica_endpoint(replica) == endpoint:
                pick.replica.end_request(pick.epoch)
                pick.replica, pick.endpoint = replica, endpoint
                pick.epoch = replica.begin_request()
                return

    def _metadata(self) -> dict[str, Any]:
        pick = self.pick
        assert pick is not None
        value = destination_value([pick.endpoint, *(replica_endpoint(r) for r in pick.fallbacks)])
        return {"dynamic_metadata": destination_metadata(value)}

    def refuse(self, error: RouterError) -> pb.ProcessingResponse:
        """An ImmediateResponse for ``error``; the stream has nothing more to answer."""
        self.done = True
        if error.status == 500:
            outcome = "router_error"
        elif error.status < 500 and error.status != 429:
            outcome = "client_error"
        else:
            outcome = "unavailable"
        kind = self.kind or self._kind(b"")[0]
        self.service.metrics.epp_request(ENDPOINT_LABELS[kind], outcome)
        return immediate_response(error, self.request_id)

    # --- the response phase ---------------------------------------------------------------

    def _first_byte(self) -> None:
        pick = self.pick
        if pick is None or pick.first_byte:
            return
        pick.first_byte = True
        seconds = time.perf_counter() - pick.sent_at
        if pick.decision is not None and pick.streamed:
            self.service.router.first_byte(pick.decision, pick.replica, seconds)

    def _end(self) -> None:
        """The response ended (or the stream closed): the replica's in-flight count drops,
        and what the replica reported it served from cache is compared with the prediction."""
        pick = self.pick
        if pick is None or pick.ended:
            return
        pick.ended = True
        pick.replica.end_request(pick.epoch)
        decision = pick.decision
        if decision is not None:  # the device blocks it held there are free
            self.service.router.ended(decision, pick.replica, complete=pick.status == 200)
        if decision is None or pick.status != 200 or len(decision.batch_sizes) > 1:
            return  # a batch reports one prompt's cached tokens (endpoints.py): not compared
        if pick.streamed:
            delivered = cached_tokens_from_sse(pick.tail)
        else:
            delivered = cached_tokens_from_body(bytes(pick.body)) if pick.body else None
        if pick.prefill is not None and pick.prefill_decision is not None:
            # A split: the decode replica reports the prefill's cached tokens as its own.
            decision, replica = pick.prefill_decision, pick.prefill
        else:
            replica = pick.replica
        view = decision.view(replica.name)
        predicted = view.predicted_cached_tokens if view is not None else 0
        self.service.accuracy.record(replica.name, decision.prompt_tokens, predicted, delivered)
        self.service.metrics.cached_tokens(
            replica.name, decision.prompt_tokens, predicted, delivered
        )
        if replica is pick.replica:
            self.service.router.answered(decision, pick.replica, delivered)

    def close(self) -> None:
        self._end()


class EndpointPicker(pb_grpc.ExternalProcessorServicer):
    """The ext_proc servicer over a running ``RouterService``."""

    def __init__(self, service: RouterService) -> None:
        self.service = service
        settings = service.settings
        self.key_digests = key_digests(settings.api_keys)
        self.replica_auth = ReplicaAuth.of(settings.api_keys, settings.replica_api_key)

    async def Process(  # the gRPC method's own name
        self, request_iterator: AsyncIterator[pb.ProcessingRequest], context: Any
    ) -> AsyncIterator[pb.ProcessingResponse]:
        exchange = _Exchange(self)
        try:
            async for request in request_iterator:
                try:
                    answers = await exchange.on(request)
                except Exception:
                    # A bug in the router, not the request's fault: refuse it, keep serving.
                    log.exception("endpoint picker: request %s failed", exchange.request_id)
                    answers = [exchange.refuse(RouterError(500, "internal router error"))]
                for answer in answers:
                    yield answer
                if exchange.done:
                    return
        finally:
            exchange.close()
