"""Seeded routing workloads: multi-turn chat, shared-prefix groups, long-document QA, agentic
loops, hot documents, tenants (llm-d's precise-routing benchmark shape). Each module's
``build(text, seed=..., **sizes) -> Workload``; see bench/workloads/base.py for what a
workload is and docs/benchmarks.md for the sizes the benchmark uses and why. Traces in the
Mooncake format replay through ``mooncake_trace`` (``kvroute bench routing --trace``)."""

from __future__ import annotations

from collections.abc import Callable

from kvroute.bench.workloads import agentic, chat, doc_qa, hot_docs, shared_prefix, tenants
from kvroute.bench.workloads.base import Session, Turn, Workload
from kvroute.bench.workloads.text import TextSource

__all__ = ["BUILDERS", "Session", "TextSource", "Turn", "Workload"]

BUILDERS: dict[str, Callable[..., Workload]] = {
    "chat": chat.build,
    "shared_prefix": shared_prefix.build,
    "doc_qa": doc_qa.build,
    "agentic": agentic.build,
    "hot_docs": hot_docs.build,
    "tenants": tenants.build,
}
