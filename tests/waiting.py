"""Polling for a condition in tests that drive real sockets and threads (no fixed sleeps)."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(
    predicate: Callable[[], object], timeout_s: float = 10.0, interval_s: float = 0.02
) -> None:
    """Return once ``predicate()`` is true; fail the test after ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    while True:
        if predicate():
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout_s}s")
        time.sleep(interval_s)
