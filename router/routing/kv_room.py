"""``KvRoom``: whether a request fits a replica's device cache now, and if not, how long until.

vLLM's scheduler admits a waiting request only when its KV cache has free blocks for it
(``KVCacheManager.allocate_slots``; the head of the waiting queue holds back those behind it),
and a running request keeps its blocks until it finishes. On a replica whose device cache
holds a few long conversations, a request sent while the cache is full waits for a running
one to finish decoding: most of a second behind a 40-token answer, many times its own
prefill. The queue term (seconds per pending request, router/routing/queue_model.py) is an
average over requests that found room and the few that did not, so it prices that wait at a
fraction of itself, while the cached prefix on that replica makes it look cheap: the
affinity that makes the hit rate is what puts those requests in the tail, and a router that
only spreads load beats it at p99 there (docs/benchmarks.md, "Small device caches").

So the router counts room as the scheduler does:

- the cache's size: ``num_gpu_blocks``, a label of vLLM's ``vllm:cache_config_info``;
- the blocks held by the requests this router sent there, from when each is sent until its
  answer ends: their prompts' blocks, counted once however many requests share them (by
  their chained keys, as vLLM counts references to a block), and their output budgets; and
  when each should end: its predicted first token, then its output budget at
  the replica's seconds per output token, learned from answers (first byte to end, over the
  budget: an answer that stops early teaches a shorter time per budgeted token, which is what
  the next budget is multiplied by);
- what peer routers' requests hold there, as they share it (router/peers/load.py);
- what else the cache holds (cached blocks a request took back from the free list, routers
  that do not share): the last scrape's usage less what the routers held at that moment,
  taken as constant until the next scrape.

A new request needs its prompt's blocks that no running request holds (a block cached but
idle is counted free by vLLM's usage, and taking it uses it up) and its output budget. One
that does not fit waits until the requests ending first free enough: this router's at
their predicted ends, its peers' at the ends they share (``frees``; an older peer's,
whose ends are not known, evenly over one answer from now); when those cannot (the rest is
held by no router), for one more answer of its own budget after the last of them. Entries
whose end was never reported are dropped ``stale_after_s`` after their predicted end. Used
on the router's event loop only.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

from kvroute.router.common.timed_values import TimedValues

__all__ = ["KvRoom", "waits_to_price"]

# How far back "what this router held" is remembered, for a scrape that old.
_HISTORY_S = 30.0


def waits_to_price(waits: dict[str, float]) -> dict[str, float]:
    """The waits a decision prices: all of them when some replica has room now, none when
    every cache is full. A wait makes a replica with room beat the prefix's holder whose
    cache is full; when no replica has room the request waits wherever it goes, and ranking
    by the waits would send it (and the requests after it) to whichever replica drains
    first, recomputing prefixes with the fleet's capacity (measured: 6-10 points of hit rate
    lost on an overloaded shared-prefix workload, docs/benchmarks.md, "Small device
    caches"); the cost's queue and pressure terms price that queue, as without room
    counting."""
    if waits and min(waits.values()) == 0.0:
        return waits
    return {}


@dataclass(slots=True)
class _Held:
    keys: Sequence[int]  # its prompt's full blocks, shared with others holding them
    blocks: int  # its own: output budget and the prompt's partial block
    budget: int  # output tokens it may generate
    ends_at: float
    first_byte_at: float | None = None


@dataclass(slots=True)
class _Replica:
    held: dict[Hashable, _Held] = field(default_factory=dict)
    refs: dict[int, int] = field(default_factory=dict)  # prompt block key -> holders
    total: int = 0  # distinct prompt blocks + every holder's own
    # (time, total) after each change: what it held at a scrape's moment
    history: TimedValues = field(default_factory=lambda: TimedValues(_HISTORY_S))
    decode_s_per_token: float | None = None
    samples: int = 0


class KvRoom:
    """Per replica: the device blocks this router's requests hold, and when each frees them."""

    def __init__(
        self,
        *,
        decode_s_per_token: float,
        learn_weight: float = 0.2,
        stale_after_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if decode_s_per_token <= 0:
            raise ValueError("decode_s_per_token must be > 0")
        if not 0.0 < learn_weight <= 1.0:
            raise ValueError("learn_weight must be in (0, 1]")
        self.prior_decode_s_per_token = decode_s_per_token
        self.learn_weight = learn_weight
        self.stale_after_s = stale_after_s
        self._clock = clock
        self._by_replica: dict[str, _Replica] = {}
        self._where: dict[Hashable, str] = {}  # a request's replica (a retry moves it)

    def decode_s_per_token(self, replica: str) -> float:
        """Seconds per budgeted output token: learned, or the prior before any answer."""
        r = self._by_replica.get(replica)
        if r is None or r.decode_s_per_token is None:
            return self.prior_decode_s_per_token
        return r.decode_s_per_token

    def samples(self, replica: str) -> int:
        r = self._by_replica.get(replica)
        return 0 if r is None else r.samples

    def need(self, replica: str, keys: Sequence[int], own_blocks: int) -> int:
        """The blocks a request would take there: its prompt's blocks past the longest run
        of them that requests there hold now (a shared prefix), and ``own_blocks``."""
        r = self._by_replica.get(replica)
        shared = 0
        if r is not None and r.refs:
            refs = r.refs
            for key in keys:
                if key not in refs:
                    break
                shared += 1
        return len(keys) - shared + max(0, own_blocks)

    def add(
        self,
        replica: str,
        key: Hashable,
        keys: Sequence[int],
        own_blocks: int,
        budget: int,
        first_token_s: float,
    ) -> None:
        """A request was sent: it holds its prompt's blocks (``keys``) and ``own_blocks``
        until it ends, which should be ``first_token_s`` from now and then ``budget``
        output tokens."""
        now = self._clock()
        before = self._where.get(key)
        if before is not None:  # sent again (a retry elsewhere): it holds nothing there now
            self.ended(before, key, learn=False)
        r = self._by_replica.setdefault(replica, _Replica())
        self._expire(r, now)
        self._where[key] = replica
        ends_at = now + max(0.0, first_token_s) + budget * self.decode_s_per_token(replica)
        held = _Held(keys, max(0, own_blocks), budget, ends_at)
        r.held[key] = held
        refs = r.refs
        for k in keys:
            n = refs.get(k, 0)
            refs[k] = n + 1
            if n == 0:
                r.total += 1
        r.total += held.blocks
        self._changed(r, now)

    def first_byte(self, replica: str, key: Hashable) -> None:
        """Its first token came: it ends ``budget`` tokens from now."""
        r = self._by_replica.get(replica)
        held = None if r is None else r.held.get(key)
        if held is None:
            return
        now = self._clock()
        held.first_byte_at = now
        held.ends_at = now + held.budget * self.decode_s_per_token(replica)

    def ended(self, replica: str, key: Hashable, *, learn: bool = True) -> None:
        """Its answer ended (or failed): its blocks are free. A whole answer (``learn``) with
        a first byte is a sample of the replica's seconds per budgeted token."""
        # Where it was sent last (a gateway's fallback may report it from another replica)
        r = self._by_replica.get(self._where.get(key, replica))
        held = None if r is None else r.held.pop(key, None)
        if r is None or held is None:
            return
        self._where.pop(key, None)
        now = self._clock()
        self._release(r, held)
        self._changed(r, now)
        if learn and held.first_byte_at is not None and held.budget > 0:
            sample = (now - held.first_byte_at) / held.budget
            if r.decode_s_per_token is None:
                r.decode_s_per_token = sample
            else:
                r.decode_s_per_token += self.learn_weight * (sample - r.decode_s_per_token)
            r.samples += 1

    def held_blocks(self, replica: str) -> int:
        r = self._by_replica.get(replica)
        if r is None:
            return 0
        self._expire(r, self._clock())
        return r.total

    def frees(self, replica: str, max_entries: int = 16) -> list[tuple[int, float]]:
        """When this router's requests there should free their blocks, for its peers:
        ``(blocks, seconds from now)``, soonest first, summing to ``held_blocks``; a prompt
        block is freed with the last of its holders. At most ``max_entries``: neighbours
        are merged at the later time (a peer then waits a little longer, never shorter)."""
        r = self._by_replica.get(replica)
        if r is None or not r.held:
            return []
        now = self._clock()
        self._expire(r, now)
        out = [(n, max(0.0, at - now)) for at, n in _release_order(r) if n]
        if len(out) > max_entries > 0:
            size = -(-len(out) // max_entries)
            out = [
                (sum(b for b, _ in out[i : i + size]), out[i : i + size][-1][1])
                for i in range(0, len(out), size)
            ]
        return out

    def held_at(self, replica: str, moment: float, until: float | None = None) -> int:
        """What this router's requests held there at ``moment`` (a scrape's time); with
        ``until``, the most they held from ``moment`` to ``until``: a metrics page shows
        one moment between its request and its answer, and a request that ended in
        between must not be read as someone else's blocks."""
        r = self._by_replica.get(replica)
        return 0 if r is None else r.history.at(moment, until)

    def wait_s(
        self,
        replica: str,
        need_blocks: int,
        capacity_blocks: int,
        used_at_scrape: float,
        scraped_at: float | None,
        budget: int,
        peers_now: int = 0,
        peers_at_scrape: int = 0,
        peer_frees: Sequence[tuple[float, int]] = (),
        scrape_sent_at: float | None = None,
    ) -> float:
        """Seconds until ``need_blocks`` are free in a cache of ``capacity_blocks`` whose last
        scrape (at ``scraped_at``) showed ``used_at_scrape`` blocks in use; 0 when they are
        free now, or when the request could never fit (vLLM refuses it, nothing to wait for).
        ``budget``: the request's own output tokens, the pace of an answer there.
        ``peers_now``, ``peers_at_scrape``: what peer routers' requests hold there now and
        held at the scrape (router/peers/load.py), beside this router's own;
        ``peer_frees``: when the peers said theirs free, ``(monotonic time, blocks)``
        soonest first (part of ``peers_now``, or all of it); ``scrape_sent_at``: when the
        scrape was asked (the page shows a moment from then to ``scraped_at``, and this
        router's part of it is the most its requests held in between)."""
        if need_blocks <= 0 or need_blocks > capacity_blocks:
            return 0.0
        now = self._clock()
        r = self._by_replica.get(replica)
        if r is not None:
            self._expire(r, now)
        own = 0 if r is None else r.total
        others = float(peers_now)
        if scraped_at is not None:
            if scrape_sent_at is not None and scrape_sent_at < scraped_at:
                known = self.held_at(replica, scrape_sent_at, scraped_at) + peers_at_scrape
            else:
                known = self.held_at(replica, scraped_at) + peers_at_scrape
            others += max(0.0, used_at_scrape - known)
        free = capacity_blocks - others - own
        if free >= need_blocks:
            return 0.0
        # Peers' requests whose ends they did not share (an older router) are taken to free
        # their blocks evenly over one answer from now, between the known ends.
        answer_s = self.decode_s_per_token(replica) * max(1, budget)
        unscheduled = max(0, peers_now - sum(blocks for _, blocks in peer_frees))
        peer_rate = unscheduled / answer_s if unscheduled > 0 else 0.0

        def reached_by(until: float) -> float | None:
            """When, by ``until``, the peers' release closes the gap (None: not by then)."""
            if peer_rate <= 0:
                return None
            at = now + (need_blocks - free) / peer_rate
            return at if at <= min(until, now + answer_s) else None

        # This router's ends and its peers' shared ones, in time order
        ends = [*peer_frees, *([] if r is None else _release_order(r))]
        ends.sort(key=lambda end: end[0])
        last = now
        for ends_at, blocks in ends:
            if (at := reached_by(ends_at)) is not None:
                return max(at, last) - now  # not before the ends already counted
            free += blocks
            last = max(last, ends_at)
            if free >= need_blocks:
                return max(0.0, ends_at - now)
        if (at := reached_by(now + answer_s)) is not None:
            return max(at, last) - now
        # Others hold the rest: they free it at about the pace of an answer like this one.
        return max(last, now + (answer_s if peer_rate else 0.0)) - now + answer_s

    def snapshot(self, replica: str) -> dict[str, float | int | None]:
        r = self._by_replica.get(replica)
        learned = None if r is None else r.decode_s_per_token
        return {
            "held_blocks": self.held_blocks(replica),
            "requests": 0 if r is None else len(r.held),
            "decode_s_per_token": None if learned is None else float(f"{learned:.4g}"),
            "decode_samples": self.samples(replica),
        }

    def forget(self, replica: str) -> None:
        r = self._by_replica.pop(replica, None)
        if r is not None:
            for key in r.held:
                self._where.pop(key, None)

    def _expire(self, r: _Replica, now: float) -> None:
        stale = [k for k, h in r.held.items() if h.ends_at + self.stale_after_s < now]
        if not stale:
            return
        for key in stale:
            self._release(r, r.held.pop(key))
            self._where.pop(key, None)
        self._changed(r, now)

    @staticmethod
    def _release(r: _Replica, held: _Held) -> None:
        r.total -= held.blocks
        refs = r.refs
        for k in held.keys:
            n = refs[k] - 1
            if n:
                refs[k] = n
            else:
                del refs[k]
                r.total -= 1

    @staticmethod
    def _changed(r: _Replica, now: float) -> None:
        r.history.add(now, r.total)


def _release_order(r: _Replica) -> list[tuple[float, int]]:
    """When ``r``'s holdings free their blocks: ``(predicted end, blocks freed)`` per request,
    soonest first; a prompt block shared by several is freed with the last of them."""
    out: list[tuple[float, int]] = []
    refs, gone = r.refs, {}
    for held in sorted(r.held.values(), key=lambda h: h.ends_at):
        freed = held.blocks
        for k in held.keys:
            n = gone.get(k, 0) + 1
            gone[k] = n
            if n == refs[k]:
                freed += 1
        out.append((held.ends_at, freed))
    return out
