"""The whole path a router takes, every publisher mixed, against a truth model.

Two model replicas (tests/indexer/index/test_index_truth_mixed.py's ``MixedReplica``: vLLM's
device, one confirmed lower tier (kvroute's connector, vLLM's offloading connector
self-describing or last-hash-only, or the SimpleCPUOffloadConnector's pool), LMCache as it
ships, Mooncake's store, vLLM's FS tier, llm-d's FS backend on a stream of its own) plus
kvroute's connector's disk tier (confirmed ``STORAGE``). Optionally both replicas are attached
to one storage domain: their disk files and llm-d's PVC are then shared, and the domain's
evictor publishes removals on a stream of its own (a third replica key, ``domain:d``).

Every stream is published as vLLM's publisher does (a sequence number from 0 per process, a
bounded replay buffer, ``BUFFER`` batches) and consumed by the router's own ``ReplicaFeed``
(gap detection, anchored replay, lost-at-source proof, restart detection, clears), over the
wire encoding. Faults: a batch missed on the wire (replayable while the buffer holds it; two
or more in a row outgrow the buffer), a batch lost at its source (numbered, never buffered),
a replica restart (sequence back to 0, in-process caches gone, files kept), resets with and
without events, an unknown event type, files deleted behind the index, and the clock.

The invariant, checked after every step for every block of every probe prompt on every
replica (``block_tiers``) and for every prediction (``lookup``):

- Never over-claim: each tier the index holds a block in is one the replica holds it in,
  except within these windows:
  - a stream that is behind (a batch missed on the wire, not yet detected: detection comes
    with the stream's next batch): whatever the replica's confirmed tiers held since the last
    batch the index applied (a restart is seen when the connection comes back: the feed asks
    the replay, finds a new process, and clears);
  - once caught up: none, if the replay held every missing batch or the stream was cleared;
    for a batch lost at its source, what the replica's confirmed tiers held while the stream
    was behind stays excused ``TTL`` after the feed applied the batch that showed the loss
    (the index's window: it then keeps only what later stores proved held), or until the
    index next drops that tier (a device clear it applies, a connector reset, an unknown
    event's clear, a clear of the stream);
  - a connector reset forwarded by the router while the replica's stream is behind, when
    vLLM could not reset the device with it (``{"success": false}``): the chunks the
    not-yet-applied batches stored stay excused until the index next drops CPU; with the
    device's reset, none: its ``AllBlocksCleared`` marks the reset in the stream, after
    those batches, and the index drops CPU again there;
  - a connector reset sent to the replica directly, with the device's (vLLM's offloading
    connector empties CPU silently): its CPU blocks, ``TTL`` after the feed applied the
    device clear (the index holds blocks a clear nobody announced may have emptied for
    ``unconfirmed_ttl_s``);
  - a storage domain's chunk stored on a stream that was behind and removed meanwhile by the
    domain's evictor (streams are not ordered with each other, docs/indexer.md): held until
    its next removal, for every replica attached to the domain;
  - none after a clear of the stream (a gap the replay could not fill, a restart): a device
    block held since before it and then stored from the prompt's start (a re-announced hit,
    ``kv_cache_report_mode: "full"``, or a copy) is never counted twice, so its removal
    takes it out (the index lost the device's history: until the next device clear such
    stores are taken once);
  - unconfirmed tiers (LMCache, Mooncake, vLLM's FS tier, llm-d's FS backend): a block
    deleted without a word, at most ``TTL`` after it was last announced.
  A prediction never covers a block that no tier of the replica may hold.
- Under-claims are bounded: on a stream that is not behind, every block the replica's device
  holds is in the index's GPU tier, unless (a) its store was not applied live since the
  stream's last clear or restart (stored while the stream was behind, or chained on such a
  block), or (b) it had a second physical copy or was re-announced (the index keeps one copy,
  docs/indexer.md). A restart or a gap the replay cannot fill is not an under-claim excuse for
  anything stored after it.
- The feed clears a stream only when it must: never when the replay still holds every batch
  missing since the last applied one (lost-at-source batches excepted).
"""

from __future__ import annotations

from collections import deque
from typing import Any

from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvroute.indexer.index import InMemoryPrefixIndex, domain_key
from kvroute.indexer.keys import RequestKeys
from kvroute.indexer.subscriber import EventSource, ReplicaFeed
from kvroute.indexer.wire import AllBlocksCleared, BlockRemoved, BlockStored, Frame, Medium
from tests.indexer.index.test_index_truth import DOCS, VARIANTS, N, blocks_of
from tests.indexer.index.test_index_truth_mixed import GPU, TTL, MixedReplica, _payload

BUFFER = 3  # batches vLLM's publisher buffers for replay (10,000 in vLLM; small to outgrow)
CPU, STORAGE = "CPU", "STORAGE"
DOMAIN = "d"
Pair = tuple[str, int]


class Publisher:
    """vLLM's publisher for one stream: numbered batches and a bounded replay buffer."""

    def __init__(self) -> None:
        self.seq = 0
        self.buffer: deque[Frame] = deque(maxlen=BUFFER)
        self.lost: set[int] = set()  # seqs numbered but never buffered

    def publish(self, payload: bytes, *, buffered: bool = True) -> Frame:
        frame = Frame("", self.seq, payload)
        self.seq += 1
        if buffered:
            self.buffer.append(frame)
        else:
            self.lost.add(frame.seq)
        return frame

    def replay(self, start: int) -> list[Frame]:
        return [f for f in self.buffer if f.seq >= start]

    def restart(self) -> None:
        self.seq = 0
        self.buffer.clear()
        self.lost.clear()


class Replica(MixedReplica):
    """``MixedReplica`` plus kvroute's disk tier, restarts and wire faults."""

    def __init__(self, lower: str, gpu: int, cpu: int, domain: bool) -> None:
        self.disk: dict[int, tuple[int, ...]] = {}  # kvroute's chunk files: last -> members
        super().__init__(lower, gpu, cpu, pvc=domain)
        self.domain = domain
        self.drop_next = 0  # batches to miss on the wire
        self.pending_doubt: set[int] = set()  # a direct reset's CPU blocks, clear not applied
        self.restarted = False

    def _doubt(self, gone: set[int]) -> None:
        """The feed applies the reset's device clear when the stream is caught up: the index's
        ``TTL`` starts then (``Router.step``); until then the stream's span excuses them."""
        self.pending_doubt |= gone

    def disk_store(self, doc: int, variant: int) -> None:
        """kvroute's connector writes the prompt's chunks to disk, in order."""
        chain = blocks_of(doc, variant)
        for c in range(len(chain) // N):
            members = chain[c * N : (c + 1) * N]
            last = members[-1].hash
            if last in self.disk:
                continue
            if any(b.hash not in self.gpu for b in members):
                return
            self.disk[last] = tuple(b.hash for b in members)
            event = self._store(members, Medium.STORAGE, with_extra=True)
            event.locality = "LOCAL"
            self.main.append(event)

    def disk_evict(self) -> None:
        """A chunk file goes: the connector announces it, or, in a domain, its evictor."""
        if not self.disk:
            return
        members = self.disk.pop(min(self.disk))
        removal = BlockRemoved(list(members), Medium.STORAGE)
        (self.evictor if self.domain else self.main).append(removal)

    def drop(self, k: int) -> None:
        self.drop_next = k

    def restart(self) -> None:
        """The engine process restarts: its device, CPU pool and LMCache (in-process) are
        gone; files, Mooncake's store (another process) and the domain stay."""
        self.gpu.clear()
        self.gpu_lru.clear()
        self.cpu.clear()
        self.pool.clear()
        self.lmcache.clear()
        self.main.clear()
        self.unknown.clear()
        self.restarted = True

    def confirmed_sets(self) -> dict[str, set[int]]:
        out = super().confirmed_sets()
        out[STORAGE] = {h for members in self.disk.values() for h in members}
        return out

    def held(self, doc: int, variant: int) -> list[set[str]]:
        out = super().held(doc, variant)
        disk = self.confirmed_sets()[STORAGE]
        for b, classes in zip(blocks_of(doc, variant), out, strict=True):
            if b.hash in disk:
                classes.add(STORAGE)
        return out


def _pairs(sets: dict[str, set[int]], classes: tuple[str, ...] = (GPU, CPU, STORAGE)) -> set[Pair]:
    return {(cls, h) for cls in classes for h in sets.get(cls, ())}


class Feed:
    """One replica's main stream as the router consumes it, and the window bookkeeping."""

    def __init__(
        self, name: str, model: Replica, index: InMemoryPrefixIndex, clock: Any = None
    ) -> None:
        self.name = name
        self.clock = clock or (lambda: 0.0)
        self.model = model
        self.index = index
        self.pub = Publisher()
        self.feed = ReplicaFeed(EventSource(name, "inproc://x"), index, replay=self.pub.replay)
        self.behind = False  # a batch missed, or a restart, not yet seen by the feed
        self.span: set[Pair] = set()  # confirmed pairs held while behind
        self.excused: set[Pair] = set()  # windows that end when the index drops the class
        self.lost: dict[Pair, float] = {}  # the lost-at-source window: pair -> until when
        self.reset_while_behind = False
        self.applied_seq = -1  # the last seq the feed applied (its anchor)
        self.vouched: set[int] = set()  # device blocks whose store was applied in order
        self.dups: set[int] = set()
        self.prev: set[Pair] = set()  # the confirmed pairs at the end of the last step

    def note_behind(self) -> None:
        """The stream is behind: the index may hold what the replica held when the stream
        was last in step (``prev``), and anything held since."""
        self.span |= self.prev | _pairs(self.model.confirmed_sets())

    def deliver(self, frame: Frame, *, live: bool) -> None:
        """Publish ``frame``'s step, delivered live or not; settle the windows."""
        if not live:
            self.behind = True
            self.note_behind()
            return
        stats = self.feed.stats
        clears, lost = stats.clears, stats.lost_batches
        # what the feed must be able to replay to avoid a clear
        missing = range(self.applied_seq + 1, frame.seq)
        held = {f.seq for f in self.pub.buffer}
        must_not_clear = (
            not self.model.restarted
            and self.applied_seq >= 0
            and self.applied_seq in held
            and all(s in held or s in self.pub.lost for s in missing)
        )
        self.feed.handle(frame)
        self.applied_seq = frame.seq
        if must_not_clear:
            assert stats.clears == clears, (stats.reason, self.pub.lost, held, frame.seq)
        if stats.clears > clears:  # the stream was cleared: nothing of the past is believed
            self.on_cleared()
            if self.reset_while_behind:
                # ... but the replayed batches after the lost ones may predate a reset that
                # nothing marks in the stream (the device's failed): their CPU stores stay
                self.excused |= {x for x in self.span if x[0] == CPU}
        else:
            if stats.lost_batches > lost:  # the index's window opened in this handle
                self.lost.update(dict.fromkeys(self.span, self.clock() + TTL))
            if self.reset_while_behind:
                self.excused |= {x for x in self.span if x[0] == CPU}
            if self.model.domain:  # the evictor's removal may have overtaken the store
                self.excused |= {x for x in self.span if x[0] == STORAGE}
        if self.behind:
            self.vouched = set()  # conservative: the replayed stores are not vouched for
        self.behind = False
        self.span = set()
        self.reset_while_behind = False
        self.model.restarted = False

    def drop_excuses(self, cls: str) -> None:
        self.excused = {x for x in self.excused if x[0] != cls}
        self.lost = {x: t for x, t in self.lost.items() if x[0] != cls}

    def on_cleared(self) -> None:
        """The feed cleared the stream: its confirmed tiers hold only what it applies from
        now on (a domain's files are not the stream's to clear)."""
        keep = {x for x in self.excused | self.span if x[0] == STORAGE and self.model.domain}
        self.excused = keep
        self.lost = {}
        self.vouched = set()

    def restart(self) -> None:
        """The engine restarted: the connection drops and comes back, the feed asks the
        replay what happened (an empty buffer: a new process) and clears."""
        self.pub.restart()
        clears = self.feed.stats.clears
        self.feed.on_disconnected()
        self.feed.on_connected()
        if self.applied_seq >= 0:
            assert self.feed.stats.clears > clears, self.feed.stats.reason
        self.on_cleared()
        self.behind = False
        self.span = set()
        self.applied_seq = -1
        self.prev = set()
        self.model.restarted = False

    def vouch(self, events: list[Any], gpu: set[int]) -> None:
        """Device stores applied live and in order, chained on vouched blocks."""
        for e in events:
            if isinstance(e, BlockStored) and e.medium == Medium.GPU:
                if e.parent_block_hash is None or e.parent_block_hash in self.vouched:
                    self.vouched.update(e.block_hashes)
            elif isinstance(e, AllBlocksCleared):
                self.drop_excuses(GPU)
        self.vouched &= gpu


class Router:
    def __init__(self, models: list[Replica], domain: bool) -> None:
        self.now = 0.0
        self.index = InMemoryPrefixIndex(unconfirmed_ttl_s=TTL, clock=lambda: self.now)
        self.models = models
        self.feeds = [Feed(f"r{i}", m, self.index, lambda: self.now) for i, m in enumerate(models)]
        # llm-d's FS backend per replica: stream "fs"
        self.aux: list[tuple[Publisher, ReplicaFeed]] = []
        for f in self.feeds:
            pub = Publisher()
            source = EventSource(f.name, "inproc://fs", stream="fs")
            self.aux.append((pub, ReplicaFeed(source, self.index, replay=pub.replay)))
        self.evictor_pub = Publisher()
        self.evictor = ReplicaFeed(
            EventSource(domain_key(DOMAIN), "inproc://gc"),
            self.index,
            replay=self.evictor_pub.replay,
        )
        if domain:
            for f in self.feeds:
                self.index.attach(f.name, DOMAIN)

    def step(self) -> None:
        for f, (aux_pub, aux_feed) in zip(self.feeds, self.aux, strict=True):
            m = f.model
            if m.restarted:
                f.restart()
            gpu_before = {h for cls, h in f.prev if cls == GPU}  # before this step's op
            if m.main or m.unknown:
                for e in m.main:
                    if isinstance(e, BlockStored) and e.medium == Medium.GPU:
                        f.dups.update(h for h in e.block_hashes if h in gpu_before)
                payload = _payload(m.main, m.unknown)
                if m.lose_next:
                    f.deliver(f.pub.publish(payload, buffered=False), live=False)
                elif m.drop_next:
                    m.drop_next -= 1
                    f.deliver(f.pub.publish(payload), live=False)
                else:
                    was_behind = f.behind
                    f.deliver(f.pub.publish(payload), live=True)
                    # a direct reset's device clear is applied now (replayed, if it was missed)
                    m.doubted.update(dict.fromkeys(m.pending_doubt, self.now + TTL))
                    m.pending_doubt.clear()
                    if not was_behind:
                        f.vouch(m.main, set(m.gpu))
                    if m.unknown:
                        f.drop_excuses(CPU)
                m.lose_next = m.gap_next = False
                m.main.clear()
                m.unknown.clear()
            elif f.behind:
                f.note_behind()
            f.vouched &= set(m.gpu)
            if m.router_reset:
                self.index.reset_connector(f.name, device_cleared=m.router_reset_device)
                if f.behind:
                    # with the device's reset, its clear drops the backlog's CPU stores
                    f.reset_while_behind = not m.router_reset_device
                else:
                    f.drop_excuses(CPU)
                m.router_reset = False
            f.prev = _pairs(m.confirmed_sets())
            if m.aux:
                aux_feed.handle(aux_pub.publish(_payload(m.aux, [])))
                m.aux.clear()
        evictions = self.models[0].evictor
        if evictions:
            self.evictor.handle(self.evictor_pub.publish(_payload(evictions, [])))
            evictions.clear()
        self.index.expire()

    def check(self) -> None:
        for f in self.feeds:
            m = f.model
            for doc in range(len(DOCS)):
                for variant, (lora, salt) in enumerate(VARIANTS):
                    request = RequestKeys(DOCS[doc], lora_name=lora, cache_salt=salt)
                    self._check(f, m, doc, variant, request)

    def _check(self, f: Feed, m: Replica, doc: int, variant: int, request: RequestKeys) -> None:
        allowed = m.allowed(doc, variant)
        chain = blocks_of(doc, variant)
        excused = f.excused | f.span | {x for x, until in f.lost.items() if self.now < until}
        if m.domain:
            # the domain's files are every attached replica's: a chunk one feed's late store
            # put back after the evictor removed it is held for all of them (the window of
            # "a storage domain's chunk whose store reaches the router after the removal")
            for g in self.feeds:
                excused |= {x for x in g.excused | g.span if x[0] == STORAGE}
        got = self.index.block_tiers(f.name, request)
        if not got:  # nothing learned yet: no block size
            got = [frozenset()] * len(chain)
        for i, (b, tiers) in enumerate(zip(chain, got, strict=True)):
            ok = allowed[i] | {cls for cls, h in excused if h == b.hash}
            where = (f.name, doc, variant, i, sorted(tiers), sorted(ok))
            assert tiers <= ok, where
            if not f.behind and b.hash in m.gpu and b.hash in f.vouched - f.dups:
                assert GPU in tiers, ("under-claim", *where)
            allowed[i] = ok
        match = self.index.lookup(request, replicas=[f.name]).get(f.name)
        blocks = 0 if match is None else match.blocks
        assert all(allowed[i] for i in range(blocks)), (f.name, doc, variant, match, allowed)


doc_st = st.integers(0, len(DOCS) - 1)
variant_st = st.integers(0, len(VARIANTS) - 1)
who = st.sampled_from([0, 0, 0, 1])  # mostly one replica: its faults meet its next batches
model_op = st.one_of(
    st.tuples(st.just("serve"), doc_st, variant_st),
    st.tuples(st.just("serve"), doc_st, variant_st),
    st.tuples(st.just("compute"), doc_st, variant_st, st.integers(1, 6)),
    st.tuples(st.just("duplicate"), doc_st, variant_st, st.integers(0, 5)),
    st.tuples(st.just("reannounce"), doc_st, variant_st, st.integers(1, 6)),
    st.tuples(st.just("evict"), st.integers(1, 6)),
    st.tuples(st.just("offload"), doc_st, variant_st),
    st.tuples(st.just("disk_store"), doc_st, variant_st),
    st.tuples(st.just("disk_evict")),
    st.tuples(st.just("lmcache_store"), doc_st),
    st.tuples(st.just("mooncake_store"), doc_st, variant_st),
    st.tuples(st.just("vllm_fs_store"), doc_st, variant_st),
    st.tuples(st.just("fs_store"), doc_st, variant_st),
    st.tuples(st.just("delete_behind"), st.integers(0, 3)),
    st.tuples(st.just("reset")),
    st.tuples(st.just("reset_external"), st.booleans()),
    st.tuples(st.just("reset_direct"), st.just(True)),
    st.tuples(st.just("tier_cleared")),
    st.tuples(st.just("lose")),
    st.tuples(st.just("drop"), st.sampled_from([1, 1, 2, BUFFER + 1])),
    st.tuples(st.just("restart")),
    st.tuples(st.just("tick"), st.sampled_from([1, 20, 61])),  # the clock: both replicas
)
op_st = st.tuples(who, model_op)


def run(
    lowers: tuple[str, str], gpu: int, cpu: int, domain: bool, ops: list[tuple[int, Any]]
) -> Router:
    models = [Replica(lower, gpu, cpu, domain) for lower in lowers]
    if domain:  # one PVC, one disk directory, one evictor
        models[1].fs = models[0].fs
        models[1].llmd_announced = models[0].llmd_announced
        models[1].disk = models[0].disk
        models[1].evictor = models[0].evictor
    router = Router(models, domain)
    for r, op in ops:
        if op[0] == "tick":
            router.now += op[1]
            for m in models:
                m.tick(op[1])
        else:
            getattr(models[r], op[0])(*op[1:])
        router.step()
        router.check()
    return router


lower_st = st.sampled_from(["connector", "native_sd", "native_ph", "simple_cpu"])


@settings(max_examples=300, deadline=None)
@given(
    st.tuples(lower_st, lower_st),
    st.integers(6, 14),
    st.integers(1, 4),
    st.booleans(),
    st.lists(op_st, min_size=4, max_size=30),
)
@example(
    ("native_sd", "connector"),
    14,
    4,
    True,
    [
        (0, ("serve", 0, 0)),
        (0, ("disk_store", 0, 0)),
        (0, ("drop", 1)),
        (0, ("evict", 6)),
        (0, ("disk_evict",)),
        (0, ("serve", 1, 0)),
    ],
)
@example(
    ("connector", "native_ph"),
    14,
    4,
    False,
    [
        (0, ("serve", 0, 0)),
        (0, ("drop", 4)),
        (0, ("evict", 2)),
        (0, ("evict", 2)),
        (0, ("evict", 2)),
        (0, ("evict", 2)),
        (0, ("serve", 1, 0)),
    ],
)
@example(
    ("simple_cpu", "native_sd"),
    14,
    4,
    True,
    [(1, ("serve", 2, 1)), (1, ("restart",)), (1, ("compute", 0, 0, 3))],
)
@example(  # a gap the replay cannot fill, then a hit re-announced past what the index knows
    ("connector", "connector"),
    14,
    4,
    False,
    [
        (0, ("serve", 0, 0)),
        (0, ("drop", BUFFER + 1)),
        *[(0, ("reannounce", 0, 0, 1))] * (BUFFER + 1),
        (0, ("reannounce", 0, 0, 2)),
        (0, ("reannounce", 0, 0, 4)),
        (0, ("evict", 6)),
    ],
)
@example(  # a reset the router forwards while the stream is behind a CPU store
    ("native_sd", "connector"),
    14,
    4,
    False,
    [
        (0, ("serve", 0, 0)),
        (0, ("drop", 2)),
        (0, ("serve", 1, 0)),
        (0, ("reset_external", True)),
        (0, ("serve", 2, 0)),
    ],
)
@example(  # a domain chunk put back by a late store is every attached replica's
    ("connector", "connector"),
    6,
    1,
    True,
    [
        (0, ("serve", 0, 0)),
        (0, ("drop", 1)),
        (0, ("disk_store", 0, 0)),
        (0, ("disk_evict",)),
        (0, ("reset",)),
    ],
)
@example(  # a removal lost at the source: gone TTL after the loss shows, what follows kept
    ("native_sd", "connector"),
    14,
    4,
    False,
    [
        (0, ("serve", 0, 0)),
        (0, ("lose",)),
        (0, ("evict", 6)),
        (0, ("serve", 1, 0)),
        (0, ("evict", 6)),
        (0, ("tick", 20)),
        (0, ("serve", 2, 0)),
        (0, ("tick", 61)),
    ],
)
@example(  # a connector reset sent directly, its batch applied late: TTL from then
    ("native_sd", "connector"),
    14,
    4,
    False,
    [
        (0, ("serve", 0, 0)),
        (0, ("drop", 1)),
        (0, ("reset_direct", True)),
        (0, ("tick", 61)),
        (0, ("serve", 1, 0)),
        (0, ("tick", 61)),
    ],
)
@example(  # a reset the device's failed, behind a gap the replay cannot fill: a LoRA chunk
    ("native_sd", "connector"),
    6,
    1,
    False,
    [
        (0, ("drop", 4)),
        (0, ("reset",)),
        (0, ("serve", 0, 0)),
        (0, ("serve", 0, 0)),
        (0, ("serve", 0, 1)),
        (0, ("reset_external", False)),
        (0, ("serve", 0, 0)),
    ],
)
def test_every_stream_through_the_feeds_stays_within_the_stated_window(
    lowers: tuple[str, str], gpu: int, cpu: int, domain: bool, ops: list[tuple[int, Any]]
) -> None:
    run(lowers, gpu, cpu, domain, ops)


def test_the_model_reaches_every_feed_path_and_checks_both_ways() -> None:
    """The property above is only as good as what it drives: each fault takes the feed down
    the path the window assumes, and the under-claim check has blocks to check."""
    ops: list[tuple[int, Any]] = [
        (0, ("serve", 0, 0)),
        (0, ("drop", 1)),  # replayed: a gap, no clear
        (0, ("evict", 2)),
        (0, ("serve", 1, 0)),
    ]
    feed = run(("connector", "native_sd"), 14, 4, True, ops).feeds[0]
    stats = feed.feed.stats
    assert (stats.gaps, stats.clears, stats.lost_batches) == (1, 0, 0)
    ops += [(0, ("lose",)), (0, ("evict", 2)), (0, ("serve", 2, 0))]
    feed = run(("connector", "native_sd"), 14, 4, True, ops).feeds[0]
    stats = feed.feed.stats
    assert (stats.gaps, stats.clears, stats.lost_batches) == (2, 0, 1)
    assert any(cls == GPU for cls, _ in feed.lost)  # the lost removals' window is open
    ops += [(0, ("reset",)), (0, ("serve", 0, 0))]
    feed = run(("connector", "native_sd"), 14, 4, True, ops).feeds[0]
    assert not any(cls == GPU for cls, _ in feed.lost)  # closed by the device clear
    assert feed.vouched and feed.vouched <= set(feed.model.gpu)
    ops += [(0, ("drop", BUFFER + 1))] + [(0, ("evict", 1))] * (BUFFER + 2)
    feed = run(("connector", "native_sd"), 14, 4, True, ops).feeds[0]
    stats = feed.feed.stats
    assert stats.clears == 1 and stats.missed_batches >= 1  # the buffer was outgrown
    ops += [(0, ("serve", 1, 0)), (0, ("restart",)), (0, ("serve", 2, 0))]
    feed = run(("connector", "native_sd"), 14, 4, True, ops).feeds[0]
    stats = feed.feed.stats
    assert stats.resets == 1 and stats.clears == 2
    assert feed.vouched == set(feed.model.gpu) and feed.vouched
