"""The simulated replica's answers to /v1/completions and /v1/chat/completions, in vLLM
0.32's shapes: the whole JSON answer and the SSE stream (a chat stream's role chunk first,
one chunk per decode step, ``stream_options``' usage, ``data: [DONE]``), with vLLM's
``return_token_ids`` (the prompt's ids in the first chunk: top level for chat, in the choice
for completions; each chunk's output ids in its choice). kvroute.bench.sim.api validates the
request and runs the generation; this module only shapes what it produced.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvroute.bench.sim.faults import ReplicaFaults
from kvroute.bench.sim.http_common import sse_data
from kvroute.bench.sim.replica import Generation, InjectedError
from kvroute.bench.sim.scheduler import ReplicaDied

__all__ = ["AnswerShape", "sse_answer", "usage", "whole_answer"]


@dataclass(frozen=True, slots=True)
class AnswerShape:
    """What every piece of one answer carries."""

    rid: str
    created: int
    model: str
    chat: bool
    decode: Callable[[Sequence[int]], str]
    prompt_ids: list[int] | None = None  # ``return_token_ids``: the prompt as computed

    def head(self, obj: str) -> dict[str, Any]:
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model}


def usage(state: Generation) -> dict[str, Any]:
    return {
        "prompt_tokens": state.prompt_tokens,
        "completion_tokens": len(state.output),
        "total_tokens": state.prompt_tokens + len(state.output),
        "prompt_tokens_details": {"cached_tokens": state.cached_tokens},
    }


def whole_answer(shape: AnswerShape, state: Generation) -> dict[str, Any]:
    """The non-streamed answer."""
    text = shape.decode(state.output)
    if shape.chat:
        choice: dict[str, Any] = {
            "index": 0,
            "message": {
                "role": "assistant",
                "content": text,
                "tool_calls": [],
                "reasoning_content": None,
            },
            "logprobs": None,
            "finish_reason": "length",
            "stop_reason": None,
        }
    else:
        choice = {
            "index": 0,
            "text": text,
            "logprobs": None,
            "finish_reason": "length",
            "stop_reason": None,
            "prompt_logprobs": None,
        }
    extra: dict[str, Any] = {}
    if shape.prompt_ids is not None:  # vLLM's return_token_ids
        choice["token_ids"] = list(state.output)
        if shape.chat:
            extra["prompt_token_ids"] = list(shape.prompt_ids)
        else:
            choice["prompt_token_ids"] = list(shape.prompt_ids)
    return {
        **extra,
        **shape.head("chat.completion" if shape.chat else "text_completion"),
        "choices": [choice],
        "usage": usage(state),
        "system_fingerprint": None,
        "service_tier": None,
        "kv_transfer_params": state.kv_transfer_params,
    }


async def sse_answer(
    shape: AnswerShape,
    gen: AsyncIterator[tuple[Generation, list[int]]],
    first: tuple[Generation, list[int]],
    faults: ReplicaFaults,
    *,
    include_usage: bool,
    continuous_usage: bool,
) -> AsyncIterator[bytes]:
    """The SSE body, from the generation's first step on. ``faults.die_after_chunks`` breaks
    it (read as it goes: a test may set it while the answer streams); a replica that dies
    just stops it, without ``[DONE]``, as a killed process does."""
    chat, prompt_ids = shape.chat, shape.prompt_ids
    obj = "chat.completion.chunk" if chat else "text_completion"
    first_chunk = [not chat]  # completions carry the prompt's ids in their first chunk

    def chunk(state: Generation, delta_ids: list[int], finish: str | None) -> bytes:
        text = shape.decode(delta_ids)
        if chat:
            choice: dict[str, Any] = {
                "index": 0,
                "delta": {"content": text},
                "logprobs": None,
                "finish_reason": finish,
                "stop_reason": None,
            }
        else:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": finish,
                "stop_reason": None,
            }
        if prompt_ids is not None:
            choice["token_ids"] = list(delta_ids)
            if first_chunk[0]:
                choice["prompt_token_ids"] = list(prompt_ids)
                first_chunk[0] = False
        out = {**shape.head(obj), "choices": [choice]}
        if include_usage and continuous_usage:
            out["usage"] = usage(state)
        return sse_data(out)

    state, ids = first
    async with contextlib.aclosing(gen):  # type: ignore[type-var]
        if chat:
            role: dict[str, Any] = {
                **shape.head(obj),
                "choices": [
                    {
                        "index": 0,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ],
            }
            if prompt_ids is not None:
                role["prompt_token_ids"] = list(prompt_ids)
            yield sse_data(role)
        done = len(state.output) >= state.max_tokens
        yield chunk(state, ids, "length" if done else None)
        sent = 1
        try:
            async for state, ids in gen:
                if sent == faults.die_after_chunks:
                    raise InjectedError("injected mid-stream death")
                done = len(state.output) >= state.max_tokens
                yield chunk(state, ids, "length" if done else None)
                sent += 1
        except ReplicaDied:
            return
    if include_usage:
        yield sse_data({**shape.head(obj), "choices": [], "usage": usage(state)})
    yield b"data: [DONE]\n\n"
