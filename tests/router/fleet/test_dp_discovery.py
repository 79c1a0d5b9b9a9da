"""``dp=auto``: the router follows what a server advertises on ``/kv_event_sources``.

A real HTTP server on 127.0.0.1 whose answer the test changes (a vLLM server restarted with
another ``--data-parallel-size``); the router's service is real, its feeds connect to
endpoints nobody publishes on (ZMQ connects lazily: nothing needs to listen).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvroute.router.config import RouterSettings
from kvroute.router.fleet.dp import DataParallelDiscovery, rank_targets
from kvroute.router.service import RouterService
from kvroute.router.specs import parse_replica_flag
from tests.router.servers import ServerThread


def source(port: int) -> dict[str, Any]:
    return {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{port}",
        "replay_endpoint": f"tcp://*:{port + 100}",
        "buffer_steps": 10000,
        "hwm": 100000,
        "max_queue_size": 100000,
        "topic": "",
    }


class Advertiser:
    """A server whose ``/kv_event_sources`` answer (or status) the test sets."""

    def __init__(self) -> None:
        self.sources: dict[str, Any] = {}
        self.status = 200
        self.asked = 0

        async def sources(request: Request) -> Response:
            self.asked += 1
            if self.status != 200:
                return Response(status_code=self.status)
            return JSONResponse(self.sources)

        self.server = ServerThread(Starlette(routes=[Route("/kv_event_sources", sources)]))


def test_discovery_hands_over_only_changed_target_lists() -> None:
    adv = Advertiser()
    with adv.server:
        server = parse_replica_flag(f"{adv.server.url},dp=auto,name=s")
        applied: list[list[str]] = []

        async def scenario() -> None:
            async with httpx.AsyncClient(trust_env=False) as client:
                discovery = DataParallelDiscovery(
                    client, lambda _, t: applied.append([x.key for x in t]), refresh_s=0.0
                )
                discovery.watch(server)
                adv.sources = {"0": source(7000), "1": source(7001)}
                await discovery.run_once()
                await discovery.run_once()  # the same answer: nothing to do
                adv.status = 500
                await discovery.run_once()  # no answer: the targets stay
                assert "500" in discovery.last_error["s"]
                adv.status = 200
                adv.sources = {"0": source(7000)}
                await discovery.run_once()
                target = discovery.targets("s")
                assert target is not None and target[0].events.endswith(":7000")
                discovery.forget("s")
                await discovery.run_once()

        asyncio.run(scenario())
        assert applied == [["s#dp0", "s#dp1"], ["s"]]
        assert adv.asked == 4


def test_service_replaces_targets_and_keeps_unchanged_ranks() -> None:
    settings = RouterSettings(replicas=[], policy="round_robin", tokenizer_check_on_start=False)
    service = RouterService(settings)
    try:
        server = parse_replica_flag("http://127.0.0.1:9,dp=auto,name=s")
        service.add_replica(server)
        assert service.registry.names() == ["s"]
        ranks = rank_targets(
            server,
            {0: ("tcp://127.0.0.1:7000", None, ""), 1: ("tcp://127.0.0.1:7001", None, "")},
        )
        service._apply_dp_targets(server, ranks)
        assert service.registry.names() == ["s#dp0", "s#dp1"]
        rank0 = service.registry.get("s#dp0")
        assert rank0 is not None and rank0.config.dp_rank == 0
        rank0.in_flight = 3  # state that must survive an unchanged rank
        grown = rank_targets(
            server,
            {
                0: ("tcp://127.0.0.1:7000", None, ""),
                1: ("tcp://127.0.0.1:7011", None, ""),  # rank 1 moved
                2: ("tcp://127.0.0.1:7002", None, ""),
            },
        )
        service._apply_dp_targets(server, grown)
        assert service.registry.names() == ["s#dp0", "s#dp1", "s#dp2"]
        assert service.registry.get("s#dp0") is rank0 and rank0.in_flight == 3
        moved = service.registry.get("s#dp1")
        assert moved is not None and moved.config.events == "tcp://127.0.0.1:7011"
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            feeds = sorted((s.replica, s.endpoint) for s in service.subscriber.sources())
            if len(feeds) == 3:
                break
            time.sleep(0.02)
        assert feeds == [
            ("s#dp0", "tcp://127.0.0.1:7000"),
            ("s#dp1", "tcp://127.0.0.1:7011"),
            ("s#dp2", "tcp://127.0.0.1:7002"),
        ]
        service.remove_replica("s")
        assert service.registry.names() == []
    finally:
        asyncio.run(service.stop())
