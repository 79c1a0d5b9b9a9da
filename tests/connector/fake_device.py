"""A fake CUDA: streams and events that only log what was asked of them.

``AsyncCopier`` talks to the device through a small backend; this one runs its copies
immediately on CPU tensors, but its events complete only when the test says so, and
every ``record``/``wait_event``/``wait_stream`` lands in one log. That lets the tests
check the asynchronous bookkeeping (when a store may be reported, who waits for what)
on a machine without a GPU.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch


class FakeEvent:
    def __init__(self, backend: FakeBackend, n: int) -> None:
        self.backend = backend
        self.name = f"ev{n}"
        self.done = False
        self.stream: FakeStream | None = None
        self.synchronized = False

    def record(self, stream: Any = None) -> None:
        self.stream = stream
        self.backend.log.append(("record", stream.name, self.name))

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.synchronized = True
        self.done = True

    def __repr__(self) -> str:
        return self.name


class FakeStream:
    def __init__(self, backend: FakeBackend, name: str) -> None:
        self.backend = backend
        self.name = name

    def wait_event(self, event: FakeEvent) -> None:
        self.backend.log.append(("wait_event", self.name, event.name))

    def wait_stream(self, stream: FakeStream) -> None:
        self.backend.log.append(("wait_stream", self.name, stream.name))


class FakeBackend:
    """``DeviceBackend`` whose 'device' is the CPU."""

    def __init__(self) -> None:
        self.log: list[tuple[str, str, str]] = []
        self.events: list[FakeEvent] = []
        self.compute = FakeStream(self, "compute")
        self._streams = 0

    def new_stream(self) -> FakeStream:
        self._streams += 1
        return FakeStream(self, f"copy{self._streams}")

    def new_event(self) -> FakeEvent:
        ev = FakeEvent(self, len(self.events))
        self.events.append(ev)
        return ev

    def current_stream(self) -> FakeStream:
        return self.compute

    @contextmanager
    def use(self, stream: FakeStream) -> Iterator[None]:
        self.log.append(("use", stream.name, ""))
        yield

    def index(self, ids: Sequence[int]) -> torch.Tensor:
        return torch.tensor(list(ids), dtype=torch.long)

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)

    def complete_all(self) -> None:
        for ev in self.events:
            ev.done = True

    def waits_of(self, stream: str) -> list[str]:
        return [e for kind, s, e in self.log if kind == "wait_event" and s == stream]
