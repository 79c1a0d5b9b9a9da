"""The router as a child process: ``RouterProcess`` starts it, waits until it is ready, stops it.

Two ways to tell the child what to route, one process handle:

* flags: ``kvroute serve --replica ... --policy ...`` plus any extra ``kvroute serve`` flags
  (``kvroute up`` and the end-to-end tests);
* ``settings``: a dict of ``RouterSettings`` fields (``replicas``: dicts, ``cost``: a dict of
  knobs), written to a JSON file that ``python -m kvroute.deploy.router_process FILE`` serves
  (the benchmarks and tests that set fields no flag reaches).

Either way it is ready when ``GET /health`` answers 200 with every replica healthy, so a
caller never routes before the router sees the whole fleet. A separate process, not a thread:
a benchmark's load generator must not share a GIL or event loop with the router it measures.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import tempfile
import time
from collections.abc import Collection, Coroutine, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvroute.deploy.processes import ChildProcess, RunsChild, child_env, free_port

__all__ = [
    "API_KEY_ENV",
    "REPLICA_API_KEY_ENV",
    "ReplicaEndpoint",
    "RouterProcess",
    "settings_from_dict",
]

# What ``kvroute serve`` reads when no key flag is given (kvroute.router.cli).
API_KEY_ENV = "KVROUTE_API_KEY"
REPLICA_API_KEY_ENV = "KVROUTE_REPLICA_API_KEY"


@dataclass(frozen=True)
class ReplicaEndpoint:
    """How the router reaches one replica: its HTTP URL and KV-event endpoints."""

    name: str
    url: str
    events: str | None = None
    replay: str | None = None
    topic: str = ""
    dp: str | None = None  # a data-parallel server: its rank count, or "auto" (ask the server)
    role: str = "both"  # its P/D pool: prefill, decode, or both (router/routing/disagg.py)

    def flag(self) -> str:
        """The ``kvroute serve --replica`` value for this replica."""
        parts = [self.url, f"name={self.name}"]
        if self.events:
            parts.append(f"events={self.events}")
        if self.replay:
            parts.append(f"replay={self.replay}")
        if self.topic:
            parts.append(f"topic={self.topic}")
        if self.dp:
            parts.append(f"dp={self.dp}")
        if self.role != "both":
            parts.append(f"role={self.role}")
        return ",".join(parts)


def settings_from_dict(data: dict[str, Any]) -> Any:
    """RouterSettings from JSON-able data (``replicas``, ``storage_domains``: dicts; ``cost``,
    ``disagg``: dicts of knobs)."""
    from kvroute.router.config import (
        CostSettings,
        DisaggSettings,
        ReplicaConfig,
        RouterSettings,
        StorageDomainConfig,
    )

    data = dict(data)
    replicas = [ReplicaConfig(**r) for r in data.pop("replicas", [])]
    cost = CostSettings(**data.pop("cost", {}))
    domains = [StorageDomainConfig(**d) for d in data.pop("storage_domains", [])]
    disagg = DisaggSettings(**data.pop("disagg", {}))
    from kvroute.router.common.admission_queue import AdmissionSettings

    admission = AdmissionSettings(**data.pop("admission", {}))
    return RouterSettings(
        replicas=replicas,
        cost=cost,
        storage_domains=domains,
        disagg=disagg,
        admission=admission,
        **data,
    )


class RouterProcess(RunsChild):
    """One router child process (a context manager: ``with`` starts, waits and stops it).

    ``settings`` given: the router serves exactly those ``RouterSettings`` fields (its
    ``host`` and ``port`` default to this handle's); ``policy``, ``replicas``, ``tokenizer``
    and ``extra_args`` are then unused. ``port=0`` picks a free port at start.
    ``api_key``: clients' key (sent by this handle's own readiness checks too);
    ``replica_api_key``: the key the replicas want.
    """

    def __init__(
        self,
        settings: dict[str, Any] | None = None,
        *,
        name: str = "router",
        policy: str = "kvroute",
        replicas: Sequence[ReplicaEndpoint] = (),
        tokenizer: str | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        extra_args: Sequence[str] = (),
        log_path: Path | None = None,
        cpus: Collection[int] | None = None,
        start_timeout_s: float = 90.0,
        api_key: str | None = None,
        replica_api_key: str | None = None,
    ) -> None:
        self.settings = None if settings is None else dict(settings)
        self.name = name
        self.policy = policy if settings is None else str(settings.get("policy", "kvroute"))
        self.replicas = list(replicas)
        self.tokenizer = tokenizer
        self.host = host if settings is None else str(settings.get("host", host))
        self.port = port if settings is None else int(settings.get("port", port))
        self.extra_args = list(extra_args)
        self.cpus = cpus
        self.start_timeout_s = start_timeout_s
        self.process = ChildProcess(name, log_path)
        self._settings_file: Path | None = None
        # Never on the command line (ps, the child's log): the child reads them from its
        # environment (flags mode) or its 0600 settings file (settings mode).
        self.api_key = api_key
        self.replica_api_key = replica_api_key

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def expected_replicas(self) -> int:
        """How many replicas the router must report healthy before it counts as ready."""
        if self.settings is not None:
            return len(self.settings.get("replicas", []))
        return len(self.replicas)

    def command(self) -> list[str]:
        if self._settings_file is not None:
            return [sys.executable, "-m", "kvroute.deploy.router_process", str(self._settings_file)]
        cmd = [sys.executable, "-m", "kvroute.deploy.cli", "serve", "--host", self.host]
        cmd += ["--port", str(self.port), "--policy", self.policy]
        if self.tokenizer:
            cmd += ["--tokenizer", self.tokenizer]
        for rep in self.replicas:
            cmd += ["--replica", rep.flag()]
        return cmd + self.extra_args

    def start(self, *, wait: bool = True) -> RouterProcess:
        """Start the child; with ``wait``, until it is ready (``wait_ready``), stopping it
        again when it is not."""
        if not self.port:
            self.port = free_port(self.host)
        if self.settings is not None:
            keys: dict[str, Any] = {}
            if self.api_key is not None:
                keys["api_keys"] = [self.api_key]
            if self.replica_api_key is not None:
                keys["replica_api_key"] = self.replica_api_key
            with tempfile.NamedTemporaryFile(
                "w", prefix="kvroute-router-", suffix=".json", delete=False
            ) as f:
                json.dump({**self.settings, "host": self.host, "port": self.port, **keys}, f)
            self._settings_file = Path(f.name)
        self.process.start(self.command(), env=self._env(), cpus=self.cpus)
        if wait:
            try:
                self.wait_ready()
            except BaseException:
                self.stop()
                raise
        return self

    def _env(self) -> dict[str, str]:
        """The child's environment: exactly this handle's keys, none inherited."""
        env = child_env()
        for name, value in (
            (API_KEY_ENV, self.api_key),
            (REPLICA_API_KEY_ENV, self.replica_api_key),
        ):
            env.pop(name, None)
            if value is not None:
                env[name] = value
        return env

    def auth_headers(self) -> dict[str, str]:
        """What a client of this router sends: its key, when it has one."""
        return {} if self.api_key is None else {"Authorization": f"Bearer {self.api_key}"}

    def wait_ready(self, timeout_s: float | None = None) -> None:
        """Until ``GET /health`` answers 200 with every replica healthy."""
        want = self.expected_replicas()

        def all_healthy(body: bytes) -> bool:
            return int(json.loads(body).get("healthy_replicas", 0)) >= want

        self.process.wait_http(
            self.url + "/health",
            self.start_timeout_s if timeout_s is None else timeout_s,
            accept=all_healthy,
            every_s=0.1,
            headers=self.auth_headers(),
        )

    def wait_feeds_settled(self, timeout_s: float = 60.0) -> bool:
        """Until no event feed is still joining or replaying (``/index/stats`` freshness): a
        run timed while the router catches up on the fleet's history would time that, not its
        routing. False when ``timeout_s`` passed first."""
        import httpx

        unsettled = ("connecting", "syncing")
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=5.0, headers=self.auth_headers()) as client:
            while time.monotonic() < deadline:
                with contextlib.suppress(httpx.HTTPError, ValueError):
                    stats = client.get(self.url + "/index/stats").json()
                    states = [e.get("freshness") for e in stats.get("replicas", {}).values()]
                    if not any(s in unsettled for s in states):
                        return True
                time.sleep(0.2)
        return False

    def stop(self, grace_s: float = 20.0) -> None:
        """Stop the child's process group (safe to call twice)."""
        self.process.stop(grace_s)
        if self._settings_file is not None:
            self._settings_file.unlink(missing_ok=True)
            self._settings_file = None

    def __enter__(self) -> RouterProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


async def _serve(settings_path: Path) -> None:
    """The ``settings`` child: the router app under uvicorn, as ``kvroute serve`` runs it."""
    import uvicorn

    from kvroute.router.app import create_app
    from kvroute.router.serving.http_protocol import header_deadline_protocol

    # A server process, as under kvroute serve (router/cli.py): its startup heap frozen.
    settings = settings_from_dict(json.loads(settings_path.read_text())).replace(gc_freeze=True)
    config = uvicorn.Config(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level="warning",
        access_log=False,
        lifespan="on",
        http=header_deadline_protocol(settings.header_timeout_s),
        timeout_keep_alive=60,
        timeout_graceful_shutdown=2,
    )
    await uvicorn.Server(config).serve()


def _run(main: Coroutine[Any, Any, None]) -> None:
    """On uvloop where it is installed, as ``kvroute serve`` runs (router/cli.py): a router
    benchmarked on the stdlib loop would pay a per-request cost the product does not."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
    else:
        uvloop.run(main)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        _run(_serve(Path(sys.argv[1])))
