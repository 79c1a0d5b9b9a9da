"""vLLM's chat rendering rules (0.32), for the router's local tokenizer.

The index is keyed by token ids, so the router must hand a chat template exactly the
conversation vLLM hands it. vLLM does not pass the request's messages through as they are
(``vllm/renderers/chat_utils.py`` and ``renderers/hf.py``); it rebuilds them:

- content: a string becomes one text part; ``None`` becomes no parts. Text-like parts
  (``text``, ``input_text``, ``output_text``, ``refusal``, ``thinking``) keep their text. For
  a template of content format ``"string"`` the texts are joined with newlines; for an
  ``"openai"`` template (one that loops over ``message.content``) the parts are passed as
  ``{"type": "text", "text": ...}`` dicts (media parts as ``{"type": <modality>}``). The
  format is detected from the template's Jinja AST, as vLLM does.
- a message keeps only ``role``, ``content`` and the fields vLLM copies: ``tool_calls`` and
  ``reasoning`` (assistant), ``tool_call_id`` (tool), ``name``, ``task``, ``tools``
  (developer). Tool messages whose parts are all text get their texts joined.
- system messages lose a leading Claude Code billing-header line (it changes per request).
- assistant tool-call arguments given as JSON strings are parsed to objects (empty,
  invalid or non-object arguments become ``{}``); an empty ``tool_calls`` list is dropped.
- the ``developer`` role becomes ``system`` when the template does not mention
  ``developer``, and the system messages are then merged into one at the front.
- ``chat_template_kwargs`` reach the template only when the template reads them (or they
  are ``apply_chat_template`` parameters); ``chat_template``/``tokenize`` there are refused.

Multimodal parts cannot be rendered here exactly (their placeholders are model-specific):
``has_media`` lets the caller send such requests to a replica's render endpoint instead.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from functools import lru_cache
from typing import Any, Literal

import jinja2.ext
import jinja2.meta
import jinja2.nodes as n
import jinja2.sandbox

from kvroute.router.errors import RouterError

__all__ = [
    "ContentFormat",
    "conversation",
    "detect_content_format",
    "filter_template_kwargs",
    "has_media",
    "map_developer_role",
    "template_variables",
    "truncate_ids",
]

ContentFormat = Literal["string", "openai"]

# part type -> the key holding its text (vLLM's TEXT_PART_TYPES)
_TEXT_PARTS = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}
# part type -> modality (vLLM's MM_PARSER_MAP media entries)
_MEDIA_PARTS = {
    "image_url": "image",
    "input_image": "image",
    "image_embeds": "image",
    "image_pil": "image",
    "audio_url": "audio",
    "input_audio": "audio",
    "audio_embeds": "audio",
    "video_url": "video",
    "video_embeds": "video",
}
_MEDIA_KEYS = frozenset(_MEDIA_PARTS) | {"prompt_embeds"}
_BILLING_HEADER = "x-anthropic-billing-header"


def has_media(messages: Sequence[dict[str, Any]] | None) -> bool:
    """Does any message carry a media (or embeddings) part?"""
    for message in messages or ():
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for part in content:
            if not isinstance(part, dict):
                continue
            kind = part.get("type")
            if kind in _MEDIA_KEYS or (kind not in _TEXT_PARTS and _MEDIA_KEYS & part.keys()):
                return True
    return False


def _strip_billing_header(parts: list[Any]) -> list[Any]:
    out: list[Any] = []
    for part in parts:
        text = part.get("text") if isinstance(part, dict) and part.get("type") == "text" else part
        if not (isinstance(text, str) and text.startswith(_BILLING_HEADER)):
            out.append(part)
            continue
        rest = text.partition("\n")[2]
        if rest:
            out.append(rest if isinstance(part, str) else {**part, "text": rest})
    return out


def _parts(role: str, content: Any) -> list[Any]:
    if content is None:
        parts: list[Any] = []
    elif isinstance(content, str):
        parts = [{"type": "text", "text": content}]
    else:
        parts = list(content)
    return _strip_billing_header(parts) if role == "system" else parts


def _part(part: Any, wrap: bool) -> Any:
    """One content part as vLLM passes it on: a string, a dict (``wrap``), or None (skip)."""
    if isinstance(part, str):
        return {"type": "text", "text": part} if wrap else part
    kind = part.get("type")
    if kind in _TEXT_PARTS:
        text = part.get(_TEXT_PARTS[kind])
        if text is None:
            return None
        if not wrap:
            return text
        extra = {k: v for k, v in part.items() if k not in ("type", _TEXT_PARTS[kind])}
        return {"type": "text", "text": text, **extra}
    if kind == "tool_reference":
        return {"type": "tool_reference", "name": part.get("name")} if wrap else part.get("name")
    modality = _MEDIA_PARTS.get(kind) if isinstance(kind, str) else None
    if modality is None:
        raise RouterError(400, f"Unsupported chat content part type: {kind!r}", param="messages")
    return {"type": modality} if wrap else None


def _arguments(value: Any) -> dict[str, Any]:
    if not value:
        return {}
    if isinstance(value, dict):
        return value
    parsed = value
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except ValueError:
            return {}
    return parsed if isinstance(parsed, dict) else {}


def _tool_calls(calls: list[Any]) -> list[Any]:
    out = []
    for call in calls:
        if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
            raise RouterError(
                400, "assistant tool_calls entries must be function objects", param="messages"
            )
        fn = dict(call["function"])
        fn["arguments"] = _arguments(fn.get("arguments"))
        out.append({**call, "function": fn})
    return out


def conversation(
    messages: Sequence[dict[str, Any]], content_format: ContentFormat
) -> list[dict[str, Any]]:
    """The messages as vLLM hands them to a chat template of ``content_format``."""
    wrap = content_format == "openai"
    out: list[dict[str, Any]] = []
    for message in messages:
        role = message["role"]
        parts = [
            p
            for p in (_part(x, wrap) for x in _parts(role, message.get("content")))
            if p is not None
        ]
        msg: dict[str, Any] = {"role": role, "content": parts if wrap else "\n".join(parts)}
        if role == "assistant":
            calls = message.get("tool_calls")
            if isinstance(calls, list) and calls:
                msg["tool_calls"] = _tool_calls(calls)
            if message.get("reasoning") is not None:
                msg["reasoning"] = msg["reasoning_content"] = message["reasoning"]
        elif role == "tool":
            if "tool_call_id" in message:
                msg["tool_call_id"] = message["tool_call_id"]
            content = msg["content"]
            if isinstance(content, list) and all(
                isinstance(p, dict) and p.get("type") == "text" for p in content
            ):
                msg["content"] = "\n".join(p.get("text", "") for p in content)
        if isinstance(message.get("name"), str):
            msg["name"] = message["name"]
        if isinstance(message.get("task"), str):
            msg["task"] = message["task"]
        if role == "developer":
            msg["tools"] = message.get("tools")
        out.append(msg)
    return out


def map_developer_role(conv: list[dict[str, Any]], template: str | None) -> list[dict[str, Any]]:
    """``developer`` -> ``system`` (and the system messages merged at the front) for a
    template that never names the developer role, as vLLM does."""
    if not any(m["role"] == "developer" for m in conv):
        return conv
    if template is not None and ('"developer"' in template or "'developer'" in template):
        return conv
    converted = []
    for m in conv:
        if m["role"] == "developer":
            m = {k: v for k, v in m.items() if k != "tools"}
            m["role"] = "system"
        converted.append(m)
    systems: list[str] = []
    rest: list[dict[str, Any]] = []
    merge = False
    for i, m in enumerate(converted):
        if m["role"] != "system":
            rest.append(m)
            continue
        if i > 0 or systems:
            merge = True
        content = m.get("content", "")
        if isinstance(content, list):
            content = "\n".join(
                p["text"] if isinstance(p, dict) else p
                for p in content
                if isinstance(p, str) or (isinstance(p, dict) and "text" in p)
            )
        if content:
            systems.append(content)
    if not merge:
        return converted
    return [{"role": "system", "content": "\n\n".join(systems)}, *rest]


# --- the template's content format, from its Jinja AST (vLLM's detection, restated) -------


class _GenerationTag(jinja2.ext.Extension):
    """HF templates may wrap assistant turns in ``{% generation %}``: parse, never run."""

    tags = {"generation"}

    def parse(self, parser: Any) -> Any:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return n.CallBlock(self.call_method("_run"), [], [], body).set_lineno(lineno)

    def _run(self, caller: Any) -> str:
        return caller()


@lru_cache(maxsize=1)
def _env() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    return jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )


def _name(node: Any, varname: str) -> bool:
    return isinstance(node, n.Name) and node.ctx == "load" and node.name == varname


def _item(node: Any, varname: str, key: str) -> bool:
    if isinstance(node, n.Getitem):
        return _name(node.node, varname) and isinstance(node.arg, n.Const) and node.arg.value == key
    if isinstance(node, n.Getattr):
        return _name(node.node, varname) and node.attr == key
    return False


def _reads(node: Any, varname: str, key: str | None = None) -> bool:
    """Is ``node`` the variable (or its ``key``), maybe through a filter, test or slice?"""
    if isinstance(node, n.Filter):
        return node.node is not None and _reads(node.node, varname, key)
    if isinstance(node, n.Test):
        return _reads(node.node, varname, key)
    if isinstance(node, n.Getitem) and isinstance(node.arg, n.Slice):
        return _reads(node.node, varname, key)
    return _item(node, varname, key) if key else _name(node, varname)


def _aliases(root: Any, varname: str) -> list[str]:
    """``varname`` and every variable assigned from it (transitively)."""
    names, queue = [varname], [varname]
    while queue:
        current = queue.pop(0)
        for assign in root.find_all(n.Assign):
            if _reads(assign.node, current) and isinstance(assign.target, n.Name):
                target = assign.target.name
                if target not in names:
                    names.append(target)
                    queue.append(target)
    return names


def _content_loops(root: Any) -> Iterator[Any]:
    messages = _aliases(root, "messages")
    message_vars = [
        loop.target.name
        for loop in root.find_all(n.For)
        if isinstance(loop.target, n.Name) and any(_reads(loop.iter, v) for v in messages)
    ]
    # Macro parameters that receive message.content, and the loops inside macros.
    macro_params: dict[int, set[str]] = {}
    in_macros: set[int] = set()
    for macro in root.find_all(n.Macro):
        arg_names = [a.name for a in macro.args]
        params: set[str] = set()
        for call in root.find_all(n.Call):
            if not (isinstance(call.node, n.Name) and call.node.name == macro.name):
                continue
            for i, arg in enumerate(call.args):
                if i < len(arg_names) and any(_reads(arg, v, "content") for v in message_vars):
                    params.add(arg_names[i])
            for kw in call.kwargs:
                if kw.key in arg_names and any(
                    _reads(kw.value, v, "content") for v in message_vars
                ):
                    params.add(kw.key)
        for loop in macro.find_all(n.For):
            in_macros.add(id(loop))
            if params:
                macro_params[id(loop)] = params
    for loop in root.find_all(n.For):
        over_content = any(_reads(loop.iter, v, "content") for v in message_vars)
        over_param = isinstance(loop.iter, n.Name) and loop.iter.name in macro_params.get(
            id(loop), ()
        )
        over_name = id(loop) not in in_macros and _name(loop.iter, "content")
        if over_content or over_param or over_name:
            yield loop


@lru_cache(maxsize=64)
def detect_content_format(template: str) -> ContentFormat:
    """``"openai"`` when the template iterates over a message's content (it wants parts),
    else ``"string"``; a template that does not parse counts as ``"string"``, vLLM's
    default."""
    try:
        root = _env().parse(template)
        return "openai" if next(_content_loops(root), None) is not None else "string"
    except Exception:
        return "string"


@lru_cache(maxsize=64)
def template_variables(template: str) -> frozenset[str]:
    """The variables a template reads from its context."""
    try:
        return frozenset(jinja2.meta.find_undeclared_variables(_env().parse(template)))
    except Exception:
        return frozenset()


def filter_template_kwargs(
    kwargs: dict[str, Any] | None, template: str | None, accepted: frozenset[str]
) -> dict[str, Any]:
    """The ``chat_template_kwargs`` vLLM lets through to the template: those it reads or
    ``apply_chat_template`` takes (``accepted``). ``chat_template`` and ``tokenize`` are a
    400, as in vLLM."""
    if not kwargs:
        return {}
    bad = {"chat_template", "tokenize"} & kwargs.keys()
    if bad:
        raise RouterError(
            400,
            f"Found unexpected chat template kwargs from request: {sorted(bad)}",
            param="chat_template_kwargs",
        )
    allowed = accepted | (template_variables(template) if template else frozenset())
    return {k: v for k, v in kwargs.items() if k in allowed}


def truncate_ids(
    ids: list[int], keep: int | None, side: str | None, max_model_len: int | None
) -> list[int]:
    """``truncate_prompt_tokens``: keep the last ``keep`` ids (vLLM truncates from the left
    unless the request says ``truncation_side: "right"``); -1 means the context length."""
    if keep is None:
        return ids
    if keep < 0:
        if max_model_len is None:
            return ids
        keep = max_model_len
    if len(ids) <= keep:
        return ids
    if side == "right":
        return ids[:keep]
    return ids[len(ids) - keep :] if keep else []
