"""``kvroute bench proxy``: what the router adds to a request, and how many it can pass.

One run measures a fast upstream twice, directly and through one router process, with the
same load generator, so every figure is a difference or a ratio against a baseline taken
minutes apart on the same machine:
- added latency = p50/p99 through the router minus p50/p99 direct, at concurrency 1 and 64;
- requests/s through the router at concurrency 64 (and direct, the harness's own ceiling).

Three processes, so no two share a GIL: the upstream (a minimal OpenAI-compatible ASGI app
answering a fixed completion), the router (``python -m router.cli``, uvicorn, 1 worker,
uvloop/httptools when installed, the default kvroute policy with a local tokenizer), and the
load generator (this process: a raw keep-alive HTTP/1.1 client on uvloop, far cheaper than
an HTTP library, so it does not hide the router's cost). With ``--pin`` (default on when the
machine has >= 2 cores) the router gets a core of its own: "req/s on one core" is literal.
Every phase is bounded by a request count and a wall-clock limit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["add_arguments", "run"]

_COMPLETION = json.dumps(
    {
        "id": "cmpl-bench",
        "object": "text_completion",
        "created": 0,
        "model": "bench",
        "choices": [{"index": 0, "text": " ok", "finish_reason": "length", "logprobs": None}],
        "usage": {
            "prompt_tokens": 64,
            "completion_tokens": 1,
            "total_tokens": 65,
            "prompt_tokens_details": {"cached_tokens": 0},
        },
    }
).encode()
_MODELS = json.dumps(
    {"object": "list", "data": [{"id": "bench", "object": "model", "parent": None}]}
).encode()
_METRICS = (
    b'vllm:num_requests_running{engine="0"} 0.0\n'
    b'vllm:num_requests_waiting{engine="0"} 0.0\n'
    b'vllm:kv_cache_usage_perc{engine="0"} 0.0\n'
)


async def _upstream_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """The fastest honest upstream: reads the whole body, answers a fixed completion."""
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    more = True
    while more:
        message = await receive()
        more = message.get("more_body", False)
    path = scope["path"]
    if path in ("/v1/completions", "/v1/chat/completions"):
        body, ctype = _COMPLETION, b"application/json"
    elif path == "/v1/models":
        body, ctype = _MODELS, b"application/json"
    elif path == "/metrics":
        body, ctype = _METRICS, b"text/plain"
    else:
        body, ctype = b"", b"text/plain"
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", ctype), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


def serve_upstream(port: int) -> None:
    import uvicorn

    uvicorn.run(
        _upstream_app,
        host="127.0.0.1",
        port=port,
        log_level="warning",
        access_log=False,
        loop="uvloop",
        http="httptools",
        lifespan="on",
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _idlest_core(cores: list[int], window_s: float = 0.5) -> int:
    """The core with the most idle time over ``window_s`` (other jobs may share the machine)."""

    def idle() -> dict[int, int]:
        out = {}
        with open("/proc/stat") as f:
            for line in f:
                name, *fields = line.split()
                if name.startswith("cpu") and name != "cpu":
                    out[int(name[3:])] = int(fields[3]) + int(fields[4])  # idle + iowait
        return out

    try:
        before = idle()
        time.sleep(window_s)
        after = idle()
        return max(cores, key=lambda c: after.get(c, 0) - before.get(c, 0))
    except (OSError, ValueError):
        return cores[0]


def _pin(cores: set[int]) -> Any:
    def apply() -> None:
        if cores:
            os.sched_setaffinity(0, cores)

    return apply


# --- load generator --------------------------------------------------------------------------


async def _load(
    port: int,
    bodies: list[bytes],
    total: int,
    concurrency: int,
    time_limit_s: float,
    rate: float | None = None,
) -> dict[str, Any]:
    """``concurrency`` keep-alive connections; closed loop (each sends as soon as its last
    answer arrived) or, with ``rate``, paced: together they offer ``rate`` req/s."""
    latencies: list[float] = []
    errors = 0
    issued = 0
    deadline = time.monotonic() + time_limit_s
    requests = [
        b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        b"authorization: Bearer bench\r\ncontent-length: %d\r\n\r\n%s" % (len(b), b)
        for b in bodies
    ]

    async def worker(index: int) -> None:
        nonlocal issued, errors
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        interval = concurrency / rate if rate else 0.0
        next_at = time.perf_counter() + interval * index / concurrency
        try:
            while issued < total and time.monotonic() < deadline:
                if interval:
                    delay = next_at - time.perf_counter()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    next_at = max(next_at + interval, time.perf_counter())
                request = requests[issued % len(requests)]
                issued += 1
                t0 = time.perf_counter()
                writer.write(request)
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line[:15].lower() == b"content-length:":
                        length = int(line[15:])
                await reader.readexactly(length)
                latencies.append(time.perf_counter() - t0)
                if not head.startswith(b"HTTP/1.1 200"):
                    errors += 1
        finally:
            writer.close()

    started = time.perf_counter()
    await asyncio.gather(*(worker(i) for i in range(concurrency)))
    elapsed = time.perf_counter() - started
    latencies.sort()
    n = len(latencies)
    return {
        "requests": n,
        "errors": errors,
        "seconds": round(elapsed, 3),
        "rps": round(n / elapsed, 1) if elapsed else 0.0,
        "p50_ms": round(1000 * latencies[n // 2], 3) if n else None,
        "p99_ms": round(1000 * latencies[min(n - 1, int(n * 0.99))], 3) if n else None,
        "mean_ms": round(1000 * statistics.fmean(latencies), 3) if n else None,
    }


def _measure(port: int, bodies: list[bytes], args: argparse.Namespace) -> dict[str, Any]:
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:  # pragma: no cover - uvloop is installed with uvicorn[standard]
        runner = asyncio.run
    runner(_load(port, bodies, args.warmup, 16, args.time_limit_s))
    return {
        "c1": runner(_load(port, bodies, args.requests_c1, 1, args.time_limit_s)),
        "c64_paced": runner(
            _load(port, bodies, args.requests_c64, 64, args.time_limit_s, args.paced_rps)
        ),
        "c64": runner(_load(port, bodies, args.requests_c64, 64, args.time_limit_s)),
    }


def _wait_http(port: int, path: str, timeout_s: float, proc: subprocess.Popen[bytes]) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process for port {port} exited with {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}{path}", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"nothing healthy on port {port}{path} after {timeout_s}s")


def _bodies(n: int) -> list[bytes]:
    """Distinct prompts sharing a system prefix (~120 tokens), like a chat fleet's traffic."""
    prefix = "You are a helpful assistant for a cache-aware router benchmark. " * 8
    return [
        json.dumps(
            {"model": "bench", "prompt": f"{prefix}Question {i}: what is {i} * 7?", "max_tokens": 1}
        ).encode()
        for i in range(n)
    ]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests-c1", type=int, default=1000)
    parser.add_argument("--requests-c64", type=int, default=8000)
    parser.add_argument("--warmup", type=int, default=1000)
    parser.add_argument("--prompts", type=int, default=512, help="distinct prompts cycled")
    parser.add_argument(
        "--paced-rps",
        type=float,
        default=500.0,
        help="offered load of the paced c64 latency phase (req/s over 64 connections)",
    )
    parser.add_argument("--time-limit-s", type=float, default=60.0, help="per phase")
    parser.add_argument("--policy", default="kvroute")
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer dir (default: a tiny local model built on first use)",
    )
    parser.add_argument(
        "--pin",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="give the router a core of its own (default: when >= 2 cores)",
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    tokenizer = args.tokenizer
    if tokenizer is None:
        from deploy.tiny_model import build_tiny_model

        tokenizer = str(build_tiny_model(Path(".kvroute/bench/tiny-model")))
    cores = sorted(os.sched_getaffinity(0))
    pin = args.pin if args.pin is not None else len(cores) >= 2
    router_core = _idlest_core(cores) if pin else None
    router_cores = {router_core} if pin else set()
    other_cores = set(cores) - router_cores if pin else set()
    up_port, router_port = _free_port(), _free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    procs: list[subprocess.Popen[bytes]] = []
    try:
        upstream = subprocess.Popen(
            [sys.executable, "-c", f"import bench.proxy_bench as b; b.serve_upstream({up_port})"],
            env=env,
            preexec_fn=_pin(other_cores),
        )
        procs.append(upstream)
        router = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "router.cli",
                "--replica",
                f"http://127.0.0.1:{up_port}",
                "--port",
                str(router_port),
                "--tokenizer",
                tokenizer,
                "--policy",
                args.policy,
                "--log-level",
                "warning",
                "--no-tokenizer-check",
            ],
            env=env,
            preexec_fn=_pin(router_cores),
        )
        procs.append(router)
        _wait_http(up_port, "/health", 30, upstream)
        _wait_http(router_port, "/health", 60, router)
        if other_cores:
            os.sched_setaffinity(0, other_cores)
        bodies = _bodies(args.prompts)
        direct = _measure(up_port, bodies, args)
        routed = _measure(router_port, bodies, args)
    finally:
        if other_cores:
            os.sched_setaffinity(0, set(cores))
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()

    def added(phase: str, q: str) -> float:
        return round(routed[phase][q] - direct[phase][q], 3)

    result: dict[str, Any] = {
        # Latency at concurrency 64 is measured paced (64 connections offering --paced-rps):
        # closed-loop c64 latency is 64 / throughput by Little's law, a throughput figure.
        "added_p50_ms_c64": added("c64_paced", "p50_ms"),
        "added_p99_ms_c64": added("c64_paced", "p99_ms"),
        "c64_mode": f"paced: 64 connections offering {args.paced_rps:g} req/s",
        "added_p50_ms_c1": added("c1", "p50_ms"),
        "added_p99_ms_c1": added("c1", "p99_ms"),
        "added_p50_ms_c64_closed_loop": added("c64", "p50_ms"),
        "added_p99_ms_c64_closed_loop": added("c64", "p99_ms"),
        "rps": routed["c64"]["rps"],
        "rps_direct": direct["c64"]["rps"],
        "rps_ratio_router_over_direct": round(routed["c64"]["rps"] / direct["c64"]["rps"], 3),
        "targets": {"added_p50_ms_c64": 1.0, "added_p99_ms_c64": 5.0, "rps": 1000},
        "router_pinned_cores": sorted(router_cores) or None,
        "load_average_1m": round(os.getloadavg()[0], 2),
        "cpu_cores": len(cores),
        "policy": args.policy,
        "direct": direct,
        "routed": routed,
    }
    result["meets_targets"] = (
        result["added_p50_ms_c64"] <= 1.0
        and result["added_p99_ms_c64"] <= 5.0
        and result["rps"] >= 1000
    )
    return result


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(description=__doc__)
    add_arguments(_parser)
    print(json.dumps(run(_parser.parse_args()), indent=2))
