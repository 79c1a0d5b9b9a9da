"""Multi-turn chat: production-stack's multi-round QA shape.

Users arrive as a Poisson process; all share one system prompt; each user brings
``history_tokens`` of their own context (production-stack's ``--user-history-prompt``: an
earlier conversation, a profile, notes) in the first message, then has ``rounds`` turns, each
a new question after a think time (exponential, mean ``think_s``), so the history (and the
prefix worth reusing) grows with every turn. A user's later turns only hit the cache of a
replica that served the earlier ones and still holds them; only the system prompt is shared.
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
    users: int = 64,
    rounds: int = 6,
    system_tokens: int = 1000,
    history_tokens: int = 0,
    question_tokens: int = 100,
    answer_tokens: int = 150,
    user_rate: float = 4.0,
    think_s: float = 5.0,
) -> Workload:
    rng = random.Random(seed)
    system = "You are a helpful assistant. " + text.text(system_tokens)
    sessions: list[Session] = []
    t = 0.0
    for u in range(users):
        t += rng.expovariate(user_rate)
        history = text.text(history_tokens) + "\n\n" if history_tokens > 0 else ""
        turns = [
            Turn(
                content=(history if r == 0 else "") + text.text(question_tokens),
                max_tokens=answer_tokens,
                think_s=0.0 if r == 0 else rng.expovariate(1.0 / think_s),
            )
            for r in range(rounds)
        ]
        sessions.append(Session(id=f"user-{u}", start_s=t, turns=turns, system=system))
    params = dict(
        users=users,
        rounds=rounds,
        system_tokens=system_tokens,
        history_tokens=history_tokens,
        question_tokens=question_tokens,
        answer_tokens=answer_tokens,
        user_rate=user_rate,
        think_s=think_s,
        seed=seed,
    )
    return Workload("chat", sessions, params)
