"""Agentic loop: an agent's context grows by a tool call and its output at every step.

Agents share a long system prompt (instructions and tool schemas) and start as a Poisson
process. Each step sends the whole history plus the latest tool output (role ``tool``) after
the tool's latency, so each request extends the previous one's prompt and output: the best
case for prefix reuse, when the agent's steps land on the replica that holds its history.
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
    agents: int = 32,
    steps: int = 8,
    system_tokens: int = 1500,
    task_tokens: int = 200,
    tool_output_tokens: tuple[int, int] = (200, 800),
    call_tokens: int = 80,
    agent_rate: float = 2.0,
    tool_latency_s: float = 1.0,
) -> Workload:
    rng = random.Random(seed)
    system = "You are an agent. Tools: search(query), read(url), run(code). " + text.text(
        system_tokens
    )
    sessions: list[Session] = []
    t = 0.0
    lo, hi = tool_output_tokens
    for a in range(agents):
        t += rng.expovariate(agent_rate)
        turns = [Turn(content="Task: " + text.text(task_tokens), max_tokens=call_tokens)]
        for _ in range(steps - 1):
            turns.append(
                Turn(
                    content="Tool result: " + text.text(rng.randint(lo, hi)),
                    max_tokens=call_tokens,
                    think_s=rng.expovariate(1.0 / tool_latency_s),
                    role="tool",
                )
            )
        sessions.append(Session(id=f"agent-{a}", start_s=t, turns=turns, system=system))
    params = dict(
        agents=agents,
        steps=steps,
        system_tokens=system_tokens,
        task_tokens=task_tokens,
        tool_output_tokens=list(tool_output_tokens),
        call_tokens=call_tokens,
        agent_rate=agent_rate,
        tool_latency_s=tool_latency_s,
        seed=seed,
    )
    return Workload("agentic", sessions, params)
