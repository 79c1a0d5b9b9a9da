"""Shared-prefix groups: G groups x P questions on long prefixes (llm-d's benchmark shape).

Each group has its own long system prompt (a tenant's instructions, a few-shot block); its P
questions arrive interleaved with every other group's, in random order, as a Poisson process.
Every question after a group's first can reuse the group's prefix, if it lands where that
prefix still is.
"""

from __future__ import annotations

import random

from kvroute.bench.workloads.base import Session, Turn, Workload
from kvroute.bench.workloads.text import TextSource

__all__ = ["build"]


def build(
    text: TextSource,
    *,
    seed: int = 0,
    groups: int = 48,
    questions: int = 8,
    prefix_tokens: int = 3000,
    question_tokens: int = 100,
    answer_tokens: int = 64,
    rate: float = 60.0,
) -> Workload:
    rng = random.Random(seed)
    prefixes = [f"Group {g} instructions. " + text.text(prefix_tokens) for g in range(groups)]
    order = [(g, q) for g in range(groups) for q in range(questions)]
    rng.shuffle(order)
    sessions: list[Session] = []
    t = 0.0
    for g, q in order:
        t += rng.expovariate(rate)
        turn = Turn(content=text.text(question_tokens), max_tokens=answer_tokens)
        sessions.append(Session(id=f"group-{g}-q{q}", start_s=t, turns=[turn], system=prefixes[g]))
    params = dict(
        groups=groups,
        questions=questions,
        prefix_tokens=prefix_tokens,
        question_tokens=question_tokens,
        answer_tokens=answer_tokens,
        rate=rate,
        seed=seed,
    )
    return Workload("shared_prefix", sessions, params)
