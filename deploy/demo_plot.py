"""The demo's picture: what a newcomer should see at a glance, in one PNG.

Three panels, one colour per policy: the TTFT distribution (a CDF: the further left, the
sooner the first token), the hit rate split by where the cached tokens came from (the
replica's device cache, or our connector's RAM tier), and the requests each replica served
(kvroute keeps a conversation where its history is; round-robin deals them out).

matplotlib comes with the ``demo`` extra; without it the demo says so and writes no PNG.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["write_png"]

COLOURS = {"kvroute": "tab:green", "round_robin": "tab:gray"}


def write_png(results: list[Any], path: Path) -> Path | None:
    """Draw ``results`` (the demo's merged RunResults) to ``path``; None without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (cdf, tiers, spread) = plt.subplots(1, 3, figsize=(15, 4.2))
    for r in results:
        xs = sorted(1000 * t for t in r.ttft_s)
        if xs:
            ys = [(i + 1) / len(xs) for i in range(len(xs))]
            cdf.step(xs, ys, where="post", label=r.policy, color=COLOURS.get(r.policy))
    cdf.set_xscale("log")
    from matplotlib.ticker import NullFormatter

    cdf.xaxis.set_minor_formatter(NullFormatter())  # 2x10^1, 3x10^1... overlap; decades say it
    cdf.set_xlabel("time to first token (ms, log scale)")
    cdf.set_ylabel("fraction of requests")
    cdf.set_title("TTFT: further left is faster")
    cdf.grid(True, alpha=0.3)
    cdf.legend()

    names = [r.policy for r in results]
    device = [r.device_hit_rate for r in results]
    connector = [r.hit_rate - r.device_hit_rate for r in results]
    tiers.bar(names, device, label="device cache", color="tab:blue")
    tiers.bar(names, connector, bottom=device, label="RAM tier (connector)", color="tab:orange")
    for i, r in enumerate(results):
        tiers.text(i, r.hit_rate + 0.02, f"{r.hit_rate:.0%}", ha="center")
    tiers.set_ylim(0, 1.1)
    tiers.set_ylabel("prompt tokens served from cache")
    tiers.set_title("hit rate, by tier")
    tiers.legend(loc="upper right", fontsize=8)

    replicas = sorted({n for r in results for n in r.per_replica})
    width = 0.8 / max(1, len(results))
    for i, r in enumerate(results):
        xs = [j + i * width for j in range(len(replicas))]
        spread.bar(
            xs,
            [r.per_replica.get(n, 0) for n in replicas],
            width=width,
            label=r.policy,
            color=COLOURS.get(r.policy),
        )
    spread.set_xticks([j + width * (len(results) - 1) / 2 for j in range(len(replicas))])
    spread.set_xticklabels(replicas)
    spread.set_ylabel("requests served")
    spread.set_title("requests per replica")
    spread.legend(fontsize=8)

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
