"""Policy variants for the routing benchmark: a policy run with wrong cost-model priors.

``kvroute bench routing --policies kvroute,kvroute~x10,kvroute~x0.1,kvroute~fixed-x10`` runs
kvroute with the simulator's true prefill and load rates as its priors, with priors 10x too
high, 10x too low (learning the rates per replica from answered requests,
router/routing/calibration.py), and 10x too high with learning off: what an operator who
guessed the hardware wrong gets with and without calibration. After each run the rates every
replica's cost is priced with are read from the router's ``/index/stats``.
"""

from __future__ import annotations

import json
import math
import urllib.request
from dataclasses import dataclass
from typing import Any

__all__ = ["RATE_NAMES", "PolicyVariant", "learned_rates_row"]

RATE_NAMES = ("prefill_s_per_token", "load_s_per_token_cpu", "load_s_per_token_storage")


@dataclass(frozen=True, slots=True)
class PolicyVariant:
    """``POLICY`` or ``POLICY~x<scale>`` (priors times scale, learned) or
    ``POLICY~fixed-x<scale>`` (priors times scale, never learned)."""

    spec: str
    policy: str
    prior_scale: float = 1.0
    learn: bool = True

    @classmethod
    def parse(cls, spec: str) -> PolicyVariant:
        policy, sep, variant = spec.partition("~")
        if not sep:
            return cls(spec, policy)
        learn = True
        if variant.startswith("fixed-"):
            learn, variant = False, variant[len("fixed-") :]
        if not variant.startswith("x"):
            raise ValueError(f"policy variant {spec!r}: want POLICY~x<scale> or ~fixed-x<scale>")
        try:
            scale = float(variant[1:])
        except ValueError:
            raise ValueError(f"policy variant {spec!r}: {variant[1:]!r} is not a number") from None
        if not math.isfinite(scale) or scale <= 0:
            raise ValueError(f"policy variant {spec!r}: the scale must be > 0")
        return cls(spec, policy, scale, learn)

    def cost(self, true_rates: dict[str, float]) -> dict[str, Any]:
        """The router's cost settings: the true rates scaled, learning on or off."""
        out: dict[str, Any] = {k: v * self.prior_scale for k, v in true_rates.items()}
        out["learn_rates"] = self.learn
        return out


def learned_rates_row(router_url: str, true_rates: dict[str, float]) -> dict[str, Any]:
    """The rates the router prices each replica with at the end of a run (median over the
    replicas), their ratio to the simulator's true rates, and the samples behind them."""
    with urllib.request.urlopen(f"{router_url}/index/stats", timeout=10) as resp:
        stats = json.loads(resp.read())
    per_replica = [
        r["cost_rates"] for r in stats.get("replicas", {}).values() if r.get("cost_rates")
    ]
    if not per_replica:
        return {}
    out: dict[str, Any] = {"learned": per_replica[0]["learned"]}
    for name in RATE_NAMES:
        values = sorted(r[name] for r in per_replica)
        median = values[len(values) // 2]
        out[name] = median
        out[f"{name}_vs_true"] = round(median / true_rates[name], 3) if true_rates[name] else None
    out["samples"] = sum(r["samples"] for r in per_replica)
    return out
