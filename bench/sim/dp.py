"""A simulated vLLM server with data parallelism: one HTTP endpoint, N simulated engines.

vLLM 0.32 with ``--data-parallel-size N`` runs N engine cores behind one API server. What the
router sees of it, and what this module reproduces:

* rank r publishes KV events on the event port + r and serves replay on the replay port + r
  (the payload's third element is r); each rank has its own sequence numbers and cache;
* ``GET /kv_event_sources``: ``{"<rank>": {publisher config}}``, endpoints as vLLM reports
  them (offset per rank, bind host ``*``);
* ``X-data-parallel-rank: r`` pins a request (any POST under ``/v1/``) to rank r (a value
  that is not an integer is ignored, as vLLM ignores it; one out of range is a 400 with
  vLLM's message); without it the server balances as vLLM's DP client does: the engine
  with the fewest requests, counting the larger of its running + waiting and the requests
  the server sent it and still has open, ties to the lowest rank;
* ``/metrics``: each engine's series under its ``engine`` label, in one page.

Simulator only, so tests can see where a request ran: every such answer carries
``x-sim-data-parallel-rank`` naming the engine that served it.

The engines are ``SimReplica`` objects started without HTTP (``start_engine``); the HTTP
handlers are the single-replica ones (kvroute.bench.sim.api) over this object (it offers the
part of ``SimReplica`` they use: ``config``, ``tokenizer``, ``metrics.render``,
``check_length``, ``generate``, ``reset_prefix_cache``, ``faults``, ``seen``), with the chosen
rank passed through a context variable set by the ASGI wrapper below, so kvroute.bench.sim.api
needs no DP code.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import socket
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from kvroute.bench.sim.api import create_app
from kvroute.bench.sim.faults import ReplicaFaults, RequestLog
from kvroute.bench.sim.http_server import SocketHTTPServer
from kvroute.bench.sim.replica import Generation, SimReplica, SimReplicaConfig
from kvroute.bench.sim.storage import SharedStorageDomain
from kvroute.bench.sim.tokenizer import SimTokenizer

__all__ = ["RANK_HEADER", "SERVED_RANK_HEADER", "SimDPServer", "engines_of", "make_server"]

RANK_HEADER = b"x-data-parallel-rank"
SERVED_RANK_HEADER = b"x-sim-data-parallel-rank"
_json = msgspec.json.Encoder()
_rank: contextvars.ContextVar[int | None] = contextvars.ContextVar("sim_dp_rank", default=None)


def make_server(
    config: SimReplicaConfig,
    tokenizer: SimTokenizer,
    data_parallel_size: int = 1,
    shared_storage: SharedStorageDomain | None = None,
) -> SimReplica | SimDPServer:
    """A plain replica, or a data-parallel server of ``data_parallel_size`` engines (every
    engine mounting ``shared_storage`` when given)."""
    if data_parallel_size > 1:
        return SimDPServer(config, tokenizer, data_parallel_size, shared_storage)
    return SimReplica(config, tokenizer, create_app, shared_storage)


def engines_of(server: SimReplica | SimDPServer) -> list[SimReplica]:
    """The engines behind a server (a plain replica is its own engine)."""
    return list(server.engines) if isinstance(server, SimDPServer) else [server]


def _free_port_run(host: str, n: int, avoid: set[int], tries: int = 64) -> int:
    """The first of ``n`` consecutive TCP ports free on ``host`` now (vLLM's rank layout)."""
    for _ in range(tries):
        with socket.socket() as probe:
            probe.bind((host, 0))
            base = probe.getsockname()[1]
        if base + n > 65535 or avoid & set(range(base, base + n)):
            continue
        held: list[socket.socket] = []
        try:
            for port in range(base, base + n):
                s = socket.socket()
                held.append(s)
                s.bind((host, port))
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
        return base
    raise RuntimeError(f"no run of {n} free ports on {host}")


def _merge_pages(pages: list[bytes]) -> bytes:
    """Prometheus text pages of the engines as one page: each family's HELP/TYPE once, then
    every engine's samples (as one registry with an ``engine`` label prints them)."""
    order: list[str] = []
    heads: dict[str, list[str]] = {}
    samples: dict[str, list[str]] = {}
    for page in pages:
        family = ""
        for line in page.decode().splitlines():
            if line.startswith("# HELP ") or line.startswith("# TYPE "):
                family = line.split(" ", 3)[2]
                if family not in heads:
                    order.append(family)
                    heads[family], samples[family] = [], []
                if len(heads[family]) < 2 and line not in heads[family]:
                    heads[family].append(line)
            elif line:
                samples.setdefault(family, []).append(line)
                if family not in heads:
                    order.append(family)
                    heads[family] = []
    out = []
    for family in order:
        out += heads[family] + samples[family]
    return ("\n".join(out) + "\n").encode()


class _Metrics:
    def __init__(self, server: SimDPServer) -> None:
        self.server = server

    def render(self) -> bytes:
        return _merge_pages([e.metrics.render() for e in self.server.engines])


class SimDPServer:
    """One simulated vLLM server with ``size`` engine ranks; runs on the fleet's loop."""

    def __init__(
        self,
        config: SimReplicaConfig,
        tokenizer: SimTokenizer,
        size: int,
        shared_storage: SharedStorageDomain | None = None,
    ) -> None:
        if size < 1:
            raise ValueError("data_parallel_size must be >= 1")
        self.config = config
        self.tokenizer = tokenizer
        self.size = size
        self.engines = [
            SimReplica(
                dataclasses.replace(config, name=f"{config.name}#dp{r}", dp_rank=r),
                tokenizer,
                shared_storage=shared_storage,
            )
            for r in range(size)
        ]
        self.metrics = _Metrics(self)
        # One set of faults for the server and its engines; one record of what it received.
        self.faults = ReplicaFaults()
        self.seen = RequestLog()
        for engine in self.engines:
            engine.faults = self.faults
        # Requests the server sent each engine and has not finished (vLLM's engine_inflight).
        self.in_flight = [0] * size
        self.pinned = [0] * size  # requests that came with the rank header
        self.balanced = [0] * size  # requests the server placed itself
        self.alive = False
        self.host = "127.0.0.1"
        self.port = 0
        self.events_port = 0
        self.replay_port = 0
        self._http = SocketHTTPServer()

    # --- what the HTTP handlers (bench/sim/api.py) use -------------------------------------------

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def topic(self) -> str:
        return f"kv@{self.host}:{self.port}@{self.config.model}"

    def check_length(self, prompt_tokens: int, max_tokens: int) -> str | None:
        return self.engines[0].check_length(prompt_tokens, max_tokens)

    def generate(
        self,
        prompt: list[int],
        max_tokens: int,
        *,
        cache_salt: str | None = None,
        lora_name: str | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> AsyncIterator[tuple[Generation, list[int]]]:
        """Run on the rank the ASGI wrapper chose for this request (least loaded without)."""
        rank = _rank.get()
        if rank is None:
            rank = self.pick()
        return self.engines[rank].generate(
            prompt,
            max_tokens,
            cache_salt=cache_salt,
            lora_name=lora_name,
            kv_transfer_params=kv_transfer_params,
        )

    def reset_prefix_cache(self, *, every_tier: bool = False) -> bool:
        """Every engine's device cache (vLLM resets all ranks); False while one is busy."""
        results = [e.reset_prefix_cache(every_tier=every_tier) for e in self.engines if e.alive]
        return all(results)

    # --- placement ----------------------------------------------------------------------------

    def load(self, rank: int) -> int:
        engine = self.engines[rank]
        queued = engine.scheduler.num_running + engine.scheduler.num_waiting
        return max(self.in_flight[rank], queued)

    def pick(self) -> int:
        """vLLM's DP balancer without a header: the least loaded live engine, ties to the
        lowest rank."""
        ranks = [r for r, e in enumerate(self.engines) if e.alive] or list(range(self.size))
        return min(ranks, key=lambda r: (self.load(r), r))

    def kv_event_sources(self) -> dict[str, dict[str, Any]]:
        """What vLLM 0.32's ``GET /kv_event_sources`` answers: per live rank its publisher's
        resolved config (ports offset by the rank, host as configured: ``*``)."""
        return {
            str(r): {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": f"tcp://*:{self.events_port + r}",
                "replay_endpoint": f"tcp://*:{self.replay_port + r}",
                "buffer_steps": 10_000,
                "hwm": 100_000,
                "max_queue_size": 100_000,
                "topic": self.topic,
            }
            for r, e in enumerate(self.engines)
            if e.alive
        }

    def describe(self) -> dict[str, object]:
        return {
            "name": self.config.name,
            "url": self.url,
            "events": f"tcp://{self.host}:{self.events_port}",
            "replay": f"tcp://{self.host}:{self.replay_port}",
            "topic": self.topic,
            "alive": self.alive,
            "data_parallel_size": self.size,
            "ranks": [e.describe() for e in self.engines],
            "block_size": self.config.block_size,
            "gpu_blocks": self.config.gpu_blocks,
            "cpu_blocks": self.config.cpu_blocks,
            "storage_blocks": self.config.storage_blocks,
            "storage_domain": self.engines[0].describe()["storage_domain"],
        }

    # --- lifecycle ----------------------------------------------------------------------------

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> None:
        """Bind HTTP, then each engine's PUB and replay sockets on consecutive ports (kept
        across restarts)."""
        self.host = host
        self.port = self._http.bind(host, port)
        if not self.events_port:
            self.events_port = _free_port_run(host, self.size, {self.port})
            avoid = {self.port, *range(self.events_port, self.events_port + self.size)}
            self.replay_port = _free_port_run(host, self.size, avoid)
        for r, engine in enumerate(self.engines):
            engine.events_endpoint = f"tcp://{host}:{self.events_port + r}"
            engine.replay_endpoint = f"tcp://{host}:{self.replay_port + r}"
            await engine.start_engine(host, self.port)
        await self._http.serve(_DPApp(create_app(self), self), f"server {self.config.name}")
        self.alive = True

    async def _shutdown(self, *, force: bool) -> None:
        self.alive = False
        await self._http.shutdown(force=force)

    async def stop(self) -> None:
        await self._shutdown(force=False)
        for engine in self.engines:
            await engine.stop()

    async def kill(self) -> None:
        """The whole server dies (every engine: vLLM does not outlive one of its engines)."""
        await self._shutdown(force=True)
        for engine in self.engines:
            if engine.alive:
                await engine.kill()

    async def restart(self) -> None:
        if self.alive:
            await self.kill()
        for engine in self.engines:
            engine.renew()
        self.in_flight = [0] * self.size
        await self.start(self.host, self.port)


class _DPApp:
    """ASGI wrapper: serves ``/kv_event_sources``, picks the rank of each completion (header
    or balancer) for ``SimDPServer.generate``, and names it in the answer."""

    def __init__(self, app: Any, server: SimDPServer) -> None:
        self.app = app
        self.server = server

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        if path == "/kv_event_sources" and scope["method"] == "GET":
            await _send_json(send, 200, self.server.kv_event_sources())
            return
        if scope["method"] != "POST" or not path.startswith("/v1/"):
            # The engine-free endpoints (tokenize, metrics, health, models, reset) stay whole.
            await self.app(scope, receive, send)
            return
        server = self.server
        rank: int | None = None
        for name, value in scope["headers"]:
            if name == RANK_HEADER:
                with contextlib.suppress(ValueError):
                    rank = int(value)
        if rank is not None and not 0 <= rank < server.size:
            message = f"data_parallel_rank {rank} is out of range [0, {server.size})."
            error = {"message": message, "type": "BadRequestError", "param": None, "code": 400}
            await _send_json(send, 400, {"error": error})
            return
        if rank is None:
            rank = server.pick()
            server.balanced[rank] += 1
        else:
            server.pinned[rank] += 1
        served = str(rank).encode()

        async def send_with_rank(message: Any) -> None:
            if message["type"] == "http.response.start":
                message = dict(message)
                message["headers"] = [*message.get("headers", []), (SERVED_RANK_HEADER, served)]
            await send(message)

        server.in_flight[rank] += 1
        token = _rank.set(rank)
        try:
            await self.app(scope, receive, send_with_rank)
        finally:
            _rank.reset(token)
            server.in_flight[rank] -= 1


async def _send_json(send: Any, status: int, body: Any) -> None:
    payload = _json.encode(body)
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(payload)).encode()),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
