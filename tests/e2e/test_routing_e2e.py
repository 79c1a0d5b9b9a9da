"""Routing decisions against what the real replicas then report.

The router's prediction (``/debug/route``: chosen replica and predicted cached tokens) is
checked against the replica's own counters (``vllm:prefix_cache_hits_total`` for the device,
``vllm:external_prefix_cache_hits_total`` for our connector's tiers) and the response's
``usage.prompt_tokens_details.cached_tokens``. Which replica served a request is read from the
replicas' finished-request counters: black-box, nothing trusted from the router.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvroute.deploy.local_fleet import LocalFleet
from kvroute.router.fleet.replicas import parse_vllm_metrics
from tests.e2e.conftest import BLOCK_SIZE, GPU_BLOCKS
from tests.e2e.helpers import chat, counters, debug_route, delta, wait_for, words

pytestmark = pytest.mark.vllm

HITS = "vllm:prefix_cache_hits_total"
EXTERNAL = "vllm:external_prefix_cache_hits_total"


def route(fleet: LocalFleet, messages: list[dict[str, str]]) -> dict[str, Any]:
    return debug_route(fleet, {"model": fleet.served_model_name, "messages": messages})


def test_next_turn_goes_to_the_replica_holding_the_conversation(fleet: LocalFleet) -> None:
    system = "You are the routing test assistant. " + words(300, "route-system")
    messages = [
        {"role": "system", "content": system},
        {"role": "user", "content": "First question: " + words(60, "route-q1")},
    ]
    reply, usage1, first = chat(fleet, messages)

    messages += [
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "Second question: " + words(60, "route-q2")},
    ]
    decision = route(fleet, messages)
    assert decision["chosen"] == first, decision
    view = next(v for v in decision["replicas"] if v["name"] == first)
    predicted = view["predicted_cached_tokens"]
    # Everything the first turn's prompt filled (whole blocks) is reusable.
    assert predicted >= (usage1["prompt_tokens"] // BLOCK_SIZE - 1) * BLOCK_SIZE, view

    before = counters(fleet)
    _, usage2, second = chat(fleet, messages)
    after = counters(fleet)
    assert second == first
    delivered = delta(before, after, first, HITS) + delta(before, after, first, EXTERNAL)
    assert abs(delivered - predicted) <= BLOCK_SIZE, (predicted, delivered)
    cached = usage2["prompt_tokens_details"]["cached_tokens"]
    assert abs(cached - predicted) <= BLOCK_SIZE, (predicted, cached)


def test_prefix_evicted_from_the_device_is_found_in_the_cpu_tier(fleet: LocalFleet) -> None:
    system = "You are the eviction test assistant. " + words(280, "evict-system")
    messages = [
        {"role": "system", "content": system},
        {"role": "user", "content": "Tell me about tiers. " + words(40, "evict-q1")},
    ]
    reply, usage1, holder = chat(fleet, messages)
    messages += [
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "And then? " + words(40, "evict-q2")},
    ]
    assert usage1["prompt_tokens"] > 8 * BLOCK_SIZE

    # Fill the holder's device cache (64 usable blocks) with other prompts, straight to it.
    rep = fleet.replica(holder)
    for i in range(3):
        flood = f"Flood {i}: " + words(620, f"evict-flood-{i}")
        rep.post(
            "/v1/completions",
            {"model": fleet.served_model_name, "prompt": flood, "max_tokens": 1},
        )

    def evicted() -> dict[str, Any] | None:
        view = next(v for v in route(fleet, messages)["replicas"] if v["name"] == holder)
        by_tier = view["tokens_by_tier"]
        return view if by_tier.get("GPU", 0) == 0 and by_tier.get("CPU", 0) > 0 else None

    view = wait_for("the conversation's prefix to leave the device tier", evicted, 20)
    decision = route(fleet, messages)
    assert decision["chosen"] == holder, decision
    predicted = view["predicted_cached_tokens"]
    assert predicted >= GPU_BLOCKS // 8 * BLOCK_SIZE, view

    before = counters(fleet)
    page_before = parse_vllm_metrics(rep.get("/metrics").decode())
    _, usage2, served = chat(fleet, messages)
    after = counters(fleet)
    page_after = parse_vllm_metrics(rep.get("/metrics").decode())
    assert served == holder
    # What the router's calibration reads from the same page (router/fleet/replicas.py,
    # router/routing/prefill_evidence.py): the tokens the connector loaded from RAM, by
    # source; the prefill's time, counted once; and the tokens it computed.
    moved = {k: page_after.get(k, 0.0) - page_before.get(k, 0.0) for k in page_after}
    loaded_by_source = moved["host_tokens"] + moved["disk_tokens"]
    assert moved["host_tokens"] > 0 and loaded_by_source == delta(before, after, holder, EXTERNAL)
    assert moved["prefills"] == 1 and moved["prefill_s"] > 0, moved
    prompt = usage2["prompt_tokens"]
    assert moved["computed_tokens"] == prompt - usage2["prompt_tokens_details"]["cached_tokens"]
    loaded = delta(before, after, holder, EXTERNAL)  # loaded by our connector, not the device
    assert loaded > 0
    assert abs(loaded + delta(before, after, holder, HITS) - predicted) <= BLOCK_SIZE, (
        predicted,
        loaded,
    )
    assert abs(usage2["prompt_tokens_details"]["cached_tokens"] - predicted) <= BLOCK_SIZE
