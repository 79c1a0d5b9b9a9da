"""Hot documents: a few long documents (or system prompts) asked about over and over.

The shape of shared-storage deployments: a handful of contracts, manuals or agent system
prompts, each read by many independent requests, together larger than any one replica's
device and CPU tiers, at an arrival rate that needs the whole fleet. Popularity is Zipf-like
(document ``d`` is drawn with weight ``1 / (d + 1) ** skew``), so the hottest documents need
more than one replica while the tail still has to be somewhere. The document is the user
message's head, after a short common system prompt, as in doc_qa.
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
    documents: int = 8,
    document_tokens: int = 2000,
    requests: int = 300,
    question_tokens: int = 40,
    answer_tokens: int = 16,
    rate: float = 8.0,
    skew: float = 0.8,
) -> Workload:
    if documents < 1 or requests < 1 or rate <= 0 or skew < 0:
        raise ValueError("documents and requests must be >= 1, rate > 0, skew >= 0")
    rng = random.Random(seed)
    system = "Answer the question using only the document."
    docs = [f"Document {d}.\n" + text.text(document_tokens) for d in range(documents)]
    weights = [1.0 / (d + 1) ** skew for d in range(documents)]
    sessions: list[Session] = []
    t = 0.0
    for i in range(requests):
        t += rng.expovariate(rate)
        d = rng.choices(range(documents), weights)[0]
        content = docs[d] + "\n\nQuestion: " + text.text(question_tokens)
        sessions.append(
            Session(
                id=f"hot-{d}-r{i}",
                start_s=t,
                system=system,
                turns=[Turn(content=content, max_tokens=answer_tokens)],
            )
        )
    params = dict(
        documents=documents,
        document_tokens=document_tokens,
        requests=requests,
        question_tokens=question_tokens,
        answer_tokens=answer_tokens,
        rate=rate,
        skew=skew,
        seed=seed,
    )
    return Workload("hot_docs", sessions, params)
