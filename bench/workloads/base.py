"""What a workload is: sessions of chat turns, with when each session starts and how long a
user (or tool) takes between turns. All times are simulated seconds.

A session is closed-loop: turn k+1 is sent ``think_s`` after turn k's response arrived, and
its messages are the session's history (system prompt, earlier turns, the replies actually
received) plus the new message. Sessions are open-loop among themselves (each starts at
``start_s`` whatever the others do), which is how production traffic and the production-stack
and llm-d benchmarks behave. A single-request session is an open-loop request.

Workloads are pure data built from a seed: the same seed gives the same sessions, so every
routing policy sees the same trace.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Session", "Turn", "Workload"]


@dataclass(frozen=True, slots=True)
class Turn:
    """One request of a session: a new message appended to the history."""

    content: str
    max_tokens: int
    think_s: float = 0.0
    role: str = "user"


@dataclass(slots=True)
class Session:
    id: str
    start_s: float
    turns: list[Turn]
    system: str | None = None


@dataclass(slots=True)
class Workload:
    """A named, seeded trace plus what it was built from (reported next to the results)."""

    name: str
    sessions: list[Session]
    params: dict[str, object] = field(default_factory=dict)

    @property
    def num_requests(self) -> int:
        return sum(len(s.turns) for s in self.sessions)
