"""The prompt inside the bodies of vLLM's other endpoints, as a ParsedRequest to route by.

/v1/completions and /v1/chat/completions are parsed by router/tokens/requests.py. This module reads
the other endpoints of vLLM 0.32 that take a prompt and says what vLLM itself will render, so the
router finds the cached prefix the replica will actually use:

- ``/v1/responses``: ``instructions`` (a system message), then ``input``: a string is one
  user message; a list of items is converted as vLLM's ``construct_input_messages`` does
  (messages, ``function_call`` merged into the assistant turn before it,
  ``function_call_output`` as a tool message, ``reasoning`` as the assistant's reasoning),
  rendered with the chat template and ``add_generation_prompt``. Content parts of type
  ``input_text`` / ``output_text`` are text parts, as vLLM's chat parser reads them.
- ``/v1/messages`` (Anthropic): ``system`` (string or text blocks, Claude Code's billing
  header dropped) then ``messages``, blocks converted as vLLM's Anthropic adapter does
  (text, ``tool_use`` as tool calls, ``tool_result`` as tool messages, ``thinking`` as
  reasoning), tools as OpenAI function tools.
- embeddings, ``/pooling``, ``/classify``: ``input`` like a completion prompt (a string,
  strings, token ids, lists of token ids; special tokens added unless
  ``add_special_tokens`` is false) or ``messages`` (or an ``input`` of messages) like a chat
  (``add_generation_prompt`` false by default, as vLLM's pooling requests have it).
- score and rerank: every text of the request (queries first, then documents), each
  tokenized like a completion prompt. An approximation: vLLM tokenizes query/document pairs
  (or renders a score template), whose prefix is the query, so the query's tokens are what
  a cached prefix is found by.
- ``/inference/v1/generate``: ``token_ids``.

A batch (several prompts in one body) is one ParsedRequest whose ``batch`` holds every
prompt: vLLM serves it on one replica, so it is routed as a whole (kvroute.router.routing.router).
``None`` means the body holds nothing the router can tokenize: it is routed by load.
Only fields read here are validated (a 400 naming the field); the replica judges the rest.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from kvroute.router.errors import RouterError
from kvroute.router.tokens.requests import (
    ParsedRequest,
    RequestLimits,
    check_messages,
    check_prompts,
    optional,
)

__all__ = ["PROMPT_PARSERS", "anthropic_messages", "response_messages"]

Parser = Callable[[dict[str, Any], RequestLimits], ParsedRequest | None]
_TEXT_PARTS = ("text", "input_text", "output_text")
_BILLING_HEADER = "x-anthropic-billing-header"


def _bad(message: str, param: str | None = None) -> RouterError:
    return RouterError(400, message, param=param)


def _model(body: dict[str, Any]) -> str:
    """The body's model, or "" when absent (vLLM then uses its served model; the endpoint
    resolves it when the fleet serves exactly one)."""
    model = body.get("model")
    if model is None:
        return ""
    if not isinstance(model, str) or not model:
        raise _bad("'model' must be a non-empty string", "model")
    return model


def _common(body: dict[str, Any]) -> tuple[str, bool, str | None]:
    stream = optional(body, "stream", bool, "a boolean") or False
    return _model(body), stream, optional(body, "cache_salt", str, "a string")


def _truncation(body: dict[str, Any], parsed: ParsedRequest) -> ParsedRequest:
    """vLLM's ``truncate_prompt_tokens`` (pooling requests take it; Responses and Anthropic
    requests have no such field, so theirs is never read)."""
    keep = optional(body, "truncate_prompt_tokens", int, "an integer")
    if keep is not None and keep < -1:
        raise _bad("'truncate_prompt_tokens' must be >= -1", "truncate_prompt_tokens")
    side = body.get("truncation_side")
    if side not in (None, "left", "right"):
        raise _bad("'truncation_side' must be 'left' or 'right'", "truncation_side")
    parsed.truncate_prompt_tokens, parsed.truncation_side = keep, side
    return parsed


def _chat(
    body: dict[str, Any],
    messages: list[dict[str, Any]],
    limits: RequestLimits,
    *,
    add_generation_prompt: bool,
    tools: list[Any] | None = None,
    param: str = "messages",
) -> ParsedRequest | None:
    if not messages:
        return None
    if len(messages) > limits.max_messages:
        raise _bad(
            f"the conversation holds {len(messages)} messages; the limit is {limits.max_messages}",
            param,
        )
    model, stream, salt = _common(body)
    parsed = ParsedRequest(
        kind="chat",
        body=body,
        model=model,
        stream=stream,
        messages=messages,
        add_special_tokens=False,
        add_generation_prompt=add_generation_prompt,
        chat_template_kwargs=optional(body, "chat_template_kwargs", dict, "an object"),
        tools=tools,
        cache_salt=salt,
    )
    return parsed


# --- /v1/responses ----------------------------------------------------------------------


def _text_content(content: object, param: str) -> str | list[dict[str, Any]] | None:
    """A message's content with Responses' text parts as chat text parts (others dropped:
    images and files are not tokenized by the router)."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad("message content must be a string or a list of parts", param)
    parts: list[dict[str, Any]] = []
    for part in content:
        if isinstance(part, str):
            parts.append({"type": "text", "text": part})
            continue
        if not isinstance(part, dict):
            raise _bad("content parts must be objects", param)
        kind = part.get("type", "text")
        if kind in _TEXT_PARTS and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            parts.append({"type": "refusal", "refusal": part["refusal"]})
    return parts


def _first_text(content: object) -> str | None:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content and isinstance(content[0], dict):
        text = content[0].get("text")
        return text if isinstance(text, str) else None
    return None


def _item_message(item: dict[str, Any], messages: list[dict[str, Any]]) -> dict[str, Any] | None:
    """One input item as vLLM converts it: a new message, or None when it was merged into
    the assistant message before it."""
    prev = messages[-1] if messages and messages[-1].get("role") == "assistant" else None
    kind = item.get("type")
    if kind == "function_call":
        call = {
            "id": item.get("call_id"),
            "type": "function",
            "function": {"name": item.get("name"), "arguments": item.get("arguments")},
        }
        if prev is not None:
            calls = prev.get("tool_calls")
            if calls is None:
                prev["tool_calls"] = [call]
                return None
            if isinstance(calls, list):
                calls.append(call)
                return None
        return {"role": "assistant", "tool_calls": [call]}
    if kind == "reasoning":
        content, summary = item.get("content") or [], item.get("summary") or []
        text = _first_text(content) if content else _first_text(summary) if summary else ""
        if prev is not None and prev.get("reasoning") is None:
            prev["reasoning"] = text or ""
            return None
        return {"role": "assistant", "reasoning": text or ""}
    if kind in ("function_call_output", "custom_tool_call_output"):
        return {"role": "tool", "content": item.get("output"), "tool_call_id": item.get("call_id")}
    role = item.get("role")
    if role == "assistant":
        text = _first_text(item.get("content"))
        if text is not None:
            if prev is not None and prev.get("content") is None:
                prev["content"] = text
                return None
            return {"role": "assistant", "content": text}
    if isinstance(role, str):
        message: dict[str, Any] = {
            "role": role,
            "content": _text_content(item.get("content"), "input"),
        }
        if isinstance(item.get("name"), str):
            message["name"] = item["name"]
        return message
    raise _bad(f"unsupported input item type: {kind!r}", "input")


def response_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The chat messages vLLM renders for a Responses request (without a previous
    response: that history lives on the replica that stored it)."""
    messages: list[dict[str, Any]] = []
    instructions = optional(body, "instructions", str, "a string")
    if instructions:
        messages.append({"role": "system", "content": instructions})
    previous = optional(body, "previous_input_messages", list, "a list")
    if previous:
        # Instructions do not carry over from earlier turns (OpenAI's rule, vLLM's code).
        history = check_messages(previous, 10**9, param="previous_input_messages")
        messages.extend(dict(m) for m in history if m.get("role") != "system")
    value = body.get("input")
    if isinstance(value, str):
        messages.append({"role": "user", "content": value})
    elif isinstance(value, list):
        for item in value:
            if not isinstance(item, dict):
                raise _bad("input items must be objects", "input")
            message = _item_message(item, messages)
            if message is not None:
                messages.append(message)
    else:
        raise _bad("'input' must be a string or a list of input items", "input")
    return messages


def _response_tools(tools: object) -> list[dict[str, Any]] | None:
    """Responses' flat function tools as the chat template sees them (chat format)."""
    if not isinstance(tools, list) or not tools:
        return None
    out = []
    for tool in tools:
        if isinstance(tool, dict) and tool.get("type") == "function":
            fn = {k: v for k, v in tool.items() if k != "type"}
            out.append({"type": "function", "function": fn})
    return out or None


def responses_request(body: dict[str, Any], limits: RequestLimits) -> ParsedRequest | None:
    if "input" not in body:
        raise _bad("'input' is required", "input")
    optional(body, "previous_response_id", str, "a string")
    if body.get("previous_response_id"):
        _common(body)
        return None  # the conversation so far is on the replica holding that response
    optional(body, "tools", list, "a list")
    messages = response_messages(body)
    return _chat(
        body,
        messages,
        limits,
        add_generation_prompt=True,
        tools=_response_tools(body.get("tools")),
        param="input",
    )


# --- /v1/messages (Anthropic) ------------------------------------------------------------


def _system_text(value: object, param: str) -> str | None:
    if value is None:
        return None
    if isinstance(value, str):
        return None if value.startswith(_BILLING_HEADER) else value
    if not isinstance(value, list):
        raise _bad(f"'{param}' must be a string or a list of content blocks", param)
    parts = [
        b["text"]
        for b in value
        if isinstance(b, dict)
        and b.get("type") == "text"
        and isinstance(b.get("text"), str)
        and b["text"]
        and not b["text"].startswith(_BILLING_HEADER)
    ]
    return "".join(parts) if parts else None


def _tool_result_text(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(
            str(i.get("text", ""))
            for i in content
            if isinstance(i, dict) and i.get("type") == "text"
        )
    return ""


def anthropic_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The chat messages vLLM's Anthropic adapter builds (inline system messages kept in
    place: vLLM merges them into the first only for templates that refuse them there)."""
    out: list[dict[str, Any]] = []
    system = _system_text(body.get("system"), "system")
    if system:
        out.append({"role": "system", "content": system})
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' must be a non-empty list of message objects", "messages")
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise _bad(f"messages[{i}] must be an object with a string role", "messages")
        role, content = msg["role"], msg.get("content")
        if role == "system":
            text = _system_text(content, "messages")
            if text:
                out.append({"role": "system", "content": text})
            continue
        converted: dict[str, Any] = {"role": role}
        if isinstance(content, str):
            converted["content"] = content
        elif isinstance(content, list):
            parts: list[dict[str, Any]] = []
            calls: list[dict[str, Any]] = []
            reasoning: list[str] = []
            for block in content:
                if not isinstance(block, dict):
                    raise _bad(f"messages[{i}].content blocks must be objects", "messages")
                kind = block.get("type")
                if kind == "text" and isinstance(block.get("text"), str) and block["text"]:
                    parts.append({"type": "text", "text": block["text"]})
                elif kind == "thinking" and isinstance(block.get("thinking"), str):
                    reasoning.append(block["thinking"])
                elif kind == "tool_use":
                    calls.append(
                        {
                            "id": block.get("id") or "call",
                            "type": "function",
                            "function": {
                                "name": block.get("name") or "",
                                "arguments": json.dumps(block.get("input") or {}),
                            },
                        }
                    )
                elif kind == "tool_result":
                    text = _tool_result_text(block.get("content"))
                    if role == "user":
                        out.append(
                            {
                                "role": "tool",
                                "tool_call_id": block.get("tool_use_id") or "",
                                "content": text,
                            }
                        )
                    else:
                        parts.append({"type": "text", "text": f"Tool result: {text}"})
            if reasoning:
                converted["reasoning"] = "".join(reasoning)
            if calls:
                converted["tool_calls"] = calls
            if len(parts) == 1:
                converted["content"] = parts[0]["text"]
            elif parts:
                converted["content"] = parts
        elif content is not None:
            raise _bad(f"messages[{i}].content must be a string or a list of blocks", "messages")
        if not (role == "user" and "content" not in converted):
            out.append(converted)
    return out


def _anthropic_tools(tools: object) -> list[dict[str, Any]] | None:
    if not isinstance(tools, list) or not tools:
        return None
    out = []
    for tool in tools:
        if isinstance(tool, dict) and isinstance(tool.get("name"), str):
            out.append(
                {
                    "type": "function",
                    "function": {
                        "name": tool["name"],
                        "description": tool.get("description"),
                        "parameters": tool.get("input_schema"),
                    },
                }
            )
    return out or None


def messages_request(body: dict[str, Any], limits: RequestLimits) -> ParsedRequest | None:
    optional(body, "tools", list, "a list")
    messages = anthropic_messages(body)
    return _chat(
        body,
        messages,
        limits,
        add_generation_prompt=True,
        tools=_anthropic_tools(body.get("tools")),
    )


# --- pooling: embeddings, /pooling, /classify --------------------------------------------


def _completion(
    body: dict[str, Any], prompts: list[str | list[int]], param: str
) -> ParsedRequest | None:
    if not prompts:
        return None
    model, stream, salt = _common(body)
    add_special = optional(body, "add_special_tokens", bool, "a boolean")
    parsed = ParsedRequest(
        kind="completion",
        body=body,
        model=model,
        stream=stream,
        prompt=prompts[0],
        batch=prompts if len(prompts) > 1 else None,
        add_special_tokens=True if add_special is None else add_special,
        cache_salt=salt,
    )
    return _truncation(body, parsed)


def _pooling_chat(
    body: dict[str, Any], messages: object, limits: RequestLimits, param: str
) -> ParsedRequest | None:
    checked = check_messages(messages, limits.max_messages, param=param)
    add_gen = optional(body, "add_generation_prompt", bool, "a boolean") or False
    parsed = _chat(body, [dict(m) for m in checked], limits, add_generation_prompt=add_gen)
    if parsed is not None:
        parsed.continue_final_message = (
            optional(body, "continue_final_message", bool, "a boolean") or False
        )
        add_special = optional(body, "add_special_tokens", bool, "a boolean")
        parsed.add_special_tokens = bool(add_special)
        if parsed.add_generation_prompt and parsed.continue_final_message:
            raise _bad(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                "continue_final_message",
            )
        _truncation(body, parsed)
    return parsed


def pooling_request(body: dict[str, Any], limits: RequestLimits) -> ParsedRequest | None:
    if body.get("messages") is not None:
        return _pooling_chat(body, body["messages"], limits, "messages")
    value = body.get("input")
    if value is None:
        return None  # an IO-processor plugin's ``data``: nothing the router can tokenize
    if isinstance(value, list) and value and all(isinstance(m, dict) for m in value):
        return _pooling_chat(body, value, limits, "input")
    return _completion(body, check_prompts(value, "input"), "input")


# --- score, rerank, generate -------------------------------------------------------------

_SCORE_FIELDS = (
    ("queries", "documents"),
    ("queries", "items"),
    ("query", "documents"),
    ("text_1", "text_2"),
    ("data_1", "data_2"),
)


def _texts(value: object) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, str)]
    return []  # multimodal score inputs: not tokenized by the router


def score_request(body: dict[str, Any], limits: RequestLimits) -> ParsedRequest | None:
    pairs = [p for p in _SCORE_FIELDS if p[0] in body] or [p for p in _SCORE_FIELDS if p[1] in body]
    if not pairs:
        return None
    first, second = pairs[0]
    return _completion(body, _texts(body.get(first)) + _texts(body.get(second)), first)


def generate_request(body: dict[str, Any], limits: RequestLimits) -> ParsedRequest | None:
    ids = body.get("token_ids")
    if ids is None:
        raise _bad("'token_ids' is required", "token_ids")
    prompts = check_prompts(ids, "token_ids")
    if len(prompts) != 1 or not isinstance(prompts[0], list):
        raise _bad("'token_ids' must be a non-empty list of token ids", "token_ids")
    parsed = _completion(body, prompts, "token_ids")
    return parsed


PROMPT_PARSERS: dict[str, Parser] = {
    "responses": responses_request,
    "messages": messages_request,
    "embeddings": pooling_request,
    "pooling": pooling_request,
    "classify": pooling_request,
    "score": score_request,
    "rerank": score_request,
    "generate": generate_request,
}
