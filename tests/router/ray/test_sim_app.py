"""A Ray Serve app of simulated engines (bench/sim/ray_serve.py), no vLLM: kvroute's request
router, loaded by Serve by name in the ingress replica, sends every follow-up turn to the
replica that holds the conversation, and predicts exactly the cached tokens that replica
reports; Ray's ``PrefixCacheAffinityRouter`` runs the same conversations in the same test."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from kvroute.bench.sim.ray_serve import build_app  # noqa: E402

PREFIX_ROUTER = "ray.serve.llm.request_router:PrefixCacheAffinityRouter"
SYSTEM = "You are a patient tutor. Explain each idea with one plain example. " * 8


@pytest.fixture(scope="module")
def handles(tiny_model_dir: Path) -> Iterator[dict[str, Any]]:
    """Both apps, deployed at once (their replicas start side by side)."""
    # A cluster of its own ("local"), never one another test started beside it.
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"location": "NoServer"})
    try:
        apps = {
            "kvroute": build_app(str(tiny_model_dir), replicas=2),
            "prefix": build_app(
                str(tiny_model_dir), replicas=2, request_router_class=PREFIX_ROUTER
            ),
        }
        targets = [serve.RunTarget(app, name=name, route_prefix=None) for name, app in apps.items()]
        yield dict(zip(apps, serve.run_many(targets), strict=True))
    finally:
        serve.shutdown()
        ray.shutdown()


def _turns(user: int, n: int) -> Iterator[list[dict[str, str]]]:
    """A conversation's requests: each turn resends the history plus a new question."""
    messages = [{"role": "system", "content": f"User {user}. {SYSTEM}"}]
    for turn in range(n):
        messages.append({"role": "user", "content": f"Question {turn} of user {user}: why?"})
        yield list(messages)
        messages.append({"role": "assistant", "content": f"Because of reason {turn}."})


def _hit_rate(answers: list[dict[str, Any]]) -> float:
    usage = [a["usage"] for a in answers]
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usage)
    return round(cached / sum(u["prompt_tokens"] for u in usage), 3)


def _run(handle: Any, users: int, turns: int) -> list[dict[str, Any]]:
    """Every user's turns, interleaved; a moment between rounds for the events to arrive."""
    convs = [_turns(u, turns) for u in range(users)]
    out = []
    for _ in range(turns):
        for user, conv in enumerate(convs):
            body = {"model": "tiny", "messages": next(conv), "max_tokens": 2}
            answer = handle.remote(body).result(timeout_s=60)
            out.append({"user": user, **answer})
        time.sleep(0.3)
    return out


def test_kvroute_keeps_conversations_on_their_replica(
    handles: dict[str, Any], tiny_model_dir: Path
) -> None:
    handle = handles["kvroute"]
    answers = _run(handle, users=4, turns=3)
    homes: dict[int, set[str]] = {}
    for a in answers:
        homes.setdefault(a["user"], set()).add(a["replica"])
    assert all(len(h) == 1 for h in homes.values()), homes
    assert len({next(iter(h)) for h in homes.values()}) == 2  # both replicas used
    follow_ups = answers[4:]
    assert all(a["usage"]["prompt_tokens_details"]["cached_tokens"] > 0 for a in follow_ups)

    [stats] = handle.router_stats.remote().result(timeout_s=30)
    assert stats["decisions"] == len(answers) and stats["routed_by_load"] == 0
    assert stats["tokenizer"] == str(tiny_model_dir)
    assert all(r["freshness"] == "live" for r in stats["replicas"].values())
    predicted = [d["predicted_cached_tokens"] for d in stats["recent"]]
    delivered = [a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers]
    assert predicted == delivered
    print("simulated engines, kvroute: prefix hit rate", _hit_rate(answers))


def test_prefix_cache_affinity_router_in_the_same_app(handles: dict[str, Any]) -> None:
    """Ray's router runs the same conversations (it never errs here; it only has to serve):
    the comparison figures are the real-vLLM test's (docs/benchmarks.md)."""
    handle = handles["prefix"]
    answers = _run(handle, users=4, turns=3)
    assert len(answers) == 12
    print("simulated engines, PrefixCacheAffinityRouter: prefix hit rate", _hit_rate(answers))
    assert handle.router_stats.remote().result(timeout_s=30) == []
