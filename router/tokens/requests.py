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

from kvroute.router.errors import RouterError

__all__ = [
    "ParsedRequest",
    "RequestLimits",
    "check_messages",
    "check_prompts",
    "decode_json",
    "optional",
    "parse_body",
]

Kind = Literal["completion", "chat"]
_decode = msgspec.json.Decoder().decode


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """Bounds on what a body may hold, so a hostile one is a quick 400, never a 500 or a stall
    (the body's byte size is bounded before parsing: ``RouterSettings.max_body_bytes``)."""

    max_json_depth: int = 128
    max_messages: int = 10_000
    # Sequences one request may ask for (OpenAI's own limit): each is a full decode on the
    # replica, so n is a multiplier on its work that no body-size limit bounds.
    max_n: int = 128


DEFAULT_LIMITS = RequestLimits()


@dataclass(slots=True)
class ParsedRequest:
    kind: Kind
    body: dict[str, Any]
    model: str
    stream: bool
    # completions: the first prompt (what the tokenizer encodes)
    prompt: str | list[int] | None = None
    # a batch: every prompt, the first included (None for one prompt). vLLM serves a batch
    # on one replica, so it is routed as a whole (kvroute.router.routing.router, docs/router.md).
    batch: list[str | list[int]] | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Any] | None = None
    cache_salt: str | None = None
    # vLLM keeps the last k prompt tokens (-1: the context length); "right": the first k
    truncate_prompt_tokens: int | None = None
    truncation_side: str | None = None


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


optional = _opt  # for the other endpoints' parsers (kvroute.router.tokens.prompts)


def _as_tuple(types: type | tuple[type, ...]) -> tuple[type, ...]:
    return types if isinstance(types, tuple) else (types,)


def _check_common(body: dict[str, Any], limits: RequestLimits) -> tuple[str, bool]:
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
    n = body.get("n")
    if n is not None and n > limits.max_n:
        raise _bad(f"'n' is {n}; this router allows at most {limits.max_n}", "n")
    for name in ("temperature", "top_p"):
        _opt(body, name, (int, float), "a number")
    _opt(body, "cache_salt", str, "a string")
    keep = _opt(body, "truncate_prompt_tokens", int, "an integer")
    if keep is not None and keep < -1:
        raise _bad("'truncate_prompt_tokens' must be >= -1", "truncate_prompt_tokens")
    if body.get("truncation_side") not in (None, "left", "right"):
        raise _bad("'truncation_side' must be 'left' or 'right'", "truncation_side")
    return model, stream


def _is_id(t: object) -> bool:
    """A token id: an int in [0, 2**32), what vLLM's ids and our block keys hold."""
    return isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**32


def check_prompts(prompt: object, param: str = "prompt") -> list[str | list[int]]:
    """Every prompt of a body. vLLM accepts a string, a list of strings, a token list, or a
    list of token lists."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(_is_id(t) for t in prompt):
            return [prompt]
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(isinstance(p, list) and p and all(_is_id(t) for t in p) for p in prompt):
            return list(prompt)
    if isinstance(prompt, list) and not prompt:
        raise _bad(f"'{param}' must not be empty", param)
    raise _bad(
        f"'{param}' must be a string, a list of strings, a list of token ids, "
        "or a list of token-id lists",
        param,
    )


def check_messages(messages: object, limit: int, param: str = "messages") -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise _bad(f"'{param}' must be a non-empty list of message objects", param)
    if len(messages) > limit:
        raise _bad(f"'{param}' holds {len(messages)} messages; the limit is {limit}", param)
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise _bad(f"{param}[{i}] must be an object", param)
        if not isinstance(message.get("role"), str):
            raise _bad(f"{param}[{i}].role must be a string", param)
        content = message.get("content")
        if content is not None and not isinstance(content, str | list):
            raise _bad(f"{param}[{i}].content must be a string or a list of parts", param)
        if isinstance(content, list):
            for part in content:
                if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                    raise _bad(f"{param}[{i}].content parts must be objects with a 'type'", param)
    return messages


def parse_body(raw: bytes, kind: Kind, limits: RequestLimits = DEFAULT_LIMITS) -> ParsedRequest:
    body = decode_json(raw, limits)
    model, stream = _check_common(body, limits)
    cache_salt = body.get("cache_salt")
    if kind == "completion":
        if "prompt" not in body or body["prompt"] is None:
            raise _bad("'prompt' is required", "prompt")
        add_special = _opt(body, "add_special_tokens", bool, "a boolean")
        prompts = check_prompts(body["prompt"])
        return ParsedRequest(
            kind=kind,
            body=body,
            model=model,
            stream=stream,
            prompt=prompts[0],
            batch=prompts if len(prompts) > 1 else None,
            add_special_tokens=True if add_special is None else add_special,
            cache_salt=cache_salt,
            truncate_prompt_tokens=body.get("truncate_prompt_tokens"),
            truncation_side=body.get("truncation_side"),
        )
    if "messages" not in body:
        raise _bad("'messages' is required", "messages")
    messages = check_messages(body["messages"], limits.max_messages)
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
        truncate_prompt_tokens=body.get("truncate_prompt_tokens"),
        truncation_side=body.get("truncation_side"),
    )
