"""``kvroute demo``: its workload, its report, and a whole run on the simulated fleet.

The real-vLLM demo is ``make demo`` (minutes); here the same program runs on the simulated
engine, which has vLLM's API, metrics and KV events, so the fleet, both routers, the
``openai`` client, the resets and the report are all exercised in seconds.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvroute.deploy.demo import RunResult, Workload, format_stats, format_table
from tests.deploy.helpers import leftovers


def test_runs_share_no_prefix_but_have_the_same_shape() -> None:
    w = Workload()
    a, b = w.system_prompt("0-0"), w.system_prompt("0-1")
    assert a != b and a[:5] == b[:5] and a.split("]", 1)[1] == b.split("]", 1)[1]
    assert a[:12] != b[:12]  # the tag comes first: no shared leading block across runs
    assert w.system_prompt("0-0") == a  # deterministic
    assert w.user_message("t", 1, 2) != w.user_message("t", 2, 1)


def test_each_user_pastes_a_document_once_then_asks_short_questions() -> None:
    """The first turn carries the user's private document (a returning user's history is
    mostly that document); later turns are short questions; no two users share a document."""
    w = Workload()
    first = [w.user_message("t", c, 0) for c in range(w.conversations)]
    later = [w.user_message("t", c, t) for c in range(w.conversations) for t in (1, w.turns - 1)]
    assert all("here is my document." in m for m in first)
    assert all(len(m.split()) > w.document_words for m in first)
    assert not any("document" in m for m in later)
    assert all(len(m.split()) <= w.user_words + 4 for m in later)
    documents = {m.split("here is my document.", 1)[1].split(". My question:")[0] for m in first}
    assert len(documents) == w.conversations
    # Enough turns that the first (a cold document for any router) are under a tenth.
    assert 1 / w.turns < 0.1


def test_hit_rate_is_token_weighted_and_ttft_percentiles() -> None:
    r = RunResult("kvroute", requests=2, prompt_tokens=1000, cached_tokens=750)
    r.ttft_s = [0.1, 0.2, 0.3, 0.4, 1.0]
    assert r.hit_rate == 0.75
    assert r.ttft(0.5) == 0.3 and r.ttft(0.9) == 1.0
    table = format_table([r, RunResult("round_robin", prompt_tokens=1000, cached_tokens=500)])
    assert "75.0%" in table and "50.0%" in table and "300.0ms" in table


def test_device_share_never_exceeds_the_hit_rate() -> None:
    """The device share comes from the replicas' metrics, the hit rate from the responses:
    the split is capped so the picture's bars never stack past the hit rate."""
    r = RunResult("kvroute", prompt_tokens=1000, cached_tokens=600, device_cached_tokens=400)
    assert r.device_hit_rate == 0.4 and r.summary()["device_hit_rate"] == 0.4
    r.device_cached_tokens = 900
    assert r.device_hit_rate == 0.6
    assert RunResult("round_robin").device_hit_rate == 0.0


def test_waves_bring_every_user_back_after_the_others(monkeypatch: pytest.MonkeyPatch) -> None:
    """Turn t of every conversation is sent before turn t+1 of any."""
    from kvroute.deploy import demo_workload

    sent: list[tuple[int, int]] = []

    def fake_turn(
        client: object, model: str, messages: list[dict[str, str]], max_tokens: int
    ) -> tuple[str, float, int, int]:
        user = messages[-1]["content"]
        c, t = (
            int(x) for x in user.split(":")[0].removeprefix("Conversation ").split(", question ")
        )
        sent.append((c, t))
        return "ok", 0.01, 100, 50

    monkeypatch.setattr(demo_workload, "_chat_turn", fake_turn)
    w = Workload(conversations=3, turns=2, concurrency=1)
    result = demo_workload.run_workload("http://127.0.0.1:9", "m", w, policy="kvroute", tag="t")
    assert sent == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)]
    assert (result.requests, result.prompt_tokens, result.cached_tokens) == (6, 600, 300)


def test_stats_summary_names_every_replica_and_tier() -> None:
    stats = {
        "fleet": {"entries": 5, "entries_by_tier": {"GPU": 3, "CPU": 1, "STORAGE": 1},
                  "predicted_cached_tokens": 640, "delivered_cached_tokens": 608},
        "replicas": {
            "replica-0": {"health": {"healthy": True}, "freshness": "live",
                          "entries_by_tier": {"GPU": 3, "CPU": 1, "STORAGE": 1},
                          "predicted_cached_tokens": 640, "delivered_cached_tokens": 608},
            "replica-1": {"health": {"healthy": False}, "freshness": "stale",
                          "entries_by_tier": {}, "predicted_cached_tokens": 0,
                          "delivered_cached_tokens": 0},
        },
    }  # fmt: skip
    text = format_stats(stats)
    assert "replica-0    ok       live" in text
    assert "replica-1    DOWN     stale" in text
    assert "predicted cached tokens 640, delivered 608" in text


def test_demo_runs_end_to_end_on_the_simulated_fleet(tmp_path: Path) -> None:
    out = tmp_path / "demo.json"
    state = tmp_path / "state"
    done = subprocess.run(
        [sys.executable, "-m", "kvroute.deploy.cli", "demo", "--engine", "sim", "--state-dir",
         str(state), "--conversations", "3", "--turns", "3", "--rounds", "1",
         "--json-out", str(out), "--png", str(tmp_path / "demo.png")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "kvroute vs round_robin" in done.stdout
    # Not a terminal: one progress line per run, no carriage-return redraws; dashboards named.
    assert "\r" not in done.stdout + done.stderr
    runs = [line for line in done.stderr.splitlines() if " req in " in line]
    assert len(runs) == 2 and all(": 9/9 req in " in line for line in runs), done.stderr
    assert "/dashboard (kvroute)" in done.stdout and "/dashboard (round_robin)" in done.stdout
    assert f"picture: {tmp_path / 'demo.png'}" in done.stdout
    assert (tmp_path / "demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "The workload: 3 users chat with the model, 3 turns each, in waves" in done.stdout
    assert "kvroute      hit rate by tier: device" in done.stdout
    report = json.loads(out.read_text())
    results = {r["policy"]: r for r in report["results"]}
    assert set(results) == {"kvroute", "round_robin"}
    for r in results.values():
        assert (r["requests"], r["errors"], r["cached_unreported_requests"]) == (9, 0, 0)
        assert r["prompt_tokens"] > 0 and r["ttft_p50_s"] > 0
        assert sum(r["requests_per_replica"].values()) == 9  # counted by the replicas
    assert sorted(results["round_robin"]["requests_per_replica"].values()) == [4, 5]
    # Later turns reuse earlier ones: the kvroute run must have hit, and the stats agree.
    assert results["kvroute"]["cached_tokens"] > 0
    fleet = report["index_stats"]["fleet"]
    # (The router records a stream's usage after relaying it: the snapshot may lag a little.)
    assert 0 < fleet["delivered_cached_tokens"] <= results["kvroute"]["cached_tokens"]
    assert fleet["predicted_cached_tokens"] > 0
    assert leftovers(state, []) == []
