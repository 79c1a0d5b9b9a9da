"""API keys against a real router and simulated vLLM replicas on 127.0.0.1, through the
official ``openai`` client: who may talk to the router (``api_keys``), what the router shows
replicas started with ``--api-key`` (``replica_api_key``), and that no key is ever logged
or echoed."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from kvroute.router.app import create_app
from kvroute.router.cli import add_arguments, settings_from_args
from kvroute.router.config import ConfigError, ReplicaConfig, RouterSettings
from kvroute.router.serving.http_protocol import header_deadline_protocol
from kvroute.router.tokens.tokenization import LocalTokenizer
from tests.deploy.helpers import wait_until_up
from tests.router.servers import ServerThread, wait_until
from tests.router.sim_fleet import Fleet, make_fleet
from tests.router.sim_replica import SimServer

ROUTER_KEY = "router-key-4f1c9a"
OTHER_ROUTER_KEY = "router-key-second-77d2"
REPLICA_KEY = "replica-key-b83e21"
MESSAGES = [{"role": "user", "content": "Which replica holds this prefix?"}]


def _client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _assert_openai_error(body: dict[str, Any], status: int) -> None:
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status and error["message"]


@contextlib.contextmanager
def _keyed_fleet(
    tokenizer: LocalTokenizer, replica_key: str | None, n: int = 1, **settings_kw: Any
) -> Iterator[Fleet]:
    """``n`` simulated replicas started with ``--api-key replica_key`` behind a router (not
    waiting for them to turn healthy: some tests expect them refused)."""
    with contextlib.ExitStack() as stack:
        fakes = []
        for i in range(n):
            fake = SimServer(f"r{i}", tokenizer.name)
            fake.replica.config.api_key = replica_key
            stack.callback(fake.close)
            fakes.append(fake.start())
        configs = [
            ReplicaConfig(url=f.url, events=f.events, replay=f.replay, name=f.name) for f in fakes
        ]
        defaults: dict[str, Any] = {
            "health_interval_s": 0.2,
            "health_timeout_s": 1.0,
            "tokenizer_check_on_start": False,
        }
        settings = RouterSettings(replicas=configs, **(defaults | settings_kw))
        router = ServerThread(
            create_app(settings, tokenizer=tokenizer),
            http=header_deadline_protocol(settings.header_timeout_s),
        ).start()
        stack.callback(router.stop)
        yield Fleet(router, fakes, settings)


# --- who may talk to the router ----------------------------------------------------------------


def test_client_with_a_key_chats_and_streams(local_tokenizer: LocalTokenizer) -> None:
    with make_fleet(local_tokenizer, api_keys=[ROUTER_KEY, OTHER_ROUTER_KEY]) as fleet:
        for key in (ROUTER_KEY, OTHER_ROUTER_KEY):  # any of the keys, as vLLM takes several
            client = _client(fleet.url, key)
            chat = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3)
            assert chat.choices[0].message.content
            stream = client.chat.completions.create(
                model="tiny", messages=MESSAGES, max_tokens=3, stream=True
            )
            assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
            done = client.completions.create(model="tiny", prompt="hello there", max_tokens=2)
            assert done.choices[0].text is not None
        # The client's header is the router's key: replicas never see it.
        for fake in fleet.fakes:
            for seen in fake.seen:
                assert "authorization" not in seen.headers


def test_missing_or_wrong_key_is_openais_401(local_tokenizer: LocalTokenizer) -> None:
    with make_fleet(local_tokenizer, api_keys=[ROUTER_KEY]) as fleet:
        for key in ("wrong-key", ROUTER_KEY + "x", ROUTER_KEY[:-1]):
            with pytest.raises(openai.AuthenticationError) as caught:
                _client(fleet.url, key).chat.completions.create(model="tiny", messages=MESSAGES)
            assert caught.value.status_code == 401
            body = caught.value.response.json()
            _assert_openai_error(body, 401)
            assert body["error"]["type"] == "AuthenticationError"
            assert key not in caught.value.response.text
        body = {"model": "tiny", "messages": MESSAGES}
        not_bearer = ({}, {"Authorization": ROUTER_KEY}, {"Authorization": f"Basic {ROUTER_KEY}"})
        for headers in not_bearer:
            resp = httpx.post(f"{fleet.url}/v1/chat/completions", json=body, headers=headers)
            assert resp.status_code == 401, headers
            _assert_openai_error(resp.json(), 401)
        # Nothing refused reached a replica.
        assert not [s for fake in fleet.fakes for s in fake.seen if s.path.startswith("/v1/chat")]


def test_what_the_key_guards(local_tokenizer: LocalTokenizer) -> None:
    with make_fleet(local_tokenizer, api_keys=[ROUTER_KEY]) as fleet:
        url = fleet.url
        guarded = [
            ("GET", "/v1/models", None),
            ("GET", "/index/stats", None),
            ("GET", "/dashboard/data", None),
            ("GET", "/debug/tokenizer_check", None),
            ("POST", "/debug/tokenizer_check", {"model": "tiny", "prompt": "hi"}),
            ("POST", "/debug/route", {"model": "tiny", "prompt": "hi"}),
            ("POST", "/tokenize", {"model": "tiny", "prompt": "hi"}),
            ("POST", "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 1}),
            ("GET", "/version", None),  # any other vLLM path, passed through
            ("POST", "/reset_prefix_cache", None),
        ]
        for method, path, body in guarded:
            refused = httpx.request(method, url + path, json=body)
            assert refused.status_code == 401, path
            _assert_openai_error(refused.json(), 401)
            allowed = httpx.request(method, url + path, json=body, headers=_bearer(ROUTER_KEY))
            assert allowed.status_code != 401, path
        for path in ("/index/stats", "/dashboard/data", "/v1/models", "/debug/tokenizer_check"):
            assert httpx.get(url + path, headers=_bearer(ROUTER_KEY)).status_code == 200, path
        # Monitoring, the dashboard's page (it holds no data) and the API schema stay open.
        for path in ("/health", "/metrics", "/dashboard", "/dashboard/dashboard.js"):
            assert httpx.get(url + path).status_code == 200, path
        assert httpx.get(url + "/openapi.json").status_code == 200


def test_protect_metrics_closes_health_and_metrics(local_tokenizer: LocalTokenizer) -> None:
    with make_fleet(local_tokenizer, api_keys=[ROUTER_KEY], api_key_protects_metrics=True) as fleet:
        for path in ("/health", "/metrics"):
            refused = httpx.get(fleet.url + path)
            assert refused.status_code == 401, path
            _assert_openai_error(refused.json(), 401)
            assert httpx.get(fleet.url + path, headers=_bearer(ROUTER_KEY)).status_code == 200


def test_without_keys_the_clients_header_passes_through(fleet: Fleet) -> None:
    """A router without keys of its own keeps today's behaviour: replicas see the client's
    header (a fleet whose replicas check the clients' keys themselves)."""
    _client(fleet.url, "client-own-key").completions.create(model="tiny", prompt="hi", max_tokens=1)
    seen = [s for fake in fleet.fakes for s in fake.seen if s.path == "/v1/completions"]
    assert seen and seen[-1].headers.get("authorization") == "Bearer client-own-key"


# --- what the router shows replicas ------------------------------------------------------------


def test_replicas_with_a_key_work_through_the_router(local_tokenizer: LocalTokenizer) -> None:
    with _keyed_fleet(
        local_tokenizer, REPLICA_KEY, n=2, api_keys=[ROUTER_KEY], replica_api_key=REPLICA_KEY
    ) as fleet:
        wait_until(lambda: len(fleet.service.registry.healthy()) == 2, timeout_s=10)
        client = _client(fleet.url, ROUTER_KEY)
        chat = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3)
        assert chat.choices[0].message.content
        stream = client.completions.create(model="tiny", prompt="hi", max_tokens=3, stream=True)
        assert list(stream)
        resp = httpx.post(
            f"{fleet.url}/tokenize",
            json={"model": "tiny", "prompt": "hi"},
            headers=_bearer(ROUTER_KEY),
        )
        assert resp.status_code == 200 and resp.json()["tokens"]
        sent = [s for fake in fleet.fakes for s in fake.seen]
        assert sent and all(s.headers["authorization"] == f"Bearer {REPLICA_KEY}" for s in sent)


def test_replica_key_replaces_the_clients_header(local_tokenizer: LocalTokenizer) -> None:
    """No router key, a replica key: the router speaks for itself upstream."""
    with _keyed_fleet(local_tokenizer, REPLICA_KEY, replica_api_key=REPLICA_KEY) as fleet:
        wait_until(lambda: len(fleet.service.registry.healthy()) == 1, timeout_s=10)
        _client(fleet.url, "client-own-key").completions.create(
            model="tiny", prompt="hi", max_tokens=1
        )
        (seen,) = [s for s in fleet.fakes[0].seen if s.path == "/v1/completions"]
        assert seen.headers["authorization"] == f"Bearer {REPLICA_KEY}"


def test_replica_refusing_the_router_is_reported(local_tokenizer: LocalTokenizer) -> None:
    """Replicas started with a key the router does not send: unhealthy with a reason that
    names the fix, and clients get a clear 5xx in OpenAI's schema."""
    with _keyed_fleet(local_tokenizer, REPLICA_KEY, api_keys=[ROUTER_KEY]) as fleet:
        replica = fleet.service.registry.get("r0")
        wait_until(lambda: replica.last_error is not None, timeout_s=10)
        assert not replica.healthy
        assert "refused the router's API key" in replica.last_error
        assert "--replica-api-key" in replica.last_error
        stats = httpx.get(f"{fleet.url}/index/stats", headers=_bearer(ROUTER_KEY)).json()
        assert "--replica-api-key" in json.dumps(stats)
        with pytest.raises(openai.InternalServerError) as caught:
            _client(fleet.url, ROUTER_KEY).chat.completions.create(model="tiny", messages=MESSAGES)
        assert caught.value.status_code == 503
        _assert_openai_error(caught.value.response.json(), 503)


def test_replica_refusing_a_proxied_request_is_a_502_not_the_clients_401(
    local_tokenizer: LocalTokenizer, caplog: pytest.LogCaptureFixture
) -> None:
    """A replica that refuses the router's key between health checks: its 401 is about the
    router's credentials, so the client (whose key was right) gets a 502 naming the fix. No key is
    logged on the way: not on a refused client, a proxied request or an upstream failure."""
    caplog.set_level(logging.DEBUG)
    with _keyed_fleet(
        local_tokenizer,
        REPLICA_KEY,
        api_keys=[ROUTER_KEY],
        replica_api_key=REPLICA_KEY,
        health_interval_s=60.0,
    ) as fleet:
        wait_until(lambda: len(fleet.service.registry.healthy()) == 1, timeout_s=10)
        client = _client(fleet.url, ROUTER_KEY)
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2)
        with pytest.raises(openai.AuthenticationError):
            _client(fleet.url, "wrong-key").chat.completions.create(model="tiny", messages=MESSAGES)
        fake = fleet.fakes[0]
        fake.faults.fail_status = 401  # as a replica whose key changed since its last check
        with pytest.raises(openai.APIStatusError) as caught:
            client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2)
        assert caught.value.status_code == 502
        body = caught.value.response.json()
        _assert_openai_error(body, 502)
        assert "refused the router's API key" in body["error"]["message"]
        assert "--replica-api-key" in body["error"]["message"]
        fake.stop()  # and an upstream that is gone
        with pytest.raises(openai.APIStatusError) as gone:
            client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2)
        assert gone.value.status_code >= 500
        echoed = [
            httpx.get(f"{fleet.url}{p}", headers=_bearer(ROUTER_KEY)).text
            for p in ("/index/stats", "/dashboard/data", "/debug/tokenizer_check", "/metrics")
        ]
        route = {"model": "tiny", "prompt": "hi"}
        echoed.append(
            httpx.post(f"{fleet.url}/debug/route", json=route, headers=_bearer(ROUTER_KEY)).text
        )
    captured = caplog.text
    assert "refused the router's API key" in captured  # the refusal was logged, keyless
    for key in (ROUTER_KEY, REPLICA_KEY):
        assert key not in captured
        assert key not in body["error"]["message"]
        for text in echoed:
            assert key not in text
    assert ROUTER_KEY not in repr(fleet.settings) and REPLICA_KEY not in repr(fleet.settings)


# --- configuration -----------------------------------------------------------------------------


def _serve_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["--replica", "http://127.0.0.1:9", *argv])


def test_keys_from_flags_files_and_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KVROUTE_API_KEY", raising=False)
    monkeypatch.delenv("KVROUTE_REPLICA_API_KEY", raising=False)
    assert settings_from_args(_serve_args()).api_keys == []
    key_file = tmp_path / "key"
    key_file.write_text(f"  {ROUTER_KEY}  \nsecond line ignored\n")
    replica_file = tmp_path / "replica-key"
    replica_file.write_text(REPLICA_KEY + "\n")
    s = settings_from_args(
        _serve_args("--api-key-file", str(key_file), "--replica-api-key-file", str(replica_file))
    )
    assert s.api_keys == [ROUTER_KEY] and s.replica_api_key == REPLICA_KEY
    monkeypatch.setenv("KVROUTE_API_KEY", "from-env")
    monkeypatch.setenv("KVROUTE_REPLICA_API_KEY", "replica-from-env")
    s = settings_from_args(_serve_args())
    assert s.api_keys == ["from-env"] and s.replica_api_key == "replica-from-env"
    s = settings_from_args(_serve_args("--api-key", "a", "b", "--api-key", "c"))
    assert s.api_keys == ["a", "b", "c"]  # the flag wins; several keys, as vLLM takes
    s = settings_from_args(_serve_args("--api-key-file", str(key_file)))
    assert s.api_keys == [ROUTER_KEY]  # a file wins over the variable


def test_bad_keys_are_refused_without_echoing_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KVROUTE_API_KEY", raising=False)
    for bad in ("", "   "):
        with pytest.raises(ConfigError, match="empty"):
            RouterSettings(api_keys=[bad])
        with pytest.raises(ConfigError, match="empty"):
            RouterSettings(replica_api_key=bad)
    with pytest.raises(ConfigError, match="printable ASCII") as caught:
        RouterSettings(api_keys=["has space-secret"])
    assert "secret" not in str(caught.value)
    with pytest.raises(ConfigError, match="needs an api key"):
        RouterSettings(api_key_protects_metrics=True)
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ConfigError, match="empty"):
        settings_from_args(_serve_args("--api-key-file", str(empty)))
    with pytest.raises(ConfigError, match="cannot read"):
        settings_from_args(_serve_args("--api-key-file", str(tmp_path / "missing")))
    binary = tmp_path / "binary"
    binary.write_bytes(b"\xff\xfe-not-text")
    with pytest.raises(ConfigError, match="not UTF-8"):
        settings_from_args(_serve_args("--api-key-file", str(binary)))
    monkeypatch.setenv("KVROUTE_API_KEY", "")
    with pytest.raises(ConfigError, match="empty"):
        settings_from_args(_serve_args())


# --- kvroute up --------------------------------------------------------------------------------


def test_kvroute_up_passes_keys_to_its_children_off_argv(tmp_path: Path) -> None:
    """``kvroute up --engine sim`` with both keys from the environment: the router wants the
    client's key and sends the replicas theirs, and no child's command line, log or the
    fleet manifest holds either key."""
    state = tmp_path / "fleet"
    env = {**os.environ, "KVROUTE_API_KEY": ROUTER_KEY, "KVROUTE_REPLICA_API_KEY": REPLICA_KEY}
    cmd = [sys.executable, "-m", "kvroute.deploy.cli", "up", "--engine", "sim"]
    cmd += ["--replicas", "1", "--port", "0", "--state-dir", str(state)]
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        printed = wait_until_up(proc, timeout=120)
        manifest = json.loads((state / "fleet.json").read_text())
        url = manifest["routers"]["router"]["url"]
        replica_url = manifest["replicas"][0]["url"]
        chat = _client(url, ROUTER_KEY).chat.completions.create(
            model=manifest["served_model_name"], messages=MESSAGES, max_tokens=2
        )
        assert chat.choices[0].message.content
        with pytest.raises(openai.AuthenticationError):
            _client(url, "wrong").models.list()
        assert httpx.get(f"{replica_url}/v1/models").status_code == 401  # the replica's key
        assert httpx.get(f"{replica_url}/v1/models", headers=_bearer(REPLICA_KEY)).is_success
        cmdlines = [
            Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
            for pid in manifest["process_groups"]
        ]
        assert len(cmdlines) == 2  # the simulated fleet and the router
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    texts = [printed, out, json.dumps(manifest), *cmdlines]
    texts += [log.read_text(errors="replace") for log in (state / "logs").glob("*.log")]
    for key in (ROUTER_KEY, REPLICA_KEY):
        for text in texts:
            assert key not in text
