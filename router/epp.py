"""kvroute as a Gateway API Inference Extension endpoint picker (EPP): Envoy's ext_proc.

An InferencePool's ``endpointPickerRef`` names a gRPC service that the gateway (Envoy, or a
gateway built on it) asks, for every request, which model server to send it to; Envoy then
forwards the request itself. The protocol (gateway-api-inference-extension,
docs/proposals/004-endpoint-picker-protocol) is Envoy's external processing stream,
``envoy.service.ext_proc.v3.ExternalProcessor/Process``, one bidirectional stream per HTTP
request:

* request headers, then the body (the whole body when Envoy buffers it, or chunks until
  ``end_of_stream`` in ``FULL_DUPLEX_STREAMED``, the mode the Inference Extension
  configures), then optionally the response's headers, body and trailers;
* the pick: header ``x-gateway-destination-endpoint: ip:port`` set by a header mutation,
  and the same value in the response's dynamic metadata, namespace ``envoy.lb``, key
  ``x-gateway-destination-endpoint`` (both, never two different values);
* the gateway may narrow the choice: filter metadata ``envoy.lb.subset_hint``, key
  ``x-gateway-destination-endpoint-subset``, a list of ``ip:port``; the pick must be one of
  them, and none eligible (or an empty list) is a 503;
* a request that cannot be served gets an ``ImmediateResponse`` (503 when no endpoint can
  take it), which Envoy sends to the client instead of forwarding.

Why in the router process: the pick is the router's own decision (kvroute.router.routing),
made from the same index, load and homes as a proxied request, so the request is read the
way the HTTP endpoints read it (``routing_input``, the same parsers and tokenizer), ranked by
``RouterService.decide`` and committed (burst hints, homes, blocks in progress) as if kvroute
forwarded it. Since Envoy forwards it, the router counts the request in flight on the picked
replica from the pick until the stream reports the response's end (or closes), which keeps
``pending`` and shared load (``GET /peer/load``) true when no byte passes through kvroute.

Every refusal is an ``ImmediateResponse`` whose body is OpenAI's error JSON with the status
the HTTP endpoints would answer (400, 401, 404, 413, 503 with ``retry-after``); a bug in
here answers 500 the same way. Neither ends the server or another stream.

Modes: Envoy announces its body modes in the first message (``protocol_config``). With
``FULL_DUPLEX_STREAMED`` (or no announcement: an older Envoy configured as the Inference
Extension documents) the headers answer waits for the whole body, then the body is handed
back as streamed chunks, as the reference picker does. With ``BUFFERED`` Envoy waits for an
answer to the headers before it sends the body, so the headers pass unchanged and the pick
rides on the body's answer (header mutation and metadata). ``NONE``: no body ever comes,
the request goes by load. The response's body is handed back chunk by chunk in
``FULL_DUPLEX_STREAMED`` (or without an announcement) and simply acknowledged otherwise.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import grpc
from envoy.config.core.v3 import base_pb2 as core
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as modes
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from kvroute.router.accuracy import cached_tokens_from_body, cached_tokens_from_sse
from kvroute.router.auth import REFUSED_MESSAGE, ReplicaAuth, bearer_matches, key_digests
from kvroute.router.endpoints import ENDPOINT_LABELS, routing_input
from kvroute.router.errors import RouterError, error_body
from kvroute.router.openapi import PROXIED
from kvroute.router.proxy import DP_RANK_HEADER
from kvroute.router.replicas import Replica
from kvroute.router.routing import Decision
from kvroute.router.service import RouterService

__all__ = [
    "DESTINATION_HEADER",
    "DESTINATION_NAMESPACE",
    "SUBSET_KEY",
    "SUBSET_NAMESPACE",
    "EndpointPicker",
    "EppServer",
    "destination_mutation",
    "replica_endpoint",
]

log = logging.getLogger(__name__)

# The Endpoint Picker Protocol's names (gateway-api-inference-extension, proposal 004).
DESTINATION_HEADER = "x-gateway-destination-endpoint"
DESTINATION_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
# Envoy's limit on one streamed body chunk is 64 KiB; the reference picker keeps under it.
_CHUNK = 62_000
_TAIL = 1 << 16  # the end of a response body kept to read its usage (accuracy)
_FULL_BODY_MAX = 1 << 20  # a non-streamed response body read whole for its usage, up to this
_FULL_DUPLEX = modes.ProcessingMode.FULL_DUPLEX_STREAMED
_NO_BODY = modes.ProcessingMode.NONE


def replica_endpoint(replica: Replica) -> str:
    """The ``ip:port`` Envoy connects to for a replica: its URL's host and port (IPv6 in
    brackets). Envoy routes to an address, so replicas should be given by IP (Kubernetes
    discovery does: pod IPs)."""
    parts = urlsplit(replica.url)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _normalize(endpoint: str) -> str:
    """An ``ip:port`` as the gateway wrote it, in ``replica_endpoint``'s spelling."""
    endpoint = endpoint.strip()
    parts = urlsplit(f"//{endpoint}")
    try:
        port = parts.port
    except ValueError:
        return endpoint
    host = parts.hostname or ""
    if port is None:
        return endpoint
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _kind(method: str, path: str) -> str:
    """How the HTTP endpoints would read this request (kvroute.router.openapi's table);
    paths with parameters (a stored response's) and any other path go by load."""
    ops = PROXIED.get(path.split("?", 1)[0])
    op = ops.get(method.lower()) if ops else None
    return op.kind if op is not None else "other"


def _headers(message: pb.HttpHeaders) -> dict[str, str]:
    """Header names (lowercase) to values; Envoy sends ``raw_value`` (bytes) or ``value``."""
    out: dict[str, str] = {}
    for h in message.headers.headers:
        out[h.key.lower()] = h.raw_value.decode("latin-1") if h.raw_value else h.value
    return out


def _subset(request: pb.ProcessingRequest) -> set[str] | None:
    """The gateway's subset hint (``envoy.lb.subset_hint`` → ``x-gateway-destination-endpoint
    -subset``): the endpoints the pick must come from; None when the hint is absent."""
    if SUBSET_NAMESPACE not in request.metadata_context.filter_metadata:
        return None
    hint = request.metadata_context.filter_metadata[SUBSET_NAMESPACE]
    if SUBSET_KEY not in hint.fields:
        return None
    value = hint.fields[SUBSET_KEY]
    kind = value.WhichOneof("kind")
    if kind == "list_value":
        items = [v.string_value for v in value.list_value.values if v.string_value]
    elif kind == "string_value":  # lenient: a comma-separated string
        items = value.string_value.split(",")
    else:
        items = []
    return {_normalize(e) for e in items if e.strip()}


def _header_option(key: str, value: str) -> core.HeaderValueOption:
    return core.HeaderValueOption(
        header=core.HeaderValue(key=key, raw_value=value.encode("latin-1")),
        append_action=core.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
    )


def _destination_metadata(endpoint: str) -> struct_pb2.Struct:
    metadata = struct_pb2.Struct()
    metadata.fields[DESTINATION_NAMESPACE].struct_value.fields[
        DESTINATION_HEADER
    ].string_value = endpoint
    return metadata


def _immediate(error: RouterError, request_id: str | None) -> pb.ProcessingResponse:
    """A refusal as Envoy sends it to the client: status, OpenAI's error JSON, its headers."""
    body = error_body(error.status, error.message, param=error.param, type_=error.type)
    headers = [_header_option("content-type", "application/json")]
    headers += [_header_option(k, v) for k, v in error.headers.items()]
    if request_id:
        headers.append(_header_option("x-request-id", request_id))
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=error.status),  # type: ignore[arg-type]
            headers=pb.HeaderMutation(set_headers=headers),
            body=json.dumps(body).encode(),
            details=f"kvroute: {error.status}",
        )
    )


def _body_chunks(raw: bytes, end_of_stream: bool) -> list[pb.ProcessingResponse]:
    """The request body handed back in FULL_DUPLEX_STREAMED mode (Envoy forwards only what
    the processor returns), in chunks under Envoy's limit."""
    pieces = [raw[i : i + _CHUNK] for i in range(0, len(raw), _CHUNK)] or [b""]
    return [
        pb.ProcessingResponse(
            request_body=pb.BodyResponse(
                response=pb.CommonResponse(
                    body_mutation=pb.BodyMutation(
                        streamed_response=pb.StreamedBodyResponse(
                            body=piece, end_of_stream=end_of_stream and i == len(pieces) - 1
                        )
                    )
                )
            )
        )
        for i, piece in enumerate(pieces)
    ]


def destination_mutation(
    replica: Replica, endpoint: str, auth: ReplicaAuth, content_length: int | None = None
) -> pb.HeaderMutation:
    """The pick as a header mutation, plus what kvroute's proxy would have changed in the
    forwarded request: a data-parallel rank's pin (``X-data-parallel-rank``), and the
    replicas' ``Authorization`` (router/auth.py: the router's key is never forwarded; the
    replica key, when set, replaces it)."""
    headers = [_header_option(DESTINATION_HEADER, endpoint)]
    if replica.config.dp_rank is not None:
        headers.append(_header_option(DP_RANK_HEADER.decode(), str(replica.config.dp_rank)))
    if content_length is not None:
        headers.append(_header_option("content-length", str(content_length)))
    remove: list[str] = []
    if auth.header is not None:
        headers.append(_header_option("authorization", auth.header.decode("latin-1")))
    elif auth.drop_client:
        remove.append("authorization")
    return pb.HeaderMutation(set_headers=headers, remove_headers=remove)


@dataclass(slots=True)
class _Pick:
    """One request's pick and what its accounting needs until the response ends."""

    replica: Replica
    endpoint: str
    epoch: int
    decision: Decision | None
    sent_at: float = field(default_factory=time.perf_counter)
    first_byte: bool = False
    streamed: bool = False
    status: int | None = None
    tail: bytes = b""
    body: bytearray | None = field(default_factory=bytearray)
    ended: bool = False


class _Exchange:
    """One ext_proc stream: one HTTP request through the gateway, from its headers to its
    response's end. Answers each message in the order Envoy expects (headers, body,
    trailers; request phase, then response phase)."""

    def __init__(self, picker: EndpointPicker) -> None:
        self.picker = picker
        self.service = picker.service
        # Until Envoy says otherwise (module docstring): the Inference Extension's modes.
        self.duplex_request = True
        self.duplex_response = True
        self.no_body = False
        self.headers: dict[str, str] = {}
        self.subset: set[str] | None = None
        self.body = bytearray()
        self.pick: _Pick | None = None
        self.request_id: str | None = None
        self.done = False  # an ImmediateResponse went out: nothing more to answer

    # --- messages -------------------------------------------------------------------------

    async def on(self, request: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        if request.HasField("protocol_config"):
            config = request.protocol_config
            self.duplex_request = config.request_body_mode == _FULL_DUPLEX
            self.duplex_response = config.response_body_mode == _FULL_DUPLEX
            self.no_body = config.request_body_mode == _NO_BODY
        which = request.WhichOneof("request")
        try:
            if which == "request_headers":
                return await self._request_headers(request)
            if which == "request_body":
                return await self._request_body(request.request_body)
            if which == "request_trailers":
                return await self._request_trailers()
            if which == "response_headers":
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
        self.headers = _headers(message)
        self.request_id = self.headers.get("x-request-id")
        self.subset = _subset(request)
        self._check_key()
        if message.end_of_stream or self.no_body:
            # No body (a GET) or none will come: decided now, by load when nothing says more.
            header_response = await self._decide(b"")
            return [pb.ProcessingResponse(request_headers=header_response, **self._metadata())]
        if self.duplex_request:
            return []  # the body streams in without waiting: answer once it is whole
        return [pb.ProcessingResponse(request_headers=pb.HeadersResponse())]

    async def _request_body(self, message: pb.HttpBody) -> list[pb.ProcessingResponse]:
        if self.pick is not None:  # decided already (Envoy's body mode NONE): pass it on
            if self.duplex_request:
                return _body_chunks(message.body, message.end_of_stream)
            return [pb.ProcessingResponse(request_body=pb.BodyResponse())]
        self.body += message.body
        limit = self.service.settings.max_body_bytes
        if len(self.body) > limit:
            raise RouterError(413, f"request body exceeds {limit} bytes")
        if not message.end_of_stream:
            if self.duplex_request:
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
        common = await self._decide(raw, content_length=len(raw) if self.duplex_request else None)
        if self.duplex_request:
            first = pb.ProcessingResponse(request_headers=common, **self._metadata())
            return [first, *_body_chunks(raw, end_of_stream)]
        # Buffered: Envoy holds the headers until the body's answer, which may mutate them.
        body_response = pb.BodyResponse(response=common.response)
        return [pb.ProcessingResponse(request_body=body_response, **self._metadata())]

    def _response_headers(self, message: pb.HttpHeaders) -> list[pb.ProcessingResponse]:
        pick = self.pick
        if pick is not None:
            headers = _headers(message)
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

    async def _decide(self, raw: bytes, content_length: int | None = None) -> pb.HeadersResponse:
        """Read the body as the HTTP endpoints do, rank and commit as a proxied request, and
        count it in flight on the pick; the headers answer that carries the pick."""
        service = self.service
        method = self.headers.get(":method", "POST")
        kind = _kind(method, self.headers.get(":path", "/"))
        # No body will come (Envoy's body mode NONE): by load, the body unread.
        parsed, model = (None, None) if self.no_body else routing_input(service, kind, raw)
        decision: Decision | None = None
        if parsed is not None:
            session = self.headers.get(service.settings.session_header.lower())
            decision = await service.decide(parsed, session, self._narrow)
            replica = decision.ranked[0]
            service.router.commit(decision, replica)
        else:
            pool = self._narrow(service.pool(model))
            replica = min(pool, key=lambda r: r.pending)
        endpoint = replica_endpoint(replica)
        self.pick = _Pick(replica, endpoint, replica.begin_request(), decision)
        service.metrics.epp_request(ENDPOINT_LABELS[kind], "picked")
        return pb.HeadersResponse(
            response=pb.CommonResponse(
                header_mutation=destination_mutation(
                    replica, endpoint, self.picker.replica_auth, content_length
                ),
                clear_route_cache=True,
            )
        )

    def _metadata(self) -> dict[str, Any]:
        assert self.pick is not None
        return {"dynamic_metadata": _destination_metadata(self.pick.endpoint)}

    def refuse(self, error: RouterError) -> pb.ProcessingResponse:
        """An ImmediateResponse for ``error``; the stream has nothing more to answer."""
        self.done = True
        if error.status == 500:
            outcome = "router_error"
        elif error.status < 500 and error.status != 429:
            outcome = "client_error"
        else:
            outcome = "unavailable"
        method, path = self.headers.get(":method", "POST"), self.headers.get(":path", "/")
        self.service.metrics.epp_request(ENDPOINT_LABELS[_kind(method, path)], outcome)
        return _immediate(error, self.request_id)

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
        if decision is None or pick.status != 200 or len(decision.batch_sizes) > 1:
            return  # a batch reports one prompt's cached tokens (endpoints.py): not compared
        if pick.streamed:
            delivered = cached_tokens_from_sse(pick.tail)
        else:
            delivered = cached_tokens_from_body(bytes(pick.body)) if pick.body else None
        view = decision.view(pick.replica.name)
        predicted = view.predicted_cached_tokens if view is not None else 0
        self.service.accuracy.record(
            pick.replica.name, decision.prompt_tokens, predicted, delivered
        )
        self.service.metrics.cached_tokens(
            pick.replica.name, decision.prompt_tokens, predicted, delivered
        )

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


# grpc.health.v1 (the gRPC Health Checking Protocol, which the Endpoint Picker Protocol asks
# of a picker), built here from its two messages: the generated module ships in a separate
# package (grpcio-health-checking) that kvroute would need for nothing else.
_HEALTH_SERVICE = "grpc.health.v1.Health"
_SERVING, _NOT_SERVING = 1, 2


def _health_messages() -> tuple[type[Any], type[Any]]:
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    proto = descriptor_pb2.FileDescriptorProto(
        name="kvroute/grpc_health_v1.proto", package="grpc.health.v1", syntax="proto3"
    )
    request = proto.message_type.add(name="HealthCheckRequest")
    request.field.add(name="service", number=1, type=9, label=1)  # string
    response = proto.message_type.add(name="HealthCheckResponse")
    status = response.enum_type.add(name="ServingStatus")
    for number, name in enumerate(("UNKNOWN", "SERVING", "NOT_SERVING", "SERVICE_UNKNOWN")):
        status.value.add(name=name, number=number)
    response.field.add(
        name="status",
        number=1,
        type=14,  # enum
        label=1,
        type_name=".grpc.health.v1.HealthCheckResponse.ServingStatus",
    )
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return (
        message_factory.GetMessageClass(
            pool.FindMessageTypeByName("grpc.health.v1.HealthCheckRequest")
        ),
        message_factory.GetMessageClass(
            pool.FindMessageTypeByName("grpc.health.v1.HealthCheckResponse")
        ),
    )


def _health_handler(ready: Callable[[], bool]) -> grpc.GenericRpcHandler:
    """``Check`` as the protocol names its services: ``liveness`` (and ``""``, the server)
    SERVING while the process answers; ``readiness`` and the ext_proc service SERVING when
    ``ready()`` (the router's ``GET /ready``), else NOT_SERVING; any other, NOT_FOUND."""
    request_type, response_type = _health_messages()
    picker = pb.DESCRIPTOR.services_by_name["ExternalProcessor"].full_name

    async def check(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if request.service in ("", "liveness"):
            return response_type(status=_SERVING)
        if request.service in ("readiness", picker):
            return response_type(status=_SERVING if ready() else _NOT_SERVING)
        await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")

    return grpc.method_handlers_generic_handler(
        _HEALTH_SERVICE,
        {
            "Check": grpc.unary_unary_rpc_method_handler(
                check,
                request_deserializer=request_type.FromString,
                response_serializer=response_type.SerializeToString,
            )
        },
    )


class EppServer:
    """The picker's gRPC server, on the HTTP app's event loop (started by its lifespan).
    Plaintext, or TLS with ``epp_tls_cert``/``epp_tls_key`` (the Inference Extension's own
    picker serves TLS by default, and gateways set up for it may dial TLS)."""

    def __init__(
        self,
        service: RouterService,
        host: str,
        port: int,
        ready: Callable[[], bool] | None = None,
    ) -> None:
        self.service = service
        self.ready = ready or (lambda: bool(service.registry.healthy()))
        self.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self.server: grpc.aio.Server | None = None

    async def start(self) -> None:
        settings = self.service.settings
        # A buffered body arrives in one message: let one as large as --max-body-bytes in,
        # so that the picker, not gRPC, refuses a larger one (413 in OpenAI's schema).
        limit = settings.max_body_bytes + (1 << 20)
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", limit)])
        pb_grpc.add_ExternalProcessorServicer_to_server(EndpointPicker(self.service), server)
        server.add_generic_rpc_handlers((_health_handler(self.ready),))
        if settings.epp_tls_cert and settings.epp_tls_key:
            with open(settings.epp_tls_key, "rb") as key, open(settings.epp_tls_cert, "rb") as cert:
                credentials = grpc.ssl_server_credentials([(key.read(), cert.read())])
            server.add_secure_port(self.address, credentials)  # raises when it cannot bind
        else:
            server.add_insecure_port(self.address)
        await server.start()
        self.server = server
        tls = "TLS" if settings.epp_tls_cert else "plaintext"
        log.info("endpoint picker (ext_proc gRPC, %s) listening on %s", tls, self.address)

    async def stop(self, grace_s: float = 2.0) -> None:
        if self.server is not None:
            await self.server.stop(grace_s)
            self.server = None


async def start_epp(
    service: RouterService, host: str, port: int, ready: Callable[[], bool] | None = None
) -> EppServer:
    """Start the endpoint picker beside the HTTP app (kvroute.router.app's lifespan);
    ``ready``: what its gRPC health service calls readiness (default: a healthy replica)."""
    server = EppServer(service, host, port, ready)
    await server.start()
    return server
