"""Warm start over real HTTP on 127.0.0.1: ``GET /index/snapshot`` (guarded by the API key,
503 while there is nothing live to copy), a second router seeded from the first router's
snapshot, and every kind of bad peer falling back to the replicas' replay. The replicas are
simulated vLLM servers with real ZMQ publishers (tests/router/sim_replica.py)."""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from starlette.applications import Starlette
from starlette.responses import Response
from starlette.routing import Route

from kvroute.indexer.snapshot import SnapshotError
from kvroute.router.app import create_app
from kvroute.router.cli import add_arguments, settings_from_args
from kvroute.router.config import ConfigError, RouterSettings
from kvroute.router.peers.snapshot import FORMAT, End, Header, _frame, decode_snapshot
from kvroute.router.tokens.tokenization import LocalTokenizer
from tests.router.servers import ServerThread, listening_socket, wait_until
from tests.router.sim_fleet import Fleet, make_fleet

KEY = "sk-warm-start-test"
SYSTEM = "You answer questions about caches, briefly and exactly. " * 30


def _traffic(fleet: Fleet, n: int, api_key: str = KEY) -> None:
    client = openai.OpenAI(base_url=f"{fleet.url}/v1", api_key=api_key, max_retries=0)
    for i in range(n):
        client.chat.completions.create(
            model="tiny",
            messages=[
                {"role": "system", "content": f"Tenant {i % 3}. " + SYSTEM},
                {"role": "user", "content": f"question {i}?"},
            ],
            max_tokens=2,
        )


def _stats(url: str, key: str | None = KEY) -> dict[str, Any]:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.get(f"{url}/index/stats", headers=headers, timeout=5).json()


def _entries(url: str, key: str | None = KEY) -> dict[str, int]:
    return {n: r["entries"] for n, r in _stats(url, key)["replicas"].items()}


def _settled(fleet: Fleet, key: str | None = KEY) -> dict[str, int]:
    """Entries per replica once every publisher's events are applied (two equal reads)."""
    seen: list[dict[str, int]] = []

    def same_twice() -> bool:
        seen.append(_entries(fleet.url, key))
        return len(seen) > 1 and seen[-1] == seen[-2] and all(seen[-1].values())

    wait_until(same_twice, timeout_s=10, interval_s=0.3)
    return seen[-1]


@contextlib.contextmanager
def _second_router(fleet: Fleet, tokenizer: LocalTokenizer, **changes: Any) -> Iterator[str]:
    settings = fleet.settings.replace(**changes)
    with ServerThread(create_app(settings, tokenizer=tokenizer)) as router:
        yield router.url


def test_the_snapshot_needs_the_api_key(local_tokenizer: LocalTokenizer) -> None:
    with make_fleet(local_tokenizer, n=2, api_keys=[KEY]) as fleet:
        _traffic(fleet, 4)
        _settled(fleet)
        refused = httpx.get(f"{fleet.url}/index/snapshot", timeout=5)
        assert refused.status_code == 401
        assert refused.json()["error"]["type"] == "AuthenticationError"
        wrong = httpx.get(
            f"{fleet.url}/index/snapshot", headers={"authorization": "Bearer nope"}, timeout=5
        )
        assert wrong.status_code == 401
        resp = httpx.get(
            f"{fleet.url}/index/snapshot", headers={"authorization": f"Bearer {KEY}"}, timeout=5
        )
        assert resp.status_code == 200, resp.text
        records = {r.name: r for r in decode_snapshot(resp.content)}
        entries = _entries(fleet.url)
        assert {n for n, e in entries.items() if e} == set(records)
        for name, record in records.items():
            assert record.state.entries == entries[name]
            assert record.replay == fleet.settings.replicas[int(name[1:])].replay


def test_a_router_with_no_live_feed_answers_503(local_tokenizer: LocalTokenizer) -> None:
    with make_fleet(local_tokenizer, n=1, events=False) as fleet:
        resp = httpx.get(f"{fleet.url}/index/snapshot", timeout=5)
        assert resp.status_code == 503
        error = resp.json()["error"]
        assert "no replica's event feed is live" in error["message"]
        assert resp.headers["retry-after"]


def test_a_second_router_starts_from_the_first_ones_snapshot(
    local_tokenizer: LocalTokenizer,
) -> None:
    with make_fleet(local_tokenizer, n=3, api_keys=[KEY]) as fleet:
        _traffic(fleet, 9)
        want = _settled(fleet)
        full = {n: r["feed"]["batches"] for n, r in _stats(fleet.url)["replicas"].items()}
        with _second_router(fleet, local_tokenizer, peers=[fleet.url]) as second:
            wait_until(lambda: _stats(second)["start"]["replicas_pending"] == 0)
            start = _stats(second)["start"]
            assert start["mode"] == "peer_snapshot" and start["peer"] == fleet.url
            assert start["error"] is None
            assert start["replicas_from_snapshot"] == 3 == start["replicas_verified"]
            assert start["entries_imported"] == sum(want.values())
            assert start["gap_batches_replayed"] == 0  # nothing happened since the snapshot
            assert start["took_s"] is not None
            assert _entries(second) == want
            stats = _stats(second)["replicas"]
            for name, replica in stats.items():
                assert replica["freshness"] == "live"
                assert replica["feed"]["batches"] == 0 < full[name]
            # Both route the next request alike, and both follow the live events after it.
            body = {
                "model": "tiny",
                "messages": [{"role": "system", "content": "Tenant 1. " + SYSTEM}],
            }
            auth = {"authorization": f"Bearer {KEY}"}
            first_view = httpx.post(f"{fleet.url}/debug/route", json=body, headers=auth).json()
            second_view = httpx.post(f"{second}/debug/route", json=body, headers=auth).json()
            assert first_view["chosen"] == second_view["chosen"]

            def matches(view: dict[str, Any]) -> dict[str, Any]:
                return {v["name"]: (v["match_tokens"], v["tokens_by_tier"]) for v in view}

            assert matches(first_view["replicas"]) == matches(second_view["replicas"])
            assert max(t for t, _ in matches(second_view["replicas"]).values()) > 300
            _traffic(fleet, 3)
            after = _settled(fleet)
            wait_until(lambda: _entries(second) == after)


def _garbage_app() -> Starlette:
    async def snapshot(request: Any) -> Response:
        return Response(b"\x00\x00\x00\x05not a snapshot", media_type="application/octet-stream")

    return Starlette(routes=[Route("/index/snapshot", snapshot)])


def test_bad_peers_fall_back_to_replay(local_tokenizer: LocalTokenizer) -> None:
    """A garbage answer, a closed port, a router without the key, a router that is not live:
    each is logged, the next is tried, and the router starts from the replay."""
    with make_fleet(local_tokenizer, n=2, api_keys=[KEY]) as fleet:
        _traffic(fleet, 4)
        want = _settled(fleet)
        closed = listening_socket()
        closed_url = f"http://127.0.0.1:{closed.getsockname()[1]}"
        closed.close()
        with (
            ServerThread(_garbage_app()) as garbage,
            make_fleet(local_tokenizer, n=1, events=False) as not_live,
        ):
            peers = [garbage.url, closed_url, not_live.url]
            with _second_router(fleet, local_tokenizer, peers=peers, api_keys=["other"]) as b:
                start = _stats(b, "other")["start"]
                assert start["mode"] == "replay" and start["peer"] is None
                assert start["replicas_from_snapshot"] == 0
                error = start["error"]
                assert f"{garbage.url}/index/snapshot: " in error
                assert f"{closed_url}/index/snapshot: ConnectError" in error
                assert f"{not_live.url}/index/snapshot answered 503" in error
                wait_until(lambda: _entries(b, "other") == want)
            # The right peer, but this router's key is not the peer's: 401, then replay.
            with _second_router(fleet, local_tokenizer, peers=[fleet.url], api_keys=["x"]) as b:
                start = _stats(b, "x")["start"]
                assert start["mode"] == "replay"
                assert "answered 401" in start["error"]
                wait_until(lambda: _entries(b, "x") == want)


def _body(*records: Any) -> bytes:
    return b"".join(_frame(r) for r in records)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"", "empty snapshot"),
        (b"\x00\x00\x00\x03abc", "not a snapshot record"),
        (_body(End(0)), "does not start with its header"),
        (_body(Header("other-format", 1, 0.0), End(0)), "'other-format' version 1"),
        (_body(Header(FORMAT, 2, 0.0), End(0)), "version 2"),
        (_body(Header(FORMAT, 1, 0.0)), "no end record"),
        (_body(Header(FORMAT, 1, 0.0), End(1)), "claiming 1 replicas, holds 0"),
        (_body(Header(FORMAT, 1, 0.0), End(0))[:-1], "cut short"),
        (_body(Header(FORMAT, 1, 0.0), End(0), End(0)), "data after the snapshot's end"),
    ],
)
def test_a_bad_snapshot_body_is_refused_with_the_reason(body: bytes, message: str) -> None:
    with pytest.raises(SnapshotError, match=message):
        decode_snapshot(body)


def test_peer_flags_reach_the_settings() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        [
            "--peer",
            "http://10.0.0.1:8000",
            "--peer",
            "http://10.0.0.2:8000",
            "--peer-timeout-s",
            "2",
        ]
    )
    settings = settings_from_args(args)
    assert settings.peers == ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]
    assert settings.peer_timeout_s == 2.0
    with pytest.raises(ConfigError, match="peer must be"):
        settings_from_args(parser.parse_args(["--peer", "10.0.0.1:8000"]))


def test_peer_flags_are_checked() -> None:
    with pytest.raises(ConfigError, match="peer must be"):
        RouterSettings(peers=["127.0.0.1:8000"])
    with pytest.raises(ConfigError, match="peer_timeout_s"):
        RouterSettings(peer_timeout_s=0)
