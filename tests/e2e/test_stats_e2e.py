"""``/index/stats`` shows predicted next to delivered cached tokens, per replica and fleet."""

from __future__ import annotations

import pytest

from kvroute.deploy.local_fleet import LocalFleet
from tests.e2e.conftest import BLOCK_SIZE
from tests.e2e.helpers import chat, router_stats, wait_for, words

pytestmark = pytest.mark.vllm


def test_predicted_and_delivered_cached_tokens_in_stats(fleet: LocalFleet) -> None:
    before = router_stats(fleet)["fleet"]
    messages = [
        {"role": "system", "content": "Stats test. " + words(200, "stats-system")},
        {"role": "user", "content": words(30, "stats-q1")},
    ]
    reply, _, _ = chat(fleet, messages)
    messages += [
        {"role": "assistant", "content": reply},
        {"role": "user", "content": words(30, "stats-q2")},
    ]
    _, usage, replica = chat(fleet, messages)
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0

    def moved() -> dict | None:
        fleet_now = router_stats(fleet)["fleet"]
        grew = fleet_now["delivered_cached_tokens"] - before["delivered_cached_tokens"]
        return fleet_now if grew >= cached else None

    after = wait_for("delivered cached tokens to reach /index/stats", moved, 10)
    predicted_gain = after["predicted_cached_tokens"] - before["predicted_cached_tokens"]
    delivered_gain = after["delivered_cached_tokens"] - before["delivered_cached_tokens"]
    assert delivered_gain == cached
    assert abs(predicted_gain - delivered_gain) <= BLOCK_SIZE, (predicted_gain, delivered_gain)

    entry = router_stats(fleet)["replicas"][replica]
    assert entry["delivered_cached_tokens"] >= cached
    assert entry["predicted_cached_tokens"] > 0
    assert entry["freshness"] == "live", entry
    assert isinstance(entry["accuracy"], dict)
