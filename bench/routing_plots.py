"""The routing benchmark's PNG plots: per workload, each policy's TTFT CDF and token hit rate
against the infinite-cache bound."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["draw_plots"]


def draw_plots(rows: list[dict[str, Any]], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    paths: list[str] = []
    fig, axes = plt.subplots(1, len(workloads), figsize=(5 * len(workloads), 4), squeeze=False)
    for ax, w in zip(axes[0], workloads, strict=True):
        for r in (r for r in rows if r["workload"] == w):
            xs = sorted(r["ttfts_s"])
            if xs:
                ys = [(i + 1) / len(xs) for i in range(len(xs))]
                ax.step(xs, ys, where="post", label=r["policy"])
        ax.set_xscale("log")
        ax.set_title(f"TTFT CDF: {w}")
        ax.set_xlabel("time to first token (simulated s)")
        ax.set_ylabel("fraction of requests")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / "routing_ttft_cdf.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    paths.append(str(path))

    fig, axes = plt.subplots(1, len(workloads), figsize=(5 * len(workloads), 4), squeeze=False)
    for ax, w in zip(axes[0], workloads, strict=True):
        sel = [r for r in rows if r["workload"] == w]
        ax.bar([r["policy"] for r in sel], [r["hit_rate"] for r in sel], color="tab:blue")
        ub = max(r["upper_bound_hit_rate"] for r in sel)
        ax.axhline(ub, color="tab:red", linestyle="--", label=f"infinite cache ({ub:.2f})")
        ax.set_ylim(0, 1)
        ax.set_title(f"token hit rate: {w}")
        ax.tick_params(axis="x", rotation=30)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / "routing_hit_rate.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    paths.append(str(path))
    return paths
