"""The shared-storage routing scenario: hot documents, a scale-up and a restart mid-run.

Hot documents (bench/workloads/hot_docs.py) larger together than any replica's device + CPU
tiers, at a rate that needs the whole fleet, replayed four times on a fresh simulated fleet:

- ``kvroute_shared``: kvroute, every replica mounting one shared STORAGE domain, the router
  subscribed to the domain's evictor stream (``storage_domains``);
- ``kvroute_private``: kvroute, each replica with a private disk; the disks add up to the
  shared domain's capacity (the same bytes of storage, not shared);
- ``approx_prefix`` and ``round_robin`` on the shared fleet (the same hardware as the first
  arm: what the router adds on top of it).

Mid-run, in every arm at the same simulated times: one replica is added (the fleet starts it,
the router learns it from the replicas file it watches) and one replica is restarted (device
and CPU tiers lost; its disk, private or shared, survives; nothing listens on its port for
``restart_down_s``). Each row is the routing
benchmark's row plus what the fleet changes did: the added replica's first hit (its k-th
request) and the restarted replica's first hit after its restart, with hit rates before and
after. ``kvroute bench routing --scenario shared_storage`` runs it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from kvroute.bench.sim.fleet import SimFleet, SimFleetConfig
from kvroute.bench.sim.latency import LatencyModel
from kvroute.bench.sim.tokenizer import SimTokenizer
from kvroute.bench.workloads import BUILDERS, TextSource
from kvroute.bench.workloads.base import Session, Turn, Workload
from kvroute.bench.workloads.runner import RequestRecord, run_workload
from kvroute.deploy.router_process import RouterProcess

__all__ = ["ARMS", "SCENARIO_PRESETS", "run_scenario"]

# (row name, router policy, shared domain?)
ARMS: tuple[tuple[str, str, bool], ...] = (
    ("kvroute_shared", "kvroute", True),
    ("kvroute_private", "kvroute", False),
    ("approx_prefix", "approx_prefix", True),
    ("round_robin", "round_robin", True),
)

# Per replica: 128 device + 64 CPU blocks (3,072 tokens). The hot set (full) is 24 documents
# of 2,000 tokens, 3,000 blocks: 15 replicas' worth of device + CPU; the shared domain holds
# it once (3,200 blocks), and the private disks add up to the same (800 blocks each, counting
# the replica added later), so a document kept on two private disks costs the fleet room for
# another. Offered prefill load without reuse is ~1.0x what the three starting replicas can
# compute (6 req/s x 2,100 tokens x 250 us); with every document a storage load, ~0.45x.
# (At 8 req/s every arm saturates and TTFT measures the queue: docs/benchmarks.md.)
SCENARIO_PRESETS: dict[str, dict[str, Any]] = {
    "quick": {
        "replicas": 2,
        "gpu_blocks": 96,
        "cpu_blocks": 0,
        "shared_storage_blocks": 160,  # half the hot set: the evictor runs
        "time_scale": 0.5,
        "scale_up_at_s": 4.0,
        # Early enough that ~40 requests follow the restart: with a few the restarted replica's
        # share could be one request for a document the half-size domain had evicted.
        "restart_at_s": 6.0,
        "restart_down_s": 1.0,
        "warmup": False,
        "deadline_s": 40.0,
        "sizes": dict(
            documents=5,
            document_tokens=1000,
            requests=64,
            question_tokens=30,
            answer_tokens=8,
            rate=4.0,
            skew=0.8,
        ),
    },
    "full": {
        "replicas": 3,
        "gpu_blocks": 128,
        "cpu_blocks": 64,
        "shared_storage_blocks": 3200,
        "time_scale": 1.0,
        "scale_up_at_s": 12.0,
        "restart_at_s": 24.0,
        "restart_down_s": 2.0,
        # Each document read once before the measured trace (not measured), so the trace
        # starts from a fleet that has served its hot documents before (``--scenario-cold``
        # turns it off: then every arm's first seconds are the same cold recompute).
        "warmup": True,
        "deadline_s": 110.0,
        "sizes": dict(
            documents=24,
            document_tokens=2000,
            requests=300,
            question_tokens=40,
            answer_tokens=16,
            rate=6.0,
            skew=0.6,
        ),
    },
}


def _fleet_config(args: argparse.Namespace, preset: dict[str, Any], shared: bool) -> SimFleetConfig:
    from kvroute.bench.routing_presets import BENCH_LATENCY

    total = preset["shared_storage_blocks"]
    return SimFleetConfig(
        replicas=preset["replicas"],
        block_size=args.block_size,
        gpu_blocks=preset["gpu_blocks"],
        cpu_blocks=preset["cpu_blocks"],
        # Private disks add up to the shared domain (the replicas after the scale-up).
        storage_blocks=0 if shared else total // (preset["replicas"] + 1),
        shared_storage_blocks=total if shared else 0,
        max_num_seqs=args.max_num_seqs,
        seed=args.seed,
        latency=LatencyModel(time_scale=preset["time_scale"], **BENCH_LATENCY),
    )


QUESTION = "\n\nQuestion: "


def warmup_workload(workload: Workload, rate: float) -> Workload:
    """Each document of ``workload`` once, in order of first use, ``rate`` per second, with a
    question of its own (so the measured trace gets no exact repeat): what a fleet that has
    served these documents before holds in its tiers."""
    first: dict[str, Session] = {}
    for session in workload.sessions:
        first.setdefault(session.turns[0].content.split(QUESTION, 1)[0], session)
    sessions = [
        Session(
            id=f"warmup-{i}",
            start_s=i / rate,
            system=session.system,
            turns=[
                Turn(
                    content=doc + QUESTION + "What is this document about?",
                    max_tokens=session.turns[0].max_tokens,
                )
            ],
        )
        for i, (doc, session) in enumerate(first.items())
    ]
    return Workload(f"{workload.name}_warmup", sessions, {"documents": len(sessions)})


def _write_replicas_file(path: Path, fleet: SimFleet) -> None:
    """The router's watched list, replaced whole (a watcher never reads half a file)."""
    tmp = path.with_name(path.name + ".tmp")
    entries = [fleet.replica_entry(r) for r in fleet.replicas]
    tmp.write_text(yaml.safe_dump({"replicas": entries}, sort_keys=False))
    tmp.replace(path)


def _wait_healthy(router: RouterProcess, want: int, timeout_s: float = 60.0) -> float:
    """Until the router reports ``want`` healthy replicas; returns the seconds it took."""
    t0 = time.monotonic()
    with httpx.Client(timeout=5.0) as client:
        while time.monotonic() - t0 < timeout_s:
            with contextlib.suppress(httpx.HTTPError, ValueError):
                body = client.get(router.url + "/health").json()
                if int(body.get("healthy_replicas", 0)) >= want:
                    return time.monotonic() - t0
            time.sleep(0.05)
    raise TimeoutError(f"router never saw {want} healthy replicas")


def _first_hit(records: list[RequestRecord], replica: str, after: float = 0.0) -> int | None:
    """The 1-based position, among ``replica``'s completed requests sent after ``after``,
    of the first one with a cache hit (None: no hit)."""
    mine = [r for r in records if r.ok and r.replica == replica and r.sent >= after]
    for k, r in enumerate(mine, 1):
        if r.cached_tokens > 0:
            return k
    return None


def _hit_rate(records: list[RequestRecord]) -> float | None:
    prompt = sum(r.prompt_tokens for r in records if r.ok)
    cached = sum(r.cached_tokens for r in records if r.ok)
    return cached / prompt if prompt else None


def _changes_report(
    records: list[RequestRecord], changes: dict[str, Any], time_scale: float
) -> dict[str, Any]:
    added, restarted = changes.get("added"), changes.get("restarted")
    out: dict[str, Any] = {}
    if added is not None:
        at = changes["added_at"]
        mine = [r for r in records if r.ok and r.replica == added]
        out["scale_up"] = {
            "replica": added,
            "at_s": at / time_scale,
            "router_saw_it_after_s": changes.get("added_seen_after_s"),
            "requests": len(mine),
            "first_hit_request": _first_hit(records, added),
            "hit_rate": _hit_rate(mine),
        }
    if restarted is not None:
        at = changes["restarted_at"]
        before = [r for r in records if r.ok and r.replica == restarted and r.sent < at]
        after = [r for r in records if r.ok and r.replica == restarted and r.sent >= at]
        out["restart"] = {
            "replica": restarted,
            "at_s": at / time_scale,
            "requests_after": len(after),
            "first_hit_request_after": _first_hit(records, restarted, after=at),
            "hit_rate_before": _hit_rate(before),
            "hit_rate_after": _hit_rate(after),
            "failed_around_restart": sum(
                1 for r in records if not r.ok and abs(r.sent - at) < 5 * time_scale
            ),
        }
    return out


async def _drive(
    workload: Any,
    router: RouterProcess,
    fleet: SimFleet,
    replicas_file: Path,
    preset: dict[str, Any],
    model: str,
) -> tuple[list[RequestRecord], float, dict[str, Any]]:
    """Run the workload while the fleet changes under it at the preset's simulated times."""
    ts = preset["time_scale"]
    changes: dict[str, Any] = {}

    async def fleet_changes(t0: float) -> None:
        await asyncio.sleep(max(0.0, t0 + preset["scale_up_at_s"] * ts - time.monotonic()))
        new = await asyncio.to_thread(fleet.add_replica)
        changes["added"], changes["added_at"] = new.name, time.monotonic() - t0
        _write_replicas_file(replicas_file, fleet)
        changes["added_seen_after_s"] = await asyncio.to_thread(
            _wait_healthy, router, len(fleet.replicas)
        )
        await asyncio.sleep(max(0.0, t0 + preset["restart_at_s"] * ts - time.monotonic()))
        victim = fleet.replicas[0].name
        changes["restarted_at"] = time.monotonic() - t0
        # Down for a while, as a restarting vLLM is (its port closed while it starts).
        await asyncio.to_thread(fleet.restart, victim, preset["restart_down_s"] * ts)
        changes["restarted"] = victim

    t0 = time.monotonic()
    task = asyncio.create_task(fleet_changes(t0))
    try:
        records, wall = await run_workload(
            workload, router.url, model=model, time_scale=ts, deadline_s=preset["deadline_s"]
        )
    finally:
        if not task.done():
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    return records, wall, changes


def _router_index(router: RouterProcess) -> dict[str, Any]:
    """The router's own view of its index (``/index/stats``), for the mechanics checks."""
    with contextlib.suppress(httpx.HTTPError, ValueError):
        return httpx.get(router.url + "/index/stats", timeout=5.0).json()
    return {}


def run_arm(
    args: argparse.Namespace,
    preset: dict[str, Any],
    arm: tuple[str, str, bool],
    work_dir: Path,
    inspect: Any = None,
    log_dir: Path | None = None,
) -> dict[str, Any]:
    """One arm on a fresh fleet and router. ``inspect(fleet, router, records)``, when given,
    runs before they stop (the tests look at the fleet and the router's index there);
    ``log_dir``: where the fleet's and the router's logs are kept."""
    from kvroute.bench.policy_variants import learned_rates_row
    from kvroute.bench.routing_bench import (
        _apply_router_options,
        _router_settings,
        _row,
        _true_rates,
    )

    name, policy, shared = arm
    config = _fleet_config(args, preset, shared)
    replicas_file = work_dir / f"replicas-{name}.yaml"
    logs = {} if log_dir is None else {"log_path": log_dir / f"fleet-{name}.log"}
    router_logs = {} if log_dir is None else {"log_path": log_dir / f"router-{name}.log"}
    with SimFleet(config, **logs) as fleet:
        _write_replicas_file(replicas_file, fleet)
        settings = _router_settings(fleet, policy, config)
        settings.pop("replicas")
        settings.update(replicas_file=str(replicas_file), watch_interval_s=0.2)
        _apply_router_options(settings, getattr(args, "router_option", None) or [])
        with RouterProcess(settings, **router_logs) as router:
            _wait_healthy(router, len(fleet.replicas))
            router.wait_feeds_settled()
            tokenizer = SimTokenizer(Path(fleet.model_dir))
            text = TextSource(args.seed, count_tokens=lambda s: len(tokenizer.encode(s)))
            text.rng.seed(f"{args.seed}/hot_docs")
            workload = BUILDERS["hot_docs"](text, seed=args.seed, **preset["sizes"])
            warmup = None
            if preset.get("warmup") and not getattr(args, "scenario_cold", False):
                warm = warmup_workload(workload, preset["sizes"]["rate"])
                warm_records, warm_wall = asyncio.run(
                    run_workload(
                        warm,
                        router.url,
                        model=config.model,
                        time_scale=config.latency.time_scale,
                        deadline_s=preset["deadline_s"],
                    )
                )
                warmup = {
                    "requests": len(warm_records),
                    "completed": sum(1 for r in warm_records if r.ok),
                    "wall_s": round(warm_wall, 3),
                }
            records, wall, changes = asyncio.run(
                _drive(workload, router, fleet, replicas_file, preset, config.model)
            )
            # The row's capacity figures count the fleet after its scale-up.
            grown = dataclasses.replace(config, replicas=len(fleet.replicas))
            row = _row("hot_docs", name, records, wall, config.latency.time_scale, tokenizer, grown)
            row["router_policy"] = policy
            row["storage"] = "shared" if shared else "private"
            row["sizes"] = preset["sizes"]
            row["warmup"] = warmup  # None: the trace started on cold tiers
            row |= _changes_report(records, changes, config.latency.time_scale)
            if policy.startswith("kvroute"):
                # what the cost model learned of the rates (issue 38's calibration)
                row["cost_rates"] = learned_rates_row(router.url, _true_rates(config))
            if shared:
                stats = fleet.storage_contents()
                row["storage_domain"] = {k: v for k, v in stats.items() if k != "hashes"}
            if inspect is not None:
                inspect(fleet, router, records)
    return row


def run_scenario(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every arm of the scenario (``args.scenario_arms``: a subset), rows in ARMS order."""
    import sys

    from kvroute.bench.routing_bench import workload_sizes

    preset = SCENARIO_PRESETS[args.preset]
    # ``--size hot_docs.KEY=JSON`` overrides, checked as the routing benchmark checks them.
    sizes = workload_sizes({"sizes": {"hot_docs": preset["sizes"]}}, ["hot_docs"], args.size)
    preset = {**preset, "sizes": sizes["hot_docs"]}
    wanted = getattr(args, "scenario_arms", None)
    arms = [a for a in ARMS if not wanted or a[0] in wanted]
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvroute-storage-") as tmp:
        for arm in arms:
            log_dir = Path(args.out_dir) / "shared_storage" / "logs"
            log_dir.mkdir(parents=True, exist_ok=True)
            row = run_arm(args, preset, arm, Path(tmp), log_dir=log_dir)
            rows.append(row)
            print(
                f"routing bench: hot_docs/{arm[0]}: hit {row['hit_rate']:.3f}, TTFT p90 "
                f"{row['ttft_p90_s']:.3f} s, {row['completed']}/{row['requests']} done, added "
                f"replica first hit at #{row.get('scale_up', {}).get('first_hit_request')}",
                file=sys.stderr,
                flush=True,
            )
    return rows


def scenario_targets(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The issue's targets: hit rate >= private disks + 10 points, TTFT p90 <= 0.7x."""
    by = {r["policy"]: r for r in rows}
    shared, private = by.get("kvroute_shared"), by.get("kvroute_private")
    if shared is None or private is None:
        return {}
    gain = shared["hit_rate"] - private["hit_rate"]
    ratio = (
        shared["ttft_p90_s"] / private["ttft_p90_s"]
        if shared["ttft_p90_s"] and private["ttft_p90_s"]
        else None
    )
    return {
        "hit_rate_gain_vs_private": gain,
        "ttft_p90_ratio_vs_private": ratio,
        "met_hit_rate": gain >= 0.10,
        "met_ttft_p90": ratio is not None and ratio <= 0.7,
    }
