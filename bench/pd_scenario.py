"""The prefill/decode routing scenario: kvroute's decider vs always-split vs aggregated.

The P/D mix (bench/workloads/pd_mix.py: long new prompts, returning chat users, short
prompts) replayed on a fresh simulated fleet of the same replicas per arm:

- ``kvroute_pd``: half the replicas prefill, half decode, kvroute's decider (``pd mode
  auto``: decode replica first, the prefill leg only where the cost model says it pays);
- ``always_split``: the same pools, every request split (smg's and vllm-router's rule);
- ``aggregated``: every replica serves whole requests, kvroute's policy (no P/D);
- ``kvroute_pd_prefill_killed``: ``kvroute_pd`` with one prefill replica killed mid-run
  (its port closed, its held blocks gone): requests must still all succeed.

The simulator's replicas speak vLLM's P/D protocol (bench/sim/disagg.py): a split request's
decode replica pulls the prompt at ``transfer_s_per_token``, beside its engine. They run
the simulator's step model (``STEP_BUDGET``, bench/sim/scheduler.py): vLLM's scheduler
computes a replica's prompts one after the other and its decodes wait for each step's
prefill chunk, which is what P/D removes from the decode replicas. The router's cost model is set
to the simulator's rates, as an operator sets it to the hardware. ``kvroute bench routing
--scenario pd`` runs it; the targets (issue 33): the decider's TTFT p90 no worse than the
better of the other two and at most 0.8x always-split's, and zero failed requests.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from kvroute.bench.sim.fleet import SimFleet, SimFleetConfig
from kvroute.bench.sim.latency import LatencyModel
from kvroute.bench.sim.tokenizer import SimTokenizer
from kvroute.bench.workloads import TextSource, pd_mix
from kvroute.bench.workloads.runner import RequestRecord, run_workload
from kvroute.deploy.router_process import RouterProcess

__all__ = ["ARMS", "PD_PRESETS", "pd_targets", "run_pd_arm", "run_pd_scenario"]

# (row name, pd mode, P/D pools?, kill a prefill replica mid-run?)
ARMS: tuple[tuple[str, str, bool, bool], ...] = (
    ("kvroute_pd", "auto", True, False),
    ("always_split", "always", True, False),
    ("aggregated", "never", False, False),
    ("kvroute_pd_prefill_killed", "auto", True, True),
)

# The replicas run the simulator's step model (bench/sim/scheduler.py) with vLLM's default
# token budget for an API server on an H100 (vllm/engine/arg_utils.py: 8192): where P/D
# pays in vLLM, a long prefill holds up the prompts and decode steps behind it; the
# processor-sharing model let them through beside it.
STEP_BUDGET = 8192

# The full preset's load (docs/benchmarks.md): with every prompt prefilled in the prefill
# pool (always-split), that pool is about 70% busy, long prompts at 1.25/s being most of it
# (0.78 engine-s each), as a P/D fleet is provisioned: the prefill pool is its busy part.
PD_PRESETS: dict[str, dict[str, Any]] = {
    "quick": {
        "replicas": 4,  # 2 prefill + 2 decode in the P/D arms
        "gpu_blocks": 1024,
        "time_scale": 0.5,
        "kill_at_s": 6.0,
        "deadline_s": 90.0,
        "sizes": dict(
            long_requests=10,
            long_tokens=2000,
            long_rate=0.8,
            users=6,
            rounds=3,
            history_tokens=1200,
            question_tokens=30,
            user_rate=0.8,
            think_s=2.0,
            short_requests=20,
            short_tokens=40,
            short_rate=1.6,
            answer_tokens=12,
        ),
    },
    "full": {
        "replicas": 4,
        "gpu_blocks": 2048,
        "time_scale": 1.0,
        "kill_at_s": 20.0,
        "deadline_s": 240.0,
        "sizes": dict(
            long_requests=50,
            long_tokens=3000,
            long_rate=1.25,
            users=24,
            rounds=5,
            history_tokens=1500,
            question_tokens=40,
            user_rate=0.8,
            think_s=3.0,
            short_requests=80,
            short_tokens=40,
            short_rate=2.0,
            answer_tokens=16,
        ),
    },
}


def _fleet_config(args: argparse.Namespace, preset: dict[str, Any]) -> SimFleetConfig:
    from kvroute.bench.routing_bench import BENCH_LATENCY

    return SimFleetConfig(
        replicas=preset["replicas"],
        block_size=args.block_size,
        gpu_blocks=preset["gpu_blocks"],
        cpu_blocks=0,
        storage_blocks=0,
        max_num_seqs=args.max_num_seqs,
        seed=args.seed,
        latency=LatencyModel(
            time_scale=preset["time_scale"],
            max_num_batched_tokens=STEP_BUDGET,
            **BENCH_LATENCY,
        ),
    )


def _roles(n: int, split: bool) -> list[str]:
    if not split:
        return ["both"] * n
    return ["prefill"] * (n // 2) + ["decode"] * (n - n // 2)


def _pd_stats(router: RouterProcess) -> dict[str, Any] | None:
    with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
        return httpx.get(router.url + "/index/stats", timeout=5.0).json()["disaggregation"]
    return None


async def _drive(
    workload: Any,
    router: RouterProcess,
    fleet: SimFleet,
    preset: dict[str, Any],
    model: str,
    victim: str | None,
) -> tuple[list[RequestRecord], float, float | None]:
    """Run the workload; kill ``victim`` at the preset's simulated time when given."""
    ts = preset["time_scale"]
    killed: list[float] = []

    async def kill(t0: float) -> None:
        assert victim is not None
        await asyncio.sleep(max(0.0, t0 + preset["kill_at_s"] * ts - time.monotonic()))
        await asyncio.to_thread(fleet.kill, victim)
        killed.append((time.monotonic() - t0) / ts)

    t0 = time.monotonic()
    task = asyncio.create_task(kill(t0)) if victim else None
    try:
        records, wall = await run_workload(
            workload, router.url, model=model, time_scale=ts, deadline_s=preset["deadline_s"]
        )
    finally:
        if task is not None and not task.done():
            task.cancel()
        if task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await task
    return records, wall, killed[0] if killed else None


def run_pd_arm(
    args: argparse.Namespace,
    preset: dict[str, Any],
    arm: tuple[str, str, bool, bool],
    log_dir: Path | None = None,
) -> dict[str, Any]:
    """One arm on a fresh fleet and router: the routing benchmark's row, the P/D counters,
    and when the prefill replica was killed."""
    from kvroute.bench.routing_bench import _apply_router_options, _router_settings, _row
    from kvroute.bench.storage_scenario import _wait_healthy

    name, mode, split, kill = arm
    config = _fleet_config(args, preset)
    logs = {} if log_dir is None else {"log_path": log_dir / f"fleet-{name}.log"}
    router_logs = {} if log_dir is None else {"log_path": log_dir / f"router-{name}.log"}
    lat = config.latency
    with SimFleet(config, **logs) as fleet:
        settings = _router_settings(fleet, "kvroute", config)
        roles = _roles(len(fleet.replicas), split)
        for entry, role in zip(settings["replicas"], roles, strict=True):
            entry["role"] = role
        settings["disagg"] = {
            "mode": mode,
            "transfer_s_per_token": lat.transfer_s_per_token * lat.time_scale,
            # The decode leg's first token is a step of its own on the decode replica (its
            # last partial block computed after the pull; a decode-only request's comes with
            # its prefill's step), plus the second HTTP leg: measured 0.07 s slower than
            # decode-only on idle replicas, of which the pull is 0.03 s.
            "split_overhead_s": lat.decode_s_per_step * lat.time_scale + 0.002,
        }
        _apply_router_options(settings, getattr(args, "router_option", None) or [])
        with RouterProcess(settings, **router_logs) as router:
            _wait_healthy(router, len(fleet.replicas))
            router.wait_feeds_settled()
            tokenizer = SimTokenizer(Path(fleet.model_dir))
            text = TextSource(args.seed, count_tokens=lambda s: len(tokenizer.encode(s)))
            text.rng.seed(f"{args.seed}/pd_mix")
            workload = pd_mix.build(text, seed=args.seed, **preset["sizes"])
            victim = fleet.replicas[0].name if kill else None
            records, wall, killed_at = asyncio.run(
                _drive(workload, router, fleet, preset, config.model, victim)
            )
            row = _row("pd_mix", name, records, wall, lat.time_scale, tokenizer, config)
            row["pd_mode"] = mode
            row["roles"] = dict(zip([r.name for r in fleet.replicas], roles, strict=True))
            row["pd"] = _pd_stats(router)
            row["killed"] = None if victim is None else {"replica": victim, "at_s": killed_at}
            row["failed"] = row["requests"] - row["completed"]
            row["sizes"] = preset["sizes"]
            row.update(_by_kind(records, lat.time_scale))
    return row


def _by_kind(records: list[RequestRecord], time_scale: float) -> dict[str, Any]:
    """TTFT p50/p90 per kind of request (long, user: a returning user's turn after the
    first, user_first, short) and the time per output token after the first (TPOT) p90,
    where a decode stalled by a prefill beside it shows."""
    from kvroute.bench.routing_bench import percentile

    ttfts: dict[str, list[float]] = {}
    tpots: list[float] = []
    for r in records:
        if not r.ok or r.first_token is None or r.done is None:
            continue
        kind = r.session.split("-")[0]
        if kind == "user" and r.turn == 0:
            kind = "user_first"
        ttfts.setdefault(kind, []).append((r.first_token - r.sent) / time_scale)
        if r.completion_tokens > 1:
            tpots.append((r.done - r.first_token) / time_scale / (r.completion_tokens - 1))
    return {
        "ttft_p50_by_kind_s": {k: percentile(v, 50) for k, v in sorted(ttfts.items())},
        "ttft_p90_by_kind_s": {k: percentile(v, 90) for k, v in sorted(ttfts.items())},
        "tpot_p90_s": percentile(tpots, 90) if tpots else None,
    }


def run_pd_scenario(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every arm (``args.scenario_arms``: a subset), rows in ARMS order."""
    preset = PD_PRESETS[args.preset]
    wanted = getattr(args, "scenario_arms", None)
    rows = []
    log_dir = Path(args.out_dir) / "pd" / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    for arm in [a for a in ARMS if not wanted or a[0] in wanted]:
        row = run_pd_arm(args, preset, arm, log_dir=log_dir)
        rows.append(row)
        pd = row["pd"] or {}
        kinds = ", ".join(f"{k} {v:.3f}" for k, v in row["ttft_p90_by_kind_s"].items())
        print(
            f"routing bench: pd_mix/{arm[0]}: TTFT p90 {row['ttft_p90_s']:.3f} s "
            f"({kinds}), TPOT p90 {row['tpot_p90_s']}, "
            f"{row['completed']}/{row['requests']} done, split {pd.get('split')}, "
            f"bypass rate {pd.get('bypass_rate')}, decisions {pd.get('decisions')}",
            file=sys.stderr,
            flush=True,
        )
    return rows


def pd_targets(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Issue 33's targets: the decider's TTFT p90 <= min(always-split, aggregated) and
    <= 0.8x always-split's; zero failed requests in every arm, the killed one included."""
    by = {r["policy"]: r for r in rows}
    pd, split, agg = by.get("kvroute_pd"), by.get("always_split"), by.get("aggregated")
    out: dict[str, Any] = {"failed": {name: r["failed"] for name, r in by.items()}}
    out["met_zero_failures"] = all(r["failed"] == 0 for r in rows)
    if pd is None or split is None or agg is None:
        return out
    p90 = pd["ttft_p90_s"]
    out["ttft_p90_s"] = {
        n: by[n]["ttft_p90_s"] for n in ("kvroute_pd", "always_split", "aggregated")
    }
    out["ratio_vs_always_split"] = p90 / split["ttft_p90_s"] if split["ttft_p90_s"] else None
    out["met_no_worse_than_best"] = p90 <= min(split["ttft_p90_s"], agg["ttft_p90_s"])
    ratio = out["ratio_vs_always_split"]
    out["met_0_8x_always_split"] = ratio is not None and ratio <= 0.8
    return out
