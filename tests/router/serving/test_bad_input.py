"""Client mistakes get OpenAI-schema errors with the right status, never a 500, and lose
nothing: the router keeps serving afterwards."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.router.sim_fleet import Fleet

CASES = [
    # (path, raw body, status, param)
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b"", 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", b'{"prompt": "x"}', 400, "model"),
    ("/v1/completions", b'{"model": 5, "prompt": "x"}', 400, "model"),
    ("/v1/completions", b'{"model": "tiny"}', 400, "prompt"),
    ("/v1/completions", b'{"model": "tiny", "prompt": 3}', 400, "prompt"),
    ("/v1/completions", b'{"model": "tiny", "prompt": []}', 400, "prompt"),
    ("/v1/completions", b'{"model": "tiny", "prompt": [1, "a"]}', 400, "prompt"),
    ("/v1/completions", b'{"model": "tiny", "prompt": [-1]}', 400, "prompt"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "stream": "yes"}', 400, "stream"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "max_tokens": "9"}', 400, "max_tokens"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "max_tokens": true}', 400, "max_tokens"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "cache_salt": 1}', 400, "cache_salt"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "n": 129}', 400, "n"),
    ("/v1/chat/completions", b'{"model": "tiny"}', 400, "messages"),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": []}', 400, "messages"),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": "hi"}', 400, "messages"),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"content": "x"}]}', 400, "messages"),
    (
        "/v1/chat/completions",
        b'{"model": "tiny", "messages": [{"role": "user", "content": 7}]}',
        400,
        "messages",
    ),
    (
        "/v1/chat/completions",
        b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}],'
        b' "continue_final_message": true}',
        400,
        "continue_final_message",
    ),
    (
        "/v1/chat/completions",
        b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}],'
        b' "chat_template_kwargs": []}',
        400,
        "chat_template_kwargs",
    ),
    ("/v1/completions", b'{"model": "nope", "prompt": "x"}', 404, "model"),
    (
        "/v1/chat/completions",
        b'{"model": "nope", "messages": [{"role": "user", "content": "x"}]}',
        404,
        "model",
    ),
    ("/tokenize", b"{bad", 400, None),
    ("/tokenize", b'{"model": "nope", "prompt": "x"}', 404, "model"),
    ("/debug/route", b'{"model": "tiny"}', 400, "prompt"),
    ("/debug/route", b"nope", 400, None),
    # not UTF-8 inside a JSON string: msgspec raises UnicodeDecodeError, not a DecodeError
    ("/v1/completions", b'{"model": "tiny", "prompt": "\xff\xfe"}', 400, None),
    ("/tokenize", b'{"model": "tiny", "prompt": "\xc3"}', 400, None),
    # nesting past the parser's recursion limit, and past the router's own depth limit
    ("/v1/completions", b"[" * 5000 + b"]" * 5000, 400, None),
    ("/v1/completions", b'{"a":' * 5000 + b"1" + b"}" * 5000, 400, None),
    (
        "/v1/completions",
        b'{"model": "tiny", "prompt": "x", "x": ' + b"[" * 200 + b"]" * 200 + b"}",
        400,
        None,
    ),
]


def _assert_openai_error(resp: httpx.Response, status: int, param: str | None) -> None:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status and error["message"]
    if param is not None:
        assert error["param"] == param


def test_bad_bodies(fleet: Fleet) -> None:
    with httpx.Client(base_url=fleet.url, timeout=10) as client:
        for path, raw, status, param in CASES:
            resp = client.post(path, content=raw, headers={"content-type": "application/json"})
            _assert_openai_error(resp, status, param)
        assert sum(len(f.seen) for f in fleet.fakes) == 0  # nothing bad was forwarded
        ok = client.post("/v1/completions", json={"model": "tiny", "prompt": "still fine"})
        assert ok.status_code == 200
        metrics = client.get("/metrics").text
        assert 'kvroute_requests_total{endpoint="completions",outcome="client_error"}' in metrics


def test_body_too_large(local_tokenizer) -> None:
    from tests.router.sim_fleet import make_fleet

    with make_fleet(local_tokenizer, max_body_bytes=2048) as fleet:
        big = {"model": "tiny", "prompt": "x" * 5000}
        resp = httpx.post(f"{fleet.url}/v1/completions", json=big)
        _assert_openai_error(resp, 413, None)

        def chunks():  # no Content-Length: the limit is enforced while reading
            for _ in range(10):
                yield b"x" * 1000

        resp = httpx.post(f"{fleet.url}/v1/completions", content=chunks())
        _assert_openai_error(resp, 413, None)
        assert (
            httpx.post(
                f"{fleet.url}/v1/completions", json={"model": "tiny", "prompt": "ok"}
            ).status_code
            == 200
        )


def test_limits_are_settings_and_name_what_was_exceeded(local_tokenizer) -> None:
    from tests.router.sim_fleet import make_fleet

    with make_fleet(local_tokenizer, max_json_depth=4, max_messages=2) as fleet:
        deep = {"model": "tiny", "prompt": "x", "extra": {"a": {"b": {"c": {}}}}}  # 5 levels
        resp = httpx.post(f"{fleet.url}/v1/completions", json=deep)
        _assert_openai_error(resp, 400, None)
        assert "deeper than 4 levels" in resp.json()["error"]["message"]
        ok = {"model": "tiny", "prompt": "x", "extra": {"a": {"b": {}}}}  # 4 levels
        assert httpx.post(f"{fleet.url}/v1/completions", json=ok).status_code == 200
        many = {"model": "tiny", "messages": [{"role": "user", "content": "x"}] * 3}
        resp = httpx.post(f"{fleet.url}/v1/chat/completions", json=many)
        _assert_openai_error(resp, 400, "messages")
        assert "the limit is 2" in resp.json()["error"]["message"]
        assert sum(len(f.seen) for f in fleet.fakes) == 1


def test_a_prompt_past_the_context_length_is_refused_before_it_is_tokenized(
    fleet: Fleet,
) -> None:
    """The replicas report max_model_len 4096 in /v1/models, as vLLM does. A prompt whose
    head alone exceeds it is refused from that head (not 1M words tokenized first)."""
    huge = " ".join(f"w{i % 97}" for i in range(1_000_000))
    with httpx.Client(base_url=fleet.url, timeout=60) as client:
        resp = client.post("/v1/completions", json={"model": "tiny", "prompt": huge})
        _assert_openai_error(resp, 400, "prompt")
        assert "maximum context length is 4096 tokens" in resp.json()["error"]["message"]
        chat = {"model": "tiny", "messages": [{"role": "user", "content": huge}]}
        _assert_openai_error(client.post("/v1/chat/completions", json=chat), 400, "messages")
        ids = {"model": "tiny", "prompt": list(range(5000))}
        resp = client.post("/v1/completions", json=ids)
        _assert_openai_error(resp, 400, "prompt")
        assert "at least 5000 tokens" in resp.json()["error"]["message"]
        assert sum(len(f.seen) for f in fleet.fakes) == 0
        # Long but within the limit (about 3700 of the 4096 tokens): routed as usual.
        fine = " ".join(f"w{i % 97}" for i in range(1300))
        ok = client.post("/v1/completions", json={"model": "tiny", "prompt": fine})
        assert ok.status_code == 200, ok.text


def test_unknown_path_and_method_are_the_replicas_to_answer(fleet: Fleet) -> None:
    """kvroute passes every path it does not serve itself, any method, to a replica: the
    answer is the replica's own (FastAPI's ``{"detail": ...}`` from vLLM), with
    ``x-kvroute-replica`` naming it, which the router's own errors never carry."""
    direct = httpx.get(f"{fleet.servers[0].url}/v1/nothing")
    for method, path, status in (("GET", "/v1/nothing", 404), ("GET", "/v1/completions", 405)):
        resp = httpx.request(method, f"{fleet.url}{path}")
        assert resp.status_code == status, resp.text
        assert resp.headers["x-kvroute-replica"] in fleet.names()
        if status == 404:
            assert resp.content == direct.content
    refused = httpx.post(f"{fleet.url}/v1/completions", content=b"{")
    _assert_openai_error(refused, 400, None)
    assert "x-kvroute-replica" not in refused.headers


def test_openai_client_sees_typed_errors(fleet: Fleet) -> None:
    client = openai.OpenAI(base_url=f"{fleet.url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="missing", prompt="x")
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=[])
