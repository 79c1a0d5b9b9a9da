"""``/index/stats`` shows predicted next to delivered cached tokens, per replica and fleet."""

from __future__ import annotations

import re

import httpx
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


def test_the_router_reads_each_replicas_device_cache_size_from_vllm(fleet: LocalFleet) -> None:
    """vLLM's ``vllm:cache_config_info`` gauge names its device cache's size in blocks
    (``num_gpu_blocks``); the router reads it with the load gauges (router/fleet/replicas.py)
    and counts the wait for room against it (router/routing/kv_room.py). Compared with the
    label as each vLLM page has it, read here with a regex of its own."""
    info = re.compile(r'vllm:cache_config_info\{[^}]*num_gpu_blocks="(\d+)"')
    for replica in fleet.replicas:
        page = httpx.get(replica.url + "/metrics", timeout=30).text
        sizes = {int(n) for n in info.findall(page)}
        assert len(sizes) == 1 and min(sizes) > 0, sizes
        name, size = replica.spec.name, sizes.pop()

        def read(name: str = name, size: int = size) -> dict | None:
            load = router_stats(fleet)["replicas"][name]["load"]
            return load if load["kv_cache_blocks"] == size else None

        load = wait_for("the router to read the device cache's size", read, 15)
        assert load["kv_room"] is not None and load["kv_room"]["held_blocks"] >= 0
