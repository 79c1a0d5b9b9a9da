"""Scale-in that keeps the cache: ``controller.kubernetes.io/pod-deletion-cost`` per replica pod.

Why: a ReplicaSet (or a Deployment's) scale-down deletes the pods it ranks cheapest to lose,
lowest ``pod-deletion-cost`` first; left alone, every pod costs 0 and the choice ignores the
cache. The router knows what each replica alone holds (``PrefixIndex.sole_holdings``: blocks
no other replica and no storage domain has), so it can say what losing each pod costs: the
time the fleet would spend recomputing those prefixes instead of reading them, by the cost
model's own figures (``CostSettings``): a block held on the device costs its prefill
(``prefill_s_per_token``), one held only in CPU memory or on disk the prefill less the load
it would have taken (``load_s_per_token_cpu``/``_storage``). The annotation is that cost in
milliseconds, summed over the pod's replicas (its ports, its data-parallel ranks), capped at
int32 as the API requires.

Bounded: a round every ``interval_s``; a pod is patched only when its cost moved by more than
``min_change`` (relative) since its last patch, or it never was, and at most ``max_patches``
pods a round (the largest moves first), so a busy fleet does not write the API server at
the rate its caches change. Off unless ``--deletion-cost`` is given (the routers then need
``patch`` on pods: the RBAC component). StatefulSets ignore the annotation (they delete the
highest ordinal): it serves replica pods run by a Deployment or ReplicaSet, LeaderWorkerSet
groups, or any controller that honours it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvroute.router.config import CostSettings

if TYPE_CHECKING:  # fleet sits beside the indexer (tests/test_layout.py): no load-time edge
    from kvroute.indexer.index import PrefixIndex
    from kvroute.indexer.wire import Medium

__all__ = ["ANNOTATION", "DeletionCosts", "costs_from_index", "deletion_costs", "pod_of"]

log = logging.getLogger(__name__)

ANNOTATION = "controller.kubernetes.io/pod-deletion-cost"
_INT32_MAX = 2**31 - 1


def pod_of(replica: str) -> str:
    """The pod a replica runs in: its name less a data-parallel rank (``#dpN``) and a port
    (``:8001``, a pool with several target ports). Pod names contain neither."""
    return replica.split("#", 1)[0].split(":", 1)[0]


def deletion_costs(
    sole: dict[str, dict[Medium, int]],
    block_sizes: dict[str, int | None],
    cost: CostSettings,
    pods: Iterable[str],
) -> dict[str, int]:
    """Each pod's deletion cost (milliseconds of recompute its loss would cause); every pod
    in ``pods`` gets one, 0 when it holds nothing alone (or its block size is unknown)."""
    from kvroute.indexer.wire import Medium

    saved = {
        Medium.GPU: cost.prefill_s_per_token,
        Medium.CPU: max(cost.prefill_s_per_token - cost.load_s_per_token_cpu, 0.0),
        Medium.STORAGE: max(cost.prefill_s_per_token - cost.load_s_per_token_storage, 0.0),
    }
    seconds = dict.fromkeys(pods, 0.0)
    for replica, tiers in sole.items():
        pod = pod_of(replica)
        size = block_sizes.get(replica)
        if pod not in seconds or not size:
            continue
        seconds[pod] += sum(blocks * size * saved[tier] for tier, blocks in tiers.items())
    return {pod: min(round(s * 1000), _INT32_MAX) for pod, s in seconds.items()}


def costs_from_index(index: PrefixIndex, cost: CostSettings, pods: list[str]) -> dict[str, int]:
    """``deletion_costs`` of the index's sole holdings now (a scan of the index: called off
    the event loop)."""
    sole = index.sole_holdings()
    return deletion_costs(sole, {r: index.block_size(r) for r in sole}, cost, pods)


@dataclass
class DeletionCosts:
    """One round after another: compute every pod's cost, patch the ones that moved.

    ``compute`` gives the current costs of the given pods (run in a thread: it scans the
    index); ``patch`` writes one pod's annotation (the discovery's API client). What was
    written is remembered, so a pod is not patched again for a change below ``min_change``."""

    compute: Callable[[list[str]], dict[str, int]]
    patch: Callable[[str, int], Awaitable[None]]
    min_change: float = 0.1
    max_patches: int = 20
    written: dict[str, int] = field(default_factory=dict)
    patches: int = 0
    failures: int = 0
    last_error: str | None = None

    def due(self, costs: dict[str, int]) -> list[tuple[str, int]]:
        """The pods to patch this round, largest relative move first, at most max_patches."""
        moves = []
        for pod, value in costs.items():
            old = self.written.get(pod)
            if old is None:
                moves.append((float("inf"), pod, value))
                continue
            change = abs(value - old) / max(old, 1)
            if change > self.min_change and value != old:
                moves.append((change, pod, value))
        moves.sort(key=lambda m: (-m[0], m[1]))
        return [(pod, value) for _, pod, value in moves[: self.max_patches]]

    async def round(self, pods: list[str]) -> None:
        costs = await asyncio.to_thread(self.compute, pods)
        for pod in set(self.written) - set(costs):
            del self.written[pod]  # gone from the fleet
        for pod, value in self.due(costs):
            try:
                await self.patch(pod, value)
            except Exception as exc:  # the next round retries; the router serves on
                self.failures += 1
                self.last_error = f"{pod}: {exc}"
                log.warning("deletion cost: patching pod %s failed: %s", pod, exc)
                continue
            self.written[pod] = value
            self.patches += 1

    def status(self) -> dict[str, object]:
        return {
            "annotation": ANNOTATION,
            "costs_ms": dict(sorted(self.written.items())),
            "patches": self.patches,
            "failures": self.failures,
            "last_error": self.last_error,
        }
