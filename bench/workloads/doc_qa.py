"""Long-document QA: each document is asked several questions, in shuffled order.

The document is the user message's head (as in LMCache's long-doc QA benchmark), so only the
short common system prompt comes before it; a repeated document hits only where it was read.
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
    documents: int = 24,
    questions: int = 4,
    document_tokens: int = 6000,
    question_tokens: int = 60,
    answer_tokens: int = 64,
    rate: float = 20.0,
) -> Workload:
    rng = random.Random(seed)
    system = "Answer the question using only the document."
    docs = [f"Document {d}.\n" + text.text(document_tokens) for d in range(documents)]
    order = [(d, q) for d in range(documents) for q in range(questions)]
    rng.shuffle(order)
    sessions: list[Session] = []
    t = 0.0
    for d, q in order:
        t += rng.expovariate(rate)
        content = docs[d] + "\n\nQuestion: " + text.text(question_tokens)
        sessions.append(
            Session(
                id=f"doc-{d}-q{q}",
                start_s=t,
                system=system,
                turns=[Turn(content=content, max_tokens=answer_tokens)],
            )
        )
    params = dict(
        documents=documents,
        questions=questions,
        document_tokens=document_tokens,
        question_tokens=question_tokens,
        answer_tokens=answer_tokens,
        rate=rate,
        seed=seed,
    )
    return Workload("doc_qa", sessions, params)
