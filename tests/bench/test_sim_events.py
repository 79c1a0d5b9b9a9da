"""The simulator's KV events over real ZMQ, through the indexer's own subscriber.

An ``InMemoryPrefixIndex`` fed by ``kvroute.indexer.subscriber.EventSubscriber`` from a simulated
replica's PUB/replay sockets must hold exactly what the replica's cache holds, tier by tier,
also after dropped batches (recovered through replay) and after a restart (seq reset). The
replica's engine hashes are vLLM-like sha256 chains, so agreement proves the index re-keys
blocks from token ids rather than trusting engine hashes.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest

from kvroute.bench.sim.fleet import SimFleet
from kvroute.bench.sim.hashing import EngineHasher, digest_to_int
from kvroute.indexer.index import InMemoryPrefixIndex
from kvroute.indexer.subscriber import EventSource, EventSubscriber, Freshness
from kvroute.indexer.wire import Medium

REPLICA = "sim-1"
BS = 16


@pytest.fixture(scope="module")
def mirror(sim_fleet: SimFleet) -> Iterator[InMemoryPrefixIndex]:
    index = InMemoryPrefixIndex()
    r = next(r for r in sim_fleet.replicas if r.name == REPLICA)
    with EventSubscriber(index, replay_timeout_s=2.0) as sub:
        sub.add_source(EventSource(REPLICA, r.events, r.replay, r.topic))
        deadline = time.monotonic() + 10
        # No traffic yet: the feed turns live on its first batch; send one request.
        _chat(sim_fleet, "warm-up", "hello")
        while sub.freshness(REPLICA)[0] is not Freshness.LIVE and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sub.freshness(REPLICA)[0] is Freshness.LIVE, sub.freshness(REPLICA)
        yield index


def _url(fleet: SimFleet) -> str:
    return next(r.url for r in fleet.replicas if r.name == REPLICA)


def _messages(system: str, question: str) -> list[dict[str, str]]:
    return [
        {
            "role": "system",
            "content": f"Instructions {system}: " + "think step by step and be precise. " * 12,
        },
        {"role": "user", "content": question},
    ]


def _chat(fleet: SimFleet, system: str, question: str, max_tokens: int = 20) -> httpx.Response:
    body = {
        "model": "kvroute-sim",
        "messages": _messages(system, question),
        "max_tokens": max_tokens,
    }
    return httpx.post(_url(fleet) + "/v1/chat/completions", json=body, timeout=30)


def _traffic(fleet: SimFleet, rounds: int = 2) -> list[list[int]]:
    """Several shared prefixes, asked repeatedly: more blocks than the device holds."""
    prompts = []
    for r in range(rounds):
        for s in range(6):
            for q in range(2):
                resp = _chat(fleet, f"tenant {s}", f"question {q} of round {r}?")
                assert resp.status_code == 200, resp.text
        for s in range(6):
            ids = httpx.post(
                _url(fleet) + "/tokenize",
                json={"messages": _messages(f"tenant {s}", "question 0 of round 0?")},
            ).json()["tokens"]
            prompts.append(ids)
    return prompts


def _disagreement(
    fleet: SimFleet, index: InMemoryPrefixIndex, prompts: list[list[int]]
) -> str | None:
    contents = fleet.cache_contents(REPLICA)
    tier_of = {h: Medium[t] for t in ("GPU", "CPU", "STORAGE") for h in contents[t]}
    summary = {s.replica: s.entries_by_tier for s in index.summary()}.get(REPLICA, {})
    for t in ("GPU", "CPU", "STORAGE"):
        if summary.get(t, 0) != len(contents[t]):
            return f"{t}: index has {summary.get(t, 0)} entries, replica {len(contents[t])}"
    hasher = EngineHasher()
    for ids in prompts:
        want: dict[Medium, int] = {}
        for d in hasher.chain(ids, BS):
            tier = tier_of.get(digest_to_int(d))
            if tier is None:
                break
            want[tier] = want.get(tier, 0) + 1
        got = index.lookup(ids, replicas=[REPLICA])[REPLICA]
        if (
            got.blocks != sum(want.values())
            or {t: n for t, n in got.blocks_by_tier.items() if n} != want
        ):
            return f"lookup: index {got.blocks} {got.blocks_by_tier}, replica {want}"
    return None


def _assert_agrees(fleet: SimFleet, index: InMemoryPrefixIndex, prompts: list[list[int]]) -> None:
    deadline = time.monotonic() + 10
    problem = _disagreement(fleet, index, prompts)
    while problem and time.monotonic() < deadline:
        time.sleep(0.1)
        problem = _disagreement(fleet, index, prompts)
    assert problem is None, problem


def test_index_fed_by_events_agrees_with_the_cache(
    sim_fleet: SimFleet, mirror: InMemoryPrefixIndex
) -> None:
    prompts = _traffic(sim_fleet)
    contents = sim_fleet.cache_contents(REPLICA)
    # The traffic overflowed the device, so lower tiers are in play.
    assert contents["CPU"] and contents["STORAGE"]
    _assert_agrees(sim_fleet, mirror, prompts)


def test_dropped_batches_are_recovered(sim_fleet: SimFleet, mirror: InMemoryPrefixIndex) -> None:
    sim_fleet.set_faults(REPLICA, drop_event_rate=0.3)
    try:
        prompts = _traffic(sim_fleet, rounds=1)
    finally:
        sim_fleet.set_faults(REPLICA, drop_event_rate=0.0)
    assert sim_fleet.cache_contents(REPLICA)["batches_dropped"] > 0
    # A gap shows only when a later batch arrives: one more request after the faults.
    assert _chat(sim_fleet, "tenant 0", "after the drops").status_code == 200
    _assert_agrees(sim_fleet, mirror, prompts)


def test_restart_resets_sequence_and_keeps_storage(
    sim_fleet: SimFleet, mirror: InMemoryPrefixIndex
) -> None:
    # Long, unrelated prompts in turn push the first ones down to STORAGE, heads last
    # (tail-first eviction). A STORAGE block survives a restart only with its whole chain:
    # its device and CPU ancestors die with the process.
    prompts = []
    for doc in ("alpha", "beta", "gamma", "delta", "epsilon"):
        text = f"{doc} document: " + f"{doc} facts and figures for the record. " * 20
        body = {"model": "kvroute-sim", "prompt": text, "max_tokens": 4}
        resp = httpx.post(_url(sim_fleet) + "/v1/completions", json=body, timeout=30)
        assert resp.status_code == 200, resp.text
        prompts.append(
            httpx.post(_url(sim_fleet) + "/tokenize", json={"prompt": text}).json()["tokens"]
        )
    _assert_agrees(sim_fleet, mirror, prompts)
    storage_before = set(sim_fleet.cache_contents(REPLICA)["STORAGE"])
    assert storage_before
    sim_fleet.kill(REPLICA)
    with pytest.raises(httpx.ConnectError):
        httpx.get(_url(sim_fleet) + "/health")
    sim_fleet.restart(REPLICA)
    after = sim_fleet.cache_contents(REPLICA)
    assert not after["GPU"] and not after["CPU"]
    assert after["STORAGE"] and set(after["STORAGE"]) <= storage_before
    assert httpx.get(_url(sim_fleet) + "/health").status_code == 200
    # The restarted replica's first batch re-announces STORAGE; the subscriber sees seq go
    # back to 0, clears the replica and rebuilds from the new process's history.
    assert _chat(sim_fleet, "tenant 1", "after the restart").status_code == 200
    _assert_agrees(sim_fleet, mirror, prompts)
    kept = set(after["STORAGE"])
    heads = [digest_to_int(EngineHasher().chain(p, BS)[0]) in kept for p in prompts]
    assert any(heads), heads
    survivor = prompts[heads.index(True)]
    hit = httpx.post(
        _url(sim_fleet) + "/v1/completions",
        json={"model": "kvroute-sim", "prompt": survivor, "max_tokens": 2},
        timeout=30,
    ).json()
    # The surviving chain serves hits after the restart (loaded from STORAGE).
    assert hit["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
