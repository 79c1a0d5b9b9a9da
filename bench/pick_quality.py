"""How well a run's picks avoided queues: the prefill queued at the chosen replica beyond the
least-queued one, at the moment each request was sent.

Why a second measure beside TTFT p90: the p90 of a 1,200-request run moves by 5-10% between
runs of the same configuration (the simulated fleet, the clients and the routers share a
few cores), so two router setups whose decisions differ by a few percent cannot be told
apart by it without many runs. This measure reads only what the decisions did: for each
request, the uncached prompt tokens of the requests still waiting for their first token on
the replica it went to, minus the same sum on the least-queued replica. A router that sees
every request at once and picks the shortest queue scores low; one that sees its peers'
requests late, or misjudges a queue, scores higher. It is not zero for a good router: a
cache hit is worth some queue (the cost model weighs them).

From the client's records only (sent, first token, prompt and cached tokens, the replica
that answered), so it is the same for every policy and any number of routers.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

from kvroute.bench.workloads.runner import RequestRecord

__all__ = ["queued_prefill_at_pick"]


def queued_prefill_at_pick(
    records: Sequence[RequestRecord], replicas: Iterable[str]
) -> dict[str, Any]:
    """``{"requests", "mean_tokens", "p90_tokens", "over_2000"}`` over the completed requests:
    the extra queued prefill (tokens) at each pick, and the share of picks where it exceeded
    2,000 tokens (a fraction of a second of prefill on the simulated GPU)."""
    ok = [r for r in records if r.ok and r.first_token is not None and r.replica is not None]
    names = set(replicas) | {r.replica for r in ok if r.replica is not None}
    # A request is queued from when it was sent until its first token. Ends before starts at
    # the same instant; a request's own start comes after every other event at its instant.
    events: list[tuple[float, int, int, int]] = []  # (time, order, index, +1 start / -1 end)
    for i, r in enumerate(ok):
        events.append((r.sent, 1, i, 1))
        events.append((r.first_token, 0, i, -1))  # type: ignore[arg-type]
    events.sort()
    queued = dict.fromkeys(names, 0)
    extra: list[float] = []
    for _, _, i, sign in events:
        r = ok[i]
        uncached = max(0, r.prompt_tokens - r.cached_tokens)
        if sign > 0:
            extra.append(float(queued[r.replica] - min(queued.values())))  # type: ignore[index]
        queued[r.replica] += sign * uncached  # type: ignore[index]
    if not extra:
        return {"requests": 0, "mean_tokens": None, "p90_tokens": None, "over_2000": None}
    return {
        "requests": len(extra),
        "mean_tokens": round(sum(extra) / len(extra), 1),
        "p90_tokens": sorted(extra)[math.ceil(0.9 * len(extra)) - 1],  # nearest rank
        "over_2000": round(sum(1 for x in extra if x > 2000) / len(extra), 4),
    }
