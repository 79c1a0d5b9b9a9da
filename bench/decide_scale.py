"""A routing decision at fleet scale: ``Router.decide`` over every replica of a large fleet.

At a thousand replicas what a router pays per request is no longer the index's walk but
its own per-replica work around it: each replica's view of load and learned rates, the
per-tier match accounting, the cost estimate and the ranking (docs/benchmarks.md,
"A decision at 1,000 replicas"). ``kvroute bench indexer`` reports it beside the lookups so
the two are read from the same run: the decision's p50 and p90, and the share of it the
lookup takes (the same probe's lookup, timed alone on the same index).

The fleet: every replica healthy, serving one model, 0-3 requests running; its index holds
a 64-block system prompt on every replica and three 200-block histories after it on each
(the chat-shaped probe of the indexer bench, three histories instead of ten to keep the
fill short). The request is a completion whose prompt is one replica's first history as
token ids plus three tokens, so that replica holds it whole and is chosen. No HTTP and no
event feeds: the decision alone, on the router's own event loop, after a warm-up.
"""

from __future__ import annotations

import asyncio
import gc
import json
import random
import statistics
import time
from typing import Any

from kvroute.indexer import native_core
from kvroute.indexer.keys import RequestKeys
from kvroute.indexer.wire import BlockStored

__all__ = ["decide_at_scale"]

_SYSTEM_BLOCKS = 64
_HISTORY_BLOCKS = 200
_HISTORIES = 3


def decide_at_scale(
    replicas: int, rng: random.Random, *, decisions: int = 50, block_size: int = 16
) -> dict[str, Any]:
    """``decide_p50_ms``, ``decide_p90_ms`` and ``decide_lookup_share`` at ``replicas``, on
    the index core a router runs (``decide_index_core``)."""
    # Imported here: the router (and its tokenizer) only for this figure.
    from kvroute.deploy.state_dir import default_state_dir
    from kvroute.deploy.tiny_model import build_tiny_model
    from kvroute.router.config import ReplicaConfig, RouterSettings
    from kvroute.router.service import RouterService
    from kvroute.router.tokens.requests import parse_body

    tokenizer = build_tiny_model(default_state_dir() / "bench" / "tiny-model", weights=False)
    configs = [ReplicaConfig(url=f"http://r{i}:8000", name=f"r{i}") for i in range(replicas)]
    settings = RouterSettings(replicas=configs, policy="kvroute", tokenizer=str(tokenizer))
    service = RouterService(settings)
    fleet = [service.add_replica(config) for config in configs]
    service.tokenizer = service.router.tokenizer = service._make_tokenizer()
    system = [rng.randrange(1000) for _ in range(_SYSTEM_BLOCKS * block_size)]
    chosen = fleet[replicas // 2]
    probe: list[int] = []
    for replica in fleet:
        replica.healthy = True
        replica.models = {"tiny": {"id": "tiny", "object": "model"}}
        replica.running = float(rng.randrange(4))
        for h in range(_HISTORIES):
            tokens = system + [rng.randrange(1000) for _ in range(_HISTORY_BLOCKS * block_size)]
            hashes = [rng.getrandbits(63) for _ in range(_SYSTEM_BLOCKS + _HISTORY_BLOCKS)]
            service.index.apply(replica.name, [BlockStored(hashes, None, tokens, block_size)])
            if replica is chosen and h == 0:
                probe = tokens
    chosen.running = 0.0
    body = json.dumps({"model": "tiny", "prompt": [*probe, 1, 2, 3], "max_tokens": 8})
    parsed = parse_body(body.encode(), "completion", service.limits)
    gc.collect()
    gc.freeze()  # as kvroute serve does: a full collection mid-decision is the bench's own

    async def measure() -> tuple[list[float], str, str]:
        candidates = service.candidates("tiny")
        times = []
        decision = await service.router.decide(parsed, candidates, None)  # warm-up
        for _ in range(decisions):
            started = time.perf_counter()
            decision = await service.router.decide(parsed, candidates, None)
            times.append(time.perf_counter() - started)
        return times, decision.ranked[0].name, decision.reason

    times, winner, reason = asyncio.run(measure())
    if winner != chosen.name:
        raise RuntimeError(f"the decision chose {winner} ({reason}), not the prompt's holder")
    request = RequestKeys([*probe, 1, 2, 3])
    request.keys(block_size)
    names = [r.name for r in fleet]
    lookups = []
    for _ in range(decisions):
        started = time.perf_counter()
        service.index.lookup(request, replicas=names)
        lookups.append(time.perf_counter() - started)
    gc.unfreeze()
    times.sort()
    p50 = statistics.median(times)
    return {
        "decide_index_core": native_core.CORE,
        "decide_p50_ms": round(1000 * p50, 2),
        "decide_p90_ms": round(1000 * times[int(0.9 * (len(times) - 1))], 2),
        "decide_lookup_share": round(statistics.median(lookups) / p50, 3),
    }
