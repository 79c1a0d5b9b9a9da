"""What a local fleet is told: ``FleetConfig`` and the command-line flags that build one.

``kvroute up`` and ``kvroute demo`` share these flags (``add_fleet_arguments``); the demo and the
tests build a ``FleetConfig`` directly.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvroute.deploy.state_dir import default_state_dir
from kvroute.router.routing.policies import POLICIES as _POLICY_CLASSES

__all__ = [
    "ENGINES",
    "POLICIES",
    "FleetConfig",
    "add_fleet_arguments",
    "add_key_arguments",
    "config_from_args",
]

ENGINES = ("vllm", "sim")
POLICIES = tuple(_POLICY_CLASSES)  # the router's policies, by name


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
    state_dir: Path = field(default_factory=lambda: default_state_dir() / "fleet")
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
    # API keys: what clients must send the router, and what the replicas are started with
    # (vLLM's --api-key; the router sends it). Passed to children by environment, never argv.
    api_key: str | None = field(default=None, repr=False)
    replica_api_key: str | None = field(default=None, repr=False)
    ready_timeout_s: float = 420.0
    # Prefill/decode disaggregation: the first ``prefill`` replicas serve the prefill leg,
    # the next ``decode`` the decode leg (``replicas`` is then their sum); 0 and 0: all both.
    prefill: int = 0
    decode: int = 0

    def roles(self) -> list[str]:
        """Each replica's P/D role, in order (router/routing/disagg.py)."""
        if not (self.prefill or self.decode):
            return ["both"] * self.replicas
        return ["prefill"] * self.prefill + ["decode"] * self.decode

    def validate(self) -> None:
        if self.prefill or self.decode:
            if self.prefill < 1 or self.decode < 1:
                raise ValueError("--prefill and --decode go together, each >= 1")
            if self.engine != "sim" and not self.connector:
                raise ValueError(
                    "--prefill/--decode with real vLLM run kvroute's connector on a shared "
                    "storage domain (the P/D transport): drop --no-connector, or start "
                    "NixlConnector pools yourself (docs/router.md, P/D)"
                )
            self.replicas = self.prefill + self.decode
        if self.replicas < 1:
            raise ValueError("--replicas must be >= 1")
        if self.engine not in ENGINES:
            raise ValueError(f"--engine must be one of {ENGINES}")
        if self.policy not in POLICIES:
            raise ValueError(f"--policy must be one of {POLICIES}")
        for flag, key in (("--api-key", self.api_key), ("--replica-api-key", self.replica_api_key)):
            if key is not None and not key.strip():
                raise ValueError(f"{flag} is empty: give a non-empty key, or none at all")
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


def add_fleet_arguments(parser: argparse.ArgumentParser, *, replicas: int = 2) -> None:
    """Flags shared by ``kvroute up`` and ``kvroute demo``."""
    parser.add_argument("--replicas", type=int, default=replicas, help="number of replicas")
    parser.add_argument(
        "--prefill",
        type=int,
        default=0,
        help="prefill/decode disaggregation: this many prefill replicas (with --decode)",
    )
    parser.add_argument(
        "--decode", type=int, default=0, help="this many decode replicas (with --prefill)"
    )
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
    parser.add_argument(
        "--state-dir",
        type=Path,
        help="logs, sockets and disk tiers (default: a folder in $KVROUTE_STATE_DIR, else in "
        "$XDG_CACHE_HOME/kvroute or ~/.cache/kvroute)",
    )
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


def add_key_arguments(parser: argparse.ArgumentParser) -> None:
    """``kvroute up``'s API-key flags (the demo, which sends requests itself, has none)."""
    parser.add_argument(
        "--api-key",
        help="clients must send the router 'Authorization: Bearer KEY' (default: "
        "$KVROUTE_API_KEY); /health and /metrics stay open",
    )
    parser.add_argument(
        "--replica-api-key",
        help="start every replica with this --api-key; the router sends it to them "
        "(default: $KVROUTE_REPLICA_API_KEY)",
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
        "prefill": getattr(args, "prefill", 0),
        "decode": getattr(args, "decode", 0),
    }
    if hasattr(args, "api_key"):  # add_key_arguments
        values["api_key"] = args.api_key or os.environ.get("KVROUTE_API_KEY")
        values["replica_api_key"] = args.replica_api_key or os.environ.get(
            "KVROUTE_REPLICA_API_KEY"
        )
    if args.state_dir is not None:
        values["state_dir"] = args.state_dir
    values.update(overrides)
    return FleetConfig(**values)
