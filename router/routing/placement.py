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
  each replica took on, early in a run mostly the new prefixes it was given;
- the blocks the routers sent each replica to compute that its feed has not announced yet
  (``UnstoredBlocks``: this router's own, plus its peers' from ``GET /peer/load``). A
  prefix's blocks are announced only once its prefill is done. The cost bound already keeps
  a replica busy with a long prefill out of the near-equals, except when every replica is
  busy: then new prefixes arriving within one prefill of each other saw the same rates and
  were spread by rendezvous alone (2, 2, 4, 4 homes for 12 prefixes on 4 replicas in
  tests/router/routing/test_ha_placement.py; 3 each with it).

``pick_new`` is bounded-load rendezvous hashing: among the replicas within the cost bound
(the near-equals), those whose stored rate is at most ``(1 + slack)`` x the near-equals'
mean may take it, and the prefix goes to the first of them in its rendezvous order. Two
prefixes arriving together usually hash to different replicas (an ``argmin`` of a lagging
signal would send both to the same one), a replica far above the mean takes no new prefix
until the others catch up, and a replica leaving moves only the prefixes that ranked it
first. The router's own counts (the old per-router placement rate) diverged between
routers and are gone; the homes LRU (router/routing/router.py) still remembers where this router
placed a prefix, but a router that never saw a prefix places it by this same rule.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

import xxhash

if TYPE_CHECKING:  # policies.py imports this module
    from kvroute.router.routing.policies import ReplicaView

__all__ = ["StoredRate", "UnstoredBlocks", "pick_new", "rendezvous"]


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
    a count that goes down (a new feed after a restart) is taken as a fresh start, and so is
    a reset of the replica's prefix cache (its feed's count of device-tier clears went up):
    the work it stored before is no longer in its cache, and counting it would steer new
    prefixes away from a replica that holds less than the others."""

    __slots__ = ("_clock", "_decay", "_state", "half_life_s")

    def __init__(self, half_life_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if half_life_s <= 0:
            raise ValueError("half_life_s must be > 0")
        self.half_life_s = half_life_s
        self._decay = math.log(2.0) / half_life_s
        self._clock = clock
        # name -> (last cumulative count, cache resets seen, decayed blocks, at)
        self._state: dict[str, tuple[int, int, float, float]] = {}

    def update(
        self, counts: Mapping[str, int], resets: Mapping[str, int] | None = None
    ) -> dict[str, int]:
        """Take each replica's cumulative stored-block count (and count of prefix-cache
        resets) as of now; returns the blocks each one stored since the last sample (none
        for a replica first seen)."""
        now = self._clock()
        added_by: dict[str, int] = {}
        for name, count in counts.items():
            reset = resets.get(name, 0) if resets else 0
            prev = self._state.get(name)
            if prev is None:
                self._state[name] = (count, reset, 0.0, now)
                continue
            last, last_reset, value, at = prev
            added = count - last if count >= last else count
            if added:
                added_by[name] = added
            if reset != last_reset:  # the cache was reset: what it stored before is gone
                value = 0.0
            else:
                value *= math.exp(-self._decay * (now - at))
            self._state[name] = (count, reset, value + added, now)
        return added_by

    def rate(self, name: str, unstored: int = 0) -> float:
        """Blocks per second: the decayed count times the decay constant (a steady stream of
        r blocks per second converges to r). ``unstored`` blocks (sent, not yet announced)
        count as stored just now."""
        entry = self._state.get(name)
        if entry is None:
            return unstored * self._decay
        _, _, value, at = entry
        return (value * math.exp(-self._decay * (self._clock() - at)) + unstored) * self._decay

    def forget(self, name: str) -> None:
        self._state.pop(name, None)


class UnstoredBlocks:
    """Blocks this router sent each replica to compute that the replica's feed has not
    announced as stored yet: the prefill work in progress, which ``StoredRate`` sees only
    when it is done.

    Each request adds its expected uncached blocks when it is sent (``add``); blocks the
    feed announces settle the oldest entries first (``settle``), whoever computed them, so
    the count never stays above what is truly outstanding for long. An entry older than
    ``max_age_s`` is dropped: a request that failed, was retried elsewhere, or hit a cache
    the index did not know about stores nothing, and must not weigh on its replica."""

    __slots__ = ("_clock", "_sent", "_totals", "max_age_s")

    def __init__(self, max_age_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if max_age_s <= 0:
            raise ValueError("max_age_s must be > 0")
        self.max_age_s = max_age_s
        self._clock = clock
        self._sent: dict[str, deque[list[float]]] = {}  # name -> [[sent_at, blocks], ...]
        # name -> the blocks in its queue, kept as entries come and go (whole numbers: exact)
        self._totals: dict[str, float] = {}

    def add(self, name: str, blocks: int) -> None:
        if blocks > 0:
            self._sent.setdefault(name, deque()).append([self._clock(), float(blocks)])
            self._totals[name] = self._totals.get(name, 0.0) + blocks

    def settle(self, stored: Mapping[str, int]) -> None:
        """``stored[name]`` blocks were announced since the last call."""
        for name, count in stored.items():
            queue = self._sent.get(name)
            while queue and count > 0:
                take = min(count, queue[0][1])
                queue[0][1] -= take
                self._totals[name] -= take
                count -= take
                if queue[0][1] <= 0:
                    queue.popleft()

    def blocks(self, name: str) -> int:
        queue = self._sent.get(name)
        if not queue:
            return 0
        oldest = self._clock() - self.max_age_s
        while queue and queue[0][0] < oldest:
            self._totals[name] -= queue.popleft()[1]
        return int(self._totals[name])

    def snapshot(self, names: Iterable[str]) -> dict[str, int]:
        """Outstanding blocks by replica, for ``GET /peer/load``."""
        return {name: self.blocks(name) for name in names}

    def forget(self, name: str) -> None:
        self._sent.pop(name, None)
        self._totals.pop(name, None)
