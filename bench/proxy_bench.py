"""``kvroute bench proxy``: what the router adds to a request, and how many it can pass.

One run measures a fast upstream twice, directly and through one router process, with the
same load generator, so every figure is a difference or a ratio against a baseline taken
minutes apart on the same machine:
- added latency at concurrency 1 and 64, measured in pairs: each connection sends a request
  straight to the upstream and the same request through the router, back to back (in
  alternating order), so both sides see the same moment's machine. Reported: the quantiles
  of the per-pair difference (``added_*``) and, for reference, each side's own quantiles;
  a per-pair figure cannot come out negative the way a difference of two runs' percentiles
  can on a noisy machine;
- requests/s through the router at concurrency 64 (and direct, the harness's own ceiling);
- overload (``--overload``): an upstream with a fixed capacity (``--overload-slots`` requests
  at a time, ``--overload-service-ms`` each, like vLLM's running batch with a waiting queue
  behind it) offered ``--overload-factor`` times that capacity in an open loop (arrivals do
  not wait for answers), through a router with ``--max-in-flight`` and through one without:
  the share answered 429/503 and the p99 of the requests that were served, against the
  unbounded queue a router without a limit builds.

Three processes, so no two share a GIL: the upstream (a minimal OpenAI-compatible ASGI app
answering a fixed completion), the router (``python -m kvroute.router.cli``, uvicorn, 1 worker,
uvloop/httptools when installed, the default kvroute policy with a local tokenizer), and the
load generator (this process: a raw keep-alive HTTP/1.1 client on uvloop, far cheaper than
an HTTP library, so it does not hide the router's cost). With ``--pin`` (default on when the
machine has >= 2 cores) the router gets a core of its own: "req/s on one core" is literal.
Every phase is bounded by a request count and a wall-clock limit.

With ``--smg`` (default: when smg is installed) SGLang's gateway (bench/peer_gateway.py) is
measured the same way right after kvroute, over the same upstream, on the core kvroute had
(kvroute's router stopped first): its requests/s at c64 and its added latency in pairs,
and ``rps_ratio_kvroute_over_smg``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from typing import Any

from kvroute.bench.peer_gateway import SMG_POLICY, smg_executable, smg_version, start_smg
from kvroute.deploy.processes import ChildError, ChildProcess, free_port
from kvroute.deploy.router_process import ReplicaEndpoint, RouterProcess

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


# What one router process should add and pass on a quiet machine (docs/benchmarks.md).
_TARGETS = {"added_p50_ms_c64": 0.5, "added_p99_ms_c64": 2.0, "rps": 3000}

# kvroute's requests/s against smg's, same upstream, same core, same run (issue 36).
_SMG_TARGET = 1.0

# (slots, seconds per request) when the upstream has a fixed capacity (the overload phase).
_CAPACITY: tuple[asyncio.Semaphore, float] | None = None


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
        if _CAPACITY is not None:
            slots, seconds = _CAPACITY
            async with slots:
                await asyncio.sleep(seconds)
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


def serve_upstream(port: int, slots: int = 0, service_ms: float = 0.0) -> None:
    """Serve the upstream; with ``slots``, at most that many completions at a time, each
    taking ``service_ms`` (the rest wait, as in vLLM's queue)."""
    import uvicorn

    global _CAPACITY
    if slots:
        _CAPACITY = (asyncio.Semaphore(slots), service_ms / 1000)

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


# --- load generator --------------------------------------------------------------------------


def _keep_alive_requests(bodies: list[bytes]) -> list[bytes]:
    """Each body as a whole keep-alive HTTP/1.1 completion request, built once."""
    return [
        b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        b"authorization: Bearer bench\r\ncontent-length: %d\r\n\r\n%s" % (len(b), b)
        for b in bodies
    ]


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
    requests = _keep_alive_requests(bodies)

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
                seconds, status = await _exchange(reader, writer, request)
                latencies.append(seconds)
                if status != 200:
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
        "p50_ms": _quantile_ms(latencies, 0.5),
        "p99_ms": _quantile_ms(latencies, 0.99),
        "mean_ms": round(1000 * statistics.fmean(latencies), 3) if n else None,
    }


def _quantile_ms(values: list[float], p: float) -> float | None:
    """The ``p`` quantile of sorted seconds, in ms (nearest rank)."""
    if not values:
        return None
    return round(1000 * values[min(len(values) - 1, int(len(values) * p))], 3)


async def _exchange(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes
) -> tuple[float, int]:
    """One request on a connection, its whole answer read: (seconds, status code)."""
    t0 = time.perf_counter()
    writer.write(request)
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line[:15].lower() == b"content-length:":
            length = int(line[15:])
    await reader.readexactly(length)
    return time.perf_counter() - t0, int(head[9:12])


async def _paired_load(
    direct_port: int,
    router_port: int,
    bodies: list[bytes],
    pairs: int,
    concurrency: int,
    time_limit_s: float,
    rate: float | None = None,
) -> dict[str, Any]:
    """``concurrency`` workers, each with a keep-alive connection to the upstream and one to
    the router, send every request both ways back to back (the order alternating), at
    ``rate`` pairs/s together when given (else closed loop). Both sides of a pair see the
    same load on the machine, so their difference is what the router added."""
    direct: list[float] = []
    routed: list[float] = []
    diffs: list[float] = []
    errors = {"direct": 0, "routed": 0}
    issued = 0
    deadline = time.monotonic() + time_limit_s
    requests = _keep_alive_requests(bodies)

    async def worker(index: int) -> None:
        nonlocal issued
        d_conn = await asyncio.open_connection("127.0.0.1", direct_port)
        r_conn = await asyncio.open_connection("127.0.0.1", router_port)
        interval = concurrency / rate if rate else 0.0
        next_at = time.perf_counter() + interval * index / concurrency
        try:
            while issued < pairs and time.monotonic() < deadline:
                if interval:
                    delay = next_at - time.perf_counter()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    next_at = max(next_at + interval, time.perf_counter())
                    if issued >= pairs:
                        break
                request = requests[issued % len(requests)]
                router_first = issued % 2 == 1
                issued += 1
                if router_first:
                    r_s, r_status = await _exchange(*r_conn, request)
                    d_s, d_status = await _exchange(*d_conn, request)
                else:
                    d_s, d_status = await _exchange(*d_conn, request)
                    r_s, r_status = await _exchange(*r_conn, request)
                errors["direct"] += d_status != 200
                errors["routed"] += r_status != 200
                direct.append(d_s)
                routed.append(r_s)
                diffs.append(r_s - d_s)
        finally:
            d_conn[1].close()
            r_conn[1].close()

    started = time.perf_counter()
    await asyncio.gather(*(worker(i) for i in range(concurrency)))
    elapsed = time.perf_counter() - started
    for values in (direct, routed, diffs):
        values.sort()

    def side(values: list[float], errs: int) -> dict[str, Any]:
        return {
            "requests": len(values),
            "errors": errs,
            "p50_ms": _quantile_ms(values, 0.5),
            "p99_ms": _quantile_ms(values, 0.99),
            "mean_ms": round(1000 * statistics.fmean(values), 3) if values else None,
        }

    return {
        "pairs": len(diffs),
        "seconds": round(elapsed, 3),
        "pairs_per_s": round(len(diffs) / elapsed, 1) if elapsed else 0.0,
        "added_p50_ms": _quantile_ms(diffs, 0.5),
        "added_p90_ms": _quantile_ms(diffs, 0.9),
        "added_p99_ms": _quantile_ms(diffs, 0.99),
        "direct": side(direct, errors["direct"]),
        "routed": side(routed, errors["routed"]),
    }


async def _open_loop(
    port: int,
    bodies: list[bytes],
    total: int,
    rate: float,
    time_limit_s: float,
    max_open: int = 900,
) -> dict[str, Any]:
    """Offer ``rate`` req/s whatever the answers do (an open loop: a slow server does not slow
    the arrivals, as with many independent clients), one connection per request, at most
    ``max_open`` at once (an arrival past that is counted as not offered)."""
    statuses: dict[int, int] = {}
    served: list[float] = []
    refused: list[float] = []
    failed = not_offered = open_now = 0
    requests = [
        b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(b), b)
        for b in bodies
    ]

    async def one(request: bytes) -> None:
        nonlocal failed, open_now
        open_now += 1
        t0 = time.perf_counter()
        writer = None
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            _, status = await _exchange(reader, writer, request)
            statuses[status] = statuses.get(status, 0) + 1
            (served if status == 200 else refused).append(time.perf_counter() - t0)
        except (OSError, ValueError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            failed += 1
        finally:
            open_now -= 1
            if writer is not None:
                writer.close()

    tasks = []
    started = time.perf_counter()
    for i in range(total):
        delay = started + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if time.perf_counter() - started > time_limit_s:
            break
        if open_now >= max_open:
            not_offered += 1
            continue
        tasks.append(asyncio.create_task(one(requests[i % len(requests)])))
    offered_s = time.perf_counter() - started
    _, pending = (
        await asyncio.wait(tasks, timeout=max(1.0, time_limit_s - offered_s))
        if tasks
        else (
            set(),
            set(),
        )
    )
    for task in pending:
        task.cancel()
    served.sort()
    refused.sort()
    sent = len(tasks)

    return {
        "offered": sent,
        "offered_rps": round(sent / offered_s, 1) if offered_s else 0.0,
        "not_offered": not_offered,
        "unfinished": len(pending),
        "failed": failed,
        "statuses": {str(k): v for k, v in sorted(statuses.items())},
        "served_share": round(len(served) / sent, 4) if sent else None,
        "refused_share": round(len(refused) / sent, 4) if sent else None,
        "served_p50_ms": _quantile_ms(served, 0.5),
        "served_p99_ms": _quantile_ms(served, 0.99),
        "refused_p99_ms": _quantile_ms(refused, 0.99),
    }


def _runner() -> Any:
    try:
        import uvloop

        return uvloop.run
    except ImportError:  # pragma: no cover - uvloop is installed with uvicorn[standard]
        return asyncio.run


def _measure(port: int, bodies: list[bytes], args: argparse.Namespace) -> dict[str, Any]:
    """Closed-loop throughput at concurrency 64 on one side (after a warm-up)."""
    runner = _runner()
    runner(_load(port, bodies, args.warmup, 16, args.time_limit_s))
    return {"c64": runner(_load(port, bodies, args.requests_c64, 64, args.time_limit_s))}


def _measure_added(
    direct_port: int, router_port: int, bodies: list[bytes], args: argparse.Namespace
) -> dict[str, Any]:
    """Added latency, in pairs (see ``_paired_load``): one connection, and 64 connections
    offering ``--paced-rps`` pairs/s (closed-loop c64 latency is 64 / throughput by Little's
    law, a throughput figure, so latency at c64 is measured paced)."""
    runner = _runner()
    return {
        "c1": runner(
            _paired_load(direct_port, router_port, bodies, args.requests_c1, 1, args.time_limit_s)
        ),
        "c64_paced": runner(
            _paired_load(
                direct_port,
                router_port,
                bodies,
                args.requests_c64,
                64,
                args.time_limit_s,
                args.paced_rps,
            )
        ),
    }


def _overload(
    port: int,
    bodies: list[bytes],
    args: argparse.Namespace,
    limited: Any,
    unlimited: Any,
    stop_router: Any,
) -> dict[str, Any]:
    """The capacity of the upstream (closed loop, direct), then ``--overload-factor`` times it
    offered in an open loop through a router with ``--max-in-flight`` and one without."""
    runner = _runner()
    capacity = runner(
        _load(port, bodies, 20 * args.overload_slots, 4 * args.overload_slots, args.time_limit_s)
    )["rps"]
    rate = args.overload_factor * capacity
    total = int(rate * args.overload_s)
    phases = {}
    for name, start in (("limited", limited), ("unlimited", unlimited)):
        router_port = start()
        phases[name] = runner(_open_loop(router_port, bodies, total, rate, args.time_limit_s))
        stop_router()
    lim, unl = phases["limited"], phases["unlimited"]
    ratio = None
    if lim["served_p99_ms"] and unl["served_p99_ms"]:
        ratio = round(lim["served_p99_ms"] / unl["served_p99_ms"], 3)
    return {
        "capacity_rps": capacity,
        "offered_rps_target": round(rate, 1),
        "factor": args.overload_factor,
        "upstream": f"{args.overload_slots} at a time, {args.overload_service_ms:g} ms each",
        "max_in_flight": args.overload_max_in_flight,
        "served_share": lim["served_share"],
        "refused_share": lim["refused_share"],
        "served_p99_ms": lim["served_p99_ms"],
        "served_p99_ms_without_limit": unl["served_p99_ms"],
        "served_p99_ratio_limited_over_unlimited": ratio,
        "limited": lim,
        "unlimited": unl,
    }


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
    parser.add_argument(
        "--overload",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="measure the router offered more than its upstream can take",
    )
    parser.add_argument("--overload-slots", type=int, default=8)
    parser.add_argument("--overload-service-ms", type=float, default=20.0)
    parser.add_argument("--overload-factor", type=float, default=2.0)
    parser.add_argument("--overload-s", type=float, default=2.5, help="seconds of arrivals")
    parser.add_argument(
        "--overload-max-in-flight",
        type=int,
        default=32,
        help="the limited router's --max-in-flight (4x the upstream's slots by default)",
    )
    parser.add_argument(
        "--smg",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="measure SGLang's gateway (smg, PyPI) beside kvroute on the same upstream and "
        "core in the same run (default: when smg is installed)",
    )
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
        from kvroute.deploy.state_dir import default_state_dir
        from kvroute.deploy.tiny_model import build_tiny_model

        model_dir = default_state_dir() / "bench" / "tiny-model"
        tokenizer = str(build_tiny_model(model_dir, weights=False))  # only tokenizes
    cores = sorted(os.sched_getaffinity(0))
    pin = args.pin if args.pin is not None else len(cores) >= 2
    router_core = _idlest_core(cores) if pin else None
    router_cores = {router_core} if pin else set()
    other_cores = set(cores) - router_cores if pin else set()
    children: list[ChildProcess | RouterProcess] = []

    def start_upstream(*params: float) -> int:
        """An upstream child (``serve_upstream(port, *params)``) on a free port, once ready."""
        port = free_port()
        upstream = ChildProcess("proxy-bench upstream")
        children.append(upstream)
        call = f"serve_upstream({', '.join(repr(p) for p in (port, *params))})"
        upstream.start(
            [sys.executable, "-c", f"from kvroute.bench.proxy_bench import serve_upstream; {call}"],
            cpus=other_cores,
        )
        upstream.wait_http(f"http://127.0.0.1:{port}/health", 30)
        return port

    def start_router(upstream_port: int, *extra: str) -> int:
        """A ``kvroute serve`` child over the upstream, on its own core when pinned."""
        router = RouterProcess(
            name="proxy-bench router",
            policy=args.policy,
            replicas=[ReplicaEndpoint(name="upstream", url=f"http://127.0.0.1:{upstream_port}")],
            tokenizer=tokenizer,
            extra_args=["--log-level", "warning", "--no-tokenizer-check", *extra],
            cpus=router_cores,
            start_timeout_s=60,
        )
        children.append(router)
        router.start()
        return router.port

    with_smg = args.smg if args.smg is not None else smg_executable() is not None
    if with_smg and smg_executable() is None:  # asked for, before minutes of measuring
        raise ValueError("--smg: smg is not installed (pip install 'kvroute[smg]')")
    smg: dict[str, Any] | None = None
    try:
        up_port = start_upstream()
        router_port = start_router(up_port)
        if other_cores:
            os.sched_setaffinity(0, other_cores)
        bodies = _bodies(args.prompts)
        direct = _measure(up_port, bodies, args)
        routed = _measure(router_port, bodies, args)
        paired = _measure_added(up_port, router_port, bodies, args)
        if with_smg:
            children[1].stop()  # kvroute is measured: smg gets the same core, alone
            try:
                smg_port = start_smg(
                    f"http://127.0.0.1:{up_port}", router_cores or set(cores), children
                )
            except ChildError as exc:  # kvroute's figures stand; the JSON says why smg has none
                smg = {"version": smg_version(), "error": str(exc)}
            else:
                smg = {
                    "version": smg_version(),
                    "policy": SMG_POLICY,
                    "throughput": _measure(smg_port, bodies, args),
                    "paired": _measure_added(up_port, smg_port, bodies, args),
                }
        overload = None
        if args.overload:
            for child in children[1:]:  # the throughput routers are done: free their core
                child.stop()
            slow_port = start_upstream(args.overload_slots, args.overload_service_ms)
            overload = _overload(
                slow_port,
                bodies,
                args,
                limited=lambda: start_router(
                    slow_port, "--max-in-flight", str(args.overload_max_in_flight)
                ),
                unlimited=lambda: start_router(slow_port, "--max-in-flight", "1000000"),
                stop_router=lambda: children[-1].stop(),
            )
    finally:
        if other_cores:
            os.sched_setaffinity(0, set(cores))
        for child in children:
            child.stop(grace_s=10)

    result: dict[str, Any] = {
        # Per-pair differences (router minus direct, same request, back to back).
        "added_p50_ms_c64": paired["c64_paced"]["added_p50_ms"],
        "added_p99_ms_c64": paired["c64_paced"]["added_p99_ms"],
        "c64_mode": f"paced: 64 connections offering {args.paced_rps:g} pairs/s",
        "added_p50_ms_c1": paired["c1"]["added_p50_ms"],
        "added_p99_ms_c1": paired["c1"]["added_p99_ms"],
        "added_method": "per-pair: each request sent direct and through the router back to "
        "back on the same worker, order alternating; quantiles of the differences",
        "rps": routed["c64"]["rps"],
        "rps_direct": direct["c64"]["rps"],
        "rps_ratio_router_over_direct": round(routed["c64"]["rps"] / direct["c64"]["rps"], 3),
        "targets": dict(_TARGETS),
        "router_pinned_cores": sorted(router_cores) or None,
        "load_average_1m": round(os.getloadavg()[0], 2),
        "cpu_cores": len(cores),
        "policy": args.policy,
        "paired": paired,
        "direct": direct,
        "routed": routed,
    }
    if overload is not None:
        result["overload"] = overload
    if smg is not None and "error" in smg:
        result["smg"] = smg
    elif smg is not None:
        smg_rps = smg["throughput"]["c64"]["rps"]
        result["smg"] = {
            "version": smg["version"],
            "policy": smg["policy"],
            "rps": smg_rps,
            "added_p50_ms_c64": smg["paired"]["c64_paced"]["added_p50_ms"],
            "added_p99_ms_c64": smg["paired"]["c64_paced"]["added_p99_ms"],
            "added_p50_ms_c1": smg["paired"]["c1"]["added_p50_ms"],
            "added_p99_ms_c1": smg["paired"]["c1"]["added_p99_ms"],
            "throughput": smg["throughput"],
            "paired": smg["paired"],
        }
        result["rps_ratio_kvroute_over_smg"] = round(routed["c64"]["rps"] / smg_rps, 3)
        result["meets_smg_target"] = result["rps_ratio_kvroute_over_smg"] >= _SMG_TARGET
    result["meets_targets"] = (
        result["added_p50_ms_c64"] is not None
        and result["added_p50_ms_c64"] <= _TARGETS["added_p50_ms_c64"]
        and result["added_p99_ms_c64"] <= _TARGETS["added_p99_ms_c64"]
        and result["rps"] >= _TARGETS["rps"]
    )
    return result


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(description=__doc__)
    add_arguments(_parser)
    print(json.dumps(run(_parser.parse_args()), indent=2))
