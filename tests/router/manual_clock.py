"""A clock the test moves by hand, for the router's time-decayed estimates."""

from __future__ import annotations


class ManualClock:
    def __init__(self, start: float = 100.0) -> None:
        self.t = start

    def __call__(self) -> float:
        return self.t
