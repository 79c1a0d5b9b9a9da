"""The ``kvroute`` command: one entry point, a subcommand per job.

Each subcommand lives in the package that owns it and exposes ``add_arguments(parser)`` plus
``main(args) -> int`` (servers, launchers) or ``run(args) -> dict`` (benchmarks, whose result is
printed as JSON with ``--json`` and as a table otherwise). This module only wires them up.

Only the chosen subcommand's module is imported: the tables below name every subcommand, so
``kvroute --help`` needs none of them, and ``kvroute serve`` does not pay for (or need) the
torch and vLLM imports of the benchmarks and the connector.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

__all__ = ["main"]

# subcommand -> (module, help)
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("kvroute.router.cli", "run the cache-aware OpenAI-compatible router"),
    "up": (
        "kvroute.deploy.launcher",
        "start a local fleet (vLLM or simulated replicas) and the router",
    ),
    "sim": ("kvroute.bench.sim.fleet", "run simulated vLLM replicas (API, metrics and KV events)"),
    "demo": (
        "kvroute.deploy.demo",
        "start a fleet, drive a multi-turn chat workload, compare policies",
    ),
    "tiny-model": (
        "kvroute.deploy.tiny_model",
        "build the tiny local Llama model used on CPU machines",
    ),
}
# ``kvroute storage <job>``: jobs on a storage domain (a directory replicas share)
STORAGE: dict[str, tuple[str, str]] = {
    "gc": (
        "kvroute.connector.storage_gc_cli",
        "keep a storage domain under its byte budget, publishing removals as KV events",
    ),
}
BENCHES: dict[str, tuple[str, str]] = {
    "indexer": (
        "kvroute.bench.indexer_bench",
        "event ingest throughput, lookup latency, memory/entry",
    ),
    "proxy": ("kvroute.bench.proxy_bench", "latency the router adds over a direct upstream"),
    "connector": ("kvroute.bench.connector_bench", "tier store/load throughput and CPU-hit TTFT"),
    "routing": ("kvroute.bench.routing_bench", "routing quality per policy on the simulated fleet"),
    "admission": (
        "kvroute.bench.admission_bench",
        "a saturated fleet: queue by priority and cost vs FCFS vs refusing (2x capacity)",
    ),
    "compare": (
        "kvroute.bench.compare",
        "two arms' TTFT percentiles from paired routing runs, with bootstrap intervals",
    ),
    "tokenizer": (
        "kvroute.bench.tokenizer_bench",
        "chat render and encode cost per request, one router and several",
    ),
    "trace-gen": (
        "kvroute.bench.workloads.trace_gen",
        "write a synthetic trace in the Mooncake format (for bench routing --trace)",
    ),
}


def _load(module_name: str) -> ModuleType | ImportError:
    try:
        return importlib.import_module(module_name)
    except ImportError as exc:
        return exc


def _print_table(result: Any, indent: str = "") -> None:
    if isinstance(result, dict):
        for key, value in result.items():
            if isinstance(value, dict | list):
                print(f"{indent}{key}:")
                _print_table(value, indent + "  ")
            else:
                print(f"{indent}{key:<32} {value}")
    elif isinstance(result, list):
        for item in result:
            _print_table(item, indent + "  ")
            print()
    else:
        print(f"{indent}{result}")


def _wire(parser: argparse.ArgumentParser, module_name: str) -> None:
    """Import the chosen subcommand's module and let it add its arguments."""
    module = _load(module_name)
    if isinstance(module, ImportError):
        # Take any arguments, so that the import error is what the user reads.
        parser.add_argument("argv", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
        parser.set_defaults(_missing=f"{module_name} could not be imported: {module}")
        return
    if hasattr(module, "add_arguments"):
        module.add_arguments(parser)
        parser.set_defaults(_module=module, _argv=None)
    else:  # a module with its own argv parser: hand it the rest of the command line
        parser.add_argument("argv", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
        parser.set_defaults(_module=module, _argv=True)


def _chosen(argv: Sequence[str]) -> tuple[str | None, str | None]:
    """The subcommand and benchmark names ``argv`` asks for (the first words that are not
    options), before any parsing: they decide which one module gets imported."""
    words = [arg for arg in argv if not arg.startswith("-")]
    command = words[0] if words else None
    bench = words[1] if command in ("bench", "storage") and len(words) > 1 else None
    return command, bench


def build_parser(argv: Sequence[str] = ()) -> argparse.ArgumentParser:
    """The full command line parser, with the arguments of the subcommand ``argv`` chooses
    (and only that one's module imported); the others are listed by name and help."""
    command, bench_name = _chosen(argv)
    parser = argparse.ArgumentParser(prog="kvroute", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module_name, help_text) in COMMANDS.items():
        command_parser = sub.add_parser(name, help=help_text, description=help_text)
        if name == command:
            _wire(command_parser, module_name)
    storage = sub.add_parser("storage", help="jobs on a shared storage domain")
    storage_sub = storage.add_subparsers(dest="job", required=True)
    for name, (module_name, help_text) in STORAGE.items():
        job_parser = storage_sub.add_parser(name, help=help_text, description=help_text)
        if command == "storage" and name == bench_name:
            _wire(job_parser, module_name)
    bench = sub.add_parser("bench", help="benchmarks with JSON output")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    for name, (module_name, help_text) in BENCHES.items():
        bench_parser = bench_sub.add_parser(name, help=help_text, description=help_text)
        if command == "bench" and name == bench_name:
            _wire(bench_parser, module_name)
            bench_parser.add_argument(
                "--json", action="store_true", help="print the result as JSON"
            )
            bench_parser.add_argument("--out", help="also write the JSON result to this file")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(argv).parse_args(argv)
    missing = getattr(args, "_missing", None)
    if missing:
        print(f"kvroute: {missing}", file=sys.stderr)
        return 2
    module = args._module
    if args.command == "bench":
        try:
            result = module.run(args)
        except ValueError as exc:  # bad input (a flag, a trace file): its message, no traceback
            print(f"kvroute bench {args.bench}: {exc}", file=sys.stderr)
            return 2
        text = json.dumps(result, indent=2)
        if args.out:
            with open(args.out, "w", encoding="utf-8") as fh:
                fh.write(text + "\n")
        if args.json:
            print(text)
        else:
            _print_table(result)
        return 0
    if args._argv:
        return int(module.main(args.argv) or 0)
    return int(module.main(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
