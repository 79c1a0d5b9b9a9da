"""Every publisher at once, with resets, gaps and lost batches: the index never believes a block
is held in a tier the replica lacks, beyond the windows docs/indexer.md states.

test_index_truth.py checks the publishers that announce every change (and two that never
remove, with nothing deleted behind them). This one runs one replica with all of them mixed on
its streams, in any order, and with what real fleets do to streams:

- the device (vLLM's block pool) and one confirmed lower tier: kvroute's connector, vLLM's
  offloading connector (self-describing or last-hash-only) or the SimpleCPUOffloadConnector's
  CPU block pool (one block per event, reset with a bare ``AllBlocksCleared``);
- publishers that never remove, whose blocks go without a word: LMCache as it ships (its own
  chunk hashes, the chunk's tokens plus the next one, medium ``cpu``), Mooncake's store (vLLM's
  hashes, no extra keys, medium ``cpu``), vLLM's FS tier (``STORAGE`` without extra keys) and
  llm-d's FS backend on a stream of its own, into a PVC whose evictor publishes removals on a
  third stream (or deletes silently);
- resets that publish nothing but pass through the router (``reset_external``), or are sent
  to the replica directly (``reset_direct``: with the device's clear, the offloading
  connector's CPU blocks are excused for ``TTL`` after it; without, until CPU is next
  dropped), events of an
  unknown type that may be resets, a gap the replay cannot fill (the stream is cleared), and a
  batch lost at its source (vLLM's publisher consumed the sequence number, nothing buffered).

The stated windows, checked after every step (the clock moves; ``expire`` runs as the router's
periodic task runs it):
- confirmed tiers: none. What the index holds in GPU or CPU, the replica holds.
- unconfirmed tiers (publishers that never remove): a block deleted without a word stays at
  most ``unconfirmed_ttl_s`` after it was last announced.
- a batch lost at its source: a block it removed (or a clear it held) stays believed at most
  ``unconfirmed_ttl_s`` after the index is told of the loss (``note_lost``; the index keeps,
  when that window ends, only what the stream's later stores proved held), or until the index
  next drops that tier (a device reset it sees, a connector reset, a gap's clear), whichever
  comes first.
- a connector reset sent directly whose device reset failed: its CPU blocks stay believed
  until the index next drops CPU (nothing in the stream marks it), or until the replica's
  answer to a request routed on them proves them gone (``answer``: the router's audit,
  router/routing/cpu_audit.py, with the cached tokens vLLM would report).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import msgspec
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvroute.indexer.index import InMemoryPrefixIndex, domain_key
from kvroute.indexer.keys import RequestKeys
from kvroute.indexer.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    Medium,
    decode_batch,
    encode_batch,
)
from kvroute.router.routing.cpu_audit import audit_cpu
from kvroute.router.routing.match_tiers import TIER_DROP_ORDER as _TIER_DROP_ORDER
from kvroute.router.routing.policies import ReplicaView
from kvroute.router.routing.router import Decision, match_tiers, predicted_cached_tokens
from tests.indexer.index.test_index_truth import (
    BS,
    DOCS,
    LM_CHUNK,
    VARIANTS,
    ModelReplica,
    N,
    _h,
    blocks_of,
)

TTL = 60.0
GPU, CPU, CPU_U, STORAGE_U = "GPU", "CPU", "CPU_UNCONFIRMED", "STORAGE_UNCONFIRMED"
UNCONFIRMED = (CPU_U, STORAGE_U)
PVC = "pvc"


class MixedReplica(ModelReplica):
    """ModelReplica's device and lower tier, plus every other publisher, the clock and the
    stream faults; ``excused`` holds what the stated windows allow the index to believe."""

    def __init__(self, lower: str, gpu_blocks: int, cpu_chunks: int, pvc: bool) -> None:
        super().__init__("connector" if lower == "simple_cpu" else lower, gpu_blocks, cpu_chunks)
        self.simple = lower == "simple_cpu"
        self.pvc = pvc
        self.now = 0.0
        self.pool: OrderedDict[int, None] = OrderedDict()  # SimpleCPU's CPU pool: hashes
        self.mooncake: set[int] = set()
        self.vllm_fs: set[int] = set()
        # class -> hash -> when its publisher last announced it (unconfirmed classes)
        self.announced: dict[str, dict[int, float]] = {CPU_U: {}, STORAGE_U: {}}
        self.lm_announced: dict[tuple[int, ...], float] = {}  # LMCache: by token prefix
        self.llmd_announced: dict[int, float] = {}  # llm-d's FS backend
        # (class, hash) the index may still believe after a lost batch -> until when (the
        # window the loss opened), unless the index drops the class first
        self.lost: dict[tuple[str, int], float] = {}
        # CPU hashes a direct connector reset emptied whose device reset failed: nothing marks
        # it, believed until the index next drops CPU
        self.silent: set[tuple[str, int]] = set()
        self.evictor: list[Event] = []  # llm-d's PVC evictor's stream
        self.unknown: list[dict[str, Any]] = []
        self.lose_next = False
        self.gap_next = False
        self.router_reset = False
        self.router_reset_device = False
        # CPU hashes a connector reset sent directly emptied, excused until then (docs/
        # indexer.md: ``unconfirmed_ttl_s`` after the device clear that came with it)
        self.doubted: dict[int, float] = {}
        self.asked: tuple[int, int] | None = None  # a request to answer (``answer``)
        self.prev = self.confirmed_sets()  # what the index was last told of confirmed tiers

    # --- the lower tier: SimpleCPUOffloadConnector's pool instead of chunks ------------------

    def offload(self, doc: int, variant: int) -> None:
        if not self.simple:
            super().offload(doc, variant)
            return
        for b in blocks_of(doc, variant):
            if b.hash in self.pool:
                self.pool.move_to_end(b.hash)
                continue
            if b.hash not in self.gpu:
                return
            while len(self.pool) >= self.cpu_chunks * N:
                victim, _ = self.pool.popitem(last=False)
                self.main.append(BlockRemoved([victim], Medium.CPU))
            self.pool[b.hash] = None
            event = self._store([b], Medium.CPU, with_extra=True)
            event.locality, event.spec_kind = "LOCAL", "full_attention"
            self.main.append(event)

    def reset(self) -> None:
        """/reset_prefix_cache: a bare clear; with SimpleCPU its pool's reset follows, also
        bare (after the connector's events, as vLLM orders them)."""
        super().reset()
        if self.simple and self.pool:
            self.pool.clear()
            self.main.append(AllBlocksCleared())

    def reset_external(self, device: bool = True) -> None:
        """``reset_external``/``/pause``: vLLM resets the device's prefix cache (its block pool
        publishes ``AllBlocksCleared``), unless blocks are still in use (``device`` false:
        ``{"success": false}``), then the connector: vLLM's offloading connector empties its
        CPU tier and says nothing; kvroute's announces it (reset_lower). The router forwarded
        the request and tells the index (``reset_connector``)."""
        if device:
            self.gpu.clear()
            self.gpu_lru.clear()
            self.main.append(AllBlocksCleared())
        self.router_reset_device = device
        if self.lower == "connector" and not self.simple:
            self.reset_lower()
        else:
            self.cpu.clear()
            self.pool.clear()
        self.router_reset = True

    def reset_direct(self, device: bool) -> None:
        """A connector reset sent to the replica directly: the router never hears of it.
        vLLM's offloading connector empties its CPU tier without a word; the index, seeing a
        device clear it was not told of, holds those chunks for ``TTL`` only. Without the
        device's reset (``{"success": false}``) nothing in the stream says anything: they stay
        until the index next drops CPU. kvroute's connector announces its reset, the
        SimpleCPUOffloadConnector's pool with a bare clear."""
        silent = self.lower in ("native_sd", "native_ph")
        gone = {h for members in self.cpu.values() for h in members} if silent else set()
        self.reset_external(device)
        self.router_reset = False
        if self.simple:
            self.main.append(AllBlocksCleared())  # the pool's own reset, announced
        if device:
            self._doubt(gone)
        else:
            self.silent |= {(CPU, h) for h in gone}

    def drop_excuses(self, cls: str) -> None:
        """The index dropped ``cls``: nothing a lost batch or a silent reset left is excused."""
        self.lost = {x: t for x, t in self.lost.items() if x[0] != cls}
        self.silent = {x for x in self.silent if x[0] != cls}

    def _doubt(self, gone: set[int]) -> None:
        """The index applies the reset's device clear in this step: ``TTL`` from now."""
        self.doubted.update(dict.fromkeys(gone, self.now + TTL))

    # --- publishers that never remove --------------------------------------------------------

    def lmcache_store(self, doc: int) -> None:
        """LMCache 0.5.6 as it ships: its chunk hash, the chunk's tokens and the next token
        (``tokens[start:end+1]``), the chunk's length as block size, medium ``cpu``."""
        tokens = DOCS[doc]
        chain = blocks_of(doc, 0)
        parent = None
        for start in range(0, len(tokens), LM_CHUNK):
            end = min(start + LM_CHUNK, len(tokens))
            if any(b.hash not in self.gpu for b in chain[start // BS : end // BS]):
                return
            prefix = tuple(tokens[:end])
            chunk_hash = self.lmcache.setdefault(prefix, _h("lmcache", prefix))
            self.lm_announced[prefix] = self.now
            self.main.append(
                BlockStored(
                    [chunk_hash],
                    parent,
                    tokens[start : end + 1],
                    end - start,
                    medium=Medium.CPU,
                    confirmed=False,
                    medium_name="cpu",
                )
            )
            parent = chunk_hash

    def mooncake_store(self, doc: int, variant: int) -> None:
        """Mooncake's store: one block per event, vLLM's hash, no extra keys, ``cpu``."""
        for b in blocks_of(doc, variant):
            if b.hash not in self.gpu:
                return
            self.mooncake.add(b.hash)
            self.announced[CPU_U][b.hash] = self.now
            self.main.append(
                BlockStored(
                    [b.hash],
                    b.parent,
                    list(b.tokens),
                    BS,
                    medium=Medium.CPU,
                    confirmed=False,
                    medium_name="cpu",
                    engine_hashes=True,
                )
            )

    def vllm_fs_store(self, doc: int, variant: int) -> None:
        """vLLM's FS tier (self-describing): chunks of N blocks, no extra keys, ``STORAGE``."""
        chain = blocks_of(doc, variant)
        for c in range(len(chain) // N):
            members = chain[c * N : (c + 1) * N]
            if any(b.hash not in self.gpu for b in members):
                return
            for b in members:
                self.vllm_fs.add(b.hash)
                self.announced[STORAGE_U][b.hash] = self.now
            event = self._store(members, Medium.STORAGE, with_extra=False)
            event.locality = "LOCAL"
            self.main.append(event)

    def fs_store(self, doc: int, variant: int) -> None:
        before = set(self.fs)
        super().fs_store(doc, variant)
        for last in set(self.fs) - before:
            for h in self.fs[last]:
                self.llmd_announced[h] = self.now

    def delete_behind(self, which: int) -> None:
        """An external evictor (or Mooncake's own) deletes what a never-removing publisher
        stored; llm-d's PVC evictor announces its deletions on its own stream."""
        if which == 0 and self.mooncake:
            self.mooncake.discard(min(self.mooncake))
        elif which == 1 and self.vllm_fs:
            self.vllm_fs.discard(min(self.vllm_fs))
        elif which == 2 and self.fs:
            last = min(self.fs)
            members = self.fs.pop(last)
            if self.pvc:  # announced: no window
                for h in members:
                    self.llmd_announced.pop(h, None)
                self.evictor.append(
                    BlockRemoved(
                        [last], Medium.STORAGE, confirmed=False, medium_name="SHARED_STORAGE"
                    )
                )
        elif which == 3 and self.lmcache:
            del self.lmcache[min(self.lmcache)]

    # --- stream faults -----------------------------------------------------------------------

    def tier_cleared(self) -> None:
        """A publisher newer than the decoder empties its CPU tier with an event type the
        decoder does not know (vLLM's proposed ``TierBlocksCleared``)."""
        self.cpu.clear()
        self.pool.clear()
        self.mooncake.clear()
        self.lmcache.clear()
        self.unknown.append({"type": "TierBlocksCleared", "medium": "CPU"})

    def lose(self) -> None:
        """The next step's batch on the main stream is lost at its source."""
        self.lose_next = True

    def gap(self) -> None:
        """The next step's batch is missed and the replay no longer holds it."""
        self.gap_next = True

    def answer(self, doc: int, variant: int) -> None:
        """A request for the prompt, answered without computing anything (the router's part
        is in ``Router.step``): what the replica would report as cached tokens."""
        self.asked = (doc, variant)

    def cached_tokens(self, doc: int, variant: int) -> int:
        """vLLM's reported cached tokens for the prompt: the device's hit (whole blocks, at
        most the prompt less its last token), then, if the CPU tier holds the next block,
        something more (the audit only asks whether it went past the device's part)."""
        chain = blocks_of(doc, variant)
        device = 0
        while device < len(chain) and chain[device].hash in self.gpu:
            device += 1
        device = min(device, (len(DOCS[doc]) - 1) // BS)
        more = device < len(chain) and chain[device].hash in self.confirmed_sets()[CPU]
        return device * BS + (BS if more else 0)

    def serve(self, doc: int, variant: int) -> None:
        """A whole prompt computed, then offloaded (the connector's usual order)."""
        self.compute(doc, variant, 6)
        self.offload(doc, variant)

    def tick(self, seconds: int) -> None:
        self.now += seconds

    # --- the truth ---------------------------------------------------------------------------

    def confirmed_sets(self) -> dict[str, set[int]]:
        cpu = {h for members in self.cpu.values() for h in members} | set(self.pool)
        return {GPU: set(self.gpu), CPU: cpu}

    def held(self, doc: int, variant: int) -> list[set[str]]:
        out = []
        tokens = DOCS[doc]
        lm = self._lmcache_blocks()
        fs = {h for members in self.fs.values() for h in members}
        confirmed = self.confirmed_sets()
        for b in blocks_of(doc, variant):
            held = {cls for cls, hashes in confirmed.items() if b.hash in hashes}
            if b.hash in self.mooncake:
                held.add(CPU_U)
            if variant == 0 and tuple(tokens[: (b.index + 1) * BS]) in lm:
                held.add(CPU_U)
            if b.hash in fs or b.hash in self.vllm_fs:
                held.add(STORAGE_U)
            out.append(held)
        return out

    def allowed(self, doc: int, variant: int) -> list[set[str]]:
        """``held`` plus what the stated windows excuse."""
        out = self.held(doc, variant)
        tokens = DOCS[doc]
        for b, classes in zip(blocks_of(doc, variant), out, strict=True):
            for cls in (GPU, CPU):
                if self.now < self.lost.get((cls, b.hash), -1.0) or (cls, b.hash) in self.silent:
                    classes.add(cls)
            if self.now <= self.doubted.get(b.hash, -1.0):
                classes.add(CPU)
            for cls in UNCONFIRMED:
                if self.now - self.announced[cls].get(b.hash, -1e9) <= TTL:
                    classes.add(cls)
            if self.now - self.llmd_announced.get(b.hash, -1e9) <= TTL:
                classes.add(STORAGE_U)
            if variant == 0 and self._lmcache_recent(tuple(tokens[: (b.index + 1) * BS])):
                classes.add(CPU_U)
        return out

    def _lmcache_recent(self, block_prefix: tuple[int, ...]) -> bool:
        """An LMCache chunk announced within the TTL covers this block (keyed by tokens)."""
        end = len(block_prefix)
        return any(
            self.now - t <= TTL and len(p) - LM_CHUNK < end <= len(p) and p[:end] == block_prefix
            for p, t in self.lm_announced.items()
        )


doc_st = st.integers(0, len(DOCS) - 1)
variant_st = st.integers(0, len(VARIANTS) - 1)
op_st = st.one_of(
    st.tuples(st.just("serve"), doc_st, variant_st),
    st.tuples(st.just("compute"), doc_st, variant_st, st.integers(1, 6)),
    st.tuples(st.just("compute"), doc_st, variant_st, st.just(6)),
    st.tuples(st.just("duplicate"), doc_st, variant_st, st.integers(0, 5)),
    st.tuples(st.just("reannounce"), doc_st, variant_st, st.integers(1, 6)),
    st.tuples(st.just("evict"), st.integers(1, 6)),
    st.tuples(st.just("offload"), doc_st, variant_st),
    st.tuples(st.just("lmcache_store"), doc_st),
    st.tuples(st.just("mooncake_store"), doc_st, variant_st),
    st.tuples(st.just("vllm_fs_store"), doc_st, variant_st),
    st.tuples(st.just("fs_store"), doc_st, variant_st),
    st.tuples(st.just("delete_behind"), st.integers(0, 3)),
    st.tuples(st.just("reset")),
    st.tuples(st.just("reset_external"), st.booleans()),
    st.tuples(st.just("reset_direct"), st.booleans()),
    st.tuples(st.just("tier_cleared")),
    st.tuples(st.just("lose")),
    st.tuples(st.just("gap")),
    st.tuples(st.just("tick"), st.sampled_from([1, 20, 61])),
    st.tuples(st.just("answer"), doc_st, variant_st),
)


def _payload(events: list[Event], unknown: list[dict[str, Any]]) -> bytes:
    if not unknown:
        return encode_batch(events, ts=0.0)
    wire = msgspec.msgpack.decode(encode_batch(events, ts=0.0))
    return msgspec.msgpack.encode([wire[0], [*wire[1], *unknown]])


class Router:
    """What the subscriber and the router do with the model's streams."""

    def __init__(self, model: MixedReplica) -> None:
        self.model = model
        self.index = InMemoryPrefixIndex(unconfirmed_ttl_s=TTL, clock=lambda: model.now)
        if model.pvc:
            self.index.attach("r", PVC)

    def step(self) -> None:
        m = self.model
        before = m.confirmed_sets()
        if m.main or m.unknown:
            if m.lose_next or m.gap_next:
                if m.gap_next:  # the subscriber clears what the stream vouched for
                    self.index.clear_source("r", "", restarted=False)
                    m.lost = {}
                    m.silent = set()
                else:  # lost at the source: counted, the index told (its window opens now)
                    self.index.note_lost("r")
                    m.lost.update(dict.fromkeys(self._gone(m.prev, before), m.now + TTL))
                m.lose_next = m.gap_next = False
            else:
                batch = decode_batch(_payload(m.main, m.unknown))
                assert not batch.rejected and not batch.unknown_media, batch.rejected
                result = self.index.apply("r", batch.events)
                if any(isinstance(e, AllBlocksCleared) for e in m.main):
                    m.drop_excuses(GPU)
                if m.unknown:
                    assert result.distrusted
                    m.drop_excuses(CPU)
            m.main.clear()
            m.unknown.clear()
        if m.router_reset:
            self.index.reset_connector("r", device_cleared=m.router_reset_device)
            m.drop_excuses(CPU)
            m.router_reset = False
        for events, source, replica in (
            (m.aux, "fs", "r"),
            (m.evictor, "", domain_key(PVC)),  # a domain feed is its own replica
        ):
            if events:
                batch = decode_batch(encode_batch(events, ts=0.0))
                assert not batch.rejected and not batch.unknown_media
                self.index.apply(replica, batch.events, source=source)
                events.clear()
        if m.asked is not None:
            self._answer(*m.asked)
            m.asked = None
        self.index.expire()
        m.prev = m.confirmed_sets()

    def _answer(self, doc: int, variant: int) -> None:
        """The router routes the prompt here as it would (the index's match, trimmed by vLLM's
        last-token rule: Router._match) and audits the answer's cached tokens; the silent
        reset's excuse ends for the CPU blocks the audit refuted."""
        m = self.model
        lora, salt = VARIANTS[variant]
        request = RequestKeys(DOCS[doc], lora_name=lora, cache_salt=salt)
        match = self.index.lookup(request).get("r")
        if match is None or not match.tokens:
            return
        view = ReplicaView(name="r", block_size=BS)
        view.match_tokens = predicted_cached_tokens(match.tokens, len(DOCS[doc]), BS)
        tiers = match_tiers(match)
        excess = match.tokens - view.match_tokens
        for tier in _TIER_DROP_ORDER:
            take = min(max(excess, 0), tiers.get(tier, 0))
            tiers[tier] = tiers.get(tier, 0) - take
            excess -= take
        view.tokens_by_tier = {t: n for t, n in tiers.items() if n}
        decision = Decision("kvroute", "", [], [view], len(DOCS[doc]))
        decision.keys = {BS: request.keys(BS)}
        if audit_cpu(self.index, decision, "r", m.cached_tokens(doc, variant)):
            gpu, cpu = tiers.get(GPU, 0) // BS, tiers.get(CPU, 0) // BS
            refuted = {(CPU, b.hash) for b in blocks_of(doc, variant)[gpu : gpu + cpu]}
            m.silent -= refuted
            got = self.index.block_tiers("r", request)
            assert not any(CPU in got[i] for i in range(gpu, gpu + cpu)), (got, gpu, cpu)

    @staticmethod
    def _gone(prev: dict[str, set[int]], now: dict[str, set[int]]) -> set[tuple[str, int]]:
        return {(cls, h) for cls in prev for h in prev[cls] - now.get(cls, set())}


@settings(max_examples=500, deadline=None)
@given(
    st.sampled_from(["connector", "native_sd", "native_ph", "simple_cpu"]),
    st.integers(6, 14),
    st.integers(1, 4),
    st.booleans(),
    st.lists(op_st, min_size=1, max_size=40),
)
# One of each fault, so that every run checks them whatever hypothesis draws.
@example("native_sd", 14, 4, True, [("serve", 0, 0), ("fs_store", 0, 0), ("delete_behind", 2)])
@example("native_ph", 14, 4, False, [("serve", 0, 1), ("reset_external",)])
@example("native_sd", 14, 4, False, [("serve", 0, 0), ("reset_direct", True), ("tick", 61)])
@example("connector", 14, 4, False, [("serve", 0, 2), ("mooncake_store", 0, 2), ("tier_cleared",)])
@example("simple_cpu", 14, 4, False, [("serve", 1, 0), ("lose",), ("evict", 6), ("reset",)])
@example("native_ph", 8, 2, False, [("serve", 1, 0), ("lose",), ("evict", 6), ("tick", 61)])
@example(
    "native_sd",
    14,
    4,
    False,
    [("serve", 0, 0), ("evict", 6), ("reset_direct", False), ("answer", 0, 0)],
)
@example("native_sd", 14, 4, False, [("serve", 2, 0), ("gap",), ("evict", 6), ("serve", 2, 0)])
@example("simple_cpu", 14, 4, False, [("serve", 1, 0), ("vllm_fs_store", 1, 0), ("tick", 61)])
def test_every_publisher_mixed_with_faults_stays_within_the_stated_windows(
    lower: str, gpu_blocks: int, cpu_chunks: int, pvc: bool, ops: list[tuple[Any, ...]]
) -> None:
    model = MixedReplica(lower, gpu_blocks, cpu_chunks, pvc)
    router = Router(model)
    for op in ops:
        getattr(model, op[0])(*op[1:])
        router.step()
        for doc in range(len(DOCS)):
            for variant, (lora, salt) in enumerate(VARIANTS):
                allowed = model.allowed(doc, variant)
                request = RequestKeys(DOCS[doc], lora_name=lora, cache_salt=salt)
                got = router.index.block_tiers("r", request)
                for i, tiers in enumerate(got):
                    assert tiers <= allowed[i], (op, doc, variant, i, sorted(tiers), allowed[i])


def test_the_mixed_model_reaches_every_class_and_every_fault() -> None:
    """The property above is only as good as what the model sends: each publisher's blocks
    reach the index, each fault does what the windows say."""
    model = MixedReplica("simple_cpu", 40, 8, pvc=True)
    router = Router(model)
    index = router.index
    model.compute(1, 0, 6)
    router.step()
    for op in ("offload", "mooncake_store", "vllm_fs_store", "fs_store"):
        getattr(model, op)(1, 0)
        router.step()
    model.lmcache_store(1)
    router.step()
    classes = set().union(*index.block_tiers("r", DOCS[1]))
    assert classes == {GPU, CPU, CPU_U, STORAGE_U}
    # a lost batch: the device evicted everything, the index never heard
    model.lose()
    model.evict(40)
    router.step()
    assert all(GPU in t for t in index.block_tiers("r", DOCS[1]))
    assert {(GPU, b.hash) for b in blocks_of(1, 0)} <= set(model.lost)
    # the device reset is seen: the window closes
    model.reset()
    router.step()
    assert not any(GPU in t for t in index.block_tiers("r", DOCS[1]))
    # files deleted without a word stay at most the TTL
    model.delete_behind(1)
    model.tick(61)
    router.step()
    assert all(STORAGE_U not in t for t in index.block_tiers("r", DOCS[0]))


def test_an_answer_ends_the_window_of_a_silent_reset() -> None:
    """A connector reset sent directly, the device's reset failed: nothing in the stream says
    so, and the index believes the offloaded chunks; the next answer on them (device part
    only) is the proof, and the excuse ends there."""
    model = MixedReplica("native_sd", 14, 4, pvc=False)
    router = Router(model)
    for op in (("serve", 0, 0), ("evict", 6), ("reset_direct", False)):
        getattr(model, op[0])(*op[1:])
        router.step()
    assert model.silent and any(CPU in t for t in router.index.block_tiers("r", DOCS[0]))
    model.answer(0, 0)
    router.step()
    # what the router predicted from CPU goes: the prompt less its last token, in blocks (the
    # prompt's last block is never predicted, vLLM recomputes its last token: it waits for a
    # longer prompt, and alone it is no whole chunk a lookup would count)
    predicted = (len(DOCS[0]) - 1) // BS
    assert router.index.stats().refuted_cpu_blocks == predicted
    tiers = router.index.block_tiers("r", DOCS[0])
    assert [CPU in t for t in tiers] == [False] * predicted + [True] * (len(tiers) - predicted)
    assert model.silent == {(CPU, b.hash) for b in blocks_of(0, 0)[predicted:]}
    assert router.index.lookup(DOCS[0])["r"].tokens == 0
