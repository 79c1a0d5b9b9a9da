"""Seeded routing workloads: multi-turn chat, shared-prefix groups, long-document QA, agentic
loops. Each module's ``build(text, seed=..., **sizes) -> Workload``; see bench.workloads.base
for what a workload is and docs/benchmarks.md for the sizes the benchmark uses and why."""

from __future__ import annotations

from collections.abc import Callable

from bench.workloads import agentic, chat, doc_qa, shared_prefix
from bench.workloads.base import Session, Turn, Workload
from bench.workloads.text import TextSource

__all__ = ["BUILDERS", "Session", "TextSource", "Turn", "Workload"]

BUILDERS: dict[str, Callable[..., Workload]] = {
    "chat": chat.build,
    "shared_prefix": shared_prefix.build,
    "doc_qa": doc_qa.build,
    "agentic": agentic.build,
}
