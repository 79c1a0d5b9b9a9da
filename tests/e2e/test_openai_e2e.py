"""The official ``openai`` client through the router: chat and completions, streaming and
not, and errors in OpenAI's schema."""

from __future__ import annotations

import openai
import pytest
from openai import OpenAI

from kvroute.deploy.local_fleet import LocalFleet
from tests.e2e.helpers import words

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def client(fleet: LocalFleet) -> OpenAI:
    return OpenAI(base_url=fleet.router_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_models_lists_the_fleet_model(client: OpenAI, fleet: LocalFleet) -> None:
    assert fleet.served_model_name in [m.id for m in client.models.list()]


def test_chat_non_streaming(client: OpenAI, fleet: LocalFleet) -> None:
    out = client.chat.completions.create(
        model=fleet.served_model_name,
        messages=[
            {"role": "system", "content": "Be brief. " + words(30, "oa-sys")},
            {"role": "user", "content": "Say something."},
        ],
        max_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content
    assert out.usage is not None and out.usage.completion_tokens == 6
    assert out.usage.prompt_tokens_details is not None  # the fleet reports cached tokens


def test_chat_streaming_with_usage(client: OpenAI, fleet: LocalFleet) -> None:
    stream = client.chat.completions.create(
        model=fleet.served_model_name,
        messages=[{"role": "user", "content": "Stream please. " + words(20, "oa-stream")}],
        max_tokens=7,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks, pieces, finish, usage = 0, [], None, None
    for chunk in stream:
        chunks += 1
        pieces += [c.delta.content for c in chunk.choices if c.delta and c.delta.content]
        finish = next((c.finish_reason for c in chunk.choices if c.finish_reason), finish)
        usage = chunk.usage or usage
    # A role chunk, content chunk(s) and the usage chunk, as separate SSE events. (vLLM may
    # merge several tokens into one content chunk when the reader lags, so no more is sure.)
    assert chunks >= 3
    assert "".join(pieces) and finish == "length"
    assert usage is not None and usage.completion_tokens == 7


def test_completions_streaming_and_not_agree(client: OpenAI, fleet: LocalFleet) -> None:
    prompt = "The quick brown fox " + words(40, "oa-cmpl")
    whole = client.completions.create(
        model=fleet.served_model_name, prompt=prompt, max_tokens=8, temperature=0
    )
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=fleet.served_model_name, prompt=prompt, max_tokens=8, temperature=0, stream=True
        )
        if c.choices
    )
    # Greedy decoding on the same prompt: the same text, whichever replica served each.
    assert whole.choices[0].text == streamed


def test_unknown_model_is_an_openai_404(client: OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
    assert "no-such-model" in str(info.value)


def test_bad_request_is_an_openai_400(client: OpenAI, fleet: LocalFleet) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=fleet.served_model_name, messages=[], max_tokens=2)
    body = info.value.body
    assert isinstance(body, dict) and body.get("message")
