"""The simulated replica's other vLLM endpoints from outside (bench/sim/more_api.py), through
the official openai client where it has the API: the Responses API with its store, Anthropic
messages, embeddings and pooling, batched completions, /version, and errors in vLLM's schema."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from kvroute.bench.sim.fleet import SimFleet

MODEL = "kvroute-sim"
SYSTEM = "You help with caches. " + "Explain prefix caching in detail. " * 12


def _url(fleet: SimFleet, i: int = 2) -> str:
    return fleet.replicas[i].url


def _client(fleet: SimFleet, i: int = 2) -> openai.OpenAI:
    return openai.OpenAI(base_url=_url(fleet, i) + "/v1", api_key="unused", max_retries=0)


def test_responses_are_stored_retrieved_continued_and_deleted(sim_fleet: SimFleet) -> None:
    client = _client(sim_fleet)
    first = client.responses.create(
        model=MODEL, input=SYSTEM + " What is a block?", max_output_tokens=4
    )
    assert first.object == "response" and first.id.startswith("resp_")
    assert first.status == "incomplete"  # max_output_tokens reached, as vLLM says it
    assert first.output_text and first.usage is not None and first.usage.output_tokens == 4
    again = client.responses.retrieve(first.id)
    assert again.id == first.id and again.output_text == first.output_text
    follow = client.responses.create(
        model=MODEL, input="And a tier?", previous_response_id=first.id, max_output_tokens=2
    )
    # The continuation renders the stored conversation first (less its instructions, which
    # do not carry over): its long first turn is cached.
    assert follow.usage is not None and follow.usage.input_tokens_details.cached_tokens > 0
    with pytest.raises(openai.BadRequestError, match="Cannot cancel a synchronous response"):
        client.responses.cancel(first.id)
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError) as gone:
        client.responses.retrieve(first.id)
    assert gone.value.body["param"] == "response_id"
    with pytest.raises(openai.NotFoundError):
        client.responses.create(
            model=MODEL, input="x", previous_response_id=first.id, max_output_tokens=2
        )


def test_streamed_responses_follow_vllms_event_sequence(sim_fleet: SimFleet) -> None:
    body = {"model": MODEL, "input": "Stream please.", "max_output_tokens": 5, "stream": True}
    resp = httpx.post(_url(sim_fleet) + "/v1/responses", json=body, timeout=30)
    assert resp.headers["content-type"].startswith("text/event-stream")
    events: list[tuple[str, dict[str, Any]]] = []
    for block in (b for b in resp.text.split("\n\n") if b):
        name, data = block.split("\n", 1)
        events.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    kinds = [k for k, _ in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert all(k == "response.output_text.delta" for k in kinds[4:-4]) and len(kinds) > 8
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    assert all(d["type"] == k for k, d in events)
    done = events[-1][1]["response"]
    text = "".join(d["delta"] for k, d in events if k == "response.output_text.delta")
    assert done["output"][0]["content"][0]["text"] == text
    assert done["usage"]["output_tokens"] == 5
    stored = httpx.get(_url(sim_fleet) + f"/v1/responses/{done['id']}", timeout=10).json()
    assert stored["id"] == events[0][1]["response"]["id"] == done["id"]


def test_embeddings_and_pooling(sim_fleet: SimFleet) -> None:
    client = _client(sim_fleet)
    out = client.embeddings.create(model=MODEL, input=[SYSTEM, "short"])  # base64 on the wire
    assert [d.index for d in out.data] == [0, 1]
    assert len(out.data[0].embedding) == 8 and out.data[0].embedding != out.data[1].embedding
    floats = client.embeddings.create(model=MODEL, input=SYSTEM, encoding_format="float")
    assert floats.data[0].embedding == pytest.approx(out.data[0].embedding, abs=1e-6)
    assert out.usage.prompt_tokens == out.usage.total_tokens > 0
    pooled = httpx.post(_url(sim_fleet) + "/pooling", json={"model": MODEL, "input": [1, 2, 3]})
    body = pooled.json()
    assert pooled.status_code == 200 and body["id"].startswith("pool-")
    assert body["data"][0]["object"] == "pooling" and body["usage"]["prompt_tokens"] == 3
    bad = httpx.post(_url(sim_fleet) + "/v1/embeddings", json={"model": MODEL, "input": 5})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "input"


def test_anthropic_messages(sim_fleet: SimFleet) -> None:
    body = {
        "model": MODEL,
        "max_tokens": 3,
        "system": SYSTEM,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
    }
    first = httpx.post(_url(sim_fleet) + "/v1/messages", json=body, timeout=30).json()
    assert first["type"] == "message" and first["stop_reason"] == "max_tokens"
    again = httpx.post(_url(sim_fleet) + "/v1/messages", json=body, timeout=30).json()
    usage = again["usage"]
    assert usage["cache_read_input_tokens"] > 0 and usage["output_tokens"] == 3
    streamed = httpx.post(
        _url(sim_fleet) + "/v1/messages", json={**body, "stream": True}, timeout=30
    ).text
    kinds = [b.split("\n", 1)[0].removeprefix("event: ") for b in streamed.split("\n\n") if b]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]


def test_a_batch_reports_its_last_prompts_cached_tokens(sim_fleet: SimFleet) -> None:
    """As vLLM 0.32 does: usage sums the prompts' tokens, cached_tokens is the last one's."""
    client = _client(sim_fleet, 1)
    cached_prompt = SYSTEM + " batch"
    client.completions.create(model=MODEL, prompt=cached_prompt, max_tokens=1)
    out = client.completions.create(
        model=MODEL, prompt=["a fresh prompt " * 5, cached_prompt + " again"], max_tokens=2
    )
    assert [c.index for c in out.choices] == [0, 1]
    assert out.usage is not None and out.usage.prompt_tokens_details is not None
    assert out.usage.prompt_tokens_details.cached_tokens >= 16 * 10
    flipped = client.completions.create(
        model=MODEL, prompt=[cached_prompt + " once more", "another fresh one " * 5], max_tokens=2
    )
    assert flipped.usage is not None and flipped.usage.prompt_tokens_details is not None
    assert flipped.usage.prompt_tokens_details.cached_tokens == 0


def test_version_and_errors_in_vllms_schema(sim_fleet: SimFleet) -> None:
    assert httpx.get(_url(sim_fleet) + "/version").json() == {"version": "0.32.0"}
    wrong = httpx.put(_url(sim_fleet) + "/v1/responses")
    assert wrong.status_code == 405 and wrong.json()["error"]["code"] == 405
