"""A simulated replica's prefix cache: device, CPU and STORAGE tiers with LRU and events.

The rules follow vLLM's block manager where vLLM has one, and are stated here where it has not:
- A block is cached under its chained engine digest; a request hits the longest run of its
  full prompt blocks present in any tier, capped so that the last prompt token is computed.
- Blocks in use by a running request (``ref > 0``) are on the device and never evicted. Freed
  blocks join the device LRU tail-first (vLLM frees a request's blocks in reverse order), so a
  request's later blocks are evicted before its shared head.
- Tiers are exclusive: a block lives in exactly one tier. Device eviction demotes to CPU, CPU
  eviction demotes to STORAGE, STORAGE eviction drops; a hit in a lower tier promotes the
  block back to the device (a load, which the latency model charges).
- Invariant: a cached block's parent is cached (in some tier). Dropping a block therefore
  drops its cached descendants too. They were unreachable by any prefix lookup anyway, and
  the invariant guarantees that every event's ``parent_block_hash`` names a block the
  subscriber knows, as in vLLM, where stores always extend a live chain.
- Every change is an event, in vLLM's wire classes: BlockStored for new device blocks (runs of
  one chain in one event) and, self-describing (token ids, parent, block size), for every
  demotion and promotion; BlockRemoved per block and tier. A store into the new tier is always
  emitted before the removal from the old one, so no reader ever sees the block vanish.
  Reuse of a cached block is not announced (vLLM's default).
- With a shared storage domain (bench/sim/storage.py) the STORAGE tier is the domain, not
  the replica's own: a lookup continues into the domain where the local tiers end, a domain
  hit is a load (the file stays for the other replicas: no BlockRemoved), and a block leaving
  the last local tier is written there (BlockStored(STORAGE) only when the domain did not
  hold it, as the connector announces only files it wrote) and dropped locally. A domain
  written through (``SharedStorageDomain.write_through``) also gets every block once its
  prefill is done (``write_through``), while the block stays in the local tiers: the one
  place where the tiers are not exclusive, as the connector's ``write_through`` disk policy
  keeps a chunk on the device and on disk. The domain's evictions are its own evictor's
  events, never this cache's.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvroute.bench.sim.hashing import digest_to_int
from kvroute.bench.sim.storage import SharedStorageDomain, StoredBlock, leading_run
from kvroute.indexer.wire import AllBlocksCleared, BlockRemoved, BlockStored, Event, Medium

__all__ = ["Allocation", "CachedBlock", "TieredPrefixCache"]

_LOWER: dict[Medium, Medium | None] = {
    Medium.GPU: Medium.CPU,
    Medium.CPU: Medium.STORAGE,
    Medium.STORAGE: None,
}


@dataclass(eq=False, slots=True)
class CachedBlock:
    """One cached block. ``tier`` None means dropped (a stale reference)."""

    digest: bytes
    hash: int
    parent: CachedBlock | None = field(repr=False)
    tokens: tuple[int, ...]
    extra: tuple[Any, ...] | None
    tier: Medium | None
    ref: int = 0
    lora_name: str | None = None  # the adapter that computed it (its events name it)
    kids: set[CachedBlock] = field(default_factory=set, repr=False)
    # The request still computing this block (vLLM caches blocks when it schedules them, so
    # others can hit them before they are computed; the scheduler makes those wait).
    owner: object | None = field(default=None, repr=False)


@dataclass(slots=True)
class Allocation:
    """A running request's hold on the device: its chain of cached blocks and private blocks.

    ``hit_tiers`` says where each hit block was found (the latency model charges loads from
    CPU and STORAGE); ``private`` counts device blocks held for tokens not cached yet.
    """

    blocks: list[CachedBlock]
    private: int
    hit_tiers: list[Medium]

    @property
    def hit_blocks(self) -> int:
        return len(self.hit_tiers)

    def hit_blocks_in(self, tier: Medium) -> int:
        return sum(1 for t in self.hit_tiers if t == tier)


class TieredPrefixCache:
    """The prefix cache of one simulated replica (pure state: no I/O, no clock).

    Events accumulate in order and are handed over by ``take_events`` once per engine step, as
    vLLM publishes one batch per step.
    """

    def __init__(
        self,
        block_size: int,
        gpu_blocks: int,
        cpu_blocks: int = 0,
        storage_blocks: int = 0,
        shared: SharedStorageDomain | None = None,
    ) -> None:
        if block_size <= 0 or gpu_blocks <= 0 or cpu_blocks < 0 or storage_blocks < 0:
            raise ValueError("block_size and gpu_blocks must be positive, other tiers >= 0")
        if shared is not None and storage_blocks:
            raise ValueError("a replica's STORAGE tier is either its own or a shared domain")
        self.block_size = block_size
        self.shared = shared
        self.capacity = {
            Medium.GPU: gpu_blocks,
            Medium.CPU: cpu_blocks,
            Medium.STORAGE: shared.capacity if shared is not None else storage_blocks,
        }
        self._blocks: dict[bytes, CachedBlock] = {}
        # GPU: only evictable (ref == 0) blocks; CPU and STORAGE: every block of the tier.
        self._lru: dict[Medium, OrderedDict[bytes, CachedBlock]] = {
            t: OrderedDict() for t in Medium
        }
        self._gpu_cached = 0
        self._private = 0
        self._events: list[Event] = []

    # --- queries ------------------------------------------------------------------------------

    def match(self, digests: Sequence[bytes]) -> list[CachedBlock]:
        """The longest run of ``digests`` (a request's chain) cached in any tier."""
        return leading_run(self._blocks, digests)

    def max_hit_blocks(self, prompt_len: int) -> int:
        """vLLM always computes the last prompt token: a hit covers at most prompt_len - 1."""
        return max(0, prompt_len - 1) // self.block_size

    def free_gpu_blocks(self) -> int:
        """Device blocks a new request could get (evictable cached blocks count as free)."""
        return (
            self.capacity[Medium.GPU]
            - self._gpu_cached
            - self._private
            + len(self._lru[Medium.GPU])
        )

    def usage(self) -> float:
        """vLLM's kv_cache_usage_perc: blocks in use over all device blocks (0..1)."""
        used = self._gpu_cached - len(self._lru[Medium.GPU]) + self._private
        return used / self.capacity[Medium.GPU]

    def tier_of(self, digest: bytes) -> Medium | None:
        block = self._blocks.get(digest)
        return None if block is None else block.tier

    def contents(self) -> dict[Medium, set[int]]:
        """Engine int hashes per tier (what an index fed by the events must hold)."""
        out: dict[Medium, set[int]] = {t: set() for t in Medium}
        for block in self._blocks.values():
            assert block.tier is not None
            out[block.tier].add(block.hash)
        return out

    def __len__(self) -> int:
        return len(self._blocks)

    def in_use_blocks(self) -> int:
        return sum(1 for b in self._blocks.values() if b.ref > 0)

    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (used by the tests)."""
        gpu = [b for b in self._blocks.values() if b.tier is Medium.GPU]
        assert len(gpu) == self._gpu_cached, "device count drifted"
        assert self._gpu_cached + self._private <= self.capacity[Medium.GPU], "device overfull"
        for tier in (Medium.CPU, Medium.STORAGE):
            assert len(self._lru[tier]) <= self.capacity[tier], f"{tier.name} overfull"
            assert all(b.tier is tier for b in self._lru[tier].values())
        for d, b in self._blocks.items():
            assert b.digest == d and b.tier is not None
            assert b.parent is None or self._blocks.get(b.parent.digest) is b.parent, "orphan"
            assert b.ref == 0 or b.tier is Medium.GPU, "in-use block off the device"
            if b.tier is Medium.GPU:
                assert (b.ref == 0) == (d in self._lru[Medium.GPU]), "device LRU out of sync"
            if b.ref > 0 and b.parent is not None:
                assert b.parent.ref > 0, "in-use block with a free parent"

    # --- request lifecycle --------------------------------------------------------------------

    def allocate(
        self, digests: Sequence[bytes], prompt_len: int, total_blocks: int
    ) -> Allocation | None:
        """Admit a request needing ``total_blocks`` device blocks over its life, or return None.

        Hits are pinned (device) or promoted (lower tiers); the rest are private blocks that
        ``commit`` turns into cached blocks as their tokens are computed.
        """
        limit = self.max_hit_blocks(prompt_len)
        hits = self.match(digests[:limit])
        # The local chain ends where the domain's may go on (a local block's parent is local).
        loads = self.shared.run(digests[len(hits) : limit]) if self.shared is not None else []
        total_blocks = max(total_blocks, len(hits) + len(loads))
        on_gpu = sum(1 for b in hits if b.tier is Medium.GPU)
        evictable_hits = sum(1 for b in hits if b.tier is Medium.GPU and b.ref == 0)
        need = total_blocks - on_gpu
        if need > self.free_gpu_blocks() - evictable_hits:
            return None
        tiers: list[Medium] = [b.tier for b in hits if b.tier is not None]
        tiers += [Medium.STORAGE] * len(loads)
        if loads:
            assert self.shared is not None
            self.shared.read(loads)  # before making room: our own writes must not evict them
        promoted: list[CachedBlock] = []
        for b in hits:
            if b.tier is Medium.GPU:
                if b.ref == 0:
                    del self._lru[Medium.GPU][b.digest]
                b.ref += 1
            else:
                assert b.tier is not None
                del self._lru[b.tier][b.digest]
                promoted.append(b)
        self._make_gpu_room(need)
        run: list[CachedBlock] = []
        for b in promoted:
            old = b.tier
            assert old is not None and old is not Medium.GPU
            b.tier = Medium.GPU
            b.ref += 1
            self._gpu_cached += 1
            run.append(b)
        loaded = self._load_shared(hits[-1] if hits else None, loads)
        self._emit_store(run + loaded, Medium.GPU)
        lower = (t for t in tiers[: len(hits)] if t is not Medium.GPU)
        for b, old in zip(promoted, lower, strict=True):
            self._events.append(BlockRemoved(block_hashes=[b.hash], medium=old))
        held = hits + loaded
        self._private += total_blocks - len(held)
        return Allocation(blocks=held, private=total_blocks - len(held), hit_tiers=tiers)

    def _load_shared(
        self, parent: CachedBlock | None, loads: Sequence[StoredBlock]
    ) -> list[CachedBlock]:
        """Domain hits become pinned device blocks (a load; the domain keeps its copy)."""
        out: list[CachedBlock] = []
        for s in loads:
            block = CachedBlock(
                digest=s.digest,
                hash=s.hash,
                parent=parent,
                tokens=s.tokens,
                extra=s.extra,
                tier=Medium.GPU,
                ref=1,
                lora_name=s.lora_name,
            )
            self._blocks[s.digest] = block
            if parent is not None:
                parent.kids.add(block)
            self._gpu_cached += 1
            out.append(block)
            parent = block
        return out

    def commit(
        self,
        alloc: Allocation,
        tokens: Sequence[int],
        digests: Sequence[bytes],
        extra_keys: Sequence[tuple[Any, ...] | None] | None = None,
        lora_name: str | None = None,
    ) -> list[CachedBlock]:
        """The request computes ``tokens``: cache its full blocks past those it already holds.

        ``digests`` is the chain of ``tokens``' full blocks. A block another request cached
        meanwhile is shared (our private block goes back); new ones are announced as one
        BlockStored per run, on the device. Returns the blocks this call created.
        """
        bs = self.block_size
        run: list[CachedBlock] = []
        created: list[CachedBlock] = []
        for i in range(len(alloc.blocks), len(digests)):
            if alloc.private <= 0:
                break
            d = digests[i]
            parent = alloc.blocks[-1] if alloc.blocks else None
            block = self._blocks.get(d)
            if block is not None and block.tier is Medium.GPU:
                self._emit_store(run, Medium.GPU)
                run = []
                if block.ref == 0:
                    del self._lru[Medium.GPU][d]
                block.ref += 1
                self._private -= 1
            elif block is not None:
                # Cached meanwhile in a lower tier: our freshly computed copy promotes it.
                self._emit_store(run, Medium.GPU)
                run = []
                old = block.tier
                assert old is not None
                del self._lru[old][d]
                block.tier = Medium.GPU
                block.ref += 1
                self._private -= 1
                self._gpu_cached += 1
                self._emit_store([block], Medium.GPU)
                self._events.append(BlockRemoved(block_hashes=[block.hash], medium=old))
            else:
                extra = extra_keys[i] if extra_keys is not None and i < len(extra_keys) else None
                block = CachedBlock(
                    digest=d,
                    hash=digest_to_int(d),
                    parent=parent,
                    tokens=tuple(tokens[i * bs : (i + 1) * bs]),
                    extra=extra,
                    tier=Medium.GPU,
                    ref=1,
                    lora_name=lora_name,
                )
                self._blocks[d] = block
                if parent is not None:
                    parent.kids.add(block)
                self._private -= 1
                self._gpu_cached += 1
                run.append(block)
                created.append(block)
            alloc.private -= 1
            alloc.blocks.append(block)
        self._emit_store(run, Medium.GPU)
        return created

    def release(self, alloc: Allocation) -> None:
        """The request finished: its blocks become evictable, tail first (vLLM's order)."""
        lru = self._lru[Medium.GPU]
        for block in reversed(alloc.blocks):
            block.ref -= 1
            if block.ref == 0 and block.tier is Medium.GPU:
                lru[block.digest] = block
        self._private -= alloc.private
        alloc.blocks = []
        alloc.private = 0

    # --- events -------------------------------------------------------------------------------

    def take_events(self) -> list[Event]:
        events, self._events = self._events, []
        return events

    def _emit_store(self, blocks: list[CachedBlock], tier: Medium) -> None:
        """One self-describing BlockStored per run of consecutive chain blocks."""
        start = 0
        for i in range(1, len(blocks) + 1):
            if i == len(blocks) or blocks[i].parent is not blocks[i - 1]:
                self._store_event(blocks[start:i], tier)
                start = i

    def _store_event(self, run: list[CachedBlock], tier: Medium) -> None:
        if not run:
            return
        tokens: list[int] = []
        for b in run:
            tokens.extend(b.tokens)
        parent = run[0].parent
        self._events.append(
            BlockStored(
                block_hashes=[b.hash for b in run],
                parent_block_hash=None if parent is None else parent.hash,
                token_ids=tokens,
                block_size=self.block_size,
                medium=tier,
                lora_name=run[0].lora_name,  # a chain never mixes adapters (its extra keys)
                # One entry per block, always, as vLLM's block pool and kvroute's connector
                # send them (None for a block without extra keys).
                extra_keys=[b.extra for b in run],
            )
        )

    # --- eviction -----------------------------------------------------------------------------

    def _make_gpu_room(self, n: int) -> None:
        lru = self._lru[Medium.GPU]
        while self.capacity[Medium.GPU] - self._gpu_cached - self._private < n:
            _, victim = lru.popitem(last=False)
            self._move_down(victim)

    def _move_down(self, block: CachedBlock) -> None:
        """Demote an evicted (already unlinked from its LRU) block one tier, or drop it."""
        src = block.tier
        assert src is not None
        dst = _LOWER[src]
        while dst is not None and self.capacity[dst] == 0:
            dst = _LOWER[dst]
        if dst is None:
            self._drop(block)
            return
        if dst is Medium.STORAGE and self.shared is not None:
            self._write_shared(block)
            return
        lru = self._lru[dst]
        while len(lru) >= self.capacity[dst]:
            _, victim = lru.popitem(last=False)
            self._move_down(victim)
            if block.tier is None:
                return  # dropped with an ancestor while making room
        if src is Medium.GPU:
            self._gpu_cached -= 1
        block.tier = dst
        lru[block.digest] = block
        self._store_event([block], dst)
        self._events.append(BlockRemoved(block_hashes=[block.hash], medium=src))

    @staticmethod
    def _stored(block: CachedBlock) -> StoredBlock:
        parent = block.parent
        return StoredBlock(
            digest=block.digest,
            hash=block.hash,
            parent_hash=None if parent is None else parent.hash,
            tokens=block.tokens,
            extra=block.extra,
            lora_name=block.lora_name,
        )

    def _write_shared(self, block: CachedBlock) -> None:
        """Write an evicted block to the domain, then drop it (and its local descendants,
        unreachable locally now) from this replica's tiers."""
        assert self.shared is not None
        if self.shared.put(self._stored(block)):
            self._store_event([block], Medium.STORAGE)
        self._drop(block)

    def write_through(self, blocks: Sequence[CachedBlock]) -> None:
        """``blocks`` (one chain, in order) are computed: write those the domain lacks to it,
        when it is written through, announced as runs of BlockStored(STORAGE); the local
        copies stay. No-op without such a domain."""
        if self.shared is None or not self.shared.write_through:
            return
        run: list[CachedBlock] = []
        for block in blocks:
            if block.tier is not None and self.shared.put(self._stored(block)):
                run.append(block)
                continue
            self._store_event(run, Medium.STORAGE)  # a gap ends the run: runs are chains
            run = []
        self._store_event(run, Medium.STORAGE)

    def _drop(self, block: CachedBlock) -> None:
        """Remove a block that no request uses, and its cached descendants (see module doc)."""
        stack = [block]
        while stack:
            b = stack.pop()
            assert b.ref == 0, "dropping a block in use"
            stack.extend(b.kids)
            b.kids = set()
            tier = b.tier
            assert tier is not None
            self._lru[tier].pop(b.digest, None)
            if tier is Medium.GPU:
                self._gpu_cached -= 1
            del self._blocks[b.digest]
            if b.parent is not None:
                b.parent.kids.discard(b)
            b.tier = None
            self._events.append(BlockRemoved(block_hashes=[b.hash], medium=tier))

    # --- whole-cache operations ---------------------------------------------------------------

    def reset(self, *, every_tier: bool = False) -> bool:
        """vLLM's /reset_prefix_cache: the device tier is dropped and AllBlocksCleared
        published; the lower tiers are kept (vLLM resets offloading only when asked to).
        Refused while requests hold blocks. Lower-tier blocks whose parent was on the device
        go too (the module's invariant), each with its BlockRemoved.

        ``every_tier``: the replica's own CPU and STORAGE blocks go as well, each with its
        BlockRemoved (a shared domain is not the replica's to clear). Benchmarks reset this way
        between runs, so that no run starts on blocks an earlier run's policy left in RAM."""
        if self._private or any(b.ref for b in self._blocks.values()):
            return False
        self._events.append(AllBlocksCleared())
        device = [b for b in self._blocks.values() if b.tier is Medium.GPU]
        for b in device:
            self._lru[Medium.GPU].pop(b.digest, None)
            b.tier = Medium.GPU  # still set: _drop below removes it and its descendants
        for b in device:
            if b.tier is None:
                continue  # dropped with an ancestor already
            # The clear covered the device copies: only lower tiers' removals are announced.
            n_events = len(self._events)
            self._drop(b)
            self._events[n_events:] = [
                e
                for e in self._events[n_events:]
                if not (isinstance(e, BlockRemoved) and e.medium is Medium.GPU)
            ]
        self._gpu_cached = 0
        if every_tier:
            for b in list(self._blocks.values()):
                if b.tier is not None and (b.parent is None or b.parent.tier is None):
                    self._drop(b)  # a chain's first local block takes the rest with it
        return True

    def restart(self) -> list[CachedBlock]:
        """The process died: device and CPU contents are gone, STORAGE survives.

        Pending events die with the process. STORAGE blocks whose parent was not in STORAGE
        are unreachable and go too. Returns the survivors parents-first, for re-announcement.
        """
        self._events = []
        survivors: dict[bytes, CachedBlock] = {}
        for b in self._blocks.values():  # insertion order is parents-first
            if b.tier is Medium.STORAGE and (b.parent is None or b.parent.digest in survivors):
                survivors[b.digest] = b
        for b in self._blocks.values():
            if b.digest not in survivors:
                b.tier = None
        for b in survivors.values():
            b.kids = {k for k in b.kids if k.digest in survivors}
            b.ref = 0
        self._blocks = survivors
        self._lru[Medium.GPU].clear()
        self._lru[Medium.CPU].clear()
        storage = OrderedDict(
            (d, b) for d, b in self._lru[Medium.STORAGE].items() if d in survivors
        )
        self._lru[Medium.STORAGE] = storage
        self._gpu_cached = 0
        self._private = 0
        return list(survivors.values())

    def announce(self, blocks: Sequence[CachedBlock]) -> None:
        """Self-describing stores of existing blocks in their tier (parents first)."""
        for b in blocks:
            assert b.tier is not None
            self._store_event([b], b.tier)

    def iter_blocks(self) -> Iterator[CachedBlock]:
        return iter(self._blocks.values())
