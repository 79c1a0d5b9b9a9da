"""Reading delivered cached tokens from responses, and the predicted-vs-delivered totals."""

from __future__ import annotations

import json

import httpx

from kvroute.router.routing.accuracy import (
    AccuracyTracker,
    cached_tokens_from_body,
    cached_tokens_from_sse,
)
from tests.router.sim_fleet import make_fleet


def _usage(cached: object) -> dict:
    return {"usage": {"prompt_tokens": 100, "prompt_tokens_details": {"cached_tokens": cached}}}


def test_cached_tokens_from_bodies_and_streams() -> None:
    assert cached_tokens_from_body(json.dumps(_usage(48)).encode()) == 48
    assert cached_tokens_from_body(json.dumps(_usage(None)).encode()) is None
    assert cached_tokens_from_body(b'{"usage": {"prompt_tokens_details": null}}') is None
    assert cached_tokens_from_body(b"not json cached_tokens") is None
    stream = (
        b'data: {"choices": [{"text": "a"}]}\n\n'
        + b"data: "
        + json.dumps({"choices": [], **_usage(32)}).encode()
        + b"\n\n"
        + b"data: [DONE]\n\n"
    )
    assert cached_tokens_from_sse(stream) == 32
    assert cached_tokens_from_sse(b'data: {"choices": []}\n\ndata: [DONE]\n\n') is None


def test_tracker_counts_unreported_apart() -> None:
    t = AccuracyTracker()
    t.record("a", 100, 64, 64)
    t.record("a", 100, 64, 32)  # over-predicted
    t.record("b", 50, 0, None)  # not reported: not a miss
    fleet = t.to_dict()["fleet"]
    assert fleet["requests"] == 3 and fleet["reported_requests"] == 2
    assert fleet["predicted_cached_tokens"] == 128 and fleet["delivered_cached_tokens"] == 96
    assert fleet["over_predicted"] == 1 and fleet["delivered_over_predicted"] == 0.75
    assert t.replica("b")["reported_requests"] == 0


def test_streamed_usage_is_recorded(local_tokenizer) -> None:
    with make_fleet(local_tokenizer, n=1, hint_ttl_s=0.0) as fleet:
        body = {
            "model": "tiny",
            "prompt": "repeat after me " * 30,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        for _ in range(2):
            httpx.post(f"{fleet.url}/v1/completions", json=body, timeout=10).raise_for_status()
        acc = fleet.stats()["replicas"]["r0"]["accuracy"]
        assert acc["reported_requests"] == 2
        assert acc["delivered_cached_tokens"] > 0  # the second pass hit the fake's cache
