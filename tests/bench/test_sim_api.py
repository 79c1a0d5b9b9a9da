"""A simulated replica from outside, through the official openai client and plain HTTP:
the endpoints, shapes and errors of vLLM's OpenAI server."""

from __future__ import annotations

import httpx
import openai
import pytest

from kvroute.bench.sim.fleet import SimFleet
from kvroute.bench.sim.tokenizer import SimTokenizer
from kvroute.router.fleet.replicas import parse_vllm_metrics

SYSTEM = "You are a helpful assistant. " + "Answer with care and cite the document. " * 20


def _client(fleet: SimFleet, i: int = 0) -> openai.OpenAI:
    return openai.OpenAI(base_url=fleet.replicas[i].url + "/v1", api_key="unused", max_retries=0)


def _messages(question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def test_chat_non_streaming_reports_cached_tokens(sim_fleet: SimFleet) -> None:
    client = _client(sim_fleet)
    first = client.chat.completions.create(
        model="kvroute-sim", messages=_messages("What is a cache?"), max_tokens=5
    )
    assert first.object == "chat.completion"
    assert first.choices[0].message.role == "assistant"
    assert first.choices[0].message.content
    assert first.choices[0].finish_reason == "length"
    assert first.usage is not None and first.usage.completion_tokens == 5
    again = client.chat.completions.create(
        model="kvroute-sim", messages=_messages("What is a router?"), max_tokens=5
    )
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    cached = again.usage.prompt_tokens_details.cached_tokens
    # The shared system prompt is cached, in whole blocks, and the new question is not.
    assert cached is not None and 0 < cached < again.usage.prompt_tokens
    assert cached % 16 == 0


def test_chat_streaming_with_usage(sim_fleet: SimFleet) -> None:
    stream = _client(sim_fleet).chat.completions.create(
        model="kvroute-sim",
        messages=_messages("Stream please."),
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.strip()
    finals = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finals[-1] == "length" and all(f is None for f in finals[:-1])
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert usage.completion_tokens == 12 and usage.prompt_tokens > 0


def test_raw_sse_ends_with_done(sim_fleet: SimFleet) -> None:
    body = {"model": "kvroute-sim", "prompt": "hello there", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", sim_fleet.replicas[0].url + "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in resp.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert all(line.startswith("data: ") for line in lines)


def test_completions_text_and_token_ids(sim_fleet: SimFleet) -> None:
    client = _client(sim_fleet)
    out = client.completions.create(
        model="kvroute-sim", prompt="The quick brown fox " * 10, max_tokens=4
    )
    assert out.object == "text_completion" and out.choices[0].text
    ids = httpx.post(
        sim_fleet.replicas[0].url + "/tokenize", json={"prompt": "The quick brown fox " * 10}
    ).json()
    by_ids = client.completions.create(model="kvroute-sim", prompt=ids["tokens"], max_tokens=4)
    assert by_ids.usage is not None and out.usage is not None
    assert by_ids.usage.prompt_tokens == out.usage.prompt_tokens == ids["count"]
    # Same prompt, same (deterministic) answer, and now from the cache.
    assert by_ids.choices[0].text == out.choices[0].text
    assert by_ids.usage.prompt_tokens_details is not None
    assert by_ids.usage.prompt_tokens_details.cached_tokens > 0


def test_tokenize_matches_transformers_chat_template(sim_fleet: SimFleet) -> None:
    tok = SimTokenizer(sim_fleet.model_dir)
    messages = _messages("How many tokens?")
    resp = httpx.post(sim_fleet.replicas[1].url + "/tokenize", json={"messages": messages})
    body = resp.json()
    text = tok.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    expected = tok.tok.encode(text, add_special_tokens=False)
    assert body["tokens"] == expected and body["count"] == len(expected)
    assert body["max_model_len"] == 8192
    back = httpx.post(sim_fleet.replicas[1].url + "/detokenize", json={"tokens": expected}).json()
    assert back["prompt"] == tok.tok.decode(expected)


def test_models_health_and_metrics(sim_fleet: SimFleet) -> None:
    url = sim_fleet.replicas[2].url
    models = _client(sim_fleet, 2).models.list()
    assert [m.id for m in models.data] == ["kvroute-sim"]
    assert httpx.get(url + "/health").status_code == 200
    before = httpx.get(url + "/metrics").text
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:external_prefix_cache_hits_total",
        "vllm:time_to_first_token_seconds_bucket",
    ):
        assert name in before, name
    client = _client(sim_fleet, 2)
    for q in ("one", "two"):
        client.chat.completions.create(model="kvroute-sim", messages=_messages(q), max_tokens=2)
    after = httpx.get(url + "/metrics").text

    def value(text: str, name: str) -> float:
        line = next(ln for ln in text.splitlines() if ln.startswith(name + "{"))
        return float(line.rsplit(" ", 1)[1])

    assert value(after, "vllm:prefix_cache_queries_total") > value(
        before, "vllm:prefix_cache_queries_total"
    )
    assert value(after, "vllm:prefix_cache_hits_total") > value(
        before, "vllm:prefix_cache_hits_total"
    )
    assert value(after, "vllm:time_to_first_token_seconds_count") >= 2
    # vLLM's cache-config info gauge, read by the router as the device cache's size
    assert parse_vllm_metrics(after)["kv_blocks"] == 48


@pytest.mark.parametrize(
    ("body", "status", "etype", "param"),
    [
        (
            {"model": "nope", "messages": [{"role": "user", "content": "x"}]},
            404,
            "NotFoundError",
            "model",
        ),
        ({"model": "kvroute-sim"}, 400, "BadRequestError", "messages"),
        ({"model": "kvroute-sim", "messages": "hi"}, 400, "BadRequestError", "messages"),
        (
            {
                "model": "kvroute-sim",
                "messages": [{"role": "user", "content": "x"}],
                "max_tokens": 0,
            },
            400,
            "BadRequestError",
            "max_tokens",
        ),
        (
            {
                "model": "kvroute-sim",
                "messages": [{"role": "user", "content": "x"}],
                "max_tokens": 9000,
            },
            400,
            "BadRequestError",
            None,
        ),
        (
            {"model": "kvroute-sim", "messages": [{"role": "user", "content": "x"}], "n": 2},
            400,
            "BadRequestError",
            "n",
        ),
    ],
)
def test_errors_use_vllm_schema(
    sim_fleet: SimFleet, body: dict, status: int, etype: str, param: str | None
) -> None:
    resp = httpx.post(sim_fleet.replicas[0].url + "/v1/chat/completions", json=body)
    assert resp.status_code == status
    err = resp.json()["error"]
    assert err["type"] == etype and err["code"] == status and err["param"] == param
    assert err["message"]


def test_bad_json_and_unknown_path(sim_fleet: SimFleet) -> None:
    url = sim_fleet.replicas[0].url
    resp = httpx.post(
        url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert resp.status_code == 400 and resp.json()["error"]["type"] == "BadRequestError"
    resp = httpx.get(url + "/v2/nothing")
    assert resp.status_code == 404 and "error" in resp.json()
    # The replica is still serving after bad input.
    assert httpx.get(url + "/health").status_code == 200


def test_openai_client_sees_context_length_error(sim_fleet: SimFleet) -> None:
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        _client(sim_fleet).completions.create(model="kvroute-sim", prompt="hi", max_tokens=100_000)
