"""Tenants: the shape of llm-d's published precise-prefix-routing benchmark, for the simulator.

llm-d's benchmark of its precise (KV-event driven) prefix-cache routing has many tenants, each
with a long system prompt of its own that all its users share, several users per tenant
asking short questions, and a request rate that ramps up in stages until a cache-blind
fleet can no longer keep up. This builder makes that shape at a size a 2-core machine can
drive through the simulator (the ``llmd`` preset of ``kvroute bench routing``, below).

Each request is one question, open-loop: stage ``i`` lasts ``stages[i][0]`` simulated
seconds with Poisson arrivals at ``stages[i][1]`` requests/s; each request picks a tenant and
one of its users uniformly at random. Only the tenant's prefix is shared: a question reuses
it where it lands on a replica that holds it, in any tier.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from kvroute.bench.workloads.base import Session, Turn, Workload
from kvroute.bench.workloads.text import TextSource

__all__ = ["LLMD_PRESET", "build"]

DEFAULT_STAGES: tuple[tuple[float, float], ...] = (
    (15.0, 3.0),
    (15.0, 6.0),
    (15.0, 9.0),
    (15.0, 12.0),
)


def build(
    text: TextSource,
    *,
    seed: int = 0,
    tenants: int = 48,
    users: int = 5,
    prefix_tokens: int = 3000,
    question_tokens: int = 150,
    answer_tokens: int = 32,
    stages: Sequence[Sequence[float]] = DEFAULT_STAGES,
) -> Workload:
    if tenants < 1 or users < 1:
        raise ValueError("tenants and users must be >= 1")
    plan = [(float(d), float(r)) for d, r in stages]
    if not plan or any(d <= 0 or r <= 0 for d, r in plan):
        raise ValueError(f"stages wants [[seconds, requests/s], ...] all > 0, got {stages!r}")
    rng = random.Random(seed)
    prefixes = [
        f"Tenant {t} instructions and knowledge base. " + text.text(prefix_tokens)
        for t in range(tenants)
    ]
    sessions: list[Session] = []
    stage_start = 0.0
    for duration, rate in plan:
        t = stage_start
        while True:
            t += rng.expovariate(rate)
            if t >= stage_start + duration:
                break
            tenant, user = rng.randrange(tenants), rng.randrange(users)
            question = f"User {user} asks: " + text.text(question_tokens)
            sessions.append(
                Session(
                    id=f"tenant-{tenant}-user-{user}-{len(sessions)}",
                    start_s=t,
                    turns=[Turn(content=question, max_tokens=answer_tokens)],
                    system=prefixes[tenant],
                )
            )
        stage_start += duration
    params: dict[str, object] = dict(
        tenants=tenants,
        users=users,
        prefix_tokens=prefix_tokens,
        question_tokens=question_tokens,
        answer_tokens=answer_tokens,
        stages=[list(s) for s in plan],
        seed=seed,
    )
    return Workload("tenants", sessions, params)


# ``kvroute bench routing --preset llmd``: the full preset's fleet (8 replicas, 12,800 device
# and as many CPU tokens each) and 48 tenants x 3,000-token prefixes (144k tokens: more than
# the fleet's device cache, less than device + CPU, so a router that keeps each tenant on a
# replica or two holds them all, and one that spreads them holds almost none). The ramp goes
# from 0.3x to 1.2x of what the fleet could prefill if nothing were reused (~10 req/s of
# 3,200-token prompts at 4k tokens/s per replica): easy at first, beyond a cache-blind fleet
# at the end. Sizes fixed from this arithmetic, before any policy ran.
LLMD_PRESET: dict[str, Any] = {
    "replicas": 8,
    "gpu_blocks": 800,
    "cpu_blocks": 800,
    "storage_blocks": 0,
    "time_scale": 0.5,
    "workloads": ["tenants"],
    "deadline_s": 150.0,
    "sizes": {
        "tenants": dict(
            tenants=48,
            users=5,
            prefix_tokens=3000,
            question_tokens=150,
            answer_tokens=32,
            stages=DEFAULT_STAGES,
        ),
    },
}
