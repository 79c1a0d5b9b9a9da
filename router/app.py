"""``create_app(settings)``: the router as a FastAPI app, usable in-process or under uvicorn.

The proxied endpoints are raw ASGI routes (kvroute.router.serving.endpoints); the rest are ordinary
FastAPI handlers. Every path the router does not serve itself, with any method, is passed through to
a replica (a catch-all route, last), so kvroute is a drop-in gateway for a vLLM fleet: an unknown
path gets the replica's own answer (and ``x-kvroute-replica``). The router's own errors are in
OpenAI's schema. With API keys set, every path but monitoring and the dashboard's page needs one
(kvroute.router.serving.auth).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvroute.router.config import RouterSettings
from kvroute.router.errors import RouterError, error_body, error_response
from kvroute.router.ops.dashboard import add_dashboard
from kvroute.router.ops.dashboard_data import DashboardData
from kvroute.router.ops.readiness import Readiness
from kvroute.router.peers.load import (
    KV_FREES_SENT,
    MAX_WAIT_S,
    STREAM_MEDIA_TYPE,
    load_body,
    load_lines,
    load_version,
)
from kvroute.router.peers.snapshot import MEDIA_TYPE, encode_stream
from kvroute.router.routing.disagg import pools
from kvroute.router.service import RouterService
from kvroute.router.serving.auth import ApiKeyMiddleware
from kvroute.router.serving.disagg import has_prefill_pool, may_serve_whole
from kvroute.router.serving.endpoints import ProxyEndpoint, debug_kind
from kvroute.router.serving.hot_paths import HotPaths
from kvroute.router.serving.openapi import PROXIED, add_proxied_paths
from kvroute.router.serving.proxy import read_body
from kvroute.router.serving.response_ids import ResponseHomes
from kvroute.router.tokens.requests import decode_json, parse_body
from kvroute.router.tokens.tokenization import TokenizerBase

__all__ = ["create_app"]


def create_app(settings: RouterSettings, *, tokenizer: TokenizerBase | None = None) -> FastAPI:
    """Build the router app. The indexer (index + event subscriber), health checks and the
    replicas-file watcher start with the app's lifespan and stop with it.
    ``tokenizer`` overrides the one ``settings`` describes (tests inject a shared instance)."""
    service = RouterService(settings, tokenizer=tokenizer)
    readiness = Readiness(service, settings.ready_grace_s)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        readiness.start()
        await service.start()
        epp = None
        try:
            if settings.epp_port is not None:
                # Imported only here: grpcio and xds-protos are needed only for the picker.
                from kvroute.router.epp.server import start_epp

                epp = await start_epp(
                    service, settings.host, settings.epp_port, lambda: readiness.check()[0]
                )
            yield
        finally:
            if epp is not None:
                await epp.stop()
            await service.stop()

    app = FastAPI(title="kvroute router", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.service = service
    app.state.readiness = readiness
    # Which replica stores each Responses object (kvroute.router.serving.response_ids), for every
    # endpoint.
    homes = app.state.response_homes = ResponseHomes()
    hot: dict[tuple[str, str], ProxyEndpoint] = {}
    for path, operations in PROXIED.items():
        (kind,) = {op.kind for op in operations.values()}
        endpoint = ProxyEndpoint(service, kind, path, homes)
        app.router.routes.append(Route(path, endpoint, methods=[m.upper() for m in operations]))
        if "{" not in path:
            hot.update({(path, method.upper()): endpoint for method in operations})
    generated = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = add_proxied_paths(generated())
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    guard = None
    if settings.api_keys or settings.peer_key:
        guard = partial(
            ApiKeyMiddleware,
            keys=settings.api_keys,
            protect_metrics=settings.api_key_protects_metrics,
            peer_key=settings.peer_key,
        )
        app.add_middleware(guard.func, **guard.keywords)
    build_stack = app.build_middleware_stack  # the proxied paths skip it (serving/hot_paths.py)
    app.build_middleware_stack = lambda: HotPaths(build_stack(), hot, guard)  # type: ignore[method-assign]

    @app.exception_handler(RouterError)
    async def _router_error(request: Request, exc: RouterError) -> Response:
        return exc.response(request.headers.get("x-request-id"))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        return error_response(exc.status_code, str(exc.detail), headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
        return error_response(400, str(exc.errors()))

    @app.get("/health")
    async def health() -> Response:
        healthy = len(service.registry.healthy())
        body = {
            "status": "ok" if healthy else "unavailable",
            "healthy_replicas": healthy,
            "replicas": len(service.registry),
        }
        if healthy:
            return JSONResponse(body)
        return JSONResponse(
            body, status_code=503, headers={"retry-after": str(settings.retry_after_s)}
        )

    @app.get(
        "/ready",
        responses={503: {"description": "not ready: no healthy replica, or feeds not live"}},
    )
    async def ready() -> Response:
        """Readiness (router/ops/readiness.py): a healthy replica, and every healthy replica's
        event feed live or the grace since start over. 503 lists the feeds not live."""
        ok, body = readiness.check()
        if ok:
            return JSONResponse(body)
        body = {**error_body(503, f"not ready: {body['reason']}"), **body}
        return JSONResponse(
            body, status_code=503, headers={"retry-after": str(settings.retry_after_s)}
        )

    @app.get("/v1/models")
    async def models() -> Response:
        cards = service.registry.known_models(service.healthy_or_503())
        return JSONResponse({"object": "list", "data": list(cards.values())})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(
            service.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8"
        )

    @app.get("/index/stats")
    async def index_stats() -> Response:
        return JSONResponse(service.stats())

    @app.get("/index/snapshot")
    async def index_snapshot() -> Response:
        """The index of every live replica, for a peer router's warm start
        (router/peers/snapshot.py); 503 while this router is itself catching up."""
        refusal = service.snapshot_refusal()
        if refusal is not None:
            raise RouterError(
                503,
                f"index snapshot not available: {refusal}",
                headers={"retry-after": str(settings.retry_after_s)},
            )
        body = encode_stream(
            [r.name for r in service.registry],
            service.subscriber.export_replica,
            settings.peer_snapshot_max_mib * 2**20,
        )
        return StreamingResponse(body, media_type=MEDIA_TYPE)

    @app.get("/peer/load")
    async def peer_load(
        wait_s: float = 0.0,
        seen: str | None = None,
        samples_from: int | None = None,
        # Not in the OpenAPI document: a stream never ends, and a generic client (or a
        # fuzzer) reading the answer to its end would wait forever.
        stream: bool = Query(False, include_in_schema=False),
    ) -> Response:
        """What this router is proxying to each replica now, for its peers' queue view
        (router/peers/load.py). With ``seen`` (the version of the asker's last answer) and
        ``wait_s``, held until the counts differ from that version or ``wait_s`` passed.
        With ``samples_from``, the queue samples this router took since then. With
        ``stream``, one answer per line, each time they change (``wait_s``: heartbeat)."""
        registry = service.registry
        learned = service.router.queue_delay

        def version() -> str:
            return load_version(registry, 0 if learned is None else learned.next_sample)

        def answer(since: int | None) -> dict[str, Any]:
            service.router.sample_stored_blocks()
            return load_body(
                service.peer_load.router_id,
                registry,
                service.router.unstored.snapshot(r.name for r in registry),
                next_sample=0 if learned is None else learned.next_sample,
                samples=None if learned is None or since is None else learned.entries_since(since),
                kv_held=None
                if service.router.kv_room is None
                else {r.name: service.router.kv_room.held_blocks(r.name) for r in registry},
                kv_frees=None
                if service.router.kv_room is None
                else {
                    r.name: service.router.kv_room.frees(r.name, KV_FREES_SENT) for r in registry
                },
            )

        if stream:
            heartbeat_s = min(wait_s, MAX_WAIT_S) if wait_s > 0 else MAX_WAIT_S  # (NaN: MAX)
            return StreamingResponse(
                load_lines(answer, version, registry.load_signal, heartbeat_s, samples_from),
                media_type=STREAM_MEDIA_TYPE,
            )
        if seen is not None and wait_s > 0:
            deadline = time.monotonic() + min(wait_s, MAX_WAIT_S)
            while version() == seen:
                left = deadline - time.monotonic()
                if not left > 0:  # (a NaN wait_s too)
                    break
                await registry.load_signal.wait(left)
        return JSONResponse(answer(samples_from))

    @app.post("/debug/route")
    async def debug_route(request: Request) -> Response:
        """What the router would do with this completion or chat body, without sending it."""
        raw = await read_body(
            request.scope, request.receive, settings.max_body_bytes, settings.body_timeout_s
        )
        body = decode_json(raw, service.limits)
        kind = request.query_params.get("kind") or debug_kind(body)
        if kind not in ("chat", "completion"):
            raise RouterError(400, "kind must be 'chat' or 'completion'", param="kind")
        parsed = parse_body(raw, kind, service.limits)  # type: ignore[arg-type]
        candidates = service.candidates(parsed.model)
        session = request.headers.get(settings.session_header)
        if not has_prefill_pool(service.registry):
            decision = await service.router.decide(parsed, candidates, session)
            return JSONResponse({"kind": kind, **decision.to_dict()})
        # P/D: the decode choice (the ranking below), then the prefill leg's, and why.
        decode_pool, prefill_pool = pools(candidates)
        decision = await service.router.decide(parsed, decode_pool, session)
        plan = await service.disagg.decide(
            decision,
            parsed,
            prefill_pool,
            lambda pool: service.router.decide(parsed, pool, session),
            record=False,
            on_prefill=may_serve_whole(kind, parsed, decision),
        )
        out: dict[str, Any] = {"kind": kind, **decision.to_dict()}
        out["disaggregation"] = plan.to_dict()
        return JSONResponse(out)

    @app.get("/debug/tokenizer_check")
    async def tokenizer_check() -> Response:
        """Self-check: the router's token ids vs each healthy replica's /tokenize."""
        results = await service.check_tokenizer()
        ok = bool(results) and all(r["ok"] for r in results)
        return JSONResponse({"ok": ok, "results": results})

    @app.post("/debug/tokenizer_check")
    async def tokenizer_check_body(request: Request) -> Response:
        """Self-check on the caller's own completion or chat body (model, prompt/messages)."""
        raw = await read_body(
            request.scope, request.receive, settings.max_body_bytes, settings.body_timeout_s
        )
        body = decode_json(raw, service.limits)
        sample = {k: v for k, v in body.items() if k != "model"}
        parse_body(json.dumps(body).encode(), debug_kind(body))  # 400 on a bad body
        results = await service.check_tokenizer([sample])
        ok = bool(results) and all(r["ok"] for r in results)
        return JSONResponse({"ok": ok, "results": results})

    add_dashboard(app, DashboardData(service).snapshot)  # GET /dashboard, /dashboard/data

    # Last: any other path, any method (a method a route above does not take included), is
    # the replicas' to answer. ``methods=None``: every method.
    catch_all = ProxyEndpoint(service, "other", "/", homes)
    app.router.routes.append(Route("/{path:path}", catch_all, methods=None))
    return app
