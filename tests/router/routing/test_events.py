"""Routing follows what replicas really cache, learned from real ZMQ KV events
(kvroute.bench.publisher.EventPublisher, vLLM's wire format), and burst hints cover the gap before
the events arrive."""

from __future__ import annotations

import asyncio
from collections import Counter

import httpx

from tests.router.servers import wait_until
from tests.router.sim_fleet import Fleet, make_fleet
from tests.router.sim_replica import ReplicaFaults

SYSTEM = (
    "You are a meticulous research assistant. Cite sources, keep answers short, and never "
    "invent facts about distributed caches or routers. "
) * 20


def _entries(fleet: Fleet, name: str) -> int:
    return fleet.stats()["replicas"][name]["entries"]


def _chat(question: str, model: str = "tiny") -> dict:
    return {
        "model": model,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        "max_tokens": 3,
    }


def test_routing_follows_cached_prefix_from_events(local_tokenizer) -> None:
    with make_fleet(local_tokenizer, n=3, hint_ttl_s=0.0) as fleet:
        first = httpx.post(f"{fleet.url}/v1/chat/completions", json=_chat("What is a KV cache?"))
        holder = first.headers["x-kvroute-replica"]
        wait_until(lambda: _entries(fleet, holder) > 0)
        decision = httpx.post(f"{fleet.url}/debug/route", json=_chat("And a radix tree?")).json()
        assert decision["chosen"] == holder and decision["reason"] == "prefix"
        views = {v["name"]: v for v in decision["replicas"]}
        assert views[holder]["match_tokens"] > 300
        assert views[holder]["tokens_by_tier"] == {"GPU": views[holder]["match_tokens"]}
        assert all(views[n]["match_tokens"] == 0 for n in views if n != holder)
        assert views[holder]["freshness"] == "live"
        assert views[holder]["est_ttft_s"] < min(
            v["est_ttft_s"] for n, v in views.items() if n != holder
        )
        for q in ("Why?", "How?", "Where?"):
            resp = httpx.post(f"{fleet.url}/v1/chat/completions", json=_chat(q))
            assert resp.headers["x-kvroute-replica"] == holder
            assert resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 300
        stats = fleet.stats()
        fleet_acc = stats["fleet"]["accuracy"]
        assert fleet_acc["reported_requests"] == 4
        # The index predicted exactly what the replica delivered.
        assert (
            stats["fleet"]["predicted_cached_tokens"] == stats["fleet"]["delivered_cached_tokens"]
        )
        assert stats["replicas"][holder]["delivered_cached_tokens"] > 900
        assert fleet_acc["delivered_over_predicted"] == 1.0
        metrics = httpx.get(f"{fleet.url}/metrics").text
        assert f'kvroute_predicted_cached_tokens_total{{replica="{holder}"}}' in metrics
        assert 'kvroute_routing_decisions_total{policy="kvroute",reason="prefix"} 3.0' in metrics
        assert f'kvroute_index_freshness{{replica="{holder}",state="live"}} 1.0' in metrics
        assert f'kvroute_event_throttled_bytes_total{{replica="{holder}"}} 0.0' in metrics


def test_lora_and_cache_salt_keep_prefixes_apart(local_tokenizer) -> None:
    with make_fleet(local_tokenizer, n=2, loras=["sql-lora"], hint_ttl_s=0.0) as fleet:
        resp = httpx.post(f"{fleet.url}/v1/chat/completions", json=_chat("q", model="sql-lora"))
        holder = resp.headers["x-kvroute-replica"]
        wait_until(lambda: _entries(fleet, holder) > 0)
        as_lora = httpx.post(f"{fleet.url}/debug/route", json=_chat("r", model="sql-lora")).json()
        assert as_lora["lora_name"] == "sql-lora" and as_lora["chosen"] == holder
        assert {v["name"]: v["match_tokens"] for v in as_lora["replicas"]}[holder] > 300
        base = httpx.post(f"{fleet.url}/debug/route", json=_chat("r")).json()
        assert base["lora_name"] is None
        assert all(v["match_tokens"] == 0 for v in base["replicas"])
        salted = httpx.post(
            f"{fleet.url}/debug/route",
            json=_chat("r", model="sql-lora") | {"cache_salt": "tenant-a"},
        ).json()
        assert all(v["match_tokens"] == 0 for v in salted["replicas"])


def _burst(fleet: Fleet, n: int) -> list[str]:
    async def go() -> list[str]:
        async with httpx.AsyncClient(timeout=30) as client:

            async def one(i: int) -> str:
                await asyncio.sleep(0.02 * i)  # siblings arrive within a burst, in order
                resp = await client.post(f"{fleet.url}/v1/chat/completions", json=_chat(f"q{i}"))
                return resp.headers["x-kvroute-replica"]

            return await asyncio.gather(*(one(i) for i in range(n)))

    return asyncio.run(go())


def test_a_prefix_remembers_its_home(local_tokenizer) -> None:
    """Events and hints off, so nothing is ever cached as far as the router knows: the first
    placement of a prefix becomes its home, and the next request with that prefix is sent
    back there (reason home) rather than placed afresh; other prefixes have no home yet."""
    with make_fleet(local_tokenizer, n=3, events=False, hint_ttl_s=0.0) as fleet:
        new = httpx.post(f"{fleet.url}/debug/route", json=_chat("First question?")).json()
        assert new["home"] is None and new["reason"] == "load"
        first = httpx.post(f"{fleet.url}/v1/chat/completions", json=_chat("First question?"))
        home = first.headers["x-kvroute-replica"]
        again = httpx.post(f"{fleet.url}/debug/route", json=_chat("First question?")).json()
        assert again["home"] == home and again["chosen"] == home and again["reason"] == "home"
        # The key is the first block past what most replicas hold, here the first block: a
        # new question behind the same system prompt shares the home.
        other = httpx.post(f"{fleet.url}/debug/route", json=_chat("Another one?")).json()
        assert other["home"] == home


def test_only_the_kvroute_policy_keeps_homes(local_tokenizer) -> None:
    """Homes cost a lookup and an insert per request; a policy that never reads them (here
    least_loaded) must not pay for them or grow the LRU."""
    with make_fleet(
        local_tokenizer, n=3, events=False, hint_ttl_s=0.0, policy="least_loaded"
    ) as fleet:
        first = httpx.post(f"{fleet.url}/v1/chat/completions", json=_chat("First question?"))
        assert first.status_code == 200
        again = httpx.post(f"{fleet.url}/debug/route", json=_chat("First question?")).json()
        assert again["home"] is None and again["reason"] != "home"


def test_burst_hints(local_tokenizer) -> None:
    faults = [ReplicaFaults(prefill_delay_s=0.6) for _ in range(3)]
    # Events off: only the router-local hints can keep siblings together.
    with make_fleet(local_tokenizer, n=3, events=False, faults=faults) as fleet:
        placed = _burst(fleet, 4)
        assert len(set(placed)) == 1, placed
        reasons = httpx.get(f"{fleet.url}/metrics").text
        assert 'reason="hint"} 3.0' in reasons
    with make_fleet(local_tokenizer, n=3, events=False, faults=faults, hint_ttl_s=0.0) as fleet:
        placed = _burst(fleet, 4)
        assert len(set(placed)) > 1, placed  # without hints the burst scatters by load


def test_hot_prefix_spills_instead_of_piling(local_tokenizer) -> None:
    faults = [ReplicaFaults(prefill_delay_s=1.0) for _ in range(2)]
    with make_fleet(local_tokenizer, n=2, events=False, faults=faults) as fleet:
        placed = Counter(_burst(fleet, 16))
        assert len(placed) == 2, placed
        # Affinity first (hints), then the queue term pushes the excess to the other replica.
        assert max(placed.values()) <= 12, placed
