"""Faults a test or benchmark injects into one simulated replica, and the record of the
requests it received.

``SimReplicaConfig.error_rate`` fails requests at random; these faults are deterministic and
can be changed while the replica runs (a test flips ``healthy`` or ``fail_status`` and
watches the router react). The record of seen requests lets a test check what reached a
replica (path, body, headers) without a second, hand-written vLLM.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ReplicaFaults", "RequestLog", "SeenRequest"]


@dataclass(slots=True)
class ReplicaFaults:
    """Deterministic misbehaviour of one replica (the defaults: none)."""

    # Generation endpoints answer this status in vLLM's error schema, before any work.
    fail_status: int | None = None
    # Extra seconds (wall clock) between admission and the first token: a slow prefill.
    prefill_delay_s: float = 0.0
    # Extra seconds (wall clock) before a request reaches the scheduler: its blocks are
    # computed, stored and announced on the event feed that much later.
    admit_delay_s: float = 0.0
    # A streamed answer's connection breaks after this many chunks, as when vLLM crashes.
    die_after_chunks: int | None = None
    # False: GET /health answers 503, as vLLM does when its engine is dead.
    healthy: bool = True
    # /tokenize answers this many seconds late (without blocking the server).
    tokenize_delay_s: float = 0.0
    # Token ids this replica prepends to every prompt it tokenizes: a replica whose
    # tokenizer differs from the router's.
    tokenizer_prefix: list[int] = field(default_factory=list)
    # Headers added to every answer of a generation endpoint.
    headers: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class SeenRequest:
    """One request as the replica received it."""

    path: str
    body: dict[str, Any]
    headers: dict[str, str]


class RequestLog:
    """The last ``limit`` requests a replica received, oldest first."""

    def __init__(self, limit: int = 1024) -> None:
        self._entries: deque[SeenRequest] = deque(maxlen=limit)

    def append(self, entry: SeenRequest) -> None:
        self._entries.append(entry)

    def clear(self) -> None:
        self._entries.clear()

    def __iter__(self) -> Iterator[SeenRequest]:
        return iter(list(self._entries))

    def __len__(self) -> int:
        return len(self._entries)
