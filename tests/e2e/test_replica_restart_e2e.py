"""A replica crashes and comes back: traffic continues, the index forgets it, then rebuilds it.

The crash is a SIGKILL of the replica's whole process group (API server, engine core and
worker), so nothing is flushed or announced: the router must notice by itself. The restarted
process numbers its event batches from 0 again; the router's feed must take that as a reset
(not as duplicates) and rebuild the replica's entries, including the disk tier the replica
kept across the restart (our connector re-announces the chunk files it finds at start).
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from openai import OpenAI

from kvroute.deploy.local_fleet import LocalFleet
from tests.e2e.conftest import BLOCK_SIZE, CHUNK_TOKENS
from tests.e2e.helpers import (
    counters,
    debug_route,
    delta,
    router_stats,
    served_by,
    tiers,
    wait_for,
    words,
)

pytestmark = pytest.mark.vllm

VICTIM = "replica-1"


def view_of(fleet: LocalFleet, prompt: str) -> dict[str, Any]:
    decision = debug_route(fleet, {"model": fleet.served_model_name, "prompt": prompt})
    return next(v for v in decision["replicas"] if v["name"] == VICTIM)


def storage_match(fleet: LocalFleet, prompt: str) -> int:
    """Tokens of ``prompt`` whose fastest copy on the victim is on its disk."""
    return int(view_of(fleet, prompt)["tokens_by_tier"].get("STORAGE", 0))


def test_killed_replica_then_restarted_with_its_disk_tier(fleet: LocalFleet) -> None:
    model = fleet.served_model_name
    victim = fleet.replica(VICTIM)
    prompt = "Restart probe: " + words(400, "restart-prefix")
    storage_before = tiers(fleet, VICTIM).get("STORAGE", 0)
    victim.post("/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 1})
    # The reply can reach us before the engine's event batch reaches the router: wait for it.
    matched = wait_for(
        "the probe's blocks in the index",
        lambda: (m := view_of(fleet, prompt)["match_tokens"]) > 4 * CHUNK_TOKENS and m,
        20,
    )  # all on device for now
    # Our connector writes every full chunk through to disk: wait until those events landed.
    wanted = storage_before + (matched // CHUNK_TOKENS - 1) * (CHUNK_TOKENS // BLOCK_SIZE)
    # A disk write finishes after its request did, and the worker reports it with the
    # engine's next step: an idle replica announces it with its next request, so nudge it.
    nudges = iter(range(1000))

    def on_disk() -> bool:
        if tiers(fleet, VICTIM).get("STORAGE", 0) >= wanted:
            return True
        body = {"model": model, "prompt": f"nudge {next(nudges)}", "max_tokens": 1}
        victim.post("/v1/completions", body)
        return False

    wait_for("the probe's chunks in the victim's STORAGE tier", on_disk, 20)
    resets_before = router_stats(fleet)["fleet"]["resets"]

    fleet.kill_replica(VICTIM)
    try:
        _while_down_and_back(fleet, prompt, matched, resets_before)
    finally:
        if not victim.is_running():  # leave the shared fleet whole for the other tests
            fleet.restart_replica(VICTIM)


def _while_down_and_back(fleet: LocalFleet, prompt: str, matched: int, resets_before: int) -> None:
    model = fleet.served_model_name
    victim = fleet.replica(VICTIM)

    # Every request still succeeds: the router retries a refused connection on the survivor
    # and its health checks eject the dead replica.
    client = OpenAI(base_url=fleet.router_url + "/v1", api_key="x", max_retries=0, timeout=60)
    for i in range(6):
        out = client.completions.create(
            model=model, prompt=f"While one is down {i}: " + words(30, f"down-{i}"), max_tokens=2
        )
        assert out.choices[0].text is not None

    def forgotten() -> dict[str, Any] | None:
        entry = router_stats(fleet)["replicas"][VICTIM]
        gone = entry["entries"] == 0 and not entry["health"]["healthy"]
        return entry if gone else None

    # The router keeps a silent publisher's entries for 30 s (a short blip must not wipe the
    # index), then drops them.
    entry = wait_for("the dead replica's entries to leave the index", forgotten, 50)
    assert entry["freshness"] == "stale", entry
    decision = debug_route(fleet, {"model": model, "prompt": prompt})
    assert VICTIM not in decision["ranked"]  # no longer a candidate at all
    assert all(v["match_tokens"] == 0 for v in decision["replicas"]), decision

    fleet.restart_replica(VICTIM)
    wait_for(
        "the router to see the restarted replica healthy",
        lambda: router_stats(fleet)["replicas"][VICTIM]["health"]["healthy"],
        30,
    )
    # vLLM publishes (and our connector re-announces its disk files) on the first engine
    # step after start: one unrelated request makes it step.
    victim.post("/v1/completions", {"model": model, "prompt": "wake up", "max_tokens": 1})

    def rebuilt() -> dict[str, Any] | None:
        stats = router_stats(fleet)
        t = stats["replicas"][VICTIM].get("entries_by_tier") or {}
        return stats if t.get("STORAGE", 0) > 0 and storage_match(fleet, prompt) > 0 else None

    stats = wait_for("the restarted replica's disk tier back in the index", rebuilt, 30)
    assert stats["fleet"]["resets"] > resets_before  # seq 0 again was seen as a restart
    assert stats["replicas"][VICTIM]["freshness"] == "live"
    # The very chunks it wrote before the crash, now its only copy: every full chunk.
    restored = storage_match(fleet, prompt)
    assert matched - CHUNK_TOKENS < restored <= matched, (matched, restored)
    assert tiers(fleet, VICTIM).get("STORAGE", 0) > 0

    # The router sends the probe back to the restarted replica, which loads it from disk.
    decision = debug_route(fleet, {"model": model, "prompt": prompt})
    assert decision["chosen"] == VICTIM, decision
    before = counters(fleet)
    resp = httpx.post(
        fleet.router_url + "/v1/completions",
        json={"model": model, "prompt": prompt, "max_tokens": 1},
        timeout=120,
    )
    assert resp.status_code == 200, resp.text
    after = wait_for("counters", lambda: (c := counters(fleet)) and _moved(before, c) and c, 10)
    assert served_by(before, after) == VICTIM
    loaded = delta(before, after, VICTIM, "vllm:external_prefix_cache_hits_total")
    assert abs(loaded - restored) <= BLOCK_SIZE, (restored, loaded)


def _moved(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> bool:
    try:
        served_by(before, after)
    except AssertionError:
        return False
    return True
