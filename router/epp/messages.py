"""The Endpoint Picker Protocol's names and the ext_proc messages the picker builds: the destination
(header mutation and ``envoy.lb`` metadata), the subset hint, immediate responses with OpenAI's
error JSON, body chunks under Envoy's limit. Pure functions of protobuf messages.
"""

from __future__ import annotations

import json
from urllib.parse import urlsplit

from envoy.config.core.v3 import base_pb2 as core
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from kvroute.router.errors import RouterError, error_body
from kvroute.router.fleet.replicas import Replica
from kvroute.router.serving.auth import ReplicaAuth
from kvroute.router.serving.openapi import PROXIED
from kvroute.router.serving.proxy import DP_RANK_HEADER

__all__ = [
    "DESTINATION_HEADER",
    "DESTINATION_NAMESPACE",
    "PATH_HEADERS",
    "SERVED_KEY",
    "SUBSET_KEY",
    "SUBSET_NAMESPACE",
    "body_chunks",
    "destination_metadata",
    "destination_mutation",
    "destination_value",
    "endpoint_kind",
    "header_map",
    "immediate_response",
    "kind_from_body",
    "replica_endpoint",
    "request_path",
    "served_endpoint",
    "subset_hint",
]

# The Endpoint Picker Protocol's names (gateway-api-inference-extension, proposal 004).
DESTINATION_HEADER = "x-gateway-destination-endpoint"
DESTINATION_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
# v1.0: in the response phase, the endpoint that served the request (the primary, or a
# fallback the gateway retried on), under ``envoy.lb`` in the request's metadata context.
SERVED_KEY = "x-gateway-destination-endpoint-served"

# Where the request's path may be, in the reference picker's order (llm-d/llm-d-router
# pkg/epp/framework/common/request/headers.go, GetRequestPath): the pseudo-header (Envoy and
# agentgateway send it), then headers a rewriting route or a client may set. NGINX Gateway
# Fabric's shim sends neither: no pseudo-headers, and its njs module calls the shim at the
# shim's own URL, so the client's path is not sent at all (the body's shape tells).
PATH_HEADERS = (":path", "x-original-path", "x-forwarded-path")

# Envoy's limit on one streamed body chunk is 64 KiB; the reference picker keeps under it.
_CHUNK = 62_000


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


def endpoint_kind(method: str, path: str) -> str:
    """How the HTTP endpoints would read this request (kvroute.router.serving.openapi's table);
    paths with parameters (a stored response's) and any other path go by load."""
    ops = PROXIED.get(path.split("?", 1)[0])
    op = ops.get(method.lower()) if ops else None
    return op.kind if op is not None else "other"


def request_path(headers: dict[str, str]) -> str | None:
    """The request's path from the first of ``PATH_HEADERS`` present (None: no header says;
    the body's shape then tells the endpoint, ``kind_from_body``)."""
    for name in PATH_HEADERS:
        value = headers.get(name, "").strip()
        if value:
            return value
    return None


def kind_from_body(raw: bytes) -> str:
    """The endpoint a JSON body is for, from its shape, when no header names the path:
    ``messages`` is a chat completion, ``prompt`` a completion, ``input`` a Responses API
    request (the reference picker reads the same fields). Anything else, or a body that is
    not a JSON object, goes by load ("other"): the replica answers it as it would."""
    try:
        body = json.loads(raw)
    except ValueError:
        return "other"
    if not isinstance(body, dict):
        return "other"
    if isinstance(body.get("messages"), list):
        return "chat"
    if "prompt" in body:
        return "completion"
    if "input" in body:
        return "responses"
    return "other"


def header_map(message: pb.HttpHeaders) -> dict[str, str]:
    """Header names (lowercase) to values, from ``raw_value`` (bytes) when set, else
    ``value`` (a string). Envoy sends ``raw_value``; NGINX Gateway Fabric's shim sends every
    header in ``value`` (names lowercased); agentgateway sends headers in ``raw_value`` and
    its pseudo-headers (``:path`` included) in ``value``. Names are folded to lowercase
    anyway, for a gateway that does not."""
    out: dict[str, str] = {}
    for h in message.headers.headers:
        out[h.key.lower()] = h.raw_value.decode("latin-1") if h.raw_value else h.value
    return out


def subset_hint(request: pb.ProcessingRequest) -> set[str] | None:
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


def served_endpoint(request: pb.ProcessingRequest) -> str | None:
    """The endpoint the gateway says served the request (``envoy.lb`` →
    ``x-gateway-destination-endpoint-served``, protocol v1.0), normalized; None when absent."""
    metadata = request.metadata_context.filter_metadata
    if DESTINATION_NAMESPACE not in metadata:
        return None
    fields = metadata[DESTINATION_NAMESPACE].fields
    if SERVED_KEY not in fields or not fields[SERVED_KEY].string_value.strip():
        return None
    return _normalize(fields[SERVED_KEY].string_value)


def destination_value(endpoints: list[str]) -> str:
    """The destination header's (and metadata's) value: the primary, then the fallbacks the
    gateway may retry on in order (protocol v0.4), comma-separated."""
    return ",".join(endpoints)


def _header_option(key: str, value: str) -> core.HeaderValueOption:
    return core.HeaderValueOption(
        header=core.HeaderValue(key=key, raw_value=value.encode("latin-1")),
        append_action=core.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
    )


def destination_metadata(endpoint: str) -> struct_pb2.Struct:
    metadata = struct_pb2.Struct()
    metadata.fields[DESTINATION_NAMESPACE].struct_value.fields[
        DESTINATION_HEADER
    ].string_value = endpoint
    return metadata


def immediate_response(error: RouterError, request_id: str | None) -> pb.ProcessingResponse:
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


def body_chunks(raw: bytes, end_of_stream: bool) -> list[pb.ProcessingResponse]:
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
    replica: Replica,
    endpoint: str,
    auth: ReplicaAuth,
    content_length: int | None = None,
    prefill: tuple[str, str | None] | None = None,
) -> pb.HeaderMutation:
    """The pick as a header mutation, plus what kvroute's proxy would have changed in the
    forwarded request: a data-parallel rank's pin (``X-data-parallel-rank``), and the
    replicas' ``Authorization`` (router/serving/auth.py: the router's key is never forwarded; the
    replica key, when set, replaces it). ``prefill``: (the P/D prefill header's name, the
    prefill endpoint, or None to remove a client's header of that name: router/epp/disagg.py)."""
    headers = [_header_option(DESTINATION_HEADER, endpoint)]
    remove: list[str] = []
    if prefill is not None:
        name, value = prefill
        if value is None:
            remove.append(name)
        else:
            headers.append(_header_option(name, value))
    if replica.config.dp_rank is not None:
        headers.append(_header_option(DP_RANK_HEADER.decode(), str(replica.config.dp_rank)))
    if content_length is not None:
        headers.append(_header_option("content-length", str(content_length)))
    if auth.header is not None:
        headers.append(_header_option("authorization", auth.header.decode("latin-1")))
    elif auth.drop_client:
        remove.append("authorization")
    return pb.HeaderMutation(set_headers=headers, remove_headers=remove)
