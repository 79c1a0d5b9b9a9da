"""A fleet of simulated replicas in one process, and the handle that starts it as a subprocess.

Sixteen replicas plus a router plus a load generator must share two cores, so the whole fleet
runs on one asyncio loop: one uvicorn server, one PUB and one replay socket per replica, and a
control server for what a test or benchmark does to a fleet (kill, restart, reset caches,
inject faults, read cache contents). ``python -m kvroute.bench.sim.fleet --replicas 16`` prints one
JSON line when every replica listens (``ready``), then serves until SIGINT/SIGTERM.

``SimFleet`` runs that command as a child process group (``kvroute.deploy.processes``) and
talks to its control server, so the fleet never competes with the caller's event loop or GIL.
It picks the control port, and the fleet is ready when ``GET /fleet`` answers there: the
control server listens only once every replica does. ``kvroute up --engine sim`` uses it too.

``data_parallel_size`` > 1 makes each replica a data-parallel server (bench/sim/dp.py): one HTTP
port, that many engines, each with its own event sockets. The control server knows each
engine as ``<replica>#dp<r>`` too (restart one rank, read one rank's cache).

``shared_storage_blocks`` > 0 attaches every replica to one shared STORAGE domain
(bench/sim/storage.py) instead of private disks; the fleet runs the domain's evictor stream
(PUB + replay) and names it in ``ready`` and ``GET /fleet`` as ``storage``. ``POST /replicas``
adds a replica while the fleet runs (scale-up), rewriting ``--replicas-file`` when given.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Collection
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx

from kvroute.bench.sim.latency import LatencyModel
from kvroute.bench.sim.replica import SimReplicaConfig
from kvroute.bench.sim.storage import WRITE_POLICIES
from kvroute.deploy.processes import ChildProcess, RunsChild, child_env, free_port
from kvroute.deploy.router_process import ReplicaEndpoint

API_KEY_ENV = "KVROUTE_SIM_API_KEY"

__all__ = [
    "API_KEY_ENV",
    "FleetReplica",
    "FleetStorage",
    "SimFleet",
    "SimFleetConfig",
    "add_arguments",
    "main",
    "serve_fleet",
]


@dataclass(slots=True)
class SimFleetConfig:
    """A fleet of identical replicas (``hash_seeds``: per-replica engine hash seeds)."""

    replicas: int = 4
    model: str = "kvroute-sim"
    model_dir: str | None = None
    block_size: int = 16
    gpu_blocks: int = 8192
    cpu_blocks: int = 0
    storage_blocks: int = 0
    # > 0: every replica's STORAGE tier is one shared domain of this many blocks (then
    # storage_blocks must be 0), named storage_domain in the router's replica list.
    shared_storage_blocks: int = 0
    storage_domain: str = "shared"
    # When replicas write the shared domain (bench/sim/storage.py): "through" (the connector's
    # default disk policy) or "demotion" (only blocks leaving their last local tier).
    shared_storage_writes: str = "through"
    max_num_seqs: int = 64
    max_model_len: int = 32768
    default_max_tokens: int = 16
    stream_interval_s: float = 0.02
    error_rate: float = 0.0
    drop_event_rate: float = 0.0
    hash_seeds: bool = False
    seed: int = 0
    host: str = "127.0.0.1"
    control_port: int = 0  # the control server's port; 0 picks a free one
    # Engines per replica: > 1 makes each replica a data-parallel server (kvroute.bench.sim.dp).
    data_parallel_size: int = 1
    latency: LatencyModel = field(default_factory=LatencyModel)
    # Every replica's ``--api-key`` (vLLM's check, kvroute.bench.sim.api). Never in argv: the
    # child fleet gets it through $KVROUTE_SIM_API_KEY.
    api_key: str | None = field(default=None, repr=False)

    def replica_config(self, i: int) -> SimReplicaConfig:
        return SimReplicaConfig(
            name=f"sim-{i}",
            model=self.model,
            block_size=self.block_size,
            gpu_blocks=self.gpu_blocks,
            cpu_blocks=self.cpu_blocks,
            storage_blocks=self.storage_blocks,
            max_num_seqs=self.max_num_seqs,
            max_model_len=self.max_model_len,
            latency=self.latency,
            hash_seed=f"seed-{self.seed}-{i}" if self.hash_seeds else None,
            default_max_tokens=self.default_max_tokens,
            stream_interval_s=self.stream_interval_s,
            error_rate=self.error_rate,
            drop_event_rate=self.drop_event_rate,
            seed=self.seed,
            api_key=self.api_key,
        )

    def to_argv(self) -> list[str]:
        """Command-line flags that rebuild this config in ``main`` (all but ``api_key``)."""
        argv: list[str] = []
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "api_key":
                continue
            if f.name == "latency":
                for lf in fields(LatencyModel):
                    argv += [f"--{lf.name.replace('_', '-')}", repr(getattr(value, lf.name))]
            elif isinstance(value, bool):
                if value:
                    argv.append(f"--{f.name.replace('_', '-')}")
            elif value is not None:
                argv += [f"--{f.name.replace('_', '-')}", str(value)]
        return argv


@dataclass(frozen=True, slots=True)
class FleetReplica:
    """Where one replica listens: what a router's replica list needs."""

    name: str
    url: str
    events: str
    replay: str
    topic: str
    dp: int = 1  # engines behind the URL (rank r publishes on the event/replay ports + r)
    storage_domain: str | None = None  # the shared STORAGE domain it mounts, if any


@dataclass(frozen=True, slots=True)
class FleetStorage:
    """The fleet's shared STORAGE domain: its evictor's event stream and its capacity."""

    name: str
    events: str
    replay: str
    topic: str
    capacity_blocks: int


def _fleet_replica(r: dict[str, Any]) -> FleetReplica:
    return FleetReplica(
        r["name"],
        r["url"],
        r["events"],
        r["replay"],
        r["topic"],
        r.get("data_parallel_size", 1),
        r.get("storage_domain"),
    )


# --- the fleet process -----------------------------------------------------------------------


async def serve_fleet(
    config: SimFleetConfig,
    *,
    ready: Any = None,
    replicas_file: Path | None = None,
    stop: asyncio.Event | None = None,
) -> None:
    """Run the fleet until ``stop`` is set (or SIGINT/SIGTERM). ``ready(info)`` is called once
    every replica and the control server listen."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    from kvroute.bench.publisher import EventPublisher
    from kvroute.bench.sim.dp import SimDPServer, engines_of, make_server
    from kvroute.bench.sim.http_server import SocketHTTPServer
    from kvroute.bench.sim.looplag import LoopLagMonitor
    from kvroute.bench.sim.replica import SimReplica
    from kvroute.bench.sim.storage import SharedStorageDomain
    from kvroute.bench.sim.tokenizer import SimTokenizer, ensure_model_dir

    model_dir = ensure_model_dir(
        Path(config.model_dir) if config.model_dir else None, max_model_len=config.max_model_len
    )
    tokenizer = SimTokenizer(model_dir)
    domain: SharedStorageDomain | None = None
    if config.shared_storage_blocks > 0:
        if config.storage_blocks:
            raise ValueError("storage_blocks and shared_storage_blocks exclude each other")
        domain = SharedStorageDomain(
            config.storage_domain,
            config.shared_storage_blocks,
            writes=config.shared_storage_writes,
        )
        domain.publisher = EventPublisher(
            f"tcp://{config.host}:0",
            replay_endpoint=f"tcp://{config.host}:0",
            topic=f"kv-storage@{config.storage_domain}",
            bind=True,
        )
        # The evictor's first batch (seq 0) announces the domain: a router rebuilds the
        # domain from a stream that starts over, so later removals must not be seq 0.
        domain.publisher.publish(domain.announcement(config.block_size))

    def new_server(i: int) -> SimReplica | SimDPServer:
        return make_server(config.replica_config(i), tokenizer, config.data_parallel_size, domain)

    replicas = [new_server(i) for i in range(config.replicas)]
    by_name: dict[str, SimReplica | SimDPServer] = {r.config.name: r for r in replicas}
    by_name |= {e.config.name: e for r in replicas for e in engines_of(r) if e is not r}
    lag = LoopLagMonitor()
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    with contextlib.suppress(NotImplementedError, RuntimeError):
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)

    def replica_of(request: Request) -> SimReplica | SimDPServer:
        name = request.path_params["name"]
        if name not in by_name:
            raise KeyError(name)
        return by_name[name]

    def err(message: str, code: int) -> JSONResponse:
        return JSONResponse(
            {"error": {"message": message, "type": "BadRequestError", "param": None, "code": code}},
            code,
        )

    def storage_info() -> dict[str, Any] | None:
        if domain is None or domain.publisher is None:
            return None
        return {
            "name": domain.name,
            "events": domain.publisher.endpoint,
            "replay": domain.publisher.replay_endpoint,
            "topic": domain.publisher.topic,
            "capacity_blocks": domain.capacity,
        }

    def write_replicas_file() -> None:
        if replicas_file is None:
            return
        import yaml

        entries = [
            {k: r.describe()[k] for k in ("name", "url", "events", "replay", "topic")}
            | ({"dp": r.size} if isinstance(r, SimDPServer) else {})
            | ({"storage_domain": domain.name} if domain is not None else {})
            for r in replicas
        ]
        # Written whole, then renamed: a launcher polling the file never reads half of it.
        tmp = replicas_file.with_name(replicas_file.name + ".tmp")
        tmp.write_text(yaml.safe_dump({"replicas": entries}, sort_keys=False))
        os.replace(tmp, replicas_file)

    async def describe(request: Request) -> Response:
        return JSONResponse(
            {
                "replicas": [r.describe() for r in replicas],
                "model_dir": str(model_dir),
                "storage": storage_info(),
            }
        )

    async def add_replica(request: Request) -> Response:
        """Scale-up: one more replica, started like the first ones (next free name)."""
        r = new_server(len(replicas))
        await r.start(config.host)
        replicas.append(r)
        by_name[r.config.name] = r
        by_name.update({e.config.name: e for e in engines_of(r) if e is not r})
        write_replicas_file()
        return JSONResponse(r.describe())

    async def storage(request: Request) -> Response:
        """The shared domain's counters and engine hashes (for tests and benchmarks)."""
        if domain is None:
            return err("this fleet has no shared storage domain", 404)
        return JSONResponse(
            (storage_info() or {})
            | {
                "blocks": len(domain),
                "writes": domain.writes,
                "reads": domain.reads,
                "evictions": domain.evictions,
                "removals_announced": domain.removals_announced,
                "rewritten": domain.rewritten,
                "batches_published": domain.publisher.seq if domain.publisher else 0,
                "hashes": sorted(domain.hashes()),
            }
        )

    async def kill(request: Request) -> Response:
        try:
            r = replica_of(request)
        except KeyError as exc:
            return err(f"no replica {exc}", 404)
        if r.alive:
            await r.kill()
        return JSONResponse(r.describe())

    async def restart(request: Request) -> Response:
        try:
            r = replica_of(request)
            body = await request.json() if await request.body() else {}
            down_s = float(body.get("down_s", 0.0))
            if not 0.0 <= down_s <= 600.0:
                return err("down_s must be in [0, 600]", 400)
        except KeyError as exc:
            return err(f"no replica {exc}", 404)
        except (ValueError, TypeError, AttributeError) as exc:
            return err(f"bad restart body: {exc}", 400)
        await r.restart(down_s=down_s)
        return JSONResponse(r.describe())

    async def faults(request: Request) -> Response:
        try:
            r = replica_of(request)
            body = await request.json()
            for key in ("error_rate", "drop_event_rate"):
                if key in body:
                    value = float(body[key])
                    if not 0.0 <= value <= 1.0:
                        return err(f"{key} must be in [0, 1]", 400)
                    for target in (r, *engines_of(r)):
                        setattr(target.config, key, value)
        except KeyError as exc:
            return err(f"no replica {exc}", 404)
        except (ValueError, TypeError) as exc:
            return err(f"bad fault settings: {exc}", 400)
        return JSONResponse(
            {"error_rate": r.config.error_rate, "drop_event_rate": r.config.drop_event_rate}
        )

    async def cache(request: Request) -> Response:
        """Engine hashes per tier, and per block its tokens' chain position (for tests)."""
        try:
            r = replica_of(request)
        except KeyError as exc:
            return err(f"no replica {exc}", 404)
        if isinstance(r, SimDPServer):
            return err(f"{r.config.name} is a data-parallel server: ask for <name>#dp<rank>", 400)
        return JSONResponse(
            {t.name: sorted(h) for t, h in r.cache.contents().items()}
            | {
                "in_use": r.cache.in_use_blocks(),
                "batches_published": r.publisher.seq if r.publisher else 0,
                "batches_dropped": r.batches_dropped,
            }
        )

    async def reset(request: Request) -> Response:
        """Reset every live replica's cache, every tier of its own, once it is idle
        (benchmarks, between runs: no run may start on what an earlier run left)."""
        deadline = time.monotonic() + 30
        pending = [r for r in replicas if r.alive]
        while pending:
            pending = [r for r in pending if not r.reset_prefix_cache(every_tier=True)]
            if not pending:
                break
            if time.monotonic() > deadline:
                return err(f"replicas still busy: {[r.config.name for r in pending]}", 409)
            await asyncio.sleep(0.05)
        lag.reset()
        return JSONResponse({"reset": [r.config.name for r in replicas if r.alive]})

    async def stats(request: Request) -> Response:
        out = {}
        for r in (e for server in replicas for e in engines_of(server)):
            st = r.scheduler.stats
            out[r.config.name] = {
                "alive": r.alive,
                "running": r.scheduler.num_running,
                "waiting": r.scheduler.num_waiting,
                "kv_usage": r.cache.usage(),
                "prefix_queries": st.prefix_queries,
                "prefix_hits": st.prefix_hits,
                "external_hits": st.external_hits,
                "requests_finished": st.requests_finished,
                "requests_failed": st.requests_failed,
                "cached_blocks": len(r.cache),
            }
        return JSONResponse(out)

    async def loop_lag(request: Request) -> Response:
        """How late the fleet's loop (its simulated clock) ran timers since the last reset."""
        return JSONResponse(lag.snapshot())

    async def shutdown(request: Request) -> Response:
        stop.set()
        return JSONResponse({"stopping": True})

    control_app = Starlette(
        routes=[
            Route("/fleet", describe, methods=["GET"]),
            Route("/stats", stats, methods=["GET"]),
            Route("/lag", loop_lag, methods=["GET"]),
            Route("/reset", reset, methods=["POST"]),
            Route("/shutdown", shutdown, methods=["POST"]),
            Route("/replicas", add_replica, methods=["POST"]),
            Route("/storage", storage, methods=["GET"]),
            Route("/replicas/{name}/kill", kill, methods=["POST"]),
            Route("/replicas/{name}/restart", restart, methods=["POST"]),
            Route("/replicas/{name}/faults", faults, methods=["POST"]),
            Route("/replicas/{name}/cache", cache, methods=["GET"]),
        ]
    )
    for r in replicas:
        await r.start(config.host)
    lag.start()
    control = SocketHTTPServer()
    port = control.bind(config.host, config.control_port)
    await control.serve(control_app, "fleet control")
    info = {
        "ready": True,
        "control": f"http://{config.host}:{port}",
        "model": config.model,
        "model_dir": str(model_dir),
        "replicas": [r.describe() for r in replicas],
        "storage": storage_info(),
    }
    write_replicas_file()
    if ready is not None:
        ready(info)
    try:
        await stop.wait()
    finally:
        await lag.stop()
        for r in replicas:
            await r.stop()
        await control.shutdown(force=False)
        if domain is not None and domain.publisher is not None:
            domain.publisher.close()


# --- command line ---------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = SimFleetConfig()
    parser.add_argument("--replicas", type=int, default=d.replicas, help="number of replicas")
    parser.add_argument("--model", default=d.model, help="served model name")
    parser.add_argument(
        "--model-dir", default=None, help="tokenizer/model directory (built if absent)"
    )
    parser.add_argument("--block-size", type=int, default=d.block_size)
    parser.add_argument(
        "--gpu-blocks", type=int, default=d.gpu_blocks, help="device KV blocks per replica"
    )
    parser.add_argument(
        "--cpu-blocks", type=int, default=d.cpu_blocks, help="CPU-tier blocks per replica"
    )
    parser.add_argument(
        "--storage-blocks",
        type=int,
        default=d.storage_blocks,
        help="STORAGE-tier blocks per replica (its private disk)",
    )
    parser.add_argument(
        "--shared-storage-blocks",
        type=int,
        default=d.shared_storage_blocks,
        help="> 0: one STORAGE tier of this many blocks shared by every replica (a shared "
        "file system), with its evictor's event stream; excludes --storage-blocks",
    )
    parser.add_argument(
        "--shared-storage-writes",
        choices=WRITE_POLICIES,
        default=d.shared_storage_writes,
        help="when replicas write the shared domain: 'through', every block once computed "
        "(the connector's default write_through disk policy), or 'demotion', only blocks "
        "leaving their last local tier",
    )
    parser.add_argument(
        "--storage-domain",
        default=d.storage_domain,
        help="the shared STORAGE domain's name (the replicas file's storage_domain)",
    )
    parser.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    parser.add_argument("--max-model-len", type=int, default=d.max_model_len)
    parser.add_argument("--default-max-tokens", type=int, default=d.default_max_tokens)
    parser.add_argument(
        "--stream-interval-s",
        type=float,
        default=d.stream_interval_s,
        help="minimum wall seconds between streamed chunks",
    )
    parser.add_argument(
        "--error-rate", type=float, default=d.error_rate, help="fraction of requests failed"
    )
    parser.add_argument(
        "--drop-event-rate",
        type=float,
        default=d.drop_event_rate,
        help="fraction of event batches not sent (kept for replay)",
    )
    parser.add_argument(
        "--hash-seeds", action="store_true", help="a different engine hash seed per replica"
    )
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--host", default=d.host)
    parser.add_argument(
        "--control-port",
        type=int,
        default=d.control_port,
        help="the control server's port (0: a free one)",
    )
    parser.add_argument(
        "--data-parallel-size",
        type=int,
        default=d.data_parallel_size,
        help="engines per replica (> 1: each replica is a data-parallel server)",
    )
    lat = LatencyModel()
    for f in fields(LatencyModel):
        parser.add_argument(
            f"--{f.name.replace('_', '-')}", type=float, default=getattr(lat, f.name)
        )
    parser.add_argument(
        "--replicas-file",
        type=Path,
        default=None,
        help="write the router's replica list (YAML) here once ready",
    )
    parser.add_argument(
        "--api-key",
        default=None,
        help=f"replicas answer vLLM's 401 without 'Authorization: Bearer KEY' on /v1/* "
        f"(default: ${API_KEY_ENV})",
    )


def config_from_args(args: argparse.Namespace) -> SimFleetConfig:
    latency = LatencyModel(**{f.name: getattr(args, f.name) for f in fields(LatencyModel)})
    kwargs = {f.name: getattr(args, f.name) for f in fields(SimFleetConfig) if f.name != "latency"}
    if kwargs["api_key"] is None:
        kwargs["api_key"] = os.environ.get(API_KEY_ENV)
    if kwargs["api_key"] is not None and not kwargs["api_key"].strip():
        raise SystemExit("kvroute sim: the API key is empty")
    return SimFleetConfig(latency=latency, **kwargs)


def main(args: argparse.Namespace) -> int:
    """Serve a fleet until interrupted; prints one JSON line (``ready``) on stdout."""
    config = config_from_args(args)

    def ready(info: dict[str, Any]) -> None:
        print(json.dumps(info), flush=True)

    asyncio.run(serve_fleet(config, ready=ready, replicas_file=args.replicas_file))
    return 0


# --- the handle ------------------------------------------------------------------------------


class SimFleet(RunsChild):
    """Start a fleet subprocess, wait until it listens, and control it.

    Use as a context manager; ``stop`` always ends the child's process group (SIGTERM, then
    SIGKILL after a grace period). ``log_path``: where the child's output goes (default: a
    temporary file, removed at stop).
    """

    name = "sim-fleet"

    def __init__(
        self,
        config: SimFleetConfig | None = None,
        *,
        start_timeout_s: float = 120.0,
        log_path: Path | None = None,
        cpus: Collection[int] | None = None,
    ) -> None:
        self.config = config or SimFleetConfig()
        self.cpus = cpus  # the cores the fleet process may run on (None: any)
        self.start_timeout_s = start_timeout_s
        self.replicas: list[FleetReplica] = []
        self.storage: FleetStorage | None = None
        self.control = ""
        self.model_dir = ""
        self.process = ChildProcess(self.name, log_path)
        self._client = httpx.Client(timeout=60.0)

    def start(self) -> SimFleet:
        """Start the child and wait until its control server answers (it listens only once
        every replica does); stops the child again when it does not."""
        if not self.config.control_port:
            self.config = replace(self.config, control_port=free_port(self.config.host))
        self.control = f"http://{self.config.host}:{self.config.control_port}"
        cmd = [sys.executable, "-m", "kvroute.bench.sim.fleet", *self.config.to_argv()]
        env = child_env()
        env.pop(API_KEY_ENV, None)
        if self.config.api_key is not None:
            env[API_KEY_ENV] = self.config.api_key
        self.process.start(cmd, env=env, cpus=self.cpus)
        try:
            info = json.loads(self.process.wait_http(self.control + "/fleet", self.start_timeout_s))
        except BaseException:
            self.stop()
            raise
        self.model_dir = info["model_dir"]
        self.replicas = [_fleet_replica(r) for r in info["replicas"]]
        if info.get("storage"):
            self.storage = FleetStorage(**info["storage"])
        return self

    def router_settings(self, **overrides: Any) -> dict[str, Any]:
        """``RouterSettings`` fields for a router in front of this fleet: every replica with
        its event and replay sockets, and the fleet's own tokenizer used locally (the ids a
        replica computes), and the replicas' API key when they have one. ``overrides`` add or
        replace fields."""
        return {
            "replicas": [self.replica_entry(r) for r in self.replicas],
            **({"storage_domains": [self.storage_domain_entry()]} if self.storage else {}),
            "tokenizer": self.model_dir,
            "tokenizer_mode": "local",
            "default_block_size": self.config.block_size,
            **({"replica_api_key": self.config.api_key} if self.config.api_key else {}),
            **overrides,
        }

    def endpoints(self) -> list[ReplicaEndpoint]:
        """The replicas as ``RouterProcess`` takes them (URL, event and replay sockets, topic)."""
        return [
            ReplicaEndpoint(name=r.name, url=r.url, events=r.events, replay=r.replay, topic=r.topic)
            for r in self.replicas
        ]

    @staticmethod
    def replica_entry(r: FleetReplica) -> dict[str, Any]:
        """One replica as the router's replica list (or replicas file) names it."""
        entry: dict[str, Any] = {
            "url": r.url,
            "events": r.events,
            "replay": r.replay,
            "topic": r.topic,
            "name": r.name,
        }
        if r.storage_domain is not None:
            entry["storage_domain"] = r.storage_domain
        return entry

    def storage_domain_entry(self) -> dict[str, Any]:
        """The shared domain's evictor feed as ``RouterSettings.storage_domains`` names it."""
        assert self.storage is not None
        s = self.storage
        return {"name": s.name, "events": s.events, "replay": s.replay, "topic": s.topic}

    def add_replica(self) -> FleetReplica:
        """Scale-up: start one more replica (on the shared domain when there is one)."""
        replica = _fleet_replica(self._post("/replicas"))
        self.replicas.append(replica)
        return replica

    def storage_contents(self) -> dict[str, Any]:
        """The shared domain's counters and engine hashes (404 without a domain)."""
        return self._get("/storage")

    def _post(self, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        resp = self._client.post(self.control + path, json=body or {})
        resp.raise_for_status()
        return resp.json()

    def _get(self, path: str) -> dict[str, Any]:
        resp = self._client.get(self.control + path)
        resp.raise_for_status()
        return resp.json()

    def kill(self, name: str) -> None:
        self._post(f"/replicas/{quote(name, safe='')}/kill")

    def restart(self, name: str, down_s: float = 0.0) -> None:
        """Kill the replica and start it again ``down_s`` wall seconds later (a real vLLM
        process is down for its start-up: ports closed, /health refused)."""
        self._post(f"/replicas/{quote(name, safe='')}/restart", {"down_s": down_s})

    def set_faults(
        self, name: str, *, error_rate: float | None = None, drop_event_rate: float | None = None
    ) -> None:
        body = {
            k: v
            for k, v in (("error_rate", error_rate), ("drop_event_rate", drop_event_rate))
            if v is not None
        }
        self._post(f"/replicas/{quote(name, safe='')}/faults", body)

    def reset_caches(self) -> None:
        self._post("/reset")

    def cache_contents(self, name: str) -> dict[str, Any]:
        return self._get(f"/replicas/{quote(name, safe='')}/cache")

    def stats(self) -> dict[str, Any]:
        return self._get("/stats")

    def loop_lag(self) -> dict[str, Any]:
        """The fleet loop's timer lag since the last ``reset_caches`` (LoopLagMonitor)."""
        return self._get("/lag")

    def stop(self) -> None:
        self.process.stop(grace_s=10.0)
        self._client.close()

    def __enter__(self) -> SimFleet:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(description="Serve a fleet of simulated vLLM replicas.")
    add_arguments(_parser)
    raise SystemExit(main(_parser.parse_args()))
