"""The endpoint picker's pieces without a fleet: where the path comes from, the body's shape,
headers as each gateway writes them, the destination list, the served endpoint, and the
picker's TLS (a real ``grpc.aio`` server on 127.0.0.1, its health service called over TLS,
plaintext and a pinned certificate).

The picks themselves, over a real router and simulated fleet, are tests/router/epp/test_epp.py's.
"""

from __future__ import annotations

import asyncio
import json
import ssl
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
from envoy.config.core.v3 import base_pb2 as core
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from kvroute.deploy.processes import free_port
from kvroute.router.config import ConfigError, RouterSettings
from kvroute.router.epp.messages import (
    destination_value,
    header_map,
    kind_from_body,
    request_path,
    served_endpoint,
)
from kvroute.router.epp.server import EppServer
from kvroute.router.epp.tls import self_signed, server_credentials_pem


def test_the_path_comes_from_the_pseudo_header_then_the_gateways_headers() -> None:
    assert request_path({":path": "/v1/completions", "x-original-path": "/x"}) == "/v1/completions"
    assert request_path({"x-original-path": "/v1/chat/completions"}) == "/v1/chat/completions"
    assert request_path({"x-forwarded-path": "/v1/responses"}) == "/v1/responses"
    assert (
        request_path({"x-original-path": "/v1/messages", "x-forwarded-path": "/v1/completions"})
        == "/v1/messages"
    )
    assert request_path({":path": " ", "content-type": "application/json"}) is None


@pytest.mark.parametrize(
    ("body", "kind"),
    [
        ({"model": "m", "messages": [{"role": "user", "content": "hi"}]}, "chat"),
        ({"model": "m", "prompt": "hi"}, "completion"),
        ({"model": "m", "prompt": [1, 2, 3]}, "completion"),
        ({"model": "m", "input": "hi"}, "responses"),
        ({"model": "m", "messages": "not a list"}, "other"),
        ({"model": "m"}, "other"),
        ([1, 2], "other"),
    ],
)
def test_the_kind_from_the_bodys_shape(body: Any, kind: str) -> None:
    assert kind_from_body(json.dumps(body).encode()) == kind


def test_a_body_that_is_not_json_goes_by_load() -> None:
    assert kind_from_body(b'{"messages": [') == "other"
    assert kind_from_body(b"\xff\xfe") == "other"


def test_headers_in_value_or_raw_value_and_any_case_are_read() -> None:
    """NGINX Gateway Fabric's shim and agentgateway's pseudo-headers: ``value`` strings; Envoy
    and agentgateway's other headers: raw bytes. The shim lowercases names; a gateway that
    does not is read the same."""
    message = pb.HttpHeaders(
        headers=core.HeaderMap(
            headers=[
                core.HeaderValue(key="X-Original-Path", value="/v1/chat/completions"),
                core.HeaderValue(key="Authorization", value="Bearer k"),
                core.HeaderValue(key=":method", raw_value=b"POST"),
                core.HeaderValue(key=":path", value="/v1/completions?x=1"),
            ]
        )
    )
    assert header_map(message) == {
        "x-original-path": "/v1/chat/completions",
        "authorization": "Bearer k",
        ":method": "POST",
        ":path": "/v1/completions?x=1",
    }


def test_the_destination_list_and_the_served_endpoint() -> None:
    assert destination_value(["10.0.0.7:8000"]) == "10.0.0.7:8000"
    assert destination_value(["10.0.0.7:8000", "10.0.0.8:8000"]) == "10.0.0.7:8000,10.0.0.8:8000"
    request = pb.ProcessingRequest()
    assert served_endpoint(request) is None
    lb = request.metadata_context.filter_metadata["envoy.lb"]
    assert served_endpoint(request) is None  # the namespace without the key
    lb.fields["x-gateway-destination-endpoint-served"].string_value = " [FD00::8]:8000 "
    assert served_endpoint(request) == "[fd00::8]:8000"


# --- TLS ----------------------------------------------------------------------------------


def _server(**settings: Any) -> EppServer:
    """An EppServer over a stand-in service: the TLS tests call only the health service,
    which needs no router behind it."""
    service = SimpleNamespace(settings=RouterSettings(epp_port=9002, **settings))
    port = free_port("127.0.0.1")
    return EppServer(service, "127.0.0.1", port, ready=lambda: True)  # type: ignore[arg-type]


async def _check(server: EppServer, credentials: grpc.ChannelCredentials | None) -> bytes | str:
    target = server.address
    channel = (
        grpc.aio.secure_channel(target, credentials)
        if credentials is not None
        else grpc.aio.insecure_channel(target)
    )
    async with channel:
        call = channel.unary_unary("/grpc.health.v1.Health/Check")
        try:
            return await asyncio.wait_for(call(b"\x0a\x09readiness"), 10)
        except grpc.aio.AioRpcError as exc:
            return exc.code().name


Credentials = grpc.ChannelCredentials | None


def _talk(server: EppServer, *makers: Any) -> list[bytes | str]:
    """Start ``server``; for each maker (server -> channel credentials, None: plaintext),
    call readiness; stop it. The answers' wire bytes, or the calls' error codes."""

    async def main() -> list[bytes | str]:
        await server.start()
        try:
            return [await _check(server, make(server)) for make in makers]
        finally:
            await server.stop(0)

    return asyncio.run(main())


SERVING = b"\x08\x01"


def _pinned(server: EppServer) -> Credentials:
    assert server.certificate is not None
    return grpc.ssl_channel_credentials(root_certificates=server.certificate)


def _plaintext(server: EppServer) -> Credentials:
    return None


def test_a_self_signed_certificate_is_made_at_start_when_none_is_given() -> None:
    """No flag: TLS with a certificate made at start. Plaintext is refused; a client that
    pins what the server presents is served; another server makes another certificate."""
    first = _server()
    assert _talk(first, _plaintext, _pinned) == ["UNAVAILABLE", SERVING]
    second = _server()
    stale = first.certificate

    def old_pin(server: EppServer) -> Credentials:
        return grpc.ssl_channel_credentials(root_certificates=stale)

    assert _talk(second, old_pin, _pinned) == ["UNAVAILABLE", SERVING]
    assert second.certificate != first.certificate


def test_the_operators_certificate_is_served(tmp_path: Path) -> None:
    chain, key = self_signed(["127.0.0.1"])
    (tmp_path / "tls.crt").write_bytes(chain)
    (tmp_path / "tls.key").write_bytes(key)
    server = _server(epp_tls_cert=str(tmp_path / "tls.crt"), epp_tls_key=str(tmp_path / "tls.key"))

    def operators(server: EppServer) -> Credentials:
        return grpc.ssl_channel_credentials(root_certificates=chain)

    assert _talk(server, operators, _plaintext) == [SERVING, "UNAVAILABLE"]
    assert server.certificate == chain


def test_plaintext_only_when_asked() -> None:
    server = _server(epp_plaintext=True)
    assert _talk(server, _plaintext) == [SERVING]
    assert server.certificate is None


def test_the_generated_certificate_names_the_hosts_and_is_not_a_ca() -> None:
    chain, _, generated = server_credentials_pem(None, None, "10.1.2.3")
    assert generated
    from cryptography import x509

    certificate = x509.load_pem_x509_certificate(chain)
    names = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    addresses = {str(a) for a in names.get_values_for_type(x509.IPAddress)}
    assert {"127.0.0.1", "10.1.2.3"} <= addresses
    assert "localhost" in names.get_values_for_type(x509.DNSName)
    assert not certificate.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert ssl.PEM_cert_to_DER_cert(chain.decode())  # a well-formed PEM


def test_unreadable_tls_files_are_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read the endpoint picker's TLS files"):
        server_credentials_pem(str(tmp_path / "missing.crt"), str(tmp_path / "missing.key"), "")
