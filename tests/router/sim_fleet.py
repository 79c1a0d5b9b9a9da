"""A fleet for the router tests: simulated vLLM replicas (kvroute.bench.sim, with their ZMQ
publishers) behind a router."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvroute.bench.sim.latency import LatencyModel
from kvroute.router.app import create_app
from kvroute.router.config import ReplicaConfig, RouterSettings
from kvroute.router.serving.http_protocol import header_deadline_protocol
from kvroute.router.tokens.tokenization import LocalTokenizer
from tests.router.servers import ServerThread, wait_until
from tests.router.sim_replica import ReplicaFaults, SimServer


@dataclass
class Fleet:
    router: ServerThread
    fakes: list[SimServer]
    settings: RouterSettings
    exits: contextlib.ExitStack = field(repr=False, default_factory=contextlib.ExitStack)

    @property
    def url(self) -> str:
        return self.router.url

    @property
    def servers(self) -> list[SimServer]:
        """The replicas as servers (``url``, ``port``, ``stop``, ``start`` again)."""
        return self.fakes

    @property
    def service(self) -> Any:
        return self.router.app.state.service

    def names(self) -> list[str]:
        return [f"r{i}" for i in range(len(self.fakes))]

    def stats(self) -> dict[str, Any]:
        return httpx.get(f"{self.url}/index/stats", timeout=5).json()


def prefill_only(prefill_s_per_token: float) -> LatencyModel:
    """Replicas whose only cost is prefill, at this rate per uncached token (wall clock):
    what the calibration tests learn back."""
    return LatencyModel(
        prefill_s_per_token=prefill_s_per_token,
        load_cpu_s_per_token=0.0,
        load_storage_s_per_token=0.0,
        decode_s_per_step=0.0,
        decode_s_per_seq=0.0,
    )


@contextlib.contextmanager
def make_fleet(
    tokenizer: LocalTokenizer,
    n: int = 2,
    *,
    events: bool = True,
    faults: list[ReplicaFaults] | None = None,
    loras: list[str] | None = None,
    inject_tokenizer: bool = True,
    latency: LatencyModel | None = None,
    roles: list[str] | None = None,
    nixl: list[bool] | None = None,
    **settings_kw: Any,
) -> Iterator[Fleet]:
    """n simulated replicas behind one router (subscribed to their KV events when
    ``events``); ``faults[i]`` is replica i's, ``roles[i]`` its P/D role (default both),
    ``nixl[i]`` whether it has a P/D connector (default yes)."""
    with contextlib.ExitStack() as stack:
        fakes, configs = [], []
        for i in range(n):
            fake = SimServer(
                f"r{i}",
                tokenizer.name,
                faults=faults[i] if faults else None,
                loras=list(loras or []),
                latency=latency,
                nixl=nixl[i] if nixl else True,
            )
            stack.callback(fake.close)
            fake.start()
            fakes.append(fake)
            configs.append(
                ReplicaConfig(
                    url=fake.url,
                    events=fake.events if events else None,
                    replay=fake.replay if events else None,
                    name=f"r{i}",
                    role=roles[i] if roles else "both",
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
        fleet = Fleet(router, fakes, settings)
        wait_until(lambda: len(fleet.service.registry.healthy()) == n, timeout_s=10)
        yield fleet
