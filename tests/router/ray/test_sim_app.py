"""A Ray Serve app of simulated engines (bench/sim/ray_serve.py), no vLLM: kvroute's request
router, loaded by Serve by name in the ingress replica, sends every follow-up turn to the
replica that holds the conversation, and predicts exactly the cached tokens that replica
reports; Ray's ``PrefixCacheAffinityRouter`` runs the same conversations in the same test;
the router's metrics are read back from Ray's Prometheus endpoint (the node's metrics agent)."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from kvroute.bench.sim.ray_serve import build_app  # noqa: E402

PREFIX_ROUTER = "ray.serve.llm.request_router:PrefixCacheAffinityRouter"
SYSTEM = "You are a patient tutor. Explain each idea with one plain example. " * 8


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


METRICS_PORT = _free_port()  # the node's metrics agent serves Prometheus text here


@pytest.fixture(scope="module")
def handles(tiny_model_dir: Path) -> Iterator[dict[str, Any]]:
    """Both apps, deployed at once (their replicas start side by side)."""
    # A cluster of its own ("local"), never one another test started beside it; workers
    # send their metrics to the node's agent every second (Ray's default: 10 s).
    ray.init(
        address="local",
        num_cpus=4,
        include_dashboard=False,
        log_to_driver=False,
        _metrics_export_port=METRICS_PORT,
        _system_config={"metrics_report_interval_ms": 1000},
    )
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


def _exported(text: str, app: str) -> dict[str, float]:
    """kvroute's series of ``app`` in Prometheus text, summed over their other labels
    (decisions also by reason, as ``decisions{reason}``)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("ray_kvroute_ray_") or f'application="{app}"' not in line:
            continue
        name, value = line.split("{", 1)[0], float(line.rsplit(" ", 1)[1])
        if name == "ray_kvroute_ray_decisions_total":
            reason = line.split('reason="', 1)[1].split('"', 1)[0]
            name = f"decisions{{{reason}}}"
        elif "_bucket" in name:
            continue
        out[name] = out.get(name, 0.0) + value
    return out


def test_the_routers_metrics_reach_rays_prometheus(handles: dict[str, Any]) -> None:
    """The counters and histogram the router records (``ray.util.metrics``, in the ingress
    replica) are what Ray's metrics agent serves at the node's Prometheus endpoint, equal to
    what the router says it decided (its stats)."""
    handle = handles["kvroute"]
    _run(handle, users=2, turns=2)  # follow-ups: cached tokens predicted
    [stats] = handle.router_stats.remote().result(timeout_s=30)
    assert stats["predicted_cached_tokens"] > 0
    expected = {f"decisions{{{r}}}": float(n) for r, n in stats["reasons"].items()} | {
        "ray_kvroute_ray_prompt_tokens_total": float(stats["prompt_tokens"]),
        "ray_kvroute_ray_predicted_cached_tokens_total": float(stats["predicted_cached_tokens"]),
        "ray_kvroute_ray_decision_seconds_count": float(stats["decisions"]),
    }
    url = f"http://127.0.0.1:{METRICS_PORT}/metrics"
    deadline, seen = time.monotonic() + 45, {}
    while time.monotonic() < deadline:  # exported every second, scraped as it comes
        seen = _exported(httpx.get(url, timeout=10).text, "kvroute")
        if {k: seen.get(k) for k in expected} == expected:
            break
        time.sleep(1)
    assert {k: seen.get(k) for k in expected} == expected, seen
    assert seen["ray_kvroute_ray_decision_seconds_sum"] > 0
