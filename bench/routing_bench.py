"""Routing-quality benchmark: every workload x every policy, on one simulated fleet.

Each policy gets its own router process (the real ``kvroute.router.app`` under uvicorn, not
a re-implementation of its policies); before each workload the fleet's caches are reset (every tier;
AllBlocksCleared on the event stream empties the router's index) and the workload is replayed
through the router. Reported per run: token-weighted cache hit rate (from the replicas'
``usage.prompt_tokens_details.cached_tokens``), client-measured TTFT percentiles in simulated
seconds, throughput, and the infinite-cache upper bound of the hit rate.

``kvroute bench routing --json`` calls ``run(args)``; ``python -m kvroute.bench.routing_bench`` too.
Results go to ``<out-dir>/routing.json`` (the list of per-run objects) with PNG plots beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import sys
import time
from collections import Counter
from collections.abc import Coroutine, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvroute.bench.pick_quality import queued_prefill_at_pick
from kvroute.bench.policy_variants import PolicyVariant, learned_rates_row
from kvroute.bench.router_scrape import (
    decision_reasons,
    feed_volume,
    router_timing_row,
    router_timings,
)
from kvroute.bench.routing_plots import draw_plots
from kvroute.bench.routing_presets import BENCH_LATENCY, PRESETS, TARGET_WORKLOADS
from kvroute.bench.sim.fleet import SimFleet, SimFleetConfig
from kvroute.bench.sim.latency import LatencyModel
from kvroute.bench.sim.looplag import LoopLagMonitor
from kvroute.bench.sim.tokenizer import SimTokenizer
from kvroute.bench.workloads import BUILDERS, TextSource, mooncake_trace
from kvroute.bench.workloads.runner import RequestRecord, run_workload, summarize_errors
from kvroute.bench.workloads.upper_bound import infinite_cache_hit_rate
from kvroute.deploy.processes import free_port
from kvroute.deploy.router_process import RouterProcess
from kvroute.router.routing.policies import POLICIES

__all__ = ["PRESETS", "add_arguments", "percentile", "run"]


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default="full",
        help="sizes of fleet and workloads (quick: < 2 min, for tests)",
    )
    parser.add_argument(
        "--workloads", default=None, help=f"comma-separated subset of {','.join(BUILDERS)}"
    )
    parser.add_argument(
        "--policies",
        default=",".join(POLICIES),
        help="comma-separated router policies to compare",
    )
    parser.add_argument("--replicas", type=int, default=None)
    parser.add_argument("--gpu-blocks", type=int, default=None, help="device blocks per replica")
    parser.add_argument("--cpu-blocks", type=int, default=None, help="CPU-tier blocks per replica")
    parser.add_argument("--storage-blocks", type=int, default=None)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument(
        "--time-scale", type=float, default=None, help="wall seconds per simulated second"
    )
    parser.add_argument(
        "--rate-scale", type=float, default=1.0, help="multiply every workload's arrival rate"
    )
    parser.add_argument(
        "--deadline-s",
        type=float,
        default=None,
        help="wall-clock cap of one (workload, policy) run (default: the preset's, scaled "
        "by --time-scale over the preset's time scale)",
    )
    parser.add_argument(
        "--routers",
        type=int,
        default=1,
        help="router processes sharing the traffic (an HA deployment; requests spread by "
        "session and turn)",
    )
    parser.add_argument(
        "--idle-routers",
        type=int,
        default=0,
        help="more router processes that subscribe to every feed and poll their peers like "
        "the others but get no request: with --routers 1 --idle-routers N-1, a baseline "
        "that runs as many router processes (their CPU beside the simulator) as --routers N",
    )
    parser.add_argument(
        "--fleet-cpus",
        type=cpu_list,
        default=None,
        metavar="LIST",
        help="cores the simulated fleet and this process (the clients) run on, e.g. 0 or 0-3 "
        "(default: any); with --router-cpus, the routers do not share cores with the fleet, "
        "as on separate machines",
    )
    parser.add_argument(
        "--router-cpus",
        type=cpu_list,
        default=None,
        metavar="LIST",
        help="cores the router processes run on, e.g. 1 or 4-7 (default: any)",
    )
    parser.add_argument(
        "--router-option",
        action="append",
        default=[],
        metavar="KEY=JSON",
        help="override a router setting for every policy, e.g. hint_ttl_s=0 or "
        "cost.delay_to_others_weight=2 (repeatable)",
    )
    parser.add_argument(
        "--size",
        action="append",
        default=[],
        metavar="WORKLOAD.KEY=JSON",
        help="override one of a workload's preset sizes, e.g. shared_prefix.groups=64 "
        "(repeatable; the rows carry the sizes they ran with)",
    )
    parser.add_argument(
        "--records",
        action="store_true",
        help="also write routing_requests.jsonl: one line per request (workload, policy, "
        "session, turn, sent and first-token times, prompt and cached tokens, the replica "
        "that answered)",
    )
    parser.add_argument(
        "--warm-up",
        action="store_true",
        help="before the first policy, run each workload once straight at the replicas (no "
        "router), then reset their caches: every policy meets a warm simulator, as a real "
        "fleet is warm (a fresh simulator process answers its first requests slowly, which "
        "only the first policy would pay)",
    )
    parser.add_argument("--seed", type=int, default=0)
    mooncake_trace.add_arguments(parser)
    parser.add_argument(
        "--out-dir",
        type=Path,
        default=Path("bench/out/routing"),
        help="directory for routing.json and the PNG plots",
    )
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument(
        "--scenario",
        choices=["shared_storage", "pd"],
        default=None,
        help="instead of workloads x policies: shared_storage (hot documents, a replica "
        "added and one restarted mid-run; kvroute with a shared STORAGE domain vs private "
        "disks vs approx_prefix vs round_robin; bench/storage_scenario.py), or pd (the "
        "prefill/decode mix: kvroute's decider vs always-split vs aggregated, and a prefill "
        "replica killed; bench/pd_scenario.py)",
    )
    parser.add_argument(
        "--scenario-cold",
        action="store_true",
        help="shared_storage: no warm-up pass (the measured trace starts on cold tiers)",
    )
    parser.add_argument(
        "--scenario-arms",
        type=lambda v: [a for a in v.split(",") if a],
        default=None,
        help="the scenario's arms to run (default: all), e.g. kvroute_shared,kvroute_private",
    )


def _fleet_config(args: argparse.Namespace, preset: dict[str, Any]) -> SimFleetConfig:
    def pick(name: str) -> Any:
        value = getattr(args, name, None)
        return preset[name] if value is None else value

    return SimFleetConfig(
        replicas=pick("replicas"),
        block_size=args.block_size,
        gpu_blocks=pick("gpu_blocks"),
        cpu_blocks=pick("cpu_blocks"),
        storage_blocks=pick("storage_blocks"),
        max_num_seqs=args.max_num_seqs,
        seed=args.seed,
        latency=LatencyModel(time_scale=pick("time_scale"), **BENCH_LATENCY),
    )


def cpu_list(text: str) -> list[int]:
    """``0,2-3`` -> [0, 2, 3]: the cores named, each one this process may run on."""
    cores: set[int] = set()
    try:
        for part in text.split(","):
            lo, _, hi = part.strip().partition("-")
            cores.update(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a CPU list (like 0,2-3): {text!r}") from None
    allowed = set(os.sched_getaffinity(0))
    if not cores or not cores <= allowed:
        raise argparse.ArgumentTypeError(
            f"CPU list {text!r} names cores this process cannot use (it may use {sorted(allowed)})"
        )
    return sorted(cores)


@contextlib.contextmanager
def _pinned(cpus: list[int] | None) -> Iterator[None]:
    """This process on ``cpus`` (None: unchanged) while the block runs."""
    if not cpus:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def _cpu_seconds(pid: int | None) -> float | None:
    """User + system CPU seconds of process ``pid`` so far (Linux /proc; None elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _affinity(pid: int | None) -> list[int] | None:
    try:
        return None if pid is None else sorted(os.sched_getaffinity(pid))
    except OSError:  # exited meanwhile
        return None


def _peer_router_settings(settings: dict[str, Any], n: int) -> list[dict[str, Any]]:
    """``n`` routers as an HA deployment runs them: each knows the others as peers (for
    warm start and shared load, router/peers/load.py), so their ports are chosen first."""
    if n == 1:
        return [settings]
    host = str(settings.get("host", "127.0.0.1"))
    ports = [free_port(host) for _ in range(n)]
    return [
        {**settings, "port": port, "peers": [f"http://{host}:{p}" for p in ports if p != port]}
        for port in ports
    ]


def _true_rates(config: SimFleetConfig) -> dict[str, float]:
    """The simulator's rates in the router's (wall-clock) seconds."""
    lat = config.latency
    return {
        "prefill_s_per_token": lat.prefill_s_per_token * lat.time_scale,
        "load_s_per_token_cpu": lat.load_cpu_s_per_token * lat.time_scale,
        "load_s_per_token_storage": lat.load_storage_s_per_token * lat.time_scale,
    }


def _router_settings(fleet: SimFleet, policy: str, config: SimFleetConfig) -> dict[str, Any]:
    # An operator sets the cost model to the hardware; here the hardware is the simulator,
    # whose simulated seconds last time_scale wall seconds (the router lives in wall time
    # and learns its queue term and rates from wall-clock first bytes). A variant
    # (bench/policy_variants.py) starts from wrong rates instead.
    variant = PolicyVariant.parse(policy)
    return fleet.router_settings(
        policy=variant.policy,
        health_interval_s=0.5,
        cost=variant.cost(_true_rates(config)),
    )


def workload_sizes(
    preset: dict[str, Any], workloads: list[str], overrides: list[str]
) -> dict[str, dict[str, Any]]:
    """The preset's sizes of each workload with ``WORKLOAD.KEY=JSON`` overrides applied; an
    unknown workload or key is an error before anything starts."""
    missing = [w for w in workloads if w not in preset["sizes"]]
    if missing:
        raise ValueError(f"this preset has no sizes for {', '.join(missing)}: pick another preset")
    sizes = {w: dict(preset["sizes"][w]) for w in workloads}
    for option in overrides:
        key, sep, raw = option.partition("=")
        workload, dot, name = key.partition(".")
        if not sep or not dot:
            raise ValueError(f"--size wants WORKLOAD.KEY=JSON, got {option!r}")
        if workload not in sizes:
            raise ValueError(f"--size {option!r}: workload {workload!r} is not being run")
        if name not in sizes[workload]:
            known = ", ".join(sorted(sizes[workload]))
            raise ValueError(f"--size {option!r}: {workload} has no size {name!r} ({known})")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--size {option!r}: the value is not JSON") from exc
        if isinstance(value, list):
            value = tuple(value)
        sizes[workload][name] = value
    return sizes


def _request_lines(
    workload: str, policy: str, records: list[RequestRecord], time_scale: float
) -> list[str]:
    """One JSON line per request, times in simulated seconds since the run's start."""
    lines = []
    for r in records:
        lines.append(
            json.dumps(
                {
                    "workload": workload,
                    "policy": policy,
                    "session": r.session,
                    "turn": r.turn,
                    "sent_s": r.sent / time_scale,
                    "ttft_s": None
                    if r.first_token is None
                    else (r.first_token - r.sent) / time_scale,
                    "done_s": None if r.done is None else r.done / time_scale,
                    "prompt_tokens": r.prompt_tokens,
                    "cached_tokens": r.cached_tokens,
                    "replica": r.replica,
                    "error": r.error,
                }
            )
        )
    return lines


def _apply_router_options(settings: dict[str, Any], options: list[str]) -> None:
    """``KEY=JSON`` overrides (``cost.NAME`` for a cost knob); a typo fails before any run
    when the router process validates its settings."""
    for option in options:
        key, sep, raw = option.partition("=")
        if not sep or not key:
            raise ValueError(f"--router-option wants KEY=JSON, got {option!r}")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw  # a bare string
        target = settings
        *parents, leaf = key.split(".")
        for part in parents:
            target = target.setdefault(part, {})
        target[leaf] = value


def _warm_up(
    fleet: SimFleet, built: dict[str, Any], config: SimFleetConfig, deadline: float
) -> None:
    """Each workload once, straight at the replicas (spread by session and turn), and the
    caches reset after: the simulator process's first requests (its first connections and
    code paths) are paid here, not by whichever policy runs first."""
    urls = [r.url for r in fleet.replicas]
    for w, workload in built.items():
        records, wall = asyncio.run(
            run_workload(
                workload,
                urls,
                model=config.model,
                time_scale=config.latency.time_scale,
                deadline_s=deadline,
            )
        )
        done = sum(1 for r in records if r.ok)
        print(
            f"routing bench: warm-up {w}: {done}/{len(records)} done, {wall:.0f} s wall",
            file=sys.stderr,
            flush=True,
        )
    fleet.reset_caches()


async def _run_measured(
    workload_run: Coroutine[Any, Any, tuple[list[RequestRecord], float]],
) -> tuple[list[RequestRecord], float, dict[str, Any]]:
    """Run the load generator with a LoopLagMonitor beside it: its timestamps are only as
    good as its loop's punctuality."""
    monitor = LoopLagMonitor()
    monitor.start()
    try:
        records, wall = await workload_run
    finally:
        await monitor.stop()
    return records, wall, monitor.snapshot()


def _row(
    workload: str,
    policy: str,
    records: list[RequestRecord],
    wall_s: float,
    time_scale: float,
    tokenizer: SimTokenizer,
    config: SimFleetConfig,
) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    ttfts = [(r.first_token - r.sent) / time_scale for r in ok if r.first_token is not None]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    ub = infinite_cache_hit_rate(records, tokenizer, config.block_size)
    sim_s = wall_s / time_scale
    return {
        "workload": workload,
        "policy": policy,
        "hit_rate": cached / prompt if prompt else 0.0,
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p90_s": percentile(ttfts, 90),
        "ttft_p99_s": percentile(ttfts, 99),
        "throughput_rps": len(ok) / sim_s if sim_s else 0.0,
        "upper_bound_hit_rate": ub.hit_rate,
        "ttft_mean_s": sum(ttfts) / len(ttfts) if ttfts else math.nan,
        "output_tokens_per_s": sum(r.completion_tokens for r in ok) / sim_s if sim_s else 0.0,
        "requests": len(records),
        "completed": len(ok),
        "errors": summarize_errors(records),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "token_mismatches": ub.token_mismatches,
        "requests_by_replica": dict(sorted(Counter(r.replica or "?" for r in ok).items())),
        "working_set_tokens": ub.distinct_blocks * config.block_size,
        "fleet_device_tokens": config.replicas * config.gpu_blocks * config.block_size,
        "fleet_cpu_tokens": config.replicas * config.cpu_blocks * config.block_size,
        "duration_s": sim_s,
        "wall_s": wall_s,
        "ttfts_s": ttfts,
    }


def _targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The routing targets (docs/benchmarks.md, "Targets"), evaluated per target workload
    present in this run."""
    by = {(r["workload"], r["policy"]): r for r in rows}
    out = []
    for w in TARGET_WORKLOADS:
        kv = by.get((w, "kvroute"))
        if kv is None:
            continue
        rr, ap = by.get((w, "round_robin")), by.get((w, "approx_prefix"))
        vs_rr = rr["ttft_p90_s"] / kv["ttft_p90_s"] if rr and kv["ttft_p90_s"] > 0 else None
        vs_ap = ap["ttft_p90_s"] / kv["ttft_p90_s"] if ap and kv["ttft_p90_s"] > 0 else None
        gap = kv["upper_bound_hit_rate"] - kv["hit_rate"]
        out.append(
            {
                "workload": w,
                "ttft_p90_vs_round_robin": vs_rr,
                "ttft_p90_vs_approx_prefix": vs_ap,
                "hit_rate_gap_to_upper_bound": gap,
                "met_vs_round_robin": vs_rr is not None and vs_rr >= 10,
                "met_vs_approx_prefix": vs_ap is not None and vs_ap >= 2,
                "met_hit_rate": gap <= 0.10,
            }
        )
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark; returns ``{"results": [...], "targets": [...], ...}``."""
    if getattr(args, "scenario", None) == "shared_storage":
        return _run_storage_scenario(args)
    if getattr(args, "scenario", None) == "pd":
        return _run_pd_scenario(args)
    preset = PRESETS[args.preset]
    trace = mooncake_trace.load_from_args(args)  # checked before anything starts
    workloads = args.workloads.split(",") if args.workloads else list(preset["workloads"])
    if trace is not None:
        workloads = [mooncake_trace.TRACE_WORKLOAD]
    policies = [p for p in args.policies.split(",") if p]
    unknown = [w for w in workloads if w not in BUILDERS and trace is None] + [
        p for p in policies if PolicyVariant.parse(p).policy not in POLICIES
    ]
    if unknown:
        raise ValueError(f"unknown workloads or policies: {unknown}")
    if args.routers < 1:
        raise ValueError("--routers must be >= 1")
    if args.idle_routers < 0:
        raise ValueError("--idle-routers must be >= 0")
    config = _fleet_config(args, preset)
    # The preset's deadline is wall time at its own clock: a slower clock needs longer.
    deadline = args.deadline_s or preset["deadline_s"] * (
        config.latency.time_scale / preset["time_scale"]
    )
    if trace is None:
        sizes_by_workload = workload_sizes(preset, workloads, args.size)
    else:
        if args.size:
            raise ValueError("--size sets a preset workload's sizes; a --trace has none")
        sizes_by_workload = {workloads[0]: mooncake_trace.trace_sizes(args, trace)}
        if not args.deadline_s:  # the trace's own span, on top of the preset's drain time
            deadline += sizes_by_workload[workloads[0]]["span_s"] * config.latency.time_scale
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    request_lines: list[str] = []
    rows: list[dict[str, Any]] = []
    started = time.monotonic()
    # The clients (this process) run beside the fleet.
    with _pinned(args.fleet_cpus), SimFleet(config, cpus=args.fleet_cpus) as fleet:
        # The cores each process may run on, read back from the kernel.
        cpus: dict[str, Any] = {
            "fleet": _affinity(fleet.process.pid),
            "clients": _affinity(os.getpid()),
            "routers": [],
        }
        tokenizer = SimTokenizer(Path(fleet.model_dir))
        text = TextSource(args.seed, count_tokens=lambda s: len(tokenizer.encode(s)))
        built = {}
        for w in workloads:
            if trace is not None:
                built[w] = mooncake_trace.workload_from_args(args, trace, tokenizer.tok)
                continue
            sizes = dict(sizes_by_workload[w])
            for key in ("rate", "user_rate", "agent_rate"):
                if key in sizes:
                    sizes[key] *= args.rate_scale
            if "stages" in sizes:  # a ramp: (seconds, rate) per stage
                sizes["stages"] = [(d, r * args.rate_scale) for d, r in sizes["stages"]]
            text.rng.seed(f"{args.seed}/{w}")
            built[w] = BUILDERS[w](text, seed=args.seed, **sizes)
        if getattr(args, "warm_up", False):
            _warm_up(fleet, built, config, deadline)
        # One router process per policy (its start-up costs seconds); the fleet's caches are
        # reset before every run, and the AllBlocksCleared events empty the router's index.
        for policy in policies:
            with contextlib.ExitStack() as stack:
                settings = _router_settings(fleet, policy, config)
                _apply_router_options(settings, args.router_option)
                # All started first, then waited for: they load and join the feeds together.
                routers = []
                for peer_settings in _peer_router_settings(
                    settings, args.routers + args.idle_routers
                ):
                    router = RouterProcess(peer_settings, cpus=args.router_cpus)
                    stack.callback(router.stop)
                    routers.append(router.start(wait=False))
                for router in routers:
                    router.wait_ready()
                    cpus["routers"].append(_affinity(router.process.pid))
                # The first --routers take the traffic; the idle ones only cost their CPU.
                urls = [r.url for r in routers[: args.routers]]
                idle_urls = [r.url for r in routers[args.routers :]]
                seen: dict[str, float] = {}
                seen_volume: dict[str, int] = {}
                for w in workloads:
                    fleet.reset_caches()
                    # The clears are what a fresh router joins the feeds on; traffic waits
                    # until every router has caught up.
                    time.sleep(0.3)
                    for router in routers:
                        router.wait_feeds_settled()
                    cpu_before = [_cpu_seconds(r.process.pid) for r in routers]
                    timings_before = router_timings(urls)
                    records, wall, client_lag = asyncio.run(
                        _run_measured(
                            run_workload(
                                built[w],
                                urls,
                                model=config.model,
                                time_scale=config.latency.time_scale,
                                deadline_s=deadline,
                            )
                        )
                    )
                    row = _row(
                        w, policy, records, wall, config.latency.time_scale, tokenizer, config
                    )
                    row["queued_prefill_at_pick"] = queued_prefill_at_pick(
                        records, (r.name for r in fleet.replicas)
                    )
                    reasons = decision_reasons(urls)
                    if PolicyVariant.parse(policy).policy == "kvroute":
                        row["cost_rates"] = learned_rates_row(urls[0], _true_rates(config))
                    row["routers"] = len(urls)
                    row["idle_routers"] = len(idle_urls)
                    # Cumulative over the policy's workloads: an idle router never decides.
                    row["idle_router_decisions"] = sum(decision_reasons(idle_urls).values())
                    row["sizes"] = sizes_by_workload[w]
                    if args.records:
                        request_lines += _request_lines(
                            w, policy, records, config.latency.time_scale
                        )
                    row["loop_lag_ms"] = {"fleet": fleet.loop_lag(), "client": client_lag}
                    # CPU seconds each router process used during the run (taking traffic
                    # first, then the idle ones): what sharing load and the feeds cost them.
                    row["router_cpu_s"] = [
                        None if a is None or b is None else round(b - a, 2)
                        for a, b in zip(
                            cpu_before, (_cpu_seconds(r.process.pid) for r in routers), strict=True
                        )
                    ]
                    row["router_timing"] = router_timing_row(
                        timings_before,
                        router_timings(urls),
                        row["ttft_mean_s"],
                        config.latency.time_scale,
                    )
                    row["route_reasons"] = {k: v - seen.get(k, 0) for k, v in reasons.items()}
                    seen = reasons
                    volume = feed_volume(urls[0])
                    row["feed_volume"] = {k: v - seen_volume.get(k, 0) for k, v in volume.items()}
                    seen_volume = volume
                    rows.append(row)
                    print(
                        f"routing bench: {w}/{policy}: hit {row['hit_rate']:.3f} "
                        f"(bound {row['upper_bound_hit_rate']:.3f}), TTFT p90 "
                        f"{row['ttft_p90_s']:.3f} s, {row['completed']}/{row['requests']} done, "
                        f"{wall:.0f} s wall",
                        file=sys.stderr,
                        flush=True,
                    )
    rows.sort(key=lambda r: (workloads.index(r["workload"]), policies.index(r["policy"])))
    # Strict JSON: a run without a single completed request has no percentiles (null).
    public = [
        {
            k: None if isinstance(v, float) and math.isnan(v) else v
            for k, v in r.items()
            if k != "ttfts_s"
        }
        for r in rows
    ]
    (out / "routing.json").write_text(json.dumps(public, indent=2))
    if args.records:
        (out / "routing_requests.jsonl").write_text("".join(x + "\n" for x in request_lines))
    plots = [] if args.no_plots or not rows else draw_plots(rows, out)
    fleet_desc = asdict(config)
    return {
        "results": public,
        "targets": _targets(rows),
        "fleet": fleet_desc,
        "workload_sizes": sizes_by_workload,
        "rate_scale": args.rate_scale,
        "routers": args.routers,
        "idle_routers": args.idle_routers,
        "cpus": cpus,
        "preset": args.preset,
        "json": str(out / "routing.json"),
        "plots": plots,
        "total_wall_s": time.monotonic() - started,
    }


def _run_storage_scenario(args: argparse.Namespace) -> dict[str, Any]:
    """The shared-storage scenario (bench/storage_scenario.py): its own fleets and arms."""
    from kvroute.bench.storage_scenario import SCENARIO_PRESETS, run_scenario, scenario_targets

    started = time.monotonic()
    rows = run_scenario(args)
    public = [
        {
            k: None if isinstance(v, float) and math.isnan(v) else v
            for k, v in r.items()
            if k != "ttfts_s"
        }
        for r in rows
    ]
    out = Path(args.out_dir) / "shared_storage"  # its plots never replace the main run's
    out.mkdir(parents=True, exist_ok=True)
    (out / "routing_shared_storage.json").write_text(json.dumps(public, indent=2))
    plots = [] if args.no_plots or not rows else draw_plots(rows, out)
    return {
        "scenario": "shared_storage",
        "results": public,
        "targets": scenario_targets(rows),
        "preset": args.preset,
        "scenario_preset": SCENARIO_PRESETS[args.preset],
        "workload_sizes": {"hot_docs": rows[0]["sizes"]} if rows else {},
        "json": str(out / "routing_shared_storage.json"),
        "plots": plots,
        "total_wall_s": time.monotonic() - started,
    }


def _run_pd_scenario(args: argparse.Namespace) -> dict[str, Any]:
    """The prefill/decode scenario (bench/pd_scenario.py): its own fleets and arms."""
    from kvroute.bench.pd_scenario import PD_PRESETS, pd_targets, run_pd_scenario

    started = time.monotonic()
    rows = run_pd_scenario(args)
    public = [
        {
            k: None if isinstance(v, float) and math.isnan(v) else v
            for k, v in r.items()
            if k != "ttfts_s"
        }
        for r in rows
    ]
    out = Path(args.out_dir) / "pd"
    out.mkdir(parents=True, exist_ok=True)
    (out / "routing_pd.json").write_text(json.dumps(public, indent=2))
    return {
        "scenario": "pd",
        "results": public,
        "targets": pd_targets(rows),
        "preset": args.preset,
        "scenario_preset": PD_PRESETS[args.preset],
        "json": str(out / "routing_pd.json"),
        "total_wall_s": time.monotonic() - started,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    result = run(parser.parse_args(argv))
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
