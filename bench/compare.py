"""``kvroute bench compare``: two deployments' TTFT percentiles from paired routing runs.

On a shared machine one routing run's chat p90 moves by 10-20% from run to run, more than
the differences worth measuring (several routers against one). The way through is many
runs of each arm, alternated so that both see the same machine, and statistics over them:
this tool reads the ``--out-dir`` of ``kvroute bench routing --records`` runs (each holds
``routing_requests.jsonl``, one line per request, and ``routing.json``) and reports

- per pair (``--a`` run i against ``--b`` run i): each run's percentile and their ratio; the
  mean (with its standard error), median and geometric mean of the ratios;
- pooled: every successful request of an arm's runs together, p50/p90/p99 per arm and
  their ratios;
- for the pooled percentile's ratio, a bootstrap over pairs (the same pairs drawn for both
  arms, so what a pair shared stays shared) and one over runs of each arm independently:
  95% intervals and the one-sided 95% upper bound;
- hit rates (from ``routing.json``) and failed requests per arm.

``--margin`` (e.g. 0.05) adds ``no_worse``: whether the paired one-sided 95% upper bound of
the pooled ratio A/B is under 1 + margin, a non-inferiority test: "A is not more than
margin worse than B at this percentile, at 95% confidence".
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from pathlib import Path
from typing import Any

from kvroute.bench.routing_bench import percentile

__all__ = ["add_arguments", "load_run", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--a", nargs="+", required=True, help="out dirs of arm A's runs")
    parser.add_argument("--b", nargs="+", required=True, help="out dirs of arm B's runs")
    parser.add_argument("--workload", default="chat")
    parser.add_argument("--policy", default="kvroute")
    parser.add_argument("--percentile", type=float, default=90.0)
    parser.add_argument("--resamples", type=int, default=4000)
    parser.add_argument("--margin", type=float, help="non-inferiority margin, e.g. 0.05")
    parser.add_argument("--seed", type=int, default=0)


def load_run(out_dir: str | Path, workload: str, policy: str) -> dict[str, Any]:
    """One run's successful TTFTs, failures and hit rate for (workload, policy)."""
    out = Path(out_dir)
    records = out / "routing_requests.jsonl"
    if not records.is_file():
        raise SystemExit(f"kvroute bench compare: {records} not found (run with --records)")
    ttfts: list[float] = []
    failed = 0
    for number, line in enumerate(records.read_text().splitlines(), 1):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise SystemExit(f"kvroute bench compare: {records}:{number}: {exc}") from exc
        if rec.get("workload") != workload or rec.get("policy") != policy:
            continue
        if rec.get("error") is None and rec.get("ttft_s") is not None:
            ttfts.append(float(rec["ttft_s"]))
        else:
            failed += 1
    if not ttfts:
        raise SystemExit(f"kvroute bench compare: no {workload}/{policy} requests in {records}")
    hit_rate = None
    summary = out / "routing.json"
    if summary.is_file():
        for row in json.loads(summary.read_text()):
            if row.get("workload") == workload and row.get("policy") == policy:
                hit_rate = row.get("hit_rate")
    return {"dir": str(out), "ttfts": ttfts, "failed": failed, "hit_rate": hit_rate}


def _pooled(runs: list[dict[str, Any]], q: float) -> float:
    return percentile([t for r in runs for t in r["ttfts"]], q)


def _pooled_pair(a: list[dict[str, Any]], b: list[dict[str, Any]], q: float) -> dict[str, float]:
    pa, pb = _pooled(a, q), _pooled(b, q)
    return {"a": pa, "b": pb, "a_over_b": pa / pb}


def _interval(ratios: list[float]) -> dict[str, float]:
    ordered = sorted(ratios)
    n = len(ordered)
    return {
        "low_95": ordered[int(0.025 * n)],
        "high_95": ordered[min(n - 1, int(0.975 * n))],
        "one_sided_upper_95": ordered[min(n - 1, int(0.95 * n))],
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.resamples < 100:
        raise SystemExit("kvroute bench compare: --resamples must be >= 100")
    if not 0 < args.percentile <= 100:
        raise SystemExit("kvroute bench compare: --percentile must be in (0, 100]")
    a = [load_run(d, args.workload, args.policy) for d in args.a]
    b = [load_run(d, args.workload, args.policy) for d in args.b]
    q = args.percentile
    paired = len(a) == len(b)
    rng = random.Random(args.seed)
    out: dict[str, Any] = {
        "bench": "compare",
        "workload": args.workload,
        "policy": args.policy,
        "percentile": q,
        "runs": {"a": len(a), "b": len(b)},
        "failed_requests": {"a": sum(r["failed"] for r in a), "b": sum(r["failed"] for r in b)},
        "hit_rates": {
            "a": [r["hit_rate"] for r in a],
            "b": [r["hit_rate"] for r in b],
        },
        "pooled": {f"p{p:g}": _pooled_pair(a, b, p) for p in sorted({50.0, q, 99.0})},
    }
    if paired:
        pairs = [
            {
                "a": percentile(ra["ttfts"], q),
                "b": percentile(rb["ttfts"], q),
                "a_over_b": percentile(ra["ttfts"], q) / percentile(rb["ttfts"], q),
            }
            for ra, rb in zip(a, b, strict=True)
        ]
        ratios = [p["a_over_b"] for p in pairs]
        out["pairs"] = pairs
        out["pair_ratios"] = {
            "mean": statistics.mean(ratios),
            "standard_error": (
                statistics.stdev(ratios) / len(ratios) ** 0.5 if len(ratios) > 1 else None
            ),
            "median": statistics.median(ratios),
            "geometric_mean": statistics.geometric_mean(ratios),
            "below_1": sum(r < 1 for r in ratios),
        }
        draws = []
        for _ in range(args.resamples):
            idx = [rng.randrange(len(a)) for _ in a]
            draws.append(_pooled([a[i] for i in idx], q) / _pooled([b[i] for i in idx], q))
        out["pooled_ratio_paired_bootstrap"] = _interval(draws)
    draws = []
    for _ in range(args.resamples):
        ra = [a[rng.randrange(len(a))] for _ in a]
        rb = [b[rng.randrange(len(b))] for _ in b]
        draws.append(_pooled(ra, q) / _pooled(rb, q))
    out["pooled_ratio_unpaired_bootstrap"] = _interval(draws)
    if args.margin is not None:
        key = "pooled_ratio_paired_bootstrap" if paired else "pooled_ratio_unpaired_bootstrap"
        upper = out[key]["one_sided_upper_95"]
        out["margin"] = args.margin
        out["no_worse"] = upper < 1 + args.margin
    return out
