"""Where a new prefix goes: the same replica from every router, with the homes balanced.

Prefix affinity makes placement sticky: a chat user, a document or a shared-prefix group
placed on a replica brings its later requests there too, so what balances the fleet is how
much of the working set each replica took on, not its queue at the instant of a first
request. Several routers share one fleet (an HA deployment, requests spread among them by
a load balancer), and a prefix no replica holds must land on the same replica whichever
router sees it first; otherwise its next requests, sent through another router, find no
cache and no home and are placed again elsewhere. So placement reads only what every router
sees alike:

- the prefix's affinity (``RouteContext.affinity``) and the healthy candidates;
- how many blocks each replica stored lately, from its KV event feed, which every router
  subscribes to (``StoredRate``): a replica that took a new prefix stores all of its blocks,
  one that serves returning users stores their new turns, so the rate is the prefill work
  each replica took on, early in a run mostly the new prefixes it was given.

``pick_new`` is bounded-load rendezvous hashing: among the replicas within the cost bound
(the near-equals), those whose stored rate is at most ``(1 + slack)`` x the near-equals'
mean may take it, and the prefix goes to the first of them in its rendezvous order. Two
prefixes arriving together usually hash to different replicas (an ``argmin`` of a lagging
signal would send both to the same one), a replica far above the mean takes no new prefix
until the others catch up, and a replica leaving moves only the prefixes that ranked it
first. The router's own counts (the old per-router placement rate) diverged between
routers and are gone; the homes LRU (router/routing.py) still remembers where this router
placed a prefix, but a router that never saw a prefix places it by this same rule.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import xxhash

if TYPE_CHECKING:  # policies.py imports this module
    from kvroute.router.policies import ReplicaView

__all__ = ["StoredRate", "pick_new", "rendezvous"]


def rendezvous(affinity: bytes, name: str) -> int:
    """Highest-random-weight hashing: the same request prefix prefers the same replica, and
    removing a replica moves only the prefixes that preferred it."""
    return xxhash.xxh3_64_intdigest(affinity + name.encode())


def pick_new(near: Sequence[ReplicaView], affinity: bytes, slack: float) -> ReplicaView:
    """The replica a new prefix goes to among ``near`` (non-empty): the first in the
    prefix's rendezvous order whose ``stored_rate`` is within ``(1 + slack)`` x their mean.
    The least loaded always qualifies (it is at most the mean)."""
    mean = sum(v.stored_rate for v in near) / len(near)
    # The relative tolerance keeps equal rates equal after float sums.
    bound = mean * (1.0 + slack) * (1.0 + 1e-9) + 1e-12
    allowed = [v for v in near if v.stored_rate <= bound]
    return max(allowed, key=lambda v: rendezvous(affinity, v.name))


class StoredRate:
    """Blocks each replica stored lately, per second (exponentially decayed), read from the
    cumulative per-replica counts of the event feeds (``FeedStats.blocks_stored``).

    Counts are sampled when the router decides, not per event: the decay makes the two
    agree up to the time between decisions. A replica first seen starts at zero (a router
    that joins late, replaying the fleet's history, does not take that history as a burst);
    a count that goes down (a new feed after a restart) is taken as a fresh start."""

    __slots__ = ("_clock", "_decay", "_state", "half_life_s")

    def __init__(self, half_life_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if half_life_s <= 0:
            raise ValueError("half_life_s must be > 0")
        self.half_life_s = half_life_s
        self._decay = math.log(2.0) / half_life_s
        self._clock = clock
        # name -> (last cumulative count, decayed blocks, at)
        self._state: dict[str, tuple[int, float, float]] = {}

    def update(self, counts: Mapping[str, int]) -> None:
        """Take each replica's cumulative stored-block count as of now."""
        now = self._clock()
        for name, count in counts.items():
            prev = self._state.get(name)
            if prev is None:
                self._state[name] = (count, 0.0, now)
                continue
            last, value, at = prev
            added = count - last if count >= last else count
            self._state[name] = (count, value * math.exp(-self._decay * (now - at)) + added, now)

    def rate(self, name: str) -> float:
        """Blocks per second: the decayed count times the decay constant (a steady stream of
        r blocks per second converges to r)."""
        entry = self._state.get(name)
        if entry is None:
            return 0.0
        _, value, at = entry
        return value * math.exp(-self._decay * (self._clock() - at)) * self._decay

    def forget(self, name: str) -> None:
        self._state.pop(name, None)
