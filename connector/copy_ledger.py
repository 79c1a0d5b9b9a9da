"""Bookkeeping of asynchronous copies: what is still in flight, and what may happen next.

On CUDA, copies between the paged KV cache and the RAM pool run on their own streams
and the host does not wait for them. Three rules keep that correct, and they live here,
apart from any CUDA call, so they are tested on CPU with fake events:

* a store (device -> RAM slot) is reported STORED only once its completion event has
  completed (``StoreLedger``): the planner serves and announces only landed chunks,
  and a write-through disk write reads the slot only then;
* a copy INTO a slot first waits (on the device, ``stream.wait_event``) for copies
  still reading or writing that slot, and a copy FROM a slot waits for the copy still
  writing it (``SlotFences``): a slot the planner freed may be reused at once;
* nothing here blocks the host except ``take_completed(wait=True)`` (shutdown, tests).

A ``Fence`` is anything with ``query()`` and ``synchronize()``: a ``torch.cuda.Event``,
``DONE`` for copies that are complete when issued (the CPU platform), or a test fake.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Protocol


class Fence(Protocol):
    """Completion marker of device work (``torch.cuda.Event`` has this interface)."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class _Done:
    """The fence of a copy that completed before it was returned (synchronous path)."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def __repr__(self) -> str:
        return "DONE"


DONE: Fence = _Done()


@dataclass
class PendingStore:
    """A chunk copied (or being copied) into RAM slot ``slot``; ``disk_header`` is set
    when it must also be written to disk (from the slot) once it landed."""

    key: bytes
    slot: int
    fence: Fence
    disk_header: dict | None = None


class StoreLedger:
    """Stores in issue order; released (to be reported) once their fence completed.

    Stores run on one copy stream, so they complete in issue order: releasing the
    oldest ones up to the first incomplete one loses nothing and queries few events.
    """

    def __init__(self) -> None:
        self._pending: deque[PendingStore] = deque()

    def add(self, store: PendingStore) -> None:
        self._pending.append(store)

    def take_completed(self, *, wait: bool = False) -> list[PendingStore]:
        """Stores whose copy completed, oldest first. ``wait`` blocks the host until
        all completed (never on the forward path)."""
        out: list[PendingStore] = []
        while self._pending:
            head = self._pending[0]
            if not head.fence.query():
                if not wait:
                    break
                head.fence.synchronize()
            out.append(self._pending.popleft())
        return out

    def __len__(self) -> int:
        return len(self._pending)


class SlotFences:
    """Last device write and last device read of each RAM slot still in flight."""

    def __init__(self) -> None:
        self._writes: dict[int, Fence] = {}
        self._reads: dict[int, Fence] = {}

    @staticmethod
    def _live(table: dict[int, Fence], slot: int) -> Fence | None:
        f = table.get(slot)
        if f is not None and f.query():
            del table[slot]  # completed: forget it, nothing needs to wait
            return None
        return f

    def before_write(self, slot: int) -> list[Fence]:
        """Fences a copy into ``slot`` must wait for (readers and the last writer)."""
        return [f for f in (self._live(self._reads, slot), self._live(self._writes, slot)) if f]

    def before_read(self, slot: int) -> list[Fence]:
        """Fences a copy from ``slot`` must wait for (the copy still filling it)."""
        f = self._live(self._writes, slot)
        return [f] if f is not None else []

    def wrote(self, slot: int, fence: Fence) -> None:
        self._writes[slot] = fence

    def read(self, slot: int, fence: Fence) -> None:
        # Reads are issued in order on one stream: the newest covers the older ones.
        self._reads[slot] = fence

    def pending(self) -> int:
        """Slots with a copy possibly still in flight (tests, diagnostics)."""
        return len(set(self._writes) | set(self._reads))
