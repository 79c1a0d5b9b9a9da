"""The two-leg driver of prefill/decode disaggregation, on vLLM's own protocol.

The decider (router/routing/disagg.py) says whether a request splits. A split runs:

1. The prefill leg, on the first prefill replica of its ranking: the client's JSON with
   one output token in every spelling the endpoint has (``max_tokens``, and
   ``max_completion_tokens`` when the client used it; ``max_output_tokens`` and
   ``store: false`` on /v1/responses), ``stream: false`` (only a non-streamed answer
   carries ``kv_transfer_params``), ``stream_options`` and ``min_tokens`` removed, and
   ``kv_transfer_params: {"do_remote_decode": true, "do_remote_prefill": false}``.
2. The decode leg: the client's own body plus the prefill answer's ``kv_transfer_params``,
   passed through whole (its keys change between vLLM versions), with ``remote_host``
   replaced by the prefill replica's URL host when it is ``localhost`` or a wildcard
   (vLLM's default side-channel host names the prefill's own machine, which the decode
   replica may not share; a loopback address someone set on purpose is kept: on one host it
   is right) and ``prompt_token_ids`` added when absent (the prefill answer's ids, else the
   router's), so both legs compute over the same tokens. It is streamed as the client
   asked, through the endpoint's own relay, which records usage and the Responses id.

Both legs carry the client's request id. The answer names both replicas:
``x-kvroute-replica`` (decode) and ``x-kvroute-prefill-replica``.

A plan ``on_prefill`` (the decider's ``whole_on_prefill``) is one ordinary leg: the
client's own bytes to that prefill replica, which vLLM serves as an aggregated request (no
``kv_transfer_params``), named by ``x-kvroute-replica``; the decode ranking follows it, so
a refusal, a 5xx the forwarder retries, a dead engine, or a failure before the answer's
first bytes (nothing relayed yet) moves the request to the decode replica the decider would
have used (``on_prefill_fallbacks``). A streamed answer is offered the prefill replica
only if it can be resumed (router/serving/resume.py): one that dies after its first bytes
is finished on the decode ranking from the ids it streamed (``resumed_streams``; one that
cannot be finished is ``resume_failures``, an error event to the client). While it runs,
the router's backlog counts it decoding there (``PrefillBacklog.serving``): the decider
prices the stall each later prefill there gives it.

Failures never reach the client while a healthy replica can serve: a prefill leg that fails
before the client saw anything (refused, 5xx, a broken or unreadable answer) moves to the next
prefill replica, ``prefill_attempts`` in all, then the request is served decode-only (vLLM
computes the whole prompt on the decode replica); a prefill answer without transfer
parameters is counted and the decode replica recomputes; a decode leg that answers 5xx
after a split (it could not pull) is counted as a transfer failure and the request is sent
again decode-only, before any byte reached the client. A prefill 4xx is the request's own
fault: it goes decode-only at once, whose answer (the same 4xx) is the client's.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import MutableMapping
from functools import partial
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import msgspec

from kvroute.router.errors import RouterError
from kvroute.router.fleet.replicas import Replica, ReplicaRegistry
from kvroute.router.routing.accuracy import cached_tokens_from_body
from kvroute.router.routing.disagg import PdPlan, pools
from kvroute.router.serving.proxy import (
    DisconnectWatch,
    Receive,
    Scope,
    Send,
    Upstream,
    upstream_headers,
)
from kvroute.router.serving.resume import StreamResume, resume_blocker
from kvroute.router.serving.upstream import UpstreamError
from kvroute.router.tokens.requests import ParsedRequest

if TYPE_CHECKING:  # the endpoints call this module
    from kvroute.router.serving.endpoints import ProxyEndpoint

__all__ = [
    "PREFILL_HEADER",
    "SPLIT_KINDS",
    "decode_body",
    "has_prefill_pool",
    "may_serve_whole",
    "prefill_body",
    "serve_disaggregated",
]

log = logging.getLogger(__name__)

PREFILL_HEADER = b"x-kvroute-prefill-replica"
# The endpoints vLLM's P/D serves in two legs; other kinds stay on the decode pool, whole.
SPLIT_KINDS = frozenset({"completion", "chat", "responses"})
# Side-channel hosts that name "this machine" rather than a routable address.
_UNROUTABLE_HOSTS = frozenset({"localhost", "0.0.0.0", "::", "", "*"})
_encode = msgspec.json.encode
_decode = msgspec.json.decode


def has_prefill_pool(registry: ReplicaRegistry) -> bool:
    """Whether the fleet has prefill replicas (then every routed request goes through here,
    so that whole requests stay off the prefill pool while it is healthy)."""
    return any(r.role == "prefill" for r in registry)


def prefill_body(body: dict[str, Any], kind: str) -> dict[str, Any]:
    """The prefill leg's body (module docstring, 1)."""
    out = dict(body)
    if kind == "responses":
        out["max_output_tokens"] = 1
        out["store"] = False  # nobody will ask the prefill replica for this response
    else:
        out["max_tokens"] = 1
        if "max_completion_tokens" in out:
            out["max_completion_tokens"] = 1
        # vLLM answers the prompt's ids with it, so the decode leg gets the prefill's own.
        out["return_token_ids"] = True
    out["stream"] = False
    out.pop("stream_options", None)
    out.pop("min_tokens", None)
    out["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False}
    return out


def _answer_ids(answer: dict[str, Any]) -> list[int] | None:
    """The prompt ids a prefill answer reports (``return_token_ids``): top level for chat,
    per choice for completions."""
    ids = answer.get("prompt_token_ids")
    if ids is None:
        choices = answer.get("choices")
        if isinstance(choices, list) and choices and isinstance(choices[0], dict):
            ids = choices[0].get("prompt_token_ids")
    if isinstance(ids, list) and ids and all(isinstance(t, int) for t in ids):
        return ids
    return None


def decode_body(
    body: dict[str, Any],
    params: dict[str, Any],
    prefill: Replica,
    token_ids: list[int] | None,
) -> tuple[dict[str, Any], bool]:
    """The decode leg's body (module docstring, 2), and whether ``remote_host`` was
    replaced."""
    params = dict(params)
    host = params.get("remote_host")
    replaced = False
    if isinstance(host, str) and host.strip("[]").lower() in _UNROUTABLE_HOSTS:
        routable = urlsplit(prefill.url).hostname
        if routable:
            params["remote_host"] = routable
            replaced = True
    if token_ids and "prompt_token_ids" not in params:
        params["prompt_token_ids"] = list(token_ids)
    out = dict(body)
    out["kv_transfer_params"] = params
    return out, replaced


class _NameBoth:
    """Adds ``x-kvroute-prefill-replica`` to the response's headers on their way out."""

    __slots__ = ("prefill", "send", "status")

    def __init__(self, send: Send, prefill: str) -> None:
        self.send = send
        self.prefill = prefill.encode("latin-1", errors="replace")
        self.status: int | None = None

    async def __call__(self, message: MutableMapping[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            message = dict(message)
            message["headers"] = [*message.get("headers", []), (PREFILL_HEADER, self.prefill)]
        await self.send(message)


async def serve_disaggregated(
    endpoint: ProxyEndpoint,
    scope: Scope,
    receive: Receive,
    send: Send,
    raw: bytes,
    request_id: str,
    parsed: ParsedRequest,
    session: str | None,
    target: str,
) -> None:
    """Serve one routed request of a fleet with prefill replicas: decode-only on the decode
    pool, or split (module docstring)."""
    service = endpoint.service
    disagg = service.disagg
    decision = await service.decide(parsed, session)  # over the decode pool
    if endpoint.kind not in SPLIT_KINDS:
        plan = PdPlan(decision, False, "single_replica_request")  # not a P/D endpoint: uncounted
    else:
        limit = service.settings.max_pending_per_replica
        prefill_pool = [
            r for r in pools(service.candidates(parsed.model))[1] if not limit or r.pending < limit
        ]
        plan = await disagg.decide(
            decision,
            parsed,
            prefill_pool,
            lambda pool: service.router.decide(parsed, pool, session),
            on_prefill=may_serve_whole(endpoint.kind, parsed, decision),
        )
    if plan.on_prefill:
        await _on_prefill(endpoint, scope, receive, send, raw, request_id, parsed, plan, target)
        return
    if not plan.split:
        await endpoint._forward(
            scope, receive, send, raw, request_id, decision.ranked, parsed.stream, decision
        )
        return
    await _split(endpoint, scope, receive, send, raw, request_id, parsed, plan, target)


async def _split(
    endpoint: ProxyEndpoint,
    scope: Scope,
    receive: Receive,
    send: Send,
    raw: bytes,
    request_id: str,
    parsed: ParsedRequest,
    plan: PdPlan,
    target: str,
) -> None:
    service = endpoint.service
    counters = service.disagg.counters
    forwarder = service.forwarder
    assert forwarder is not None, "the app's lifespan has not started"
    decision = plan.decode
    headers = upstream_headers(scope, request_id)
    commit = partial(service.router.commit, decision)
    upstream: Upstream | None = None
    named: Replica | None = None  # the prefill replica whose KV the decode leg pulls
    # Until the decode leg is sent, the decode replica's pending does not count it: a
    # prompt the decider puts there meanwhile would delay its first token (disagg.py).
    backlog, leg = service.router.backlog, (decision.ranked[0].name, id(decision))
    async with DisconnectWatch(receive) as watch:
        backlog.expect(*leg, plan.split_s or 0.0)
        try:
            prefill, answer = await _prefill_leg(endpoint, plan, parsed, target, headers)
        finally:
            backlog.arrived(*leg)
        params = None if answer is None else answer.get("kv_transfer_params")
        if prefill is None:
            counters.prefill_fallbacks += 1
        elif not isinstance(params, dict):
            counters.missing_transfer_params += 1
            log.warning(
                "request %s: prefill replica %s answered without kv_transfer_params; the "
                "decode replica recomputes the prompt",
                request_id,
                prefill.name,
            )
        elif answer is not None:
            ids = _answer_ids(answer) or _router_ids(decision)
            body, replaced = decode_body(parsed.body, params, prefill, ids)
            counters.loopback_hosts_replaced += replaced
            counters.decode_legs += 1
            # Set before it is sent: its commit then adds no prefill work to the decode
            # replica's backlog (the pull runs beside the engine), and its first byte is no
            # sample of the replica's rates.
            decision.remote_prefill = True
            upstream = await forwarder.open(decision.ranked, target, _encode(body), headers, commit)
            if upstream.status >= 500:
                decision.remote_prefill = False  # decode-only now: the whole prompt's work
                counters.transfer_failures += 1
                log.warning(
                    "request %s: decode replica %s answered %d after a split (the pull "
                    "failed?); sending it again decode-only",
                    request_id,
                    upstream.replica.name,
                    upstream.status,
                )
                forwarder.close(upstream, complete=False)
                upstream = None
            else:
                named = prefill
                _record_prefill_accuracy(service, plan, prefill, answer)
        if upstream is None:
            # Decode-only: the original bytes, ranked and committed as an aggregated request.
            upstream = await forwarder.open(decision.ranked, target, raw, headers, commit)
    if watch.disconnected:
        if upstream is not None:
            forwarder.close(upstream, complete=False)
        service.metrics.request(endpoint.label, "cancelled")
        return
    assert upstream is not None
    relay: Send = send if named is None else _NameBoth(send, named.name)
    await endpoint._forward(
        scope,
        receive,
        relay,
        raw,
        request_id,
        decision.ranked,
        parsed.stream,
        None,
        opened=upstream,
    )


async def _on_prefill(
    endpoint: ProxyEndpoint,
    scope: Scope,
    receive: Receive,
    send: Send,
    raw: bytes,
    request_id: str,
    parsed: ParsedRequest,
    plan: PdPlan,
    target: str,
) -> None:
    """The whole request on ``plan.prefill[0]`` (module docstring), the decode ranking
    behind it. Each attempt is committed with its own ranking's decision: the prefill
    replica's is no home (the conversation's home stays in the decode pool, where its next
    turn is ranked), a decode replica's is an ordinary request's. Nothing is relayed before
    the prefill replica's first bytes: one that fails before them (killed while it queued
    or computed the prompt) is given up and the request goes to the decode ranking, as a
    split's failed prefill leg does."""
    service = endpoint.service
    router = service.router
    forwarder = service.forwarder
    assert forwarder is not None, "the app's lifespan has not started"
    counters = service.disagg.counters
    on_prefill, decode = plan.prefill_decision, plan.decode
    assert on_prefill is not None and plan.prefill
    replica = plan.prefill[0]
    ranked = [replica, *[r for r in decode.ranked if r is not replica]]

    def commit(attempt: Replica) -> None:
        if attempt is replica:
            router.commit(on_prefill, attempt, home=False)
        else:
            router.commit(decode, attempt)

    headers = upstream_headers(scope, request_id)
    key = id(on_prefill)
    resume = None
    if parsed.stream:  # resumable, or the decider would not have chosen it
        resume = StreamResume(
            endpoint.kind,
            parsed.body,
            _router_ids(decode),
            forwarder=forwarder,
            registry=service.registry,
            ranked=decode.ranked,
            target=target,
            headers=headers,
            commit=partial(router.commit, decode),
        )
        raw = resume.upstream_body()
    upstream: Upstream | None = None
    try:
        async with DisconnectWatch(receive) as watch:
            upstream = await forwarder.open(ranked, target, raw, headers, commit)
            if upstream.replica is replica:
                router.backlog.serving(replica.name, key)
                try:
                    await upstream.response.wait_body()
                except UpstreamError as exc:
                    service.registry.record_failure(replica, f"proxy: {exc!r}")
                    router.backlog.drop(replica.name, key)
                    router.backlog.ended(replica.name, key)
                    forwarder.close(upstream, complete=False)
                    upstream = None
                    log.warning(
                        "request %s: %s failed before answering (%s); sending it to the "
                        "decode pool",
                        request_id,
                        replica.name,
                        exc,
                    )
                    upstream = await forwarder.open(
                        decode.ranked, target, raw, headers, partial(router.commit, decode)
                    )
        if watch.disconnected:
            if upstream is not None:
                forwarder.close(upstream, complete=False)
            service.metrics.request(endpoint.label, "cancelled")
            return
        assert upstream is not None
        served_by = upstream.replica
        if served_by is not replica:
            counters.on_prefill_fallbacks += 1
        await endpoint._forward(
            scope,
            receive,
            send,
            raw,
            request_id,
            ranked,
            parsed.stream,
            on_prefill if served_by is replica else decode,
            opened=upstream,
            resume=resume,
        )
        if resume is not None:
            counters.resumed_streams += resume.resumed > 0
            counters.resume_failures += resume.gave_up is not None
    finally:
        router.backlog.ended(replica.name, key)


def may_serve_whole(kind: str, parsed: ParsedRequest, decision: Any) -> bool:
    """Whether the decider may serve the request whole on a prefill replica: a streamed
    answer only if a failure there can be resumed elsewhere (a non-streamed one is retried
    whole: nothing reached the client before the replica's answer)."""
    if not parsed.stream:
        return True
    tokens = decision.tokens
    return resume_blocker(kind, parsed.body, bool(getattr(tokens, "mm", None))) is None


async def _prefill_leg(
    endpoint: ProxyEndpoint,
    plan: PdPlan,
    parsed: ParsedRequest,
    target: str,
    headers: list[tuple[bytes, bytes]],
) -> tuple[Replica | None, dict[str, Any] | None]:
    """The prefill leg on each prefill replica in turn: (the replica that answered 200, its
    JSON answer), or (None, None) when none did (then the request goes decode-only)."""
    service = endpoint.service
    counters = service.disagg.counters
    assert service.forwarder is not None, "the app's lifespan has not started"
    body = _encode(prefill_body(parsed.body, endpoint.kind))
    attempts = service.settings.disagg.prefill_attempts
    commit = None
    if plan.prefill_decision is not None:
        commit = partial(service.router.commit, plan.prefill_decision, home=False)
    for replica in plan.prefill[:attempts]:
        counters.prefill_legs += 1
        try:
            async with asyncio.timeout(service.settings.disagg.prefill_timeout_s):
                status, data = await _send_prefill(service, replica, target, body, headers, commit)
            # Answered: its prefill ended (the P/D decider's backlog of that replica).
            service.router.backlog.done(replica.name, id(plan.prefill_decision))
        except TimeoutError:
            service.router.backlog.drop(replica.name, id(plan.prefill_decision))
            service.registry.record_failure(replica, "proxy: the prefill leg timed out")
            counters.prefill_failures += 1
            log.warning("prefill leg on %s timed out; trying the next", replica.name)
            continue
        if status is None or data is None:
            counters.prefill_failures += 1
            continue
        if status != 200:
            counters.prefill_failures += 1
            if 400 <= status < 500:
                return None, None  # the request's own fault: decode-only says it to the client
            continue
        try:
            answer = _decode(data)
        except msgspec.DecodeError:
            counters.prefill_failures += 1
            continue
        if isinstance(answer, dict):
            return replica, answer
        counters.prefill_failures += 1
    return None, None


async def _send_prefill(
    service: Any,
    replica: Replica,
    target: str,
    body: bytes,
    headers: list[tuple[bytes, bytes]],
    commit: Any,
) -> tuple[int | None, bytes | None]:
    """One prefill attempt: (status, whole body), or (None, None) when it failed on the way
    (refused, reset, broken mid-answer)."""
    forwarder = service.forwarder
    try:
        upstream = await forwarder.open([replica], target, body, headers, commit)
    except RouterError as exc:
        log.info("prefill leg on %s failed: %s", replica.name, exc.message)
        return None, None
    complete = False
    try:
        data = await upstream.response.read()
        complete = True
    except UpstreamError as exc:
        service.registry.record_failure(replica, f"proxy: {exc!r}")
        return None, None
    finally:
        forwarder.close(upstream, complete=complete)
    return upstream.status, data


def _router_ids(decision: Any) -> list[int] | None:
    """The router's own ids of the prompt, unless multimodal (vLLM's ids then carry
    placeholders the router does not reproduce)."""
    tokens = decision.tokens
    if tokens is None or getattr(tokens, "mm", None):
        return None
    return list(tokens)


def _record_prefill_accuracy(
    service: Any, plan: PdPlan, prefill: Replica, answer: dict[str, Any]
) -> None:
    """A split's cached tokens are the prefill replica's (vLLM's decode replica reports the
    prefill's as its own): compared with what the router predicted for the prefill
    replica, like with like."""
    decision = plan.prefill_decision
    view = None if decision is None else decision.view(prefill.name)
    if view is None or decision is None:
        return
    delivered = cached_tokens_from_body(_encode(answer))
    predicted = view.predicted_cached_tokens
    decision.delivered_by, decision.delivered_cached_tokens = prefill.name, delivered
    service.accuracy.record(prefill.name, decision.prompt_tokens, predicted, delivered)
    service.metrics.cached_tokens(prefill.name, decision.prompt_tokens, predicted, delivered)
