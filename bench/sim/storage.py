"""A shared STORAGE tier: one directory of KV chunks that several simulated replicas mount.

Real deployments put the offloading connector's disk tier on a shared file system, so a chunk
one replica wrote is a load (not a recompute) for every replica of the same domain, including
one that was just added or restarted. This class is that directory, as state:

- a capacity in blocks and an LRU over them (a read or a write refreshes a block), evicted by
  the domain's own evictor, not by the replicas (``kvroute storage gc`` in a deployment);
- blocks are independent files: a lookup walks a request's chain and stops at the first
  missing block, and evicting a block leaves its descendants in place (unreachable until they
  age out too), as deleting one file does;
- every eviction is announced as ``BlockRemoved(medium=STORAGE)`` on the domain's own event
  stream (PUB + replay, the fleet's ``EventPublisher``), never on a replica's: the replicas
  announce what they write, the evictor what it deletes.

Writes come from the replicas' caches (bench/sim/cache.py): a block evicted from a replica's
CPU tier (device tier when it has no CPU tier) is written here unless already present, and
with ``writes="through"`` (the default, as kvroute's connector's default disk policy,
``write_through``) every block is also written as soon as its prefill is done, so another
replica can load a prefix while its first replica still holds it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import takewhile
from typing import TYPE_CHECKING, Any, TypeVar

from kvroute.indexer.wire import BlockRemoved, BlockStored, Event, Medium

if TYPE_CHECKING:
    from kvroute.bench.publisher import EventPublisher

__all__ = ["WRITE_POLICIES", "SharedStorageDomain", "StoredBlock", "leading_run"]

WRITE_POLICIES = ("through", "demotion")

T = TypeVar("T")


def leading_run(blocks: Mapping[bytes, T], digests: Sequence[bytes]) -> list[T]:
    """The blocks of the longest leading run of ``digests`` (a request's chain) in ``blocks``:
    a prefix lookup, in a replica's cache or in the domain."""
    return list(takewhile(lambda block: block is not None, map(blocks.get, digests)))


@dataclass(frozen=True, slots=True)
class StoredBlock:
    """One chunk file: enough to re-announce it self-describingly (tokens, parent, keys)."""

    digest: bytes
    hash: int
    parent_hash: int | None
    tokens: tuple[int, ...]
    extra: tuple[Any, ...] | None
    lora_name: str | None


class SharedStorageDomain:
    """The domain's contents and evictor. Runs on the fleet's loop; no I/O but ``flush``."""

    def __init__(self, name: str, capacity_blocks: int, *, writes: str = "through") -> None:
        if capacity_blocks <= 0:
            raise ValueError("a shared storage domain needs capacity_blocks > 0")
        if writes not in WRITE_POLICIES:
            raise ValueError(f"writes must be one of {WRITE_POLICIES}, got {writes!r}")
        self.name = name
        self.capacity = capacity_blocks
        # "through": replicas write each block once computed; "demotion": only blocks that
        # leave their last local tier.
        self.write_through = writes == "through"
        self._blocks: OrderedDict[bytes, StoredBlock] = OrderedDict()
        # Evicted, not announced yet: announced at the next ``flush`` unless written again.
        self._removed: list[StoredBlock] = []
        # The evictor's stream; set by the fleet once its sockets are bound.
        self.publisher: EventPublisher | None = None
        self.writes = 0
        self.reads = 0
        self.evictions = 0
        # Blocks announced as removed, and evictions not announced: a replica wrote the block
        # again before the announcement (``kvroute storage gc`` checks the same), or it was
        # evicted twice.
        self.removals_announced = 0
        self.rewritten = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, digest: bytes) -> bool:
        return digest in self._blocks

    def __iter__(self) -> Iterator[StoredBlock]:
        return iter(list(self._blocks.values()))

    def hashes(self) -> set[int]:
        return {b.hash for b in self._blocks.values()}

    def run(self, digests: Sequence[bytes]) -> list[StoredBlock]:
        """The longest leading run of ``digests`` present (a lookup: nothing refreshed)."""
        return leading_run(self._blocks, digests)

    def read(self, blocks: Sequence[StoredBlock]) -> None:
        """A replica loads ``blocks``: they become the most recently used."""
        for b in blocks:
            if b.digest in self._blocks:
                self._blocks.move_to_end(b.digest)
        self.reads += len(blocks)

    def put(self, block: StoredBlock) -> bool:
        """Write a block; False when it was already there (refreshed, nothing written)."""
        if block.digest in self._blocks:
            self._blocks.move_to_end(block.digest)
            return False
        while len(self._blocks) >= self.capacity:
            _, victim = self._blocks.popitem(last=False)
            self._removed.append(victim)
            self.evictions += 1
        self._blocks[block.digest] = block
        self.writes += 1
        return True

    def clear(self) -> int:
        """Delete every block (each announced as removed); returns how many."""
        n = len(self._blocks)
        self._removed.extend(self._blocks.values())
        self._blocks.clear()
        self.evictions += n
        return n

    def announcement(self, block_size: int) -> list[Event]:
        """Self-describing BlockStored(STORAGE) for the domain's blocks, what the evictor
        publishes as its stream's first batch (seq 0, after which a router rebuilds the
        domain from it). Parents first, and only chains that start at a root inside the
        domain: a block whose parent is gone is unreachable, and a subscriber could not key
        it. Replicas never re-announce the domain (the connector's shared mode does not)."""
        by_parent: dict[int | None, list[StoredBlock]] = {}
        for s in self._blocks.values():
            by_parent.setdefault(s.parent_hash, []).append(s)
        order: list[StoredBlock] = []
        stack = list(reversed(by_parent.get(None, [])))
        while stack:
            s = stack.pop()
            order.append(s)
            stack.extend(reversed(by_parent.get(s.hash, [])))
        return [
            BlockStored(
                block_hashes=[s.hash],
                parent_block_hash=s.parent_hash,
                token_ids=list(s.tokens),
                block_size=block_size,
                medium=Medium.STORAGE,
                lora_name=s.lora_name,
                extra_keys=[s.extra],
            )
            for s in order
        ]

    def take_events(self) -> list[Event]:
        """The evictor's pending removals as one event (empty when there are none). A block
        written again since its eviction is not announced: the writer may have announced
        its store already, and a removal arriving after it would take the block out of a
        router's index while the domain holds it."""
        pending, self._removed = self._removed, []
        # (a block evicted, written again and evicted again is announced once)
        removed = list(dict.fromkeys(b.hash for b in pending if b.digest not in self._blocks))
        self.rewritten += len(pending) - len(removed)
        self.removals_announced += len(removed)
        if not removed:
            return []
        return [BlockRemoved(block_hashes=removed, medium=Medium.STORAGE)]

    def flush(self) -> None:
        """Publish pending removals on the evictor's stream. Called right after a replica
        publishes a batch, so a write's BlockStored leaves before the removal it caused."""
        events = self.take_events()
        if events and self.publisher is not None:
            self.publisher.publish(events)
