"""RAM tier storage: one preallocated pool of chunk slots (worker side).

A single allocation ``[num_slots, num_layers, blocks_per_chunk, *block_shape]`` avoids
allocator churn and lets CUDA use pinned memory for fast host<->device copies. The slot
numbers are assigned by the scheduler-side planner; the pool also remembers which key
each slot holds so that a load from a slot that does not hold the expected chunk fails
(and is recomputed) instead of serving wrong KV.
"""

from __future__ import annotations

import torch


class CpuPool:
    def __init__(
        self,
        num_slots: int,
        chunk_shape: tuple[int, ...],
        dtype: torch.dtype,
        *,
        pin_memory: bool = False,
        prefault: bool = True,
    ) -> None:
        self.num_slots = num_slots
        self.chunk_shape = tuple(chunk_shape)
        self.dtype = dtype
        shape = (max(num_slots, 1), *chunk_shape)
        self.buffer = torch.empty(shape, dtype=dtype, pin_memory=pin_memory)
        if prefault and not pin_memory:
            # Touch every page now: first-touch page faults make a fresh pool copy at a
            # fraction of memcpy speed, which would land on the serving path.
            self.buffer.view(-1).view(torch.uint8)[::4096].zero_()
        self._keys: list[bytes | None] = [None] * num_slots

    def slot(self, i: int) -> torch.Tensor:
        return self.buffer[i]

    def key_of(self, i: int) -> bytes | None:
        return self._keys[i] if 0 <= i < self.num_slots else None

    def mark(self, i: int, key: bytes | None) -> None:
        self._keys[i] = key

    @property
    def chunk_bytes(self) -> int:
        return self.buffer[0].numel() * self.buffer.element_size()


def num_slots_for(cpu_bytes: int, chunk_bytes: int) -> int:
    return max(0, cpu_bytes // chunk_bytes) if chunk_bytes > 0 else 0
