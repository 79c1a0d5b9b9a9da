"""Approximate prefix affinity from the router's own routing history (SGLang-gateway style).

For fleets without KV events: the router remembers which replica it sent each prefix to, as
chained block keys over the token ids (``approx_block_size`` tokens a block), and assumes the
replica still holds it. No eviction knowledge, so it over-predicts on busy replicas; it exists
for comparison in benchmarks and for users who cannot enable events. Bounded: the least
recently routed (block, replica) pairs go first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

__all__ = ["RoutingHistory"]


class RoutingHistory:
    def __init__(self, max_keys: int = 1_000_000) -> None:
        self.max_keys = max_keys
        self._seen: OrderedDict[tuple[int, str], None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._seen)

    def insert(self, replica: str, keys: Sequence[int]) -> None:
        seen = self._seen
        for key in keys:
            pair = (key, replica)
            if pair in seen:
                seen.move_to_end(pair)
            else:
                seen[pair] = None
        while len(seen) > self.max_keys:
            seen.popitem(last=False)

    def match(self, replicas: Sequence[str], keys: Sequence[int]) -> dict[str, int]:
        out = dict.fromkeys(replicas, 0)
        seen = self._seen
        for name in replicas:
            n = 0
            for key in keys:
                if (key, name) not in seen:
                    break
                n += 1
            out[name] = n
        return out

    def forget(self, replica: str) -> None:
        for pair in [p for p in self._seen if p[1] == replica]:
            del self._seen[pair]
