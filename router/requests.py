"""Parse and validate the request bodies the router must understand to route them.

Only the fields that routing reads are checked here (model, prompt/messages, stream, the chat
template options, cache_salt); everything else is forwarded untouched for the replica to judge.
A client mistake becomes a 400 in OpenAI's schema naming the offending parameter, so the
router never answers 500 for it and never forwards a body it could not route.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from router.errors import RouterError

__all__ = ["ParsedRequest", "RequestLimits", "decode_json", "parse_body"]

Kind = Literal["completion", "chat"]
_decode = msgspec.json.Decoder().decode


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """Bounds on what a body may hold, so a hostile one is a quick 400, never a 500 or a stall
    (the body's byte size is bounded before parsing: ``RouterSettings.max_body_bytes``)."""

    max_json_depth: int = 128
    max_messages: int = 10_000


DEFAULT_LIMITS = RequestLimits()


@dataclass(slots=True)
class ParsedRequest:
    kind: Kind
    body: dict[str, Any]
    model: str
    stream: bool
    # completions: the first prompt (routing follows it; see docs/router.md for batches)
    prompt: str | list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Any] | None = None
    cache_salt: str | None = None


def _bad(message: str, param: str | None = None) -> RouterError:
    return RouterError(400, message, param=param)


def decode_json(raw: bytes, limits: RequestLimits = DEFAULT_LIMITS) -> dict[str, Any]:
    if not raw:
        raise _bad("request body is empty; expected a JSON object")
    try:
        body = _decode(raw)
    except msgspec.DecodeError as exc:
        raise _bad(f"request body is not valid JSON: {exc}") from None
    except UnicodeDecodeError as exc:
        raise _bad(
            f"request body is not valid UTF-8 (byte {exc.start}): JSON text must be UTF-8"
        ) from None
    except RecursionError:
        raise _bad(_too_deep(limits.max_json_depth)) from None
    if not isinstance(body, dict):
        raise _bad(f"request body must be a JSON object, got {type(body).__name__}")
    _check_depth(body, limits.max_json_depth)
    return body


def _too_deep(limit: int) -> str:
    return f"request body nests objects and arrays deeper than {limit} levels"


def _check_depth(body: dict[str, Any], limit: int) -> None:
    """Iterative, and it skips lists of scalars (token ids) at C speed."""
    stack: list[tuple[Any, int]] = [(body, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            raise _bad(_too_deep(limit))
        values = node.values() if isinstance(node, dict) else node
        for v in values:
            if isinstance(v, dict | list):
                stack.append((v, depth + 1))


def _opt(body: dict[str, Any], name: str, types: type | tuple[type, ...], what: str) -> Any:
    value = body.get(name)
    if value is None:
        return None
    # bool is an int subclass: a number field must not accept true/false.
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in _as_tuple(types)):
        raise _bad(f"'{name}' must be {what}, got {type(value).__name__}", name)
    return value


def _as_tuple(types: type | tuple[type, ...]) -> tuple[type, ...]:
    return types if isinstance(types, tuple) else (types,)


def _check_common(body: dict[str, Any]) -> tuple[str, bool]:
    model = body.get("model")
    if model is None:
        raise _bad("'model' is required", "model")
    if not isinstance(model, str) or not model:
        raise _bad("'model' must be a non-empty string", "model")
    stream = _opt(body, "stream", bool, "a boolean") or False
    _opt(body, "stream_options", dict, "an object")
    for name in ("max_tokens", "max_completion_tokens", "n"):
        value = _opt(body, name, int, "an integer")
        if value is not None and value < 0:
            raise _bad(f"'{name}' must be >= 0", name)
    for name in ("temperature", "top_p"):
        _opt(body, name, (int, float), "a number")
    _opt(body, "cache_salt", str, "a string")
    return model, stream


def _check_prompt(prompt: object) -> str | list[int]:
    """vLLM accepts a string, a list of strings, a token list, or a list of token lists."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt):
            return prompt
        if all(isinstance(p, str) for p in prompt):
            return first
        if all(
            isinstance(p, list)
            and p
            and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in p)
            for p in prompt
        ):
            return first
    if isinstance(prompt, list) and not prompt:
        raise _bad("'prompt' must not be empty", "prompt")
    raise _bad(
        "'prompt' must be a string, a list of strings, a list of token ids, "
        "or a list of token-id lists",
        "prompt",
    )


def _check_messages(messages: object, limit: int) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' must be a non-empty list of message objects", "messages")
    if len(messages) > limit:
        raise _bad(f"'messages' holds {len(messages)} messages; the limit is {limit}", "messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise _bad(f"messages[{i}] must be an object", "messages")
        if not isinstance(message.get("role"), str):
            raise _bad(f"messages[{i}].role must be a string", "messages")
        content = message.get("content")
        if content is not None and not isinstance(content, str | list):
            raise _bad(f"messages[{i}].content must be a string or a list of parts", "messages")
        if isinstance(content, list):
            for part in content:
                if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                    raise _bad(
                        f"messages[{i}].content parts must be objects with a 'type'", "messages"
                    )
    return messages


def parse_body(raw: bytes, kind: Kind, limits: RequestLimits = DEFAULT_LIMITS) -> ParsedRequest:
    body = decode_json(raw, limits)
    model, stream = _check_common(body)
    cache_salt = body.get("cache_salt")
    if kind == "completion":
        if "prompt" not in body or body["prompt"] is None:
            raise _bad("'prompt' is required", "prompt")
        add_special = _opt(body, "add_special_tokens", bool, "a boolean")
        return ParsedRequest(
            kind=kind,
            body=body,
            model=model,
            stream=stream,
            prompt=_check_prompt(body["prompt"]),
            add_special_tokens=True if add_special is None else add_special,
            cache_salt=cache_salt,
        )
    if "messages" not in body:
        raise _bad("'messages' is required", "messages")
    messages = _check_messages(body["messages"], limits.max_messages)
    add_gen = _opt(body, "add_generation_prompt", bool, "a boolean")
    cont = _opt(body, "continue_final_message", bool, "a boolean") or False
    # vLLM's defaults: add_generation_prompt=True, and both True is refused.
    add_gen = True if add_gen is None else add_gen
    if add_gen and cont:
        raise _bad(
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
            "continue_final_message",
        )
    add_special = _opt(body, "add_special_tokens", bool, "a boolean")
    return ParsedRequest(
        kind=kind,
        body=body,
        model=model,
        stream=stream,
        messages=messages,
        add_special_tokens=False if add_special is None else add_special,
        add_generation_prompt=add_gen,
        continue_final_message=cont,
        chat_template=_opt(body, "chat_template", str, "a string"),
        chat_template_kwargs=_opt(body, "chat_template_kwargs", dict, "an object"),
        tools=_opt(body, "tools", list, "a list"),
        cache_salt=cache_salt,
    )
