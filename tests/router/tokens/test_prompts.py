"""kvroute.router.tokens.prompts against vLLM 0.32's own conversions (installed here): the
conversation the router renders for a Responses or an Anthropic request is the one vLLM renders,
message for message, and the other endpoints' prompts and batches are read as vLLM reads them."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from kvroute.router.errors import RouterError
from kvroute.router.tokens.prompts import PROMPT_PARSERS, anthropic_messages, response_messages
from kvroute.router.tokens.requests import RequestLimits, parse_body
from kvroute.router.tokens.tokenization import flatten_messages

LIMITS = RequestLimits()

RESPONSE_BODIES: list[dict[str, Any]] = [
    {"model": "m", "input": "Hello there"},
    {"model": "m", "instructions": "Be brief.", "input": "Hello there"},
    {
        "model": "m",
        "instructions": "Be brief.",
        "input": [
            {"role": "developer", "content": "Use metric units."},
            {
                "type": "message",
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "First line."},
                    {"type": "input_text", "text": "Second line."},
                ],
            },
            {
                "type": "message",
                "id": "msg_1",
                "status": "completed",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "Noted.", "annotations": []}],
            },
            {
                "type": "function_call",
                "call_id": "call_1",
                "name": "get_weather",
                "arguments": '{"city": "Oslo"}',
            },
            {"type": "function_call_output", "call_id": "call_1", "output": "7 C, rain"},
            {"role": "user", "content": "And tomorrow?"},
        ],
    },
    {
        "model": "m",
        "input": [
            {
                "type": "reasoning",
                "id": "rs_1",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": "Think first."}],
            },
            {
                "type": "message",
                "id": "msg_2",
                "status": "completed",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "Done.", "annotations": []}],
            },
            {"role": "user", "content": "Next."},
        ],
    },
]


def _same_shape(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What a chat template sees of each message (vLLM's parser joins text parts)."""
    keys = ("role", "content", "tool_calls", "tool_call_id", "reasoning", "name")
    out = []
    for message in flatten_messages([dict(m) for m in messages]):
        out.append({k: message[k] for k in keys if message.get(k) is not None})
    return out


@pytest.mark.parametrize("body", RESPONSE_BODIES)
def test_responses_input_becomes_the_messages_vllm_renders(body: dict[str, Any]) -> None:
    protocol = pytest.importorskip("vllm.entrypoints.openai.responses.protocol")
    utils = pytest.importorskip("vllm.entrypoints.openai.responses.utils")
    request = protocol.ResponsesRequest.model_validate(copy.deepcopy(body))  # it mutates
    theirs = utils.construct_input_messages(
        request_instructions=request.instructions, request_input=request.input
    )
    theirs = [m if isinstance(m, dict) else m.model_dump() for m in theirs]
    assert _same_shape(response_messages(body)) == _same_shape(theirs)


ANTHROPIC_BODIES: list[dict[str, Any]] = [
    {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]},
    {
        "model": "m",
        "max_tokens": 8,
        "system": [
            {"type": "text", "text": "x-anthropic-billing-header: abc"},
            {"type": "text", "text": "You are terse."},
        ],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Weather in Oslo?"}]},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "Call the tool.", "signature": "s"},
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "tu_1", "name": "weather", "input": {"c": "Oslo"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "tu_1", "content": "7 C"},
                    {"type": "text", "text": "Thanks."},
                    {"type": "text", "text": "Tomorrow?"},
                ],
            },
        ],
        "tools": [
            {
                "name": "weather",
                "description": "Weather by city",
                "input_schema": {"type": "object", "properties": {"c": {"type": "string"}}},
            }
        ],
    },
]


@pytest.mark.parametrize("body", ANTHROPIC_BODIES)
def test_anthropic_messages_become_the_chat_vllm_renders(body: dict[str, Any]) -> None:
    protocol = pytest.importorskip("vllm.entrypoints.anthropic.protocol")
    serving = pytest.importorskip("vllm.entrypoints.anthropic.serving")
    request = protocol.AnthropicMessagesRequest.model_validate(copy.deepcopy(body))
    chat = serving.AnthropicServingMessages.to_chat_completion_request(request)
    assert _same_shape(anthropic_messages(body)) == _same_shape(list(chat.messages))
    parsed = PROMPT_PARSERS["messages"](body, LIMITS)
    assert parsed is not None and parsed.kind == "chat" and parsed.add_generation_prompt
    if body.get("tools"):
        theirs = [t.model_dump()["function"] for t in chat.tools]
        ours = [t["function"] for t in parsed.tools or []]
        keys = ("name", "description", "parameters")
        assert [{k: t[k] for k in keys} for t in ours] == [{k: t[k] for k in keys} for t in theirs]


def test_a_continuation_is_not_rendered_and_bad_fields_are_400s() -> None:
    assert PROMPT_PARSERS["responses"]({"input": "x", "previous_response_id": "r"}, LIMITS) is None
    for body, param in (
        ({"model": "m"}, "input"),
        ({"model": "m", "input": 5}, "input"),
        ({"model": "m", "input": [5]}, "input"),
        ({"model": "m", "input": "x", "instructions": 1}, "instructions"),
        ({"model": 3, "input": "x"}, "model"),
    ):
        with pytest.raises(RouterError) as err:
            PROMPT_PARSERS["responses"](body, LIMITS)
        assert (err.value.status, err.value.param) == (400, param)


def test_pooling_inputs_and_batches_are_read_like_completion_prompts() -> None:
    embed = PROMPT_PARSERS["embeddings"]
    one = embed({"model": "m", "input": "a b c"}, LIMITS)
    assert one is not None and (one.prompt, one.batch, one.add_special_tokens) == (
        "a b c",
        None,
        True,
    )
    many = embed({"model": "m", "input": ["a", "b"], "add_special_tokens": False}, LIMITS)
    assert many is not None and many.batch == ["a", "b"] and not many.add_special_tokens
    ids = embed({"input": [[1, 2], [3]]}, LIMITS)
    assert ids is not None and ids.batch == [[1, 2], [3]] and ids.model == ""
    chat = PROMPT_PARSERS["pooling"](
        {"model": "m", "messages": [{"role": "user", "content": "hi"}]}, LIMITS
    )
    assert chat is not None and chat.kind == "chat" and not chat.add_generation_prompt
    assert PROMPT_PARSERS["pooling"]({"model": "m", "data": {"x": 1}}, LIMITS) is None
    rerank = PROMPT_PARSERS["rerank"](
        {"model": "m", "query": "q", "documents": ["d1", "d2"]}, LIMITS
    )
    assert rerank is not None and rerank.batch == ["q", "d1", "d2"]
    gen = PROMPT_PARSERS["generate"]({"model": "m", "token_ids": [5, 6, 7]}, LIMITS)
    assert gen is not None and gen.prompt == [5, 6, 7] and gen.batch is None
    with pytest.raises(RouterError):
        embed({"model": "m", "input": []}, LIMITS)


def test_completion_batches_keep_every_prompt() -> None:
    batch = parse_body(b'{"model": "m", "prompt": ["a", "b", "c"]}', "completion")
    assert batch.prompt == "a" and batch.batch == ["a", "b", "c"]
    single = parse_body(b'{"model": "m", "prompt": ["a"]}', "completion")
    assert single.prompt == "a" and single.batch is None
    ids = parse_body(b'{"model": "m", "prompt": [1, 2, 3]}', "completion")
    assert ids.prompt == [1, 2, 3] and ids.batch is None
