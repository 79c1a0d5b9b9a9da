"""LMCache's controller as the router's view of LMCache's tier: a replica that names its
LMCache instance is predicted to serve what the controller says that instance holds of the
prompt (``POST /lookup``), over real HTTP; a controller that fails changes nothing and is
counted in /index/stats."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from kvroute.router.app import create_app
from kvroute.router.config import ConfigError, ReplicaConfig, RouterSettings
from kvroute.router.serving.http_protocol import header_deadline_protocol
from kvroute.router.specs import parse_replica, parse_replica_flag
from kvroute.router.tokens.tokenization import LocalTokenizer
from tests.router.servers import ServerThread, wait_until
from tests.router.sim_replica import SimServer

BS = 16
PROMPT = [5 + (i * 7) % 500 for i in range(20 * BS + 10)]


class FakeController:
    """LMCache's controller API (lmcache.v1.api_server): ``POST /lookup {"tokens"}`` ->
    ``{"event_id", "layout_info": {instance_id: [location, token_count]}}``."""

    def __init__(self) -> None:
        self.layout_info: dict[str, Any] = {}
        self.status = 200
        self.asked: list[list[int]] = []

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                await send({"type": message["type"] + ".complete"})
                if message["type"] == "lifespan.shutdown":
                    return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        assert scope["path"] == "/lookup" and scope["method"] == "POST"
        self.asked.append(json.loads(body)["tokens"])
        out = json.dumps({"event_id": "Lookup-1", "layout_info": self.layout_info}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": self.status,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": out})


@pytest.fixture
def lmcache_fleet(local_tokenizer: LocalTokenizer) -> Iterator[tuple[str, FakeController]]:
    sims = [SimServer(f"r{i}", local_tokenizer.name) for i in range(2)]
    controller = FakeController()
    servers = []
    try:
        for s in sims:
            s.start()
        servers.append(ServerThread(controller).start())
        settings = RouterSettings(
            replicas=[
                ReplicaConfig(sims[0].url, name="r0"),
                ReplicaConfig(sims[1].url, name="r1", lmcache_instance="lmc-1"),
            ],
            lmcache_controller=servers[0].url,
            lmcache_lookup_timeout_s=2.0,
            health_interval_s=0.2,
            tokenizer_check_on_start=False,
            hint_ttl_s=0.0,
        )
        router = ServerThread(
            create_app(settings, tokenizer=local_tokenizer),
            http=header_deadline_protocol(settings.header_timeout_s),
        ).start()
        servers.append(router)
        wait_until(lambda: len(router.app.state.service.registry.healthy()) == 2)
        yield router.url, controller
    finally:
        for server in reversed(servers):
            server.stop()
        for s in sims:
            s.close()


def _views(url: str) -> dict[str, dict]:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 1}
    decision = httpx.post(f"{url}/debug/route", json=body, timeout=10).json()
    return {v["name"]: v for v in decision["replicas"]}


def test_the_controller_says_what_an_lmcache_instance_holds(
    lmcache_fleet: tuple[str, FakeController],
) -> None:
    url, controller = lmcache_fleet
    controller.layout_info = {"lmc-1": ["LocalCPUBackend", 256], "elsewhere": ["x", 330]}
    views = _views(url)
    assert controller.asked == [PROMPT]
    assert views["r1"]["tokens_by_tier"] == {"CPU": 256}
    assert views["r1"]["predicted_cached_tokens"] == 256
    assert views["r0"]["predicted_cached_tokens"] == 0  # names no instance: not asked for
    # A whole-prompt hit still leaves the last token to compute.
    controller.layout_info = {"lmc-1": ["LocalCPUBackend", len(PROMPT)]}
    assert _views(url)["r1"]["predicted_cached_tokens"] == len(PROMPT) - 1
    # A failing controller changes nothing, and says so.
    controller.status = 500
    assert _views(url)["r1"]["predicted_cached_tokens"] == 0
    stats = httpx.get(f"{url}/index/stats", timeout=5).json()["lmcache_controller"]
    assert stats["lookups"] == 3 and stats["failures"] == 1 and "500" in stats["last_error"]


def test_lmcache_instances_parse_and_the_timeout_is_checked() -> None:
    assert parse_replica_flag("http://h:1,lmcache_instance=lmc-1").lmcache_instance == "lmc-1"
    assert parse_replica({"url": "http://h:1", "lmcache_instance": "a"}).lmcache_instance == "a"
    with pytest.raises(ConfigError, match="lmcache_lookup_timeout_s"):
        RouterSettings(lmcache_controller="http://c:9000", lmcache_lookup_timeout_s=0)
