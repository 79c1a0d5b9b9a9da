"""Stream resumption's logic (router/serving/resume.py): what can be resumed, the
continuation's body and path, and how each event of the original and of a continuation is
shown to the client. The whole path (a replica dying mid-answer behind the router, the
official openai client reading one answer) is in test_disagg.py."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import pytest

from kvroute.router.serving.resume import StreamResume, continuation_target, resume_blocker

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True}
COMPLETION = {"model": "tiny", "prompt": "hi", "stream": True}


def _resume(kind: str, body: dict[str, Any], prompt: list[int] | None = None) -> StreamResume:
    # No forwarder or registry: these tests never open a continuation.
    return StreamResume(
        kind,
        body,
        prompt,
        forwarder=None,  # type: ignore[arg-type]
        registry=None,  # type: ignore[arg-type]
        ranked=[],
        target="/v1/chat/completions" if kind == "chat" else "/v1/completions",
        headers=[],
        commit=None,
    )


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + msgspec.json.encode(obj)


def _shown(event: bytes) -> dict[str, Any]:
    assert event.startswith(b"data: ")
    out = msgspec.json.decode(event[6:])
    assert isinstance(out, dict)
    return out


@pytest.mark.parametrize(
    ("kind", "extra", "why"),
    [
        ("chat", {}, None),
        ("completion", {}, None),
        ("completion", {"prompt": [1, 2, 3]}, None),
        ("completion", {"prompt": ["one prompt"]}, None),
        ("chat", {"tools": [{"type": "function"}], "tool_choice": "none"}, None),
        ("chat", {"response_format": {"type": "text"}}, None),
        ("responses", {}, "endpoint"),
        ("chat", {"stream": False}, "not streamed"),
        ("chat", {"n": 2}, "several answers"),
        ("completion", {"best_of": 3}, "several answers"),
        ("chat", {"logprobs": True}, "logprobs"),
        ("chat", {"top_logprobs": 2}, "logprobs"),
        ("completion", {"logprobs": 1}, "logprobs"),
        ("completion", {"echo": True}, "prompt logprobs or echo"),
        ("completion", {"prompt_logprobs": 0}, "prompt logprobs or echo"),
        ("chat", {"tools": [{"type": "function"}]}, "tools"),
        ("chat", {"response_format": {"type": "json_object"}}, "structured output"),
        ("completion", {"structured_outputs": {"regex": "a+"}}, "structured output"),
        ("completion", {"prompt": ["a", "b"]}, "a batch of prompts"),
        ("completion", {"suffix": "x"}, "suffix"),
        ("chat", {"stop": ["\n"]}, "stop strings"),
        ("completion", {"stop": "END"}, "stop strings"),
        ("completion", {"stop": []}, None),
    ],
)
def test_what_can_be_resumed(kind: str, extra: dict[str, Any], why: str | None) -> None:
    base = CHAT if kind == "chat" else COMPLETION
    assert resume_blocker(kind, {**base, **extra}) == why


def test_a_multimodal_prompt_is_not_resumed() -> None:
    assert resume_blocker("chat", CHAT, multimodal=True) == "multimodal prompt"


def test_a_continuation_goes_to_completions_beside_the_clients_endpoint() -> None:
    assert continuation_target("chat", "/v1/chat/completions") == "/v1/completions"
    assert continuation_target("chat", "/x/v1/chat/completions?a=1") == "/x/v1/completions?a=1"
    assert continuation_target("completion", "/v1/completions") == "/v1/completions"


def test_the_upstream_body_asks_for_the_ids() -> None:
    body = msgspec.json.decode(_resume("chat", CHAT).upstream_body())
    assert body == {**CHAT, "return_token_ids": True}


def test_the_original_streams_ids_hidden_from_a_client_that_did_not_ask() -> None:
    r = _resume("chat", CHAT, prompt=[9, 9])
    first = {
        "id": "chatcmpl-1",
        "created": 5,
        "model": "tiny",
        "prompt_token_ids": [1, 2, 3],
        "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}],
    }
    shown, failed = r._event(_sse(first), original=True)
    assert failed is None
    assert _shown(shown)["prompt_token_ids"] is None  # vLLM's own value without the flag
    assert r.prompt == [1, 2, 3]  # the replica's ids win over the router's
    chunk = {"id": "chatcmpl-1", "choices": [{"index": 0, "delta": {"content": "a b"}}]}
    chunk["choices"][0]["token_ids"] = [7, 8]
    shown, _ = r._event(_sse(chunk), original=True)
    assert _shown(shown)["choices"][0]["token_ids"] is None
    assert _shown(shown)["choices"][0]["delta"] == {"content": "a b"}
    assert r.generated == [7, 8] and r.tracking and not r.finished
    assert r.head == {"id": "chatcmpl-1", "created": 5, "model": "tiny"}


def test_a_client_that_asked_for_the_ids_sees_them() -> None:
    r = _resume("completion", {**COMPLETION, "return_token_ids": True})
    chunk = {"choices": [{"index": 0, "text": "x", "token_ids": [4], "prompt_token_ids": [1]}]}
    shown, _ = r._event(_sse(chunk), original=True)
    assert _shown(shown)["choices"][0]["token_ids"] == [4]
    assert _shown(shown)["choices"][0]["prompt_token_ids"] == [1]
    assert (r.prompt, r.generated) == ([1], [4])


@pytest.mark.parametrize(
    "delta",
    [
        {"content": "text without ids"},
        {"reasoning_content": "thinking", "content": None},
        {"tool_calls": [{"index": 0, "function": {"arguments": "{"}}]},
    ],
)
def test_an_answer_whose_ids_are_not_known_or_that_a_parser_shaped_is_not_resumed(
    delta: dict[str, Any],
) -> None:
    r = _resume("chat", CHAT, prompt=[1])
    choice: dict[str, Any] = {"index": 0, "delta": delta}
    if "content" not in delta or delta["content"] is None:
        choice["token_ids"] = [3]
    r._event(_sse({"choices": [choice]}), original=True)
    assert not r.tracking
    assert r._blocker() == "the streamed ids are not known"


def test_a_server_error_event_is_a_break_and_a_client_error_event_is_relayed() -> None:
    r = _resume("chat", CHAT, prompt=[1])
    shown, failed = r._event(_sse({"error": {"message": "engine dead", "code": 500}}), True)
    assert shown == b"" and failed is not None and "engine dead" in failed
    event = _sse({"error": {"message": "bad", "code": 400}})
    assert r._event(event, True) == (event, None)
    assert r._event(b"data: [DONE]", True) == (b"data: [DONE]", None)


def test_the_continuation_body_goes_on_from_the_streamed_ids() -> None:
    body = {
        **CHAT,
        "max_completion_tokens": 10,
        "min_tokens": 4,
        "temperature": 0.0,
        "seed": 7,
        "stop_token_ids": [2],
        "chat_template_kwargs": {"x": 1},
        "stream_options": {"include_usage": True},
        "priority": 3,
    }
    r = _resume("chat", body, prompt=[1, 2])
    r.generated = [5, 6, 7]
    out = r.continuation_body()
    assert out == {
        "model": "tiny",
        "temperature": 0.0,
        "seed": 7,
        "stop_token_ids": [2],
        "priority": 3,
        "prompt": [1, 2, 5, 6, 7],
        "max_tokens": 7,
        "min_tokens": 1,
        "stream": True,
        "return_token_ids": True,
        "stream_options": {"include_usage": True},
    }
    r.generated = [5, 6, 7, 8]
    assert "min_tokens" not in r.continuation_body()
    # No budget given: vLLM's default (the rest of the context) applies to the rest too.
    plain = _resume("completion", COMPLETION, prompt=[1])
    assert "max_tokens" not in plain.continuation_body()


def test_a_continuations_events_are_shown_in_the_originals_framing() -> None:
    r = _resume("chat", {**CHAT, "stream_options": {"include_usage": True}}, prompt=[1, 2, 3])
    r.head = {"id": "chatcmpl-1", "created": 5, "model": "tiny"}
    r.generated, r.offset = [7, 8], 2
    piece = {
        "id": "cmpl-other",
        "object": "text_completion",
        "created": 99,
        "model": "tiny",
        "choices": [{"index": 0, "text": " c", "token_ids": [9], "prompt_token_ids": [1]}],
    }
    shown, failed = r._event(_sse(piece), original=False)
    assert failed is None
    assert _shown(shown) == {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 5,
        "model": "tiny",
        "choices": [
            {
                "index": 0,
                "delta": {"content": " c"},
                "logprobs": None,
                "finish_reason": None,
                "stop_reason": None,
                "token_ids": None,
            }
        ],
    }
    assert r.generated == [7, 8, 9]
    # An empty piece with nothing to say is dropped, as vLLM's chat stream drops it.
    empty = {"choices": [{"index": 0, "text": "", "token_ids": []}]}
    assert r._event(_sse(empty), original=False) == (b"", None)
    usage = {
        "choices": [],
        "usage": {
            "prompt_tokens": 5,
            "completion_tokens": 3,
            "total_tokens": 8,
            "prompt_tokens_details": {"cached_tokens": 5},
        },
    }
    shown, _ = r._event(_sse(usage), original=False)
    assert _shown(shown)["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 5,
        "total_tokens": 8,
        "prompt_tokens_details": {"cached_tokens": 3},
    }


def test_the_budget_spent_means_only_the_end_was_lost() -> None:
    r = _resume("completion", {**COMPLETION, "max_tokens": 2}, prompt=[1])
    r.generated = [4]
    assert not r._spent()
    r.generated = [4, 5]
    assert r._spent()


def test_ids_whose_text_vllm_still_holds_back_are_computed_again() -> None:
    """The streamed ids end inside a character: vLLM sent no text for its bytes yet, and
    primed with them its incremental detokenizer would answer the prompt's text (see
    tests/e2e/test_resume_e2e.py). The replica's /detokenize says where text ends."""
    texts = {(1, 2, 3, 250, 251): "ab\ufffd", (1, 2, 3, 250): "ab\ufffd", (1, 2, 3): "ab"}
    asked: list[list[int]] = []

    async def detokenize(ids: list[int]) -> str | None:
        asked.append(ids)
        return texts[tuple(ids)]

    r = _resume("chat", CHAT, prompt=[9])
    r.generated = [1, 2, 3, 250, 251]
    assert asyncio.run(r.drop_held_back(detokenize)) == 2
    assert r.generated == [1, 2, 3] and len(asked) == 3

    async def unknown(ids: list[int]) -> str | None:
        return None  # /detokenize failed: go on from every id

    r.generated = [1, 2, 3, 250]
    assert asyncio.run(r.drop_held_back(unknown)) == 0 and r.generated == [1, 2, 3, 250]
