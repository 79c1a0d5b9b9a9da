"""Client mistakes get OpenAI-schema errors with the right status, never a 500, and lose
nothing: the router keeps serving afterwards."""

from __future__ import annotations

import httpx
import openai
import pytest
from router_fleet import Fleet

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
    from router_fleet import make_fleet

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


def test_unknown_path_and_method(fleet: Fleet) -> None:
    _assert_openai_error(httpx.get(f"{fleet.url}/v1/nothing"), 404, None)
    _assert_openai_error(httpx.get(f"{fleet.url}/v1/completions"), 405, None)


def test_openai_client_sees_typed_errors(fleet: Fleet) -> None:
    client = openai.OpenAI(base_url=f"{fleet.url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="missing", prompt="x")
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=[])
