"""A fleet for the router tests: fake vLLM replicas (with ZMQ publishers) behind a router."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
from kvroute.bench.publisher import EventPublisher
from kvroute.router.app import create_app
from kvroute.router.config import ReplicaConfig, RouterSettings
from kvroute.router.http_protocol import header_deadline_protocol
from kvroute.router.tokenization import LocalTokenizer
from router_fake_vllm import FakeKnobs, FakeVLLM
from router_servers import ServerThread, wait_until


@dataclass
class Fleet:
    router: ServerThread
    fakes: list[FakeVLLM]
    servers: list[ServerThread]
    publishers: list[EventPublisher | None]
    settings: RouterSettings
    exits: contextlib.ExitStack = field(repr=False, default_factory=contextlib.ExitStack)

    @property
    def url(self) -> str:
        return self.router.url

    @property
    def service(self) -> Any:
        return self.router.app.state.service

    def names(self) -> list[str]:
        return [f"r{i}" for i in range(len(self.fakes))]

    def stats(self) -> dict[str, Any]:
        return httpx.get(f"{self.url}/index/stats", timeout=5).json()


@contextlib.contextmanager
def make_fleet(
    tokenizer: LocalTokenizer,
    n: int = 2,
    *,
    events: bool = True,
    knobs: list[FakeKnobs] | None = None,
    loras: list[str] | None = None,
    inject_tokenizer: bool = True,
    **settings_kw: Any,
) -> Iterator[Fleet]:
    """n fake replicas (each with a ZMQ publisher when ``events``) behind one router."""
    with contextlib.ExitStack() as stack:
        fakes, servers, pubs, configs = [], [], [], []
        for i in range(n):
            pub = None
            if events:
                pub = EventPublisher(
                    "tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0", bind=True
                )
                stack.callback(pub.close)
            fake = FakeVLLM(
                f"r{i}",
                tokenizer.tok,
                publisher=pub,
                knobs=(knobs[i] if knobs else FakeKnobs()),
                loras=list(loras or []),
            )
            server = ServerThread(fake.app).start()
            stack.callback(server.stop)
            fakes.append(fake)
            servers.append(server)
            pubs.append(pub)
            configs.append(
                ReplicaConfig(
                    url=server.url,
                    events=pub.endpoint if pub else None,
                    replay=pub.replay_endpoint if pub else None,
                    name=f"r{i}",
                )
            )
        defaults: dict[str, Any] = {
            "health_interval_s": 0.2,
            "health_timeout_s": 1.0,
            "tokenizer_check_on_start": False,
            "replicas": configs,
        }
        defaults.update(settings_kw)
        settings = RouterSettings(**defaults)
        router = ServerThread(
            create_app(settings, tokenizer=tokenizer if inject_tokenizer else None),
            http=header_deadline_protocol(settings.header_timeout_s),  # as `kvroute serve`
        ).start()
        stack.callback(router.stop)
        fleet = Fleet(router, fakes, servers, pubs, settings)
        wait_until(lambda: len(fleet.service.registry.healthy()) == n, timeout_s=10)
        yield fleet
