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

The decision itself is ``exchange.py``'s, the protocol's messages ``messages.py``'s; this module
serves the stream and the gRPC health service.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from kvroute.router.epp.exchange import EndpointPicker
from kvroute.router.epp.tls import server_credentials_pem

if TYPE_CHECKING:  # the composition root imports this module
    from kvroute.router.service import RouterService

__all__ = ["EppServer"]

log = logging.getLogger(__name__)

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
    TLS by default, as the Inference Extension's own picker (router/epp/tls.py: the
    gateways' generated picker clusters dial TLS): ``epp_tls_cert``/``epp_tls_key``, else a
    self-signed certificate made at start; plaintext only with ``epp_plaintext``."""

    def __init__(
        self,
        service: RouterService,
        host: str,
        port: int,
        ready: Callable[[], bool] | None = None,
    ) -> None:
        self.service = service
        self.ready = ready or (lambda: bool(service.registry.healthy()))
        self.host = host
        self.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self.server: grpc.aio.Server | None = None
        # The certificate chain served (PEM; None in plaintext): a client that pins it,
        # such as the tests, reads it here.
        self.certificate: bytes | None = None

    async def start(self) -> None:
        settings = self.service.settings
        # A buffered body arrives in one message: let one as large as --max-body-bytes in,
        # so that the picker, not gRPC, refuses a larger one (413 in OpenAI's schema).
        limit = settings.max_body_bytes + (1 << 20)
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", limit)])
        pb_grpc.add_ExternalProcessorServicer_to_server(EndpointPicker(self.service), server)
        server.add_generic_rpc_handlers((_health_handler(self.ready),))
        if settings.epp_plaintext:
            server.add_insecure_port(self.address)
            tls = "plaintext (--epp-plaintext)"
        else:
            chain, key, generated = server_credentials_pem(
                settings.epp_tls_cert, settings.epp_tls_key, self.host
            )
            self.certificate = chain
            credentials = grpc.ssl_server_credentials([(key, chain)])
            server.add_secure_port(self.address, credentials)  # raises when it cannot bind
            tls = "TLS, self-signed certificate made at start" if generated else "TLS"
        await server.start()
        self.server = server
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
