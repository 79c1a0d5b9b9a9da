"""The prefill/decode mix: what a P/D fleet serves and what the decider must tell apart.

Three kinds of request, interleaved as Poisson arrivals: long new prompts (documents nobody
sent before: the prefill pool's work), returning chat users (a long first message, then short
turns over a growing history the decode replica already holds: the prefill leg would only
move KV it has), and short one-off prompts (too small to be worth a second request). Always
splitting pays the transfer and the extra hop on the last two; never splitting runs the
long prefills on the replicas that decode. bench/pd_scenario.py replays it.
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
    long_requests: int = 24,
    long_tokens: int = 3000,
    long_rate: float = 1.0,
    users: int = 12,
    rounds: int = 4,
    history_tokens: int = 1500,
    question_tokens: int = 40,
    user_rate: float = 1.0,
    think_s: float = 2.0,
    short_requests: int = 48,
    short_tokens: int = 40,
    short_rate: float = 2.0,
    answer_tokens: int = 16,
) -> Workload:
    rng = random.Random(seed)
    sessions: list[Session] = []

    def arrivals(n: int, rate: float) -> list[float]:
        t, out = 0.0, []
        for _ in range(n):
            t += rng.expovariate(rate)
            out.append(t)
        return out

    for i, start in enumerate(arrivals(long_requests, long_rate)):
        turn = Turn(content=text.text(long_tokens), max_tokens=answer_tokens)
        sessions.append(Session(id=f"long-{i}", start_s=start, turns=[turn]))
    for u, start in enumerate(arrivals(users, user_rate)):
        turns = [
            Turn(
                content=text.text(history_tokens if r == 0 else question_tokens),
                max_tokens=answer_tokens,
                think_s=0.0 if r == 0 else rng.expovariate(1.0 / think_s),
            )
            for r in range(rounds)
        ]
        sessions.append(Session(id=f"user-{u}", start_s=start, turns=turns))
    for i, start in enumerate(arrivals(short_requests, short_rate)):
        turn = Turn(content=text.text(short_tokens), max_tokens=answer_tokens)
        sessions.append(Session(id=f"short-{i}", start_s=start, turns=[turn]))
    sessions.sort(key=lambda s: s.start_s)
    params = dict(
        long_requests=long_requests,
        long_tokens=long_tokens,
        long_rate=long_rate,
        users=users,
        rounds=rounds,
        history_tokens=history_tokens,
        question_tokens=question_tokens,
        user_rate=user_rate,
        think_s=think_s,
        short_requests=short_requests,
        short_tokens=short_tokens,
        short_rate=short_rate,
        answer_tokens=answer_tokens,
        seed=seed,
    )
    return Workload("pd_mix", sessions, params)
