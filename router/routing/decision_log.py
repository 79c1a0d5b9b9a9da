"""``DecisionLog``: the last routing decisions this router sent, for the dashboard.

Recorded on the request path (``Router.commit``), so recording must cost next to nothing: one
small tuple holding a reference to the ``Decision`` the request already built, appended to a
bounded deque. Nothing is copied or formatted until someone asks (``to_list``, read by
``GET /dashboard/data`` every few seconds), and the ring's bound keeps the decisions it pins
(their views and keys) to a few dozen.
"""

from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvroute.router.routing.router import Decision

__all__ = ["DecisionLog"]

# Candidates shown per decision: the ranked head (the chosen one and its runners-up).
_MAX_CANDIDATES = 8


class DecisionLog:
    def __init__(self, size: int = 50) -> None:
        self._ring: deque[tuple[float, Decision, str]] = deque(maxlen=max(1, size))
        self.recorded = 0  # decisions ever recorded (a retry on the next replica counts again)

    def __len__(self) -> int:
        return len(self._ring)

    def record(self, decision: Decision, replica: str) -> None:
        """``decision`` was sent to ``replica`` (its first choice, or the next one on retry)."""
        self._ring.append((time.time(), decision, replica))
        self.recorded += 1

    def to_list(self, limit: int | None = None) -> list[dict[str, Any]]:
        """The recorded decisions, newest first, as plain data."""
        entries = list(self._ring)[::-1]
        if limit is not None:
            entries = entries[:limit]
        return [_entry(at, d, replica) for at, d, replica in entries]


def _entry(at: float, d: Decision, replica: str) -> dict[str, Any]:
    views = d.views[:_MAX_CANDIDATES]
    delivered = d.delivered_cached_tokens if d.delivered_by == replica else None
    chosen = d.view(replica)
    return {
        "at": round(at, 3),
        "policy": d.policy,
        "reason": d.reason,
        "chosen": replica,
        "first_choice": d.ranked[0].name if d.ranked else None,
        "home": d.home,
        "prompt_tokens": d.prompt_tokens,
        "predicted_cached_tokens": None if chosen is None else chosen.predicted_cached_tokens,
        "delivered_cached_tokens": delivered,
        "candidates": [
            {
                "name": v.name,
                "predicted_cached_tokens": v.predicted_cached_tokens,
                "tokens_by_tier": dict(v.tokens_by_tier),
                # the prefix this router sent the replica moments ago: on its device by now,
                # whatever tier the index, its events still in flight, puts it in
                "hint_tokens": v.hint_tokens,
                "est_ttft_s": None if v.est_ttft_s is None else round(v.est_ttft_s, 6),
                "pending": v.pending,
                "freshness": v.freshness,
            }
            for v in views
        ],
        "more_candidates": max(0, len(d.views) - len(views)),
    }
