"""The infinite-cache upper bound of a run's token-weighted hit rate.

One cache of unlimited size that every request reaches: a request hits the longest run of its
full prompt blocks that any earlier request put there (capped, like vLLM, so the last prompt
token is computed). A request's prompt blocks exist from the moment it is sent, its output
blocks (vLLM caches generated tokens too) from the moment it completes. No routing policy
over any finite fleet can beat it, so ``hit_rate / upper_bound`` says how much of the
available reuse a policy delivered.

Token ids come from the fleet's own tokenizer and generator, so they are the replicas' ids;
a request whose id count differs from the ``prompt_tokens`` its replica reported is counted in
``token_mismatches`` (a tokenization mismatch would make every routing decision a guess).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from kvroute.bench.sim.tokenizer import SimTokenizer
from kvroute.bench.workloads.runner import RequestRecord
from kvroute.indexer.keys import block_keys

__all__ = ["UpperBound", "infinite_cache_hit_rate"]


@dataclass(slots=True)
class UpperBound:
    hit_rate: float
    hit_tokens: int
    prompt_tokens: int
    token_mismatches: int
    distinct_blocks: int


def infinite_cache_hit_rate(
    records: list[RequestRecord], tokenizer: SimTokenizer, block_size: int
) -> UpperBound:
    done = [r for r in records if r.ok]
    done.sort(key=lambda r: r.sent)
    cache: set[int] = set()
    outputs: list[tuple[float, int, list[int]]] = []  # (done time, tiebreak, keys)
    hit_total = prompt_total = mismatches = 0
    for n, rec in enumerate(done):
        while outputs and outputs[0][0] <= rec.sent:
            cache.update(heapq.heappop(outputs)[2])
        ids = tokenizer.encode_chat(rec.messages)
        if len(ids) != rec.prompt_tokens:
            mismatches += 1
        keys = block_keys(ids, block_size)
        limit = max(0, len(ids) - 1) // block_size
        hit = 0
        for key in keys[:limit]:
            if key not in cache:
                break
            hit += 1
        hit_total += hit * block_size
        prompt_total += len(ids)
        cache.update(keys)
        full = ids + tokenizer.generate(ids, rec.completion_tokens)
        assert rec.done is not None
        heapq.heappush(outputs, (rec.done, n, block_keys(full, block_size)[len(keys) :]))
    rate = hit_total / prompt_total if prompt_total else 0.0
    while outputs:
        cache.update(heapq.heappop(outputs)[2])
    return UpperBound(rate, hit_total, prompt_total, mismatches, len(cache))
