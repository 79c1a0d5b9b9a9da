"""A simulated fleet started with ``--api-key`` behaves like vLLM started with it: the paths
vLLM guards answer vLLM's own 401 without the key, the rest stay open, and the key reaches
the fleet's child process without appearing on its command line or in its log."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from kvroute.bench.sim.fleet import (
    API_KEY_ENV,
    SimFleet,
    SimFleetConfig,
    add_arguments,
    config_from_args,
)

KEY = "sim-key-5a0d7e"


@pytest.fixture(scope="module")
def keyed_fleet() -> Iterator[SimFleet]:
    with SimFleet(SimFleetConfig(replicas=1, default_max_tokens=2, api_key=KEY)) as fleet:
        yield fleet


def _client(fleet: SimFleet, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=fleet.replicas[0].url + "/v1", api_key=key, max_retries=0)


def test_the_right_key_is_served(keyed_fleet: SimFleet) -> None:
    client = _client(keyed_fleet, KEY)
    assert [m.id for m in client.models.list()] == ["kvroute-sim"]
    chat = client.chat.completions.create(
        model="kvroute-sim", messages=[{"role": "user", "content": "hi"}]
    )
    assert chat.choices[0].message.content


def test_guarded_paths_answer_vllms_401(keyed_fleet: SimFleet) -> None:
    with pytest.raises(openai.AuthenticationError) as caught:
        _client(keyed_fleet, "wrong").completions.create(model="kvroute-sim", prompt="hi")
    assert caught.value.status_code == 401
    url = keyed_fleet.replicas[0].url
    for headers in ({}, {"Authorization": KEY}, {"Authorization": "Bearer wrong"}):
        resp = httpx.get(url + "/v1/models", headers=headers)
        assert resp.status_code == 401
        assert resp.json() == {"error": "Unauthorized"}  # vLLM 0.32's body, not OpenAI's schema
    # vLLM guards /v1, /v2, /inference and /cohere only: the rest needs no key.
    assert httpx.get(url + "/health").status_code == 200
    assert httpx.get(url + "/metrics").status_code == 200
    tokens = httpx.post(url + "/tokenize", json={"model": "kvroute-sim", "prompt": "hi"})
    assert tokens.status_code == 200 and tokens.json()["tokens"]
    # OPTIONS is never checked (CORS preflights); the route itself refuses the method.
    assert httpx.options(url + "/v1/models").status_code != 401


def test_the_key_stays_off_argv_and_logs(keyed_fleet: SimFleet) -> None:
    assert KEY not in " ".join(keyed_fleet.config.to_argv())
    assert KEY not in repr(keyed_fleet.config)
    assert KEY not in keyed_fleet.log_path.read_text(errors="replace")
    assert keyed_fleet.router_settings()["replica_api_key"] == KEY


def test_kvroute_sim_flag_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert config_from_args(parser.parse_args([])).api_key is None
    assert config_from_args(parser.parse_args(["--api-key", KEY])).api_key == KEY
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert config_from_args(parser.parse_args([])).api_key == "from-env"
    assert config_from_args(parser.parse_args(["--api-key", KEY])).api_key == KEY
    monkeypatch.setenv(API_KEY_ENV, " ")
    with pytest.raises(SystemExit, match="empty"):
        config_from_args(parser.parse_args([]))


@pytest.mark.vllm
def test_the_check_matches_vllms_own_middleware() -> None:
    """The simulator's check against vLLM's AuthenticationMiddleware over one inner app:
    the same status and body for every path and header (needs the vLLM extra)."""
    import vllm.entrypoints.serve.middleware.authenticate as vllm_auth
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route
    from starlette.testclient import TestClient

    from kvroute.bench.sim.api import VllmKeyCheck

    async def ok(request: object) -> PlainTextResponse:
        return PlainTextResponse("ok")

    paths = ["/v1/models", "/v2/x", "/inference/y", "/cohere/z", "/health", "/tokenize", "/v10"]
    inner = Starlette(routes=[Route(p, ok, methods=["GET", "OPTIONS"]) for p in paths])
    ours = TestClient(VllmKeyCheck(inner, KEY))
    vllm_check = vllm_auth.AuthenticationMiddleware(inner, tokens=[KEY])

    async def vllm_app(scope: Any, receive: Any, send: Any) -> None:
        await vllm_check(scope, receive, send)  # vLLM's __call__ returns the awaitable

    theirs = TestClient(vllm_app)
    headers_cases = [
        {},
        {"Authorization": f"Bearer {KEY}"},
        {"Authorization": f"bearer {KEY}"},
        {"Authorization": KEY},
        {"Authorization": "Bearer wrong"},
        {"Authorization": f"Bearer  {KEY}"},
    ]
    for path in paths:
        for headers in headers_cases:
            for method in ("GET", "OPTIONS"):
                a = ours.request(method, path, headers=headers)
                b = theirs.request(method, path, headers=headers)
                assert (a.status_code, a.content) == (b.status_code, b.content), (path, headers)
