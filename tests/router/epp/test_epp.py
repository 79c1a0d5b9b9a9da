"""kvroute as a Gateway API Inference Extension endpoint picker (router/epp/server.py), end to end.

A real ``kvroute serve --epp-port`` process in front of a simulated vLLM fleet (bench/sim:
vLLM's HTTP API and ZMQ KV events), driven over Envoy's ext_proc protocol by a real
``grpc.aio`` client built on the xds-protos stubs, playing the gateway's part message by
message. Envoy itself cannot run here (no Envoy binary, no network), so what Envoy does with
the answers (connect to the picked ``ip:port``, hand the response phases back) is played by
the test: it sends the response headers and body itself, in the order Envoy would.

Checked: the pick is the replica holding a returning prefix (what ``/debug/route`` would
choose), given as the ``x-gateway-destination-endpoint`` header and as ``envoy.lb`` dynamic
metadata; the gateway's subset hint restricts it; a body streamed in several chunks
(FULL_DUPLEX_STREAMED) and a buffered one both work; the request counts in flight on the
picked replica until the response ends or the stream closes; and every bad input gets an
ImmediateResponse with OpenAI's error JSON and the HTTP endpoints' status.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

# grpcio and xds-protos are base dependencies (pyproject.toml): a missing one is a broken
# install and fails here, never a skip.
import grpc
import httpx
import pytest
from envoy.config.core.v3 import base_pb2 as core
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as modes
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from kvroute.bench.sim.fleet import SimFleet, SimFleetConfig
from kvroute.bench.sim.latency import LatencyModel
from kvroute.deploy.processes import free_port
from kvroute.deploy.router_process import RouterProcess

KEY = "sk-epp-test"
AUTH = f"Bearer {KEY}"
MODEL = "kvroute-sim"
MAX_BODY = 64 * 1024
DUPLEX = modes.ProcessingMode.FULL_DUPLEX_STREAMED
BUFFERED = modes.ProcessingMode.BUFFERED
HEALTH_INTERVAL_S = 0.3


class Setup:
    def __init__(self, fleet: SimFleet, router: RouterProcess, epp_port: int) -> None:
        self.fleet = fleet
        self.router = router
        self.epp = f"127.0.0.1:{epp_port}"
        self.endpoints = {r.name: r.url.removeprefix("http://") for r in fleet.replicas}

    def stats(self) -> dict[str, Any]:
        return httpx.get(
            f"{self.router.url}/index/stats", headers=self.router.auth_headers(), timeout=10
        ).json()

    def in_flight(self) -> dict[str, int]:
        return {n: r["load"]["in_flight"] for n, r in self.stats()["replicas"].items()}

    def debug_route(self, body: dict[str, Any]) -> dict[str, Any]:
        return httpx.post(
            f"{self.router.url}/debug/route",
            json=body,
            headers=self.router.auth_headers(),
            timeout=10,
        ).json()


@pytest.fixture(scope="module")
def setup() -> Iterator[Setup]:
    config = SimFleetConfig(
        replicas=2,
        max_model_len=4096,
        default_max_tokens=2,
        latency=LatencyModel(time_scale=0.005),
        stream_interval_s=0.002,
    )
    with SimFleet(config) as fleet:
        epp_port = free_port("127.0.0.1")
        router = RouterProcess(
            name="router-epp",
            replicas=fleet.endpoints(),
            tokenizer=fleet.model_dir,
            api_key=KEY,
            extra_args=[
                "--epp-port",
                str(epp_port),
                "--epp-plaintext",  # TLS by default: test_tls_by_default_... covers it
                "--health-interval-s",
                str(HEALTH_INTERVAL_S),
                "--max-body-bytes",
                str(MAX_BODY),
                "--no-tokenizer-check",
                "--log-level",
                "warning",
            ],
        )
        with router:
            assert router.wait_feeds_settled(30)
            yield Setup(fleet, router, epp_port)


# --- the gateway's side of the stream ----------------------------------------------------


def header_map(
    path: str = "/v1/chat/completions",
    *,
    method: str = "POST",
    end_of_stream: bool = False,
    authorization: str | None = AUTH,
    subset: list[str] | None = None,
    mode: int | None = DUPLEX,
    extra: dict[str, str] | None = None,
) -> pb.ProcessingRequest:
    """The first message of a stream, as Envoy sends it: pseudo-headers and headers as raw
    values (envoyproxy/envoy source/extensions/filters/http/ext_proc/mutation_utils.cc,
    ``headersToProto``: ``raw_value`` under the runtime flag ``send_header_raw_value``, else
    ``value``; read at 00acddf3a6fb095d9a686caeb3b31db459c97d12, and Envoy reads a mutation's
    ``raw_value`` under the same flag), the subset hint in filter metadata, the body modes
    in ``protocol_config``."""
    values = {":method": method, ":path": path, ":authority": "gateway", "x-request-id": "rq-1"}
    values["content-type"] = "application/json"
    if authorization is not None:
        values["authorization"] = authorization
    values.update(extra or {})
    request = pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(
            headers=core.HeaderMap(
                headers=[core.HeaderValue(key=k, raw_value=v.encode()) for k, v in values.items()]
            ),
            end_of_stream=end_of_stream,
        )
    )
    if subset is not None:
        hint = request.metadata_context.filter_metadata["envoy.lb.subset_hint"]
        # Present even when empty (an empty list is a refusal, not "no hint").
        hint.fields["x-gateway-destination-endpoint-subset"].list_value.SetInParent()
        for endpoint in subset:
            hint.fields["x-gateway-destination-endpoint-subset"].list_value.values.add(
                string_value=endpoint
            )
    if mode is not None:
        request.protocol_config.request_body_mode = mode
        request.protocol_config.response_body_mode = mode
    return request


def _body(data: bytes, end_of_stream: bool = True) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=data, end_of_stream=end_of_stream))


def _response_headers(status: int = 200, sse: bool = True) -> pb.ProcessingRequest:
    content_type = "text/event-stream" if sse else "application/json"
    return pb.ProcessingRequest(
        response_headers=pb.HttpHeaders(
            headers=core.HeaderMap(
                headers=[
                    core.HeaderValue(key=":status", raw_value=str(status).encode()),
                    core.HeaderValue(key="content-type", raw_value=content_type.encode()),
                ]
            )
        )
    )


def _response_body(data: bytes, end_of_stream: bool) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(response_body=pb.HttpBody(body=data, end_of_stream=end_of_stream))


class Stream:
    """One ext_proc stream over a real gRPC channel."""

    def __init__(self, call: Any) -> None:
        self.call = call

    async def send(self, *requests: pb.ProcessingRequest) -> None:
        for request in requests:
            await self.call.write(request)

    async def read(self, timeout_s: float = 10.0) -> pb.ProcessingResponse:
        answer = await asyncio.wait_for(self.call.read(), timeout_s)
        assert answer is not grpc.aio.EOF, "the picker ended the stream"
        return answer

    async def read_many(self, n: int) -> list[pb.ProcessingResponse]:
        return [await self.read() for _ in range(n)]

    async def ends(self) -> None:
        """The picker closes its side (after an ImmediateResponse)."""
        assert await asyncio.wait_for(self.call.read(), 10.0) is grpc.aio.EOF
        assert await asyncio.wait_for(self.call.code(), 10.0) == grpc.StatusCode.OK


def _run(setup: Setup, test: Callable[[Stream], Awaitable[Any]]) -> Any:
    async def main() -> Any:
        async with grpc.aio.insecure_channel(setup.epp) as channel:
            call = pb_grpc.ExternalProcessorStub(channel).Process()
            try:
                return await test(Stream(call))
            finally:
                call.cancel()

    return asyncio.run(main())


def _chat(system: str, user: str = "hello?", **more: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        "max_tokens": 2,
        **more,
    }


def _destination(answer: pb.ProcessingResponse) -> tuple[str, str, dict[str, str], list[str]]:
    """(primary endpoint, metadata value, all set headers, removed headers) of a pick; the
    header's whole value (primary, then fallbacks) equals the metadata's."""
    phase = answer.WhichOneof("response")
    assert phase in ("request_headers", "request_body"), answer
    common = getattr(answer, phase).response
    headers = {
        h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers
    }
    lb = answer.dynamic_metadata.fields["envoy.lb"].struct_value
    value = headers["x-gateway-destination-endpoint"]
    metadata = lb.fields["x-gateway-destination-endpoint"].string_value
    assert value == metadata, (value, metadata)  # never two different values
    return (
        value.split(",")[0],
        metadata,
        headers,
        list(common.header_mutation.remove_headers),
    )


async def _pick(stream: Stream, body: dict[str, Any], **headers: Any) -> str:
    """A duplex pick: headers, the whole body; the picked endpoint (header == metadata)."""
    raw = json.dumps(body).encode()
    await stream.send(header_map(**headers), _body(raw))
    answer, echoed = await stream.read_many(2)
    header, metadata, _, _ = _destination(answer)
    assert metadata.split(",")[0] == header
    assert echoed.request_body.response.body_mutation.streamed_response.body == raw
    return header


def _error(answer: pb.ProcessingResponse) -> tuple[int, dict[str, Any], dict[str, str]]:
    assert answer.WhichOneof("response") == "immediate_response", answer
    immediate = answer.immediate_response
    headers = {h.header.key: h.header.raw_value.decode() for h in immediate.headers.set_headers}
    body = json.loads(immediate.body)
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == immediate.status.code
    assert headers["content-type"] == "application/json"
    return immediate.status.code, body, headers


def _wait(check: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


# --- the tests ----------------------------------------------------------------------------


def test_the_pick_is_the_replica_holding_a_returning_prefix(setup: Setup) -> None:
    """A conversation computed on the second replica (sent to it directly) is picked there,
    as the HTTP proxy would pick it (``/debug/route``); header and metadata agree."""
    holder = setup.fleet.replicas[1]
    body = _chat("You are the EPP test's assistant. " + "Keep every answer short. " * 40)
    httpx.post(f"{holder.url}/v1/chat/completions", json=body, timeout=30).raise_for_status()

    def held() -> bool:
        route = setup.debug_route(body)
        view = next(v for v in route["replicas"] if v["name"] == holder.name)
        return route["chosen"] == holder.name and view["match_tokens"] > 0

    _wait(held)
    endpoint = _run(setup, lambda s: _pick(s, body))
    assert endpoint == setup.endpoints[holder.name]
    _wait(lambda: sum(setup.in_flight().values()) == 0)  # the stream closed: released


def test_the_subset_hint_restricts_the_pick(setup: Setup) -> None:
    holder = setup.fleet.replicas[1]
    other = setup.fleet.replicas[0]
    body = _chat("Subset hint test. " + "Repeat the question first. " * 40)
    httpx.post(f"{holder.url}/v1/chat/completions", json=body, timeout=30).raise_for_status()
    _wait(lambda: setup.debug_route(body)["chosen"] == holder.name)
    allowed = [setup.endpoints[other.name], "10.255.0.1:8000"]  # and one the fleet lacks
    assert _run(setup, lambda s: _pick(s, body, subset=allowed)) == setup.endpoints[other.name]

    async def refused(stream: Stream, subset: list[str]) -> None:
        await stream.send(header_map(subset=subset), _body(json.dumps(body).encode()))
        status, error, headers = _error(await stream.read())
        assert status == 503 and "subset" in error["error"]["message"]
        assert "retry-after" in headers
        await stream.ends()

    _run(setup, lambda s: refused(s, ["10.255.0.1:8000"]))  # none eligible
    _run(setup, lambda s: refused(s, []))  # an empty list


def test_a_body_streamed_in_chunks_and_a_buffered_body(setup: Setup) -> None:
    body = _chat("Chunked body test. " + "Think step by step. " * 60, stream=True)
    raw = json.dumps(body).encode()
    expected = setup.debug_route(body)["chosen"]

    async def chunked(stream: Stream, mode: int | None) -> None:
        await stream.send(header_map(mode=mode))
        third = len(raw) // 3
        await stream.send(_body(raw[:third], False), _body(raw[third : 2 * third], False))
        await stream.send(_body(raw[2 * third :], True))
        answer = await stream.read()
        endpoint, _, headers, removed = _destination(answer)
        assert answer.WhichOneof("response") == "request_headers"
        assert answer.request_headers.response.clear_route_cache
        assert endpoint == setup.endpoints[expected]
        assert headers["content-length"] == str(len(raw))
        # The router's key is not the replicas': not forwarded, as on HTTP (router/serving/auth.py);
        # nor a client's P/D prefill header (router/epp/disagg.py).
        assert removed == ["x-prefiller-host-port", "authorization"]
        echoed = b""
        while True:  # the body handed back, in order, the last chunk ending the stream
            chunk = (await stream.read()).request_body.response.body_mutation.streamed_response
            echoed += chunk.body
            if chunk.end_of_stream:
                break
        assert echoed == raw

    async def buffered(stream: Stream) -> None:
        await stream.send(header_map(mode=BUFFERED))
        assert (await stream.read()).WhichOneof("response") == "request_headers"
        await stream.send(_body(raw, True))
        answer = await stream.read()
        assert answer.WhichOneof("response") == "request_body"
        endpoint, metadata, _, _ = _destination(answer)
        assert endpoint == metadata.split(",")[0] == setup.endpoints[expected]

    _run(setup, lambda s: chunked(s, DUPLEX))
    _run(setup, lambda s: chunked(s, None))  # no protocol_config: the Inference Extension's
    _run(setup, buffered)


def test_in_flight_rises_and_falls_with_the_response_phases(setup: Setup) -> None:
    body = _chat("In-flight accounting test. " + "Answer in one word. " * 30, stream=True)
    names = {v: k for k, v in setup.endpoints.items()}

    async def phases(stream: Stream) -> None:
        picked = names[await _pick(stream, body)]
        assert setup.in_flight()[picked] == 1  # counted from the pick
        await stream.send(_response_headers())
        assert (await stream.read()).WhichOneof("response") == "response_headers"
        assert setup.in_flight()[picked] == 1
        await stream.send(_response_body(b'data: {"choices": []}\n\n', False))
        echoed = (await stream.read()).response_body.response.body_mutation.streamed_response
        assert echoed.body == b'data: {"choices": []}\n\n' and not echoed.end_of_stream
        assert setup.in_flight()[picked] == 1
        await stream.send(_response_body(b"data: [DONE]\n\n", True))
        last = (await stream.read()).response_body.response.body_mutation.streamed_response
        assert last.end_of_stream
        assert setup.in_flight()[picked] == 0  # the response ended

    async def abandoned(stream: Stream) -> None:
        picked = names[await _pick(stream, body)]
        assert setup.in_flight()[picked] == 1
        stream.call.cancel()  # the gateway goes away mid-request

    _run(setup, phases)
    _run(setup, abandoned)
    _wait(lambda: sum(setup.in_flight().values()) == 0)
    metrics = httpx.get(f"{setup.router.url}/metrics", timeout=10).text
    assert 'kvroute_epp_requests_total{endpoint="chat",outcome="picked"}' in metrics


@pytest.mark.parametrize(
    ("case", "status", "param"),
    [
        ("invalid_json", 400, None),
        ("not_an_object", 400, None),
        ("no_messages", 400, "messages"),
        ("unknown_model", 404, "model"),
        ("too_large", 413, None),
        ("no_key", 401, None),
        ("wrong_key", 401, None),
    ],
)
def test_bad_input_gets_an_immediate_response(
    setup: Setup, case: str, status: int, param: str | None
) -> None:
    good = json.dumps(_chat("bad input test")).encode()
    raw = {
        "invalid_json": b'{"model": "kvroute-sim", "messages": [',
        "not_an_object": b"[1, 2]",
        "no_messages": json.dumps({"model": MODEL}).encode(),
        "unknown_model": json.dumps(_chat("x") | {"model": "no-such-model"}).encode(),
        "too_large": json.dumps(_chat("x" * MAX_BODY)).encode(),
    }.get(case, good)
    authorization = {"no_key": None, "wrong_key": "Bearer sk-wrong"}.get(case, AUTH)

    async def refused(stream: Stream) -> None:
        await stream.send(header_map(authorization=authorization))
        if status != 401:  # the key is checked on the headers, before any body
            half = len(raw) // 2
            await stream.send(_body(raw[:half], False), _body(raw[half:], True))
        got, error, headers = _error(await stream.read())
        assert (got, error["error"]["param"]) == (status, param), error
        assert headers["x-request-id"] == "rq-1"
        await stream.ends()

    _run(setup, refused)
    assert sum(setup.in_flight().values()) == 0
    # The server lives on: the next request is picked.
    assert _run(setup, lambda s: _pick(s, _chat("after a bad one"))) in setup.endpoints.values()


def _health(setup: Setup, service: str) -> bytes | grpc.StatusCode:
    """grpc.health.v1.Health/Check, its messages written by hand: the wire bytes of the
    answer (``08 01``: SERVING, ``08 02``: NOT_SERVING), or the call's error code."""

    async def check() -> bytes | grpc.StatusCode:
        async with grpc.aio.insecure_channel(setup.epp) as channel:
            call = channel.unary_unary("/grpc.health.v1.Health/Check")
            request = b"\x0a" + bytes([len(service)]) + service.encode() if service else b""
            try:
                return await asyncio.wait_for(call(request), 10)
            except grpc.aio.AioRpcError as exc:
                return exc.code()

    return asyncio.run(check())


SERVING, NOT_SERVING = b"\x08\x01", b"\x08\x02"


def test_the_grpc_health_service(setup: Setup) -> None:
    for service in ("", "liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
        assert _health(setup, service) == SERVING, service
    assert _health(setup, "no.such.Service") == grpc.StatusCode.NOT_FOUND


def _served_certificate(port: int) -> bytes:
    """The certificate a TLS server on 127.0.0.1:``port`` presents, read without verifying
    it (as the gateways' generated picker clusters dial: TLS, no validation context), in
    PEM: the client then pins it."""
    import socket
    import ssl

    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    context.set_alpn_protocols(["h2"])  # gRPC's servers insist on HTTP/2
    with (
        socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
        context.wrap_socket(raw) as tls,
    ):
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return ssl.DER_cert_to_PEM_cert(der).encode()


def test_tls_by_default_and_a_router_without_keys(setup: Setup) -> None:
    """No TLS flag: the picker serves TLS with a certificate it made at start (naming
    127.0.0.1), as the Inference Extension's own picker does, and refuses plaintext. Without
    router keys the client's Authorization is left for the replicas, as on HTTP."""
    port = free_port("127.0.0.1")
    router = RouterProcess(
        name="router-epp-tls",
        replicas=setup.fleet.endpoints(),
        tokenizer=setup.fleet.model_dir,
        extra_args=[
            *("--epp-port", str(port), "--no-tokenizer-check", "--log-level", "warning"),
        ],
    )

    async def pick(certificate: bytes) -> tuple[str, list[str]]:
        credentials = grpc.ssl_channel_credentials(root_certificates=certificate)
        async with grpc.aio.secure_channel(f"127.0.0.1:{port}", credentials) as channel:
            call = pb_grpc.ExternalProcessorStub(channel).Process()
            stream = Stream(call)
            await stream.send(header_map(), _body(json.dumps(_chat("over TLS")).encode()))
            endpoint, _, _, removed = _destination(await stream.read())
            call.cancel()
            return endpoint, removed

    async def plaintext() -> grpc.StatusCode:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_unary("/grpc.health.v1.Health/Check")
            try:
                await asyncio.wait_for(call(b""), 10)
            except grpc.aio.AioRpcError as exc:
                return exc.code()
        return grpc.StatusCode.OK

    with router:
        certificate = _served_certificate(port)
        endpoint, removed = asyncio.run(pick(certificate))
        assert asyncio.run(plaintext()) == grpc.StatusCode.UNAVAILABLE
    assert b"BEGIN CERTIFICATE" in certificate
    assert endpoint in setup.endpoints.values()
    assert removed == ["x-prefiller-host-port"]  # a client's never reaches a P/D sidecar


# --- gateways other than Envoy, fallbacks, every body mode ---------------------------------
#
# Each gateway below is driven the way its source does it, read at these commits:
#
# * NGINX Gateway Fabric, nginx/nginx-gateway-fabric at e55bfe33969f313b210d3497b3ae56b923175d69:
#   cmd/gateway/endpoint_picker.go (the Go shim; last changed in
#   2ab4fe4746a3d249b6d685c19734729e6af062cd),
#   internal/controller/nginx/modules/src/epp.js (the njs module that calls the shim),
#   internal/controller/nginx/config/servers.go and maps.go (what NGINX does with the answer).
# * agentgateway, agentgateway/agentgateway at 75b4e6ce6e0e1ac7959d5548ebe8dbeaede4f180:
#   crates/agentgateway/src/http/ext_proc.rs (InferenceRouting, mutate_request,
#   send_body_stream, mutate_response), crates/agentgateway/src/http/ext_proc/headers.rs.
# * The reference picker, llm-d/llm-d-router at ebab687927f5331c1b39defcb579a07951bce56c:
#   pkg/epp/framework/common/request/headers.go (the path headers it reads, in order),
#   pkg/epp/requestcontrol/director.go (the destination list), and
#   pkg/epp/framework/plugins/scheduling/picker/common.go (one endpoint by default).


def _warm(setup: Setup, body: dict[str, Any]) -> str:
    """Compute ``body`` on the second replica directly, until the router would send it there
    (``/debug/route``) and its view of the fleet is idle again; that replica's endpoint.

    Idle, twice a health interval apart: on a busy machine a health scrape can catch the
    warm-up request still running (the replica counts it until its stream is closed), and
    until the next scrape the router rightly sees queued work on the holder, which may
    outweigh the prefix's saving (as tests/router/serving/test_gateway.py's ``warm``)."""
    holder = setup.fleet.replicas[1]
    httpx.post(f"{holder.url}/v1/chat/completions", json=body, timeout=30).raise_for_status()

    def ready() -> bool:
        loads = [r["load"] for r in setup.stats()["replicas"].values()]
        idle = all(not (x["in_flight"] or x["running"] or x["waiting"]) for x in loads)
        return idle and setup.debug_route(body)["chosen"] == holder.name

    _wait(ready)
    time.sleep(2 * HEALTH_INTERVAL_S)  # a scrape under way at the first check has landed
    _wait(ready)
    return setup.endpoints[holder.name]


def _ngf_headers(
    values: dict[str, str], *, end_of_stream: bool = False, lowercase: bool = True
) -> pb.ProcessingRequest:
    """Request headers as NGINX Gateway Fabric's shim builds them (``buildHeaderRequest``):
    the client's headers as njs forwards them to the shim, names lowercased
    (``strings.ToLower``), each value in ``value`` (never ``raw_value``); no pseudo-headers
    (the njs module fetches the shim's own URL, so the client's path is not sent at all), no
    ``protocol_config``, no metadata (no subset hint); ``end_of_stream`` when there is no body.
    ``lowercase=False``: the names as an earlier shim sent them, the keys of Go's
    ``http.Header`` unchanged, which Go keeps in canonical case (``Content-Type``)."""
    return pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(
            headers=core.HeaderMap(
                headers=[
                    core.HeaderValue(key=k.lower() if lowercase else k, value=v)
                    for k, v in values.items()
                ]
            ),
            end_of_stream=end_of_stream,
        )
    )


async def _ngf_shim(stream: Stream, headers: dict[str, str], raw: bytes) -> str | None:
    """The shim's whole exchange (``sendRequest``, then its receive loop): the headers, the
    body in one message with ``end_of_stream`` (``io.ReadAll``), half-close, then read every
    answer until the picker ends the stream. It keeps only the destination header of a
    ``request_headers`` answer, as ``raw_value`` (``GetRawValue``), and puts it whole into
    ``proxy_pass http://$inference_backend_...`` (maps.go, servers.go): one address."""
    await stream.send(_ngf_headers(headers, end_of_stream=not raw))
    if raw:
        await stream.send(_body(raw, True))
    await stream.call.done_writing()
    endpoint: str | None = None
    while (answer := await asyncio.wait_for(stream.call.read(), 10.0)) is not grpc.aio.EOF:
        assert answer.WhichOneof("response") != "immediate_response", answer
        for h in answer.request_headers.response.header_mutation.set_headers:
            if h.header.key == "x-gateway-destination-endpoint":
                endpoint = h.header.raw_value.decode()
    assert await stream.call.code() == grpc.StatusCode.OK
    return endpoint


def test_nginx_gateway_fabrics_shim_is_routed_by_cache(setup: Setup) -> None:
    """NGF's shim sends no path: the kind comes from the body's shape (``messages``: a chat
    completion), and the returning prefix goes to the replica that holds it, which routing by
    load would not promise. The destination is one address (fallbacks off by default), which
    is all NGINX can proxy to; a GET (no body) is picked at its headers, by load."""
    body = _chat("NGF shim test. " + "Be terse and exact. " * 40)
    holder = _warm(setup, body)
    raw = json.dumps(body).encode()
    headers = {
        "Content-Type": "application/json",
        "Authorization": AUTH,
        "X-Request-Id": "ngf-1",
        "X-Epp-Host": "kvroute-epp.default.svc",  # the shim's own headers, forwarded too
        "X-Epp-Port": "9002",
    }
    assert _run(setup, lambda stream: _ngf_shim(stream, headers, raw)) == holder
    get = _run(setup, lambda stream: _ngf_shim(stream, {"Authorization": AUTH}, b""))
    assert get in setup.endpoints.values()


def test_an_earlier_ngf_shim_with_go_canonical_header_names_is_routed_by_cache(
    setup: Setup,
) -> None:
    """The shim as the review behind this picker's path sources read it: NGINX Gateway
    Fabric's cmd/gateway/endpoint_picker.go at 07e470950b1ec562fb40f763e816dda88f3a0ecc, a
    commit outside NGF's main history (on main the shim lowercases the names from its first
    commit, 3dd0bed41, released in v2.2.0: the test above). There ``buildHeaderRequest``
    copies ``r.Header`` as it is, so the names keep Go's canonical case (``Authorization``,
    ``Content-Type``) in ``value``, and the headers never say ``end_of_stream``;
    ``buildBodyRequest`` then sends the whole body. The picker reads names in any case: the
    key check applies and the body's shape routes the request by cache."""
    body = _chat("Earlier NGF shim test. " + "Quote the question back. " * 40)
    holder = _warm(setup, body)
    raw = json.dumps(body).encode()
    headers = {
        "Content-Type": "application/json",
        "Authorization": AUTH,
        "X-Request-Id": "ngf-canonical-1",
        "X-Epp-Host": "kvroute-epp.default.svc",
        "X-Epp-Port": "9002",
    }

    async def shim(stream: Stream) -> str | None:
        await stream.send(_ngf_headers(headers, lowercase=False), _body(raw, True))
        await stream.call.done_writing()
        endpoint = None
        while (answer := await asyncio.wait_for(stream.call.read(), 10.0)) is not grpc.aio.EOF:
            assert answer.WhichOneof("response") != "immediate_response", answer
            for h in answer.request_headers.response.header_mutation.set_headers:
                if h.header.key == "x-gateway-destination-endpoint":
                    endpoint = h.header.raw_value.decode()
        assert await stream.call.code() == grpc.StatusCode.OK
        return endpoint

    assert _run(setup, shim) == holder

    async def wrong_key(stream: Stream) -> int:
        wrong = {**headers, "Authorization": "Bearer not-the-key"}
        # The key is checked on the headers, before any body: the picker answers and ends
        # the stream there, so a body written after them could fail to send (a race).
        await stream.send(_ngf_headers(wrong, lowercase=False))
        return _error(await stream.read())[0]

    assert _run(setup, wrong_key) == 401  # the canonical name is the key's header all the same


@pytest.mark.parametrize("path_header", ["x-original-path", "x-forwarded-path"])
def test_a_path_header_names_the_endpoint_when_there_is_no_path(
    setup: Setup, path_header: str
) -> None:
    """Without ``:path``, the reference picker reads ``x-original-path``, then
    ``x-forwarded-path`` (query stripped: headers.go); so does kvroute. None of the gateways
    read here sets them (a route's rewrite or the client may): with one naming the
    completions path, a chat-shaped body is that parser's to refuse, not guessed as chat."""
    raw = json.dumps(_chat("named path")).encode()
    headers = {"Authorization": AUTH, path_header: "/v1/completions?stream=false"}

    async def named(stream: Stream) -> int:
        await stream.send(_ngf_headers(headers), _body(raw, True))
        return _error(await stream.read())[0]

    assert _run(setup, named) == 400
    headers[path_header] = "/v1/chat/completions?x=1"
    assert _run(setup, lambda stream: _ngf_shim(stream, headers, raw)) in setup.endpoints.values()


def test_a_body_whose_guessed_kind_cannot_be_read_goes_by_load(setup: Setup) -> None:
    """Guessed from its shape (no path header, as from NGF's shim), a body the guessed parser
    refuses is not refused by the picker: the replica, at the client's real path, is the
    judge."""
    raw = json.dumps({"model": MODEL, "prompt": {"not": "a prompt"}}).encode()
    endpoint = _run(setup, lambda stream: _ngf_shim(stream, {"Authorization": AUTH}, raw))
    assert endpoint in setup.endpoints.values()
    # With the path named, the same body is the completions parser's to refuse (400).

    async def named(stream: Stream) -> int:
        await stream.send(header_map("/v1/completions"), _body(raw, True))
        return _error(await stream.read())[0]

    assert _run(setup, named) == 400


def _agentgateway_headers(path: str, values: dict[str, str]) -> pb.ProcessingRequest:
    """The first message of agentgateway's InferenceRouting stream: the request's headers in
    ``raw_value``, then the pseudo-headers ``:method``, ``:scheme`` (``http`` when the URI has
    none), ``:authority`` and ``:path`` (path and query) in ``value`` (headers.rs
    ``req_to_header_map``); ``protocol_config`` with both body modes FULL_DUPLEX_STREAMED
    (ext_proc.rs ``InferenceRouting::build``); no metadata context, so no subset hint."""
    headers = [core.HeaderValue(key=k, raw_value=v.encode()) for k, v in values.items()]
    pseudo = {":method": "POST", ":scheme": "http", ":authority": "gateway", ":path": path}
    headers += [core.HeaderValue(key=k, value=v) for k, v in pseudo.items()]
    request = pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(headers=core.HeaderMap(headers=headers))
    )
    request.protocol_config.request_body_mode = DUPLEX
    request.protocol_config.response_body_mode = DUPLEX
    return request


def _agentgateway_destination(answer: pb.ProcessingResponse) -> str:
    """What agentgateway does with the picker's headers answer (``mutate_request``): applies
    the header mutation, then parses ``x-gateway-destination-endpoint`` as one socket
    address; anything else fails the request ("EPP returned invalid address"). Dynamic
    metadata is kept for its CEL context only, never routed on."""
    assert answer.WhichOneof("response") == "request_headers", answer
    values = {
        h.header.key: (h.header.raw_value or h.header.value.encode()).decode()
        for h in answer.request_headers.response.header_mutation.set_headers
    }
    value = values["x-gateway-destination-endpoint"]
    host, _, port = value.rpartition(":")
    ipaddress.ip_address(host.strip("[]"))  # a SocketAddr: an IP literal and a port
    assert port.isdigit() and 0 < int(port) < 65536, value
    return value


@pytest.mark.parametrize("ending", ["last_chunk", "empty_chunk", "trailers"])
def test_agentgateway_is_routed_by_cache_and_reports_the_served_endpoint(
    setup: Setup, ending: str
) -> None:
    """agentgateway streams the body as its frames come (``send_body_stream``): each chunk's
    ``end_of_stream`` is whether the body has ended after it, so it is on the last chunk
    (a body of known length), or, when no chunk said so, an empty chunk with
    ``end_of_stream`` follows, or the body ends with trailers and nothing after them. Each
    way the pick comes once the body is whole, the body is handed back whole, and the
    destination parses as the one address agentgateway requires. In the response phase it
    sends ``:status`` in ``value`` and the endpoint that served in the metadata context
    (``envoy.lb`` → ``x-gateway-destination-endpoint-served``, ``mutate_response``); the
    request counts in flight on the pick until the response's body ends."""
    body = _chat(f"agentgateway test ({ending}). " + "Cite your sources. " * 40, stream=True)
    holder = _warm(setup, body)
    raw = json.dumps(body).encode()
    names = {v: k for k, v in setup.endpoints.items()}
    values = {"content-type": "application/json", "authorization": AUTH, "x-request-id": "ag-1"}

    async def agentgateway(stream: Stream) -> tuple[str, bytes]:
        await stream.send(_agentgateway_headers("/v1/chat/completions?api-version=1", values))
        last = ending == "last_chunk"
        await stream.send(_body(raw[:100], False), _body(raw[100:], last))
        if ending == "empty_chunk":
            await stream.send(_body(b"", True))
        elif ending == "trailers":
            await stream.send(pb.ProcessingRequest(request_trailers=pb.HttpTrailers()))
        endpoint = _agentgateway_destination(await stream.read())
        echoed = b""
        while True:
            answer = await stream.read()
            if answer.WhichOneof("response") == "request_trailers":
                break
            chunk = answer.request_body.response.body_mutation.streamed_response
            echoed += chunk.body
            if chunk.end_of_stream and ending != "trailers":
                break
        assert setup.in_flight()[names[endpoint]] == 1
        served = pb.ProcessingRequest(
            response_headers=pb.HttpHeaders(
                headers=core.HeaderMap(
                    headers=[
                        core.HeaderValue(key="content-type", raw_value=b"text/event-stream"),
                        core.HeaderValue(key=":status", value="200"),
                    ]
                )
            )
        )
        lb = served.metadata_context.filter_metadata["envoy.lb"]
        lb.fields["x-gateway-destination-endpoint-served"].string_value = endpoint
        await stream.send(served)
        assert (await stream.read()).WhichOneof("response") == "response_headers"
        await stream.send(_response_body(b"data: [DONE]\n\n", True))
        echoed_response = await stream.read()
        streamed = echoed_response.response_body.response.body_mutation.streamed_response
        assert streamed.body == b"data: [DONE]\n\n" and streamed.end_of_stream
        assert setup.in_flight()[names[endpoint]] == 0
        return endpoint, echoed

    assert _run(setup, agentgateway) == (holder, raw)


def test_fallbacks_follow_the_pick_and_the_served_endpoint_carries_the_load(
    setup: Setup,
) -> None:
    """``--epp-fallbacks 1`` (a router of its own: the default is 0): the destination is
    ``primary,fallback`` (header and metadata alike); when the gateway reports it served the
    request on the fallback (``x-gateway-destination-endpoint-served``), the in-flight count
    moves there.

    Who reads a list: Envoy's override_host load balancing policy, the one the Inference
    Extension's Envoy-based gateways route with, splits the header or metadata value on
    commas and takes the next address on each retry (envoyproxy/envoy
    source/extensions/load_balancing_policies/override_host/load_balancer.cc at
    043486c77de4ddeb519f7cf39f48e58550c01ca1, ``getSelectedHosts``, ``getEndpoint``), and
    the reference picker joins its picks with commas (director.go ``prepareRequest``), though
    it picks one by default (picker/common.go ``DefaultMaxNumOfEndpoints = 1``). agentgateway
    parses the header as one socket address and NGINX Gateway Fabric proxies to it whole,
    so a list breaks every request through them: hence the default of 0."""
    port = free_port("127.0.0.1")
    router = RouterProcess(
        name="router-epp-fallbacks",
        replicas=setup.fleet.endpoints(),
        tokenizer=setup.fleet.model_dir,
        api_key=KEY,
        extra_args=[
            *("--epp-port", str(port), "--epp-plaintext", "--epp-fallbacks", "1"),
            *("--no-tokenizer-check", "--log-level", "warning"),
        ],
    )
    with router:
        assert router.wait_feeds_settled(30)
        here = Setup(setup.fleet, router, port)
        body = _chat("Fallback list test. " + "Answer in French. " * 40, stream=True)
        holder = _warm(here, body)
        other = next(e for e in here.endpoints.values() if e != holder)
        names = {v: k for k, v in here.endpoints.items()}

        async def retried(stream: Stream) -> None:
            raw = json.dumps(body).encode()
            await stream.send(header_map(), _body(raw))
            answer, _ = await stream.read_many(2)
            primary, value, _, _ = _destination(answer)
            assert (primary, value) == (holder, f"{holder},{other}")
            with pytest.raises(ValueError):
                _agentgateway_destination(answer)  # what agentgateway would refuse
            assert here.in_flight()[names[holder]] == 1
            served = _response_headers()
            lb = served.metadata_context.filter_metadata["envoy.lb"]
            lb.fields["x-gateway-destination-endpoint-served"].string_value = other
            await stream.send(served)
            await stream.read()
            assert here.in_flight() == {names[holder]: 0, names[other]: 1}
            await stream.send(_response_body(b"data: [DONE]\n\n", True))
            await stream.read()
            assert sum(here.in_flight().values()) == 0

        _run(here, retried)


@pytest.mark.parametrize(
    "mode", [modes.ProcessingMode.STREAMED, modes.ProcessingMode.BUFFERED_PARTIAL]
)
def test_body_modes_that_may_forward_headers_early_go_by_load_at_the_headers(
    setup: Setup, mode: int
) -> None:
    """In STREAMED and BUFFERED_PARTIAL the headers may leave before the body is read: the
    pick is made (by load) in the headers answer, and each body chunk is acknowledged."""

    async def early(stream: Stream) -> None:
        await stream.send(header_map(mode=mode))
        answer = await stream.read()
        assert answer.WhichOneof("response") == "request_headers", answer
        assert _destination(answer)[0] in setup.endpoints.values()
        await stream.send(_body(json.dumps(_chat("early")).encode(), True))
        ack = await stream.read()
        assert ack.WhichOneof("response") == "request_body"
        assert not ack.request_body.response.HasField("body_mutation")

    _run(setup, early)
    _wait(lambda: sum(setup.in_flight().values()) == 0)


def test_no_healthy_replica_is_a_503(setup: Setup) -> None:
    """Last: it takes the fleet down."""
    for replica in setup.fleet.replicas:
        setup.fleet.kill(replica.name)
    _wait(lambda: httpx.get(f"{setup.router.url}/health", timeout=5).status_code == 503)

    async def refused(stream: Stream) -> None:
        await stream.send(header_map(), _body(json.dumps(_chat("anyone?")).encode()))
        status, _, headers = _error(await stream.read())
        assert status == 503 and headers["retry-after"]
        await stream.ends()

    _run(setup, refused)
    assert _health(setup, "readiness") == NOT_SERVING
    assert _health(setup, "liveness") == SERVING


@pytest.mark.parametrize(
    "fields",
    [
        {"epp_port": 0},
        {"epp_port": 70000},
        {"epp_port": 8000, "port": 8000},
        {"epp_port": 9002, "epp_tls_cert": "c.pem"},
        {"epp_tls_cert": "c.pem", "epp_tls_key": "k.pem"},
        {"epp_port": 9002, "epp_tls_cert": "c.pem", "epp_tls_key": "k.pem", "epp_plaintext": True},
        {"epp_port": 9002, "epp_fallbacks": -1},
        {"epp_port": 9002, "epp_fallbacks": 9},
    ],
)
def test_the_epp_settings_are_checked(fields: dict[str, Any]) -> None:
    from kvroute.router.config import ConfigError, RouterSettings

    with pytest.raises(ConfigError):
        RouterSettings(**fields)


# --- pieces, without a server -------------------------------------------------------------


def test_endpoints_subset_hints_and_the_mutation() -> None:
    from kvroute.router.config import ReplicaConfig
    from kvroute.router.epp.messages import destination_mutation, replica_endpoint, subset_hint
    from kvroute.router.fleet.replicas import Replica
    from kvroute.router.serving.auth import ReplicaAuth

    def endpoint(url: str) -> str:
        return replica_endpoint(Replica(ReplicaConfig(url=url)))

    assert endpoint("http://10.0.0.7:8000") == "10.0.0.7:8000"
    assert endpoint("http://10.0.0.7") == "10.0.0.7:80"
    assert endpoint("http://[fd00::7]:8000/") == "[fd00::7]:8000"

    assert subset_hint(header_map(subset=None)) is None
    assert subset_hint(header_map(subset=["10.0.0.7:8000", " [FD00::7]:8000"])) == {
        "10.0.0.7:8000",
        "[fd00::7]:8000",
    }
    lenient = header_map()
    hint = lenient.metadata_context.filter_metadata["envoy.lb.subset_hint"]
    hint.fields[
        "x-gateway-destination-endpoint-subset"
    ].string_value = "10.0.0.7:8000,10.0.0.8:8000"
    assert subset_hint(lenient) == {"10.0.0.7:8000", "10.0.0.8:8000"}

    rank = Replica(ReplicaConfig(url="http://10.0.0.7:8000", name="big#dp1", dp_rank=1))
    keys = ReplicaAuth.of(["sk-router"], "sk-replica")
    mutation = destination_mutation(rank, "10.0.0.7:8000", keys, 42)
    set_headers = {h.header.key: h.header.raw_value for h in mutation.set_headers}
    assert set_headers == {
        "x-gateway-destination-endpoint": b"10.0.0.7:8000",
        "x-data-parallel-rank": b"1",
        "content-length": b"42",
        "authorization": b"Bearer sk-replica",
    }
    assert list(mutation.remove_headers) == []
    # A client's own x-gateway-destination-endpoint is replaced, never kept beside the pick.
    overwrite = core.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
    assert {h.append_action for h in mutation.set_headers} == {overwrite}
    plain = destination_mutation(rank, "10.0.0.7:8000", ReplicaAuth.of([], None))
    assert [h.header.key for h in plain.set_headers] == [
        "x-gateway-destination-endpoint",
        "x-data-parallel-rank",
    ]
    assert list(plain.remove_headers) == []
