"""Admission under overload: twice the fleet's capacity, open loop, two priority classes.

One simulated fleet (bench/sim/), a fresh router per arm, the same seeded request list
replayed in every arm:

- ``unloaded``: the same mix at ``--unloaded-factor`` (0.2) of capacity, kvroute's admission:
  the high class's TTFT when nothing waits, the reference of the 1.5x target;
- ``refuse``: ``--no-admission`` (today's limit): a request finding every replica at
  ``--max-pending-per-replica`` is refused at once;
- ``fcfs``: the router's queue in arrival order (``--admission-order fifo``), same bound
  and deadline;
- ``kvroute``: the router's queue by priority class, tenant, then cost with aging
  (the default order), one slot per replica kept for the high class (``reserve`` 1);
- ``unbounded``: no pending bound at all (everything goes to vLLM's own FIFO queue).

The mix: half the requests share one of ``groups`` long prefixes (cached once the group's
first request ran: cheap), half are cold prompts of about the same length (expensive); a
quarter are the high class (``x-kvroute-priority: -1``: ahead of vLLM's default), the rest
normal (``0``). Prefill is the
simulator's only shared work (processor sharing; decoding delays nobody), so the fleet's
capacity is ``replicas / mean prefill seconds per request``, computed from the simulator's
rates and the mix and reported. Times are simulated seconds (``--time-scale`` wall seconds
each). Goodput: requests answered with their first token within
``--ttft-target-s``. ``kvroute bench admission --json``; docs/benchmarks.md has the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from kvroute.bench.sim.fleet import SimFleet, SimFleetConfig
from kvroute.bench.sim.latency import LatencyModel
from kvroute.bench.sim.tokenizer import SimTokenizer
from kvroute.bench.workloads import TextSource
from kvroute.deploy.router_process import RouterProcess

__all__ = ["ARMS", "add_arguments", "run", "targets"]

# (arm, offered load as a multiple of capacity: None = --overload, admission settings,
# pending bound on: --max-pending-per-replica, off: 0)
ARMS: dict[str, tuple[float | None, dict[str, Any], bool]] = {
    "unloaded": (-1.0, {}, True),
    "refuse": (None, {"enabled": False}, True),
    "fcfs": (None, {"order": "fifo"}, True),
    "kvroute": (None, {"order": "cost"}, True),  # + reserve: --reserve
    "unbounded": (None, {}, False),
}


@dataclass(slots=True)
class Planned:
    at_s: float
    priority: int
    kind: str  # "cached" (a group's shared prefix) or "cold"
    prompt: str


@dataclass(slots=True)
class Outcome:
    priority: int
    kind: str
    status: int = 0
    ttft_s: float | None = None
    retry_after: str | None = None
    error: str | None = None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--max-pending-per-replica", type=int, default=2)
    parser.add_argument("--overload", type=float, default=2.0, help="offered / capacity")
    parser.add_argument(
        "--reserve",
        type=int,
        default=1,
        help="the kvroute arm's --admission-reserve: slots per replica kept for the high class",
    )
    parser.add_argument("--unloaded-factor", type=float, default=0.2)
    parser.add_argument(
        "--unloaded-duration-s",
        type=float,
        default=40.0,
        help="the unloaded arm's window: long enough for a p90 of the high class",
    )
    parser.add_argument("--duration-s", type=float, default=12.0, help="arrival window")
    parser.add_argument("--drain-s", type=float, default=40.0, help="cap after the window")
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--prefix-tokens", type=int, default=1024)
    parser.add_argument("--suffix-tokens", type=int, default=48)
    parser.add_argument("--cold-tokens", type=int, default=1024)
    parser.add_argument("--cached-share", type=float, default=0.5)
    parser.add_argument("--high-share", type=float, default=0.25)
    parser.add_argument("--max-tokens", type=int, default=2)
    parser.add_argument("--ttft-target-s", type=float, default=1.0)
    parser.add_argument(
        "--max-wait-s",
        type=float,
        default=None,
        help="the queue's deadline (default: half the TTFT target: what starts later "
        "would miss the target anyway)",
    )
    parser.add_argument("--arms", default=",".join(ARMS), help="comma-separated subset")
    parser.add_argument(
        "--time-scale",
        type=float,
        default=4.0,
        help="wall seconds per simulated second: slower than real time, so a busy machine's "
        "own delays (router, client, simulator) weigh less against the simulated work",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", default="bench-results")


def _latency(time_scale: float) -> LatencyModel:
    from kvroute.bench.routing_presets import BENCH_LATENCY

    return LatencyModel(time_scale=time_scale, **BENCH_LATENCY)


def capacity_per_s(args: argparse.Namespace, lat: LatencyModel) -> float:
    """Requests per second the fleet's prefill can serve with the mix (cached prefixes
    counted as cached: their one cold first request per group is noise)."""
    cached = (args.suffix_tokens + 1) * lat.prefill_s_per_token
    cold = args.cold_tokens * lat.prefill_s_per_token
    mean = args.cached_share * cached + (1 - args.cached_share) * cold
    return args.replicas / mean


def plan(
    args: argparse.Namespace, rate: float, text: TextSource, duration_s: float | None = None
) -> list[Planned]:
    """The seeded open-loop arrivals (Poisson) over ``duration_s`` (default: the
    ``--duration-s`` window)."""
    window = args.duration_s if duration_s is None else duration_s
    rng = random.Random(f"{args.seed}/arrivals/{rate:.6f}")
    prefixes = [text.text(args.prefix_tokens) for _ in range(args.groups)]
    out: list[Planned] = []
    t = 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= window:
            return out
        priority = -1 if rng.random() < args.high_share else 0
        if rng.random() < args.cached_share:
            prompt = prefixes[rng.randrange(args.groups)] + " " + text.text(args.suffix_tokens)
            out.append(Planned(t, priority, "cached", prompt))
        else:
            out.append(Planned(t, priority, "cold", text.text(args.cold_tokens)))


async def _one(
    client: httpx.AsyncClient, model: str, p: Planned, max_tokens: int, scale: float
) -> Outcome:
    rec = Outcome(p.priority, p.kind)
    body = {"model": model, "prompt": p.prompt, "max_tokens": max_tokens, "stream": True}
    headers = {"x-kvroute-priority": str(p.priority)}
    started = time.monotonic()
    try:
        async with client.stream("POST", "/v1/completions", json=body, headers=headers) as resp:
            rec.status = resp.status_code
            if resp.status_code != 200:
                rec.retry_after = resp.headers.get("retry-after")
                await resp.aread()
                return rec
            async for line in resp.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]" and rec.ttft_s is None:
                    rec.ttft_s = (time.monotonic() - started) / scale
    except httpx.HTTPError as exc:
        rec.error = f"{type(exc).__name__}: {exc}"
    return rec


async def _drive(
    url: str, model: str, planned: list[Planned], args: argparse.Namespace
) -> tuple[list[Outcome], float]:
    limits = httpx.Limits(max_connections=2048, max_keepalive_connections=256)
    async with httpx.AsyncClient(base_url=url, timeout=120.0, limits=limits) as client:
        t0 = time.monotonic()
        scale = args.time_scale

        async def at(p: Planned) -> Outcome:
            await asyncio.sleep(max(0.0, t0 + p.at_s * scale - time.monotonic()))
            return await _one(client, model, p, args.max_tokens, scale)

        tasks = [asyncio.create_task(at(p)) for p in planned]
        cap = (max((p.at_s for p in planned), default=0.0) + args.drain_s) * scale
        done, pending = await asyncio.wait(tasks, timeout=cap)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        wall = (time.monotonic() - t0) / scale
    out = []
    for task, p in zip(tasks, planned, strict=True):
        if task in done:
            out.append(task.result())
        else:
            out.append(Outcome(p.priority, p.kind, error="unfinished at the run's cap"))
    return out, wall


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return round(s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))], 4)


def _summary(outcomes: list[Outcome], target: float) -> dict[str, Any]:
    ok = [o for o in outcomes if o.status == 200 and o.ttft_s is not None]
    good = [o for o in ok if o.ttft_s is not None and o.ttft_s <= target]
    refused = [o for o in outcomes if o.status in (429, 503)]
    return {
        "offered": len(outcomes),
        "completed": len(ok),
        "goodput": len(good),
        "goodput_share": round(len(good) / len(outcomes), 4) if outcomes else None,
        "refused_429": sum(1 for o in refused if o.status == 429),
        "refused_503": sum(1 for o in refused if o.status == 503),
        "refused_with_retry_after": sum(1 for o in refused if o.retry_after),
        "errors": sum(1 for o in outcomes if o.error or o.status not in (0, 200, 429, 503)),
        "ttft_p50_s": _pct([o.ttft_s for o in ok if o.ttft_s is not None], 0.5),
        "ttft_p90_s": _pct([o.ttft_s for o in ok if o.ttft_s is not None], 0.9),
        "ttft_p99_s": _pct([o.ttft_s for o in ok if o.ttft_s is not None], 0.99),
        "by_kind_completed": {k: sum(1 for o in ok if o.kind == k) for k in ("cached", "cold")},
    }


def _admission_stats(url: str) -> dict[str, Any] | None:
    with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
        stats = httpx.get(url + "/index/stats", timeout=10.0).json()["admission"]
        return {k: stats[k] for k in ("queued", "admitted", "shed", "shed_by_reason")}
    return None


def _arm(
    name: str, fleet: SimFleet, config: SimFleetConfig, args: argparse.Namespace, text: TextSource
) -> dict[str, Any]:
    from kvroute.bench.routing_bench import _true_rates
    from kvroute.bench.storage_scenario import _wait_healthy

    factor, admission, bounded = ARMS[name]
    if name == "kvroute":
        admission = {**admission, "reserve": args.reserve}
    lat = config.latency
    capacity = capacity_per_s(args, lat)
    multiple = args.unloaded_factor if factor == -1.0 else args.overload
    text.rng.seed(f"{args.seed}/text")  # the same prompts in every arm of one load
    unloaded = factor == -1.0
    planned = plan(args, capacity * multiple, text, args.unloaded_duration_s if unloaded else None)
    max_wait = args.max_wait_s or args.ttft_target_s / 2
    settings = fleet.router_settings(
        policy="kvroute",
        health_interval_s=0.5,
        cost=_true_rates(config),
        max_pending_per_replica=args.max_pending_per_replica if bounded else 0,
        admission={"max_wait_s": max_wait * lat.time_scale, **admission},
    )
    fleet.reset_caches()
    log = Path(args.out_dir) / "admission" / f"router-{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with RouterProcess(settings, log_path=log) as router:
        _wait_healthy(router, len(fleet.replicas))
        router.wait_feeds_settled()
        outcomes, wall = asyncio.run(_drive(router.url, config.model, planned, args))
        stats = _admission_stats(router.url)
    row: dict[str, Any] = {
        "arm": name,
        "offered_per_s": round(capacity * multiple, 3),
        "load_factor": multiple,
        "simulated_s": round(wall, 2),
        "max_pending_per_replica": args.max_pending_per_replica if bounded else 0,
        "admission": {"max_wait_s": max_wait, **admission} if bounded else None,
        **_summary(outcomes, args.ttft_target_s),
        "by_class": {
            cls: _summary([o for o in outcomes if o.priority == p], args.ttft_target_s)
            for cls, p in (("high", -1), ("low", 0))
        },
        "router_admission": stats,
    }
    high = row["by_class"]["high"]
    print(
        f"admission bench: {name}: goodput {row['goodput']}/{row['offered']}, "
        f"high TTFT p90 {high['ttft_p90_s']} s, refused {row['refused_429']}+"
        f"{row['refused_503']}, errors {row['errors']}",
        file=sys.stderr,
        flush=True,
    )
    return row


def targets(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Issue 38's: the high class's TTFT p90 at 2x within 1.5x of its unloaded value;
    goodput above FCFS's and above the refuse-only limit's, same run."""
    by = {r["arm"]: r for r in rows}
    out: dict[str, Any] = {}
    kv, base = by.get("kvroute"), by.get("unloaded")
    if kv and base:
        loaded, idle = kv["by_class"]["high"]["ttft_p90_s"], base["by_class"]["high"]["ttft_p90_s"]
        ratio = None if not loaded or not idle else round(loaded / idle, 3)
        out["high_ttft_p90_ratio_vs_unloaded"] = ratio
        out["met_high_p90_within_1_5x"] = ratio is not None and ratio <= 1.5
    for other in ("fcfs", "refuse", "unbounded"):
        if kv and other in by:
            theirs = by[other]["goodput"]
            out[f"goodput_ratio_vs_{other}"] = round(kv["goodput"] / theirs, 3) if theirs else None
            out[f"met_goodput_above_{other}"] = kv["goodput"] > theirs
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        raise ValueError(f"unknown arm(s) {', '.join(unknown)}; pick from {', '.join(ARMS)}")
    config = SimFleetConfig(
        replicas=args.replicas,
        gpu_blocks=8192,
        max_num_seqs=64,
        seed=args.seed,
        latency=_latency(args.time_scale),
    )
    rows = []
    with SimFleet(config, log_path=Path(args.out_dir) / "admission" / "fleet.log") as fleet:
        tokenizer = SimTokenizer(Path(fleet.model_dir))
        text = TextSource(args.seed, count_tokens=lambda s: len(tokenizer.encode(s)))
        for name in arms:
            rows.append(_arm(name, fleet, config, args, text))
    return {
        "bench": "admission",
        "capacity_per_s": round(capacity_per_s(args, config.latency), 3),
        "ttft_target_s": args.ttft_target_s,
        "settings": {k: v for k, v in vars(args).items() if not k.startswith("_")},
        "arms": rows,
        "targets": targets(rows),
    }
