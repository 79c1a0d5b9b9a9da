"""KV events from real vLLM replicas reach the router's index, in every tier."""

from __future__ import annotations

import pytest

from kvroute.deploy.local_fleet import LocalFleet
from tests.e2e.conftest import BLOCK_SIZE, CHUNK_TOKENS
from tests.e2e.helpers import debug_route, tiers, wait_for, words

pytestmark = pytest.mark.vllm

TIERS = ("GPU", "CPU", "STORAGE")


def test_events_from_every_replica_reach_the_index_in_all_three_tiers(fleet: LocalFleet) -> None:
    prompts = {}
    for rep in fleet.replicas:
        name = rep.spec.name
        prompts[name] = f"Tier probe for {name}: " + words(260, f"tiers-{name}")
        # Straight to the replica: this test is about its event stream, not about routing.
        out = rep.post(
            "/v1/completions",
            {"model": fleet.served_model_name, "prompt": prompts[name], "max_tokens": 2},
        )
        assert out["usage"]["prompt_tokens"] > 3 * CHUNK_TOKENS

    for rep in fleet.replicas:
        name = rep.spec.name
        found = wait_for(
            f"{name}'s GPU, CPU and STORAGE entries in /index/stats",
            lambda name=name: (
                (t := tiers(fleet, name)) and all(t.get(k, 0) > 0 for k in TIERS) and t
            ),
        )
        assert set(TIERS) <= set(found)

    # The index knows *which* prefix each replica holds: a lookup of each probe prompt
    # matches only on the replica that computed it. (Lookups served from the CPU and
    # STORAGE tiers are covered by the eviction and restart tests.)
    for name, prompt in prompts.items():
        decision = debug_route(fleet, {"model": fleet.served_model_name, "prompt": prompt})
        views = {v["name"]: v for v in decision["replicas"]}
        mine = views[name]
        full_blocks = (decision["prompt_tokens"] - 1) // BLOCK_SIZE * BLOCK_SIZE
        assert mine["match_tokens"] == full_blocks, mine
        # /debug/route counts each block in its fastest tier: freshly computed, all on device.
        assert mine["tokens_by_tier"] == {"GPU": full_blocks}, mine
        others = [v for n, v in views.items() if n != name]
        assert all(v["match_tokens"] == 0 for v in others), others
        assert decision["chosen"] == name
