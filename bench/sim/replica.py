"""One simulated vLLM replica: engine (cache + scheduler + events) and its lifecycle.

The HTTP layer (kvroute.bench.sim.api) calls ``generate``; the fleet calls ``start``, ``kill``,
``restart``. The replica knows no HTTP: it serves whatever ASGI app its ``app_factory`` builds
for it (kvroute.bench.sim.api.create_app, given by kvroute.bench.sim.dp.make_server).

A killed replica behaves like a dead process: its port refuses connections, its event
publisher is gone, in-flight requests fail, device and CPU caches are lost. A restart
binds the same ports again with a new publisher (sequence numbers from 0, an empty replay
buffer) and keeps the STORAGE tier, which it re-announces in its first batch, as a storage
connector that indexes its store at start-up would.

A data-parallel server (bench/sim/dp.py) runs several replicas as its engines: each started with
``start_engine`` (publisher and scheduler, no HTTP of its own), its events carrying its rank.
"""

from __future__ import annotations

import asyncio
import random
import socket
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from kvroute.bench.publisher import EventPublisher
from kvroute.bench.sim.cache import TieredPrefixCache
from kvroute.bench.sim.disagg import BOARD, parse_transfer_params
from kvroute.bench.sim.faults import ReplicaFaults, RequestLog
from kvroute.bench.sim.hashing import EngineHasher
from kvroute.bench.sim.http_server import SocketHTTPServer
from kvroute.bench.sim.latency import LatencyModel
from kvroute.bench.sim.metrics import ReplicaMetrics
from kvroute.bench.sim.scheduler import ReplicaDied, Scheduler, SimRequest
from kvroute.bench.sim.storage import SharedStorageDomain
from kvroute.bench.sim.tokenizer import SimTokenizer
from kvroute.indexer.keys import request_extra_keys
from kvroute.indexer.wire import Event

__all__ = ["InjectedError", "SimReplica", "SimReplicaConfig"]


class InjectedError(RuntimeError):
    """A failure the fault injection chose for this request."""


@dataclass(slots=True)
class SimReplicaConfig:
    """Everything that shapes one replica. Capacities are in blocks of ``block_size`` tokens."""

    name: str
    model: str = "kvroute-sim"
    block_size: int = 16
    gpu_blocks: int = 8192
    cpu_blocks: int = 0
    storage_blocks: int = 0
    max_num_seqs: int = 64
    max_model_len: int = 32768
    latency: LatencyModel = field(default_factory=LatencyModel)
    hash_seed: str | None = None
    default_max_tokens: int = 16
    stream_interval_s: float = 0.02
    error_rate: float = 0.0
    drop_event_rate: float = 0.0
    seed: int = 0
    # The engine's rank inside a data-parallel server (bench/sim/dp.py): the ``engine`` label of
    # its metrics and the third element of its event payloads. None: a plain replica.
    dp_rank: int | None = None
    # LoRA adapters served besides the base model (``--lora-modules``): listed in /v1/models,
    # accepted as a request's model, their blocks keyed apart by the adapter's name.
    loras: tuple[str, ...] = ()
    # The server's ``--chat-template`` (the template text); None: the tokenizer's own.
    chat_template: str | None = None
    # ``--enable-scale-out``: serve the render endpoints; without it vLLM answers them 403.
    scale_out: bool = False
    # ``--api-key``: the paths vLLM guards need ``Authorization: Bearer <key>`` (sim api).
    api_key: str | None = field(default=None, repr=False)
    # P/D (bench/sim/disagg.py): a NixlConnector (kv_both) that serves both legs; how long a
    # prefill's blocks are held for the decode's pull (vLLM: 30 s); what a pull from a dead
    # prefill process costs before the decode recomputes (vLLM: about 5 s).
    nixl: bool = True
    pd_lease_s: float = 30.0
    dead_side_channel_s: float = 0.0


@dataclass(slots=True)
class Generation:
    """What the HTTP layer needs of a running request, filled in as it progresses."""

    prompt_tokens: int
    max_tokens: int
    cached_tokens: int = 0
    output: list[int] = field(default_factory=list)
    kv_transfer_params: dict[str, Any] | None = None  # a prefill leg's answer (P/D)


async def _port_released(endpoint: str, timeout_s: float = 5.0) -> None:
    """Wait until a tcp endpoint's port can be bound again: a closed ZMQ socket releases its
    port on ZMQ's I/O thread, a moment after ``close`` returns."""
    host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    if not endpoint.startswith("tcp://") or not port.isdigit() or int(port) == 0:
        return
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((host, int(port)))
                return
            except OSError:
                if loop.time() > deadline:
                    raise
        await asyncio.sleep(0.02)


class SimReplica:
    """A replica of the simulated fleet; every method runs on the fleet's asyncio loop."""

    def __init__(
        self,
        config: SimReplicaConfig,
        tokenizer: SimTokenizer,
        app_factory: Callable[[SimReplica], Any] | None = None,
        shared_storage: SharedStorageDomain | None = None,
    ) -> None:
        self.config = config
        # The shared STORAGE tier this replica mounts (bench/sim/storage.py); None: its own.
        self.shared_storage = shared_storage
        self.app_factory = app_factory  # builds the ASGI app ``start`` serves
        self.faults = ReplicaFaults()
        self.seen = RequestLog()
        self.requests_aborted = 0  # stopped before their end (client gone, stream broken)
        self.tokenizer = tokenizer
        self.hasher = EngineHasher(config.hash_seed)
        self.cache = TieredPrefixCache(
            config.block_size,
            config.gpu_blocks,
            config.cpu_blocks,
            config.storage_blocks,
            shared=shared_storage,
        )
        self.rng = random.Random(f"{config.seed}/{config.name}")
        self.scheduler = self._new_scheduler()
        self.metrics = self._new_metrics()
        self.publisher: EventPublisher | None = None
        self.alive = False
        self.host = "127.0.0.1"
        self.port = 0
        self.events_endpoint = ""
        self.replay_endpoint = ""
        self.batches_dropped = 0
        self._http = SocketHTTPServer()
        self._pending_events: list[Event] = []
        self._serves_http = True  # False for an engine of a data-parallel server

    def _new_metrics(self) -> ReplicaMetrics:
        return ReplicaMetrics(
            self.scheduler, self.config.model, engine=str(self.config.dp_rank or 0)
        )

    def _new_scheduler(self) -> Scheduler:
        return Scheduler(
            self.cache,
            self.config.latency,
            max_num_seqs=self.config.max_num_seqs,
            publish=self._publish,
            hasher=self.hasher,
        )

    # --- identity -----------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def engine_id(self) -> str:
        """vLLM's engine id, new with each process (a restart is a new engine)."""
        return f"{self.config.name}-{id(self.scheduler):x}"

    @property
    def topic(self) -> str:
        """vLLM's recommended topic: ``kv@<host:port>@<model>``."""
        return f"kv@{self.host}:{self.port}@{self.config.model}"

    def describe(self) -> dict[str, object]:
        return {
            "name": self.config.name,
            "url": self.url,
            "events": self.events_endpoint,
            "replay": self.replay_endpoint,
            "topic": self.topic,
            "alive": self.alive,
            "block_size": self.config.block_size,
            "gpu_blocks": self.config.gpu_blocks,
            "cpu_blocks": self.config.cpu_blocks,
            "storage_blocks": self.config.storage_blocks,
            "storage_domain": None if self.shared_storage is None else self.shared_storage.name,
        }

    # --- events -------------------------------------------------------------------------------

    def _publish(self, events: list[Event]) -> None:
        if self.publisher is None:
            return
        drop = self.config.drop_event_rate > 0 and self.rng.random() < self.config.drop_event_rate
        if drop:
            self.batches_dropped += 1
        self.publisher.publish(events, drop=drop)
        if self.shared_storage is not None:
            self.shared_storage.flush()  # the evictions this batch's writes caused

    # --- lifecycle ----------------------------------------------------------------------------

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> None:
        """Bind HTTP, PUB and replay sockets (port 0: free ports, kept across restarts)."""
        if self.app_factory is None:
            raise RuntimeError(f"replica {self.config.name} has no app_factory to serve")
        self.host = host
        self.port = self._http.bind(host, port)
        for endpoint in (self.events_endpoint, self.replay_endpoint):
            await _port_released(endpoint)  # a restart re-binds them: ZMQ frees them late
        self._open_engine(host)
        await self._http.serve(self.app_factory(self), f"replica {self.config.name}")
        self._go_live()

    def _open_engine(self, host: str) -> None:
        """The publisher (same endpoints as before a restart) and the scheduler."""
        self.publisher = EventPublisher(
            self.events_endpoint or f"tcp://{host}:0",
            replay_endpoint=self.replay_endpoint or f"tcp://{host}:0",
            topic=self.topic,
            bind=True,
            data_parallel_rank=self.config.dp_rank,
        )
        self.events_endpoint = self.publisher.endpoint
        self.replay_endpoint = self.publisher.replay_endpoint or ""
        self.scheduler.start()

    def _go_live(self) -> None:
        self.alive = True
        if self._pending_events:
            self._publish(self._pending_events)
            self._pending_events = []

    async def start_engine(self, host: str, port: int) -> None:
        """Start as an engine of a data-parallel server listening on ``host:port``: publisher
        and scheduler only (set ``events_endpoint``/``replay_endpoint`` first for fixed
        ports); the server owns HTTP."""
        self._serves_http = False
        self.host, self.port = host, port
        for endpoint in (self.events_endpoint, self.replay_endpoint):
            await _port_released(endpoint)
        self._open_engine(host)
        self._go_live()

    async def stop(self) -> None:
        """Shut down cleanly (the fleet is exiting)."""
        await self._shutdown(force=False)

    async def kill(self) -> None:
        """Die like a crashed process: connections drop, device and CPU caches are lost."""
        await self._shutdown(force=True)
        survivors = self.cache.restart()
        self.cache.announce(survivors)  # a shared domain survives too, never re-announced
        self._pending_events = self.cache.take_events()

    async def restart(self, down_s: float = 0.0) -> None:
        """Come back on the same ports with a fresh publisher (seq from 0), after ``down_s``
        wall seconds with nothing listening; an engine of a data-parallel server restarts
        alone, its server still answering."""
        if self.alive:
            await self.kill()
        if down_s > 0:
            await asyncio.sleep(down_s)
        self.renew()
        if self._serves_http:
            await self.start(self.host, self.port)
        else:
            await self.start_engine(self.host, self.port)

    def renew(self) -> None:
        """A new process's scheduler and metrics (the caches are the cache's business)."""
        self.scheduler = self._new_scheduler()
        self.metrics = self._new_metrics()

    async def _shutdown(self, *, force: bool) -> None:
        self.alive = False
        await self.scheduler.stop()
        await self._http.shutdown(force=force)
        if self.publisher is not None:
            self.publisher.close()
            self.publisher = None

    def reset_prefix_cache(self, *, every_tier: bool = False) -> bool:
        """vLLM's POST /reset_prefix_cache: the device tier dropped, AllBlocksCleared published
        (lower tiers kept, as vLLM keeps its offloaded tiers, unless ``every_tier``)."""
        ok = self.cache.reset(every_tier=every_tier)
        if ok:
            self._publish(self.cache.take_events())
        return ok

    # --- requests -----------------------------------------------------------------------------

    def check_length(self, prompt_tokens: int, max_tokens: int) -> str | None:
        """vLLM's length errors, as its message words them (None: the request fits)."""
        total = prompt_tokens + max_tokens
        if total > self.config.max_model_len:
            return (
                f"This model's maximum context length is {self.config.max_model_len} tokens. "
                f"However, you requested {total} tokens ({prompt_tokens} in the messages, "
                f"{max_tokens} in the completion). Please reduce the length of the messages "
                "or completion."
            )
        blocks = -(-total // self.config.block_size)
        if blocks > self.config.gpu_blocks:
            return (
                f"The request needs {blocks} KV cache blocks but the replica has only "
                f"{self.config.gpu_blocks}. Please reduce the length of the messages or completion."
            )
        return None

    async def generate(
        self,
        prompt: list[int],
        max_tokens: int,
        *,
        cache_salt: str | None = None,
        lora_name: str | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> AsyncIterator[tuple[Generation, list[int]]]:
        """Run one request; yields (state, new token ids) after prefill and per decode chunk.

        Raises InjectedError (fault injection) or ReplicaDied. Always releases the request's
        blocks, also when the consumer stops early (client disconnect). A latency model whose
        decode step costs nothing yields one token per chunk, as fast as the loop runs.
        """
        if self.config.error_rate > 0 and self.rng.random() < self.config.error_rate:
            raise InjectedError("injected failure (simulated engine error)")
        if self.faults.admit_delay_s:
            await asyncio.sleep(self.faults.admit_delay_s)
        bs = self.config.block_size
        extra = request_extra_keys(len(prompt) // bs, cache_salt=cache_salt, lora_name=lora_name)
        req = SimRequest(
            prompt=prompt,
            digests=self.hasher.chain(prompt, bs, extra_keys=extra),
            extra_keys=extra,
            max_tokens=max_tokens,
            lora_name=lora_name,
        )
        gen = Generation(prompt_tokens=len(prompt), max_tokens=max_tokens)
        prefill_leg, pull_from = (
            parse_transfer_params({"kv_transfer_params": kv_transfer_params})
            if self.config.nixl
            else (False, None)
        )
        req.hold = prefill_leg
        if pull_from is not None:
            pull, dead = BOARD.take(pull_from, len(prompt), bs)
            if pull is not None:
                req.pull_tokens, req.remote_cached_tokens = pull.tokens, pull.prefill_cached_tokens
            else:
                self.scheduler.stats.nixl_failed_transfers += 1
                if dead and self.config.dead_side_channel_s:
                    await asyncio.sleep(
                        self.config.dead_side_channel_s * self.config.latency.time_scale
                    )
        sched = self.scheduler
        lat = self.config.latency
        finished = False
        try:
            t_first = await sched.prefill(req)
            gen.cached_tokens = req.cached_tokens
            if self.faults.prefill_delay_s:
                await asyncio.sleep(self.faults.prefill_delay_s)
                t_first = sched.now()
            self.metrics.observe_ttft(t_first - req.arrival)
            output = self.tokenizer.generate(prompt, max_tokens)
            gen.output = output[:1]
            yield gen, output[:1]
            progress = 0.0
            last = sched.now()
            while len(gen.output) < max_tokens:
                # the step model: the step's prefill chunk delays every decode in it
                step = lat.decode_step(sched.num_running) + sched.prefill_step_s()
                await asyncio.sleep(max(self.config.stream_interval_s, step * lat.time_scale))
                if sched is not self.scheduler or not self.alive:
                    raise ReplicaDied("replica died")
                now = sched.now()
                progress += (now - last) / step if step > 0 else 1.0
                last = now
                n = min(int(progress), max_tokens - len(gen.output))
                if n <= 0:
                    continue
                progress -= n
                new = output[len(gen.output) : len(gen.output) + n]
                gen.output.extend(new)
                yield gen, new
            finished = True
            sched.finish(req, gen.output)
            if req.hold and sched is self.scheduler:
                gen.kv_transfer_params = BOARD.hold(self, req)
            self.metrics.observe_e2e(sched.now() - req.arrival)
        except (asyncio.CancelledError, GeneratorExit):
            self.requests_aborted += 1
            raise
        finally:
            if not finished:
                sched.abort(req)
