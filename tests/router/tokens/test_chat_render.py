"""vLLM's chat rendering rules in the router's local tokenizer: the developer role, content
parts for "string" and "openai" templates, chat_template_kwargs, truncate_prompt_tokens."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvroute.router.errors import RouterError
from kvroute.router.tokens.chat_render import (
    conversation,
    detect_content_format,
    has_media,
    map_developer_role,
    truncate_ids,
)
from kvroute.router.tokens.requests import parse_body
from kvroute.router.tokens.tokenization import LocalTokenizer

# A template that loops over message content: vLLM passes it the parts as dicts.
PARTS_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for p in m['content'] %}[{{ p['type'] }}:{{ p['text'] }}]{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
DEVELOPER_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'developer' %}DEV: {% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
)
KWARGS_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking %}<think>{% endif %}{% endif %}"
)


def _req(body: dict[str, Any], kind: str = "chat"):
    return parse_body(json.dumps({"model": "tiny", **body}).encode(), kind)


def _ids(hf, text: str, special: bool = False) -> list[int]:
    return list(hf(text, add_special_tokens=special)["input_ids"])


def test_content_format_detection() -> None:
    assert detect_content_format(PARTS_TEMPLATE) == "openai"
    assert detect_content_format(KWARGS_TEMPLATE) == "string"
    aliased = (
        "{% set msgs = messages %}{% for m in msgs %}{% for c in m.content | list %}"
        "{{ c.text }}{% endfor %}{% endfor %}"
    )
    assert detect_content_format(aliased) == "openai"
    macro = (
        "{% macro show(parts) %}{% for x in parts %}{{ x.text }}{% endfor %}{% endmacro %}"
        "{% for m in messages %}{{ show(m.content) }}{% endfor %}"
    )
    assert detect_content_format(macro) == "openai"
    assert detect_content_format("{% for m in messages %") == "string"  # does not parse


def test_content_format_detection_equals_vllms() -> None:
    hf = pytest.importorskip("vllm.renderers.hf")
    templates = [
        PARTS_TEMPLATE,
        KWARGS_TEMPLATE,
        DEVELOPER_TEMPLATE,
        "{% for m in messages %}{% set content = m.content %}{% for x in content %}{{ x }}"
        "{% endfor %}{% endfor %}",
        "{% for m in messages[1:] %}{% for x in m['content'] %}{{ x }}{% endfor %}{% endfor %}",
        "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}",
    ]
    for template in templates:
        assert detect_content_format(template) == hf._detect_content_format(
            template, default="string"
        ), template


def test_string_format_joins_text_parts(local_tokenizer: LocalTokenizer, hf_tokenizer) -> None:
    messages = [
        {"role": "system", "content": None},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "part one"},
                {"type": "input_text", "text": "part two"},
                {"type": "refusal", "refusal": "no"},
            ],
        },
    ]
    text = local_tokenizer.render_chat(_req({"messages": messages}))
    assert text == (
        "<|im_start|>system\n<|im_end|>\n<|im_start|>user\npart one\npart two\nno<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert local_tokenizer.encode_sync(_req({"messages": messages})) == _ids(hf_tokenizer, text)


def test_openai_format_gets_parts_as_is(local_tokenizer: LocalTokenizer, hf_tokenizer) -> None:
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": "plain"},
    ]
    req = _req({"messages": messages, "chat_template": PARTS_TEMPLATE})
    text = local_tokenizer.render_chat(req)
    # vLLM wraps a string content into one text part for such templates too.
    assert text == (
        "<|im_start|>user\n[text:a][text:b]<|im_end|>\n<|im_start|>assistant\n[text:plain]"
        "<|im_end|>\n<|im_start|>assistant\n"
    )
    assert local_tokenizer.encode_sync(req) == _ids(hf_tokenizer, text)
    # The same template given as the replicas' --chat-template (the tokenizer's option).
    served = LocalTokenizer(
        local_tokenizer.name, tokenizer=local_tokenizer.tok, chat_template=PARTS_TEMPLATE
    )
    assert served.render_chat(_req({"messages": messages})) == text
    forced = LocalTokenizer(
        local_tokenizer.name,
        tokenizer=local_tokenizer.tok,
        chat_template=PARTS_TEMPLATE,
        content_format="string",
    )
    assert "<|im_start|>user\na\nb<|im_end|>" in forced.render_chat(_req({"messages": messages}))


def test_developer_role_is_system_unless_the_template_knows_it(
    local_tokenizer: LocalTokenizer,
) -> None:
    messages = [
        {"role": "system", "content": "Base rules."},
        {"role": "user", "content": "hi"},
        {"role": "developer", "content": "Be terse.", "tools": [{"x": 1}]},
    ]
    text = local_tokenizer.render_chat(_req({"messages": messages}))
    # vLLM: developer -> system, then every system message merged into one at the front.
    assert text.startswith("<|im_start|>system\nBase rules.\n\nBe terse.<|im_end|>\n")
    assert "developer" not in text
    assert text.count("<|im_start|>system") == 1
    kept = local_tokenizer.render_chat(
        _req({"messages": messages, "chat_template": DEVELOPER_TEMPLATE})
    )
    assert "DEV: <|im_start|>developer\nBe terse." in kept
    # A lone developer message needs no merging: it just becomes system.
    assert map_developer_role(
        conversation([{"role": "developer", "content": "x"}], "string"), None
    ) == [{"role": "system", "content": "x"}]


def test_conversation_keeps_only_what_vllm_keeps() -> None:
    messages = [
        {"role": "user", "content": "q", "name": "ann", "extra_field": 1},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "1", "type": "function", "function": {"name": "f", "arguments": ""}},
                {"id": "2", "type": "function", "function": {"name": "g", "arguments": "[1]"}},
            ],
        },
        {"role": "tool", "tool_call_id": "1", "content": [{"type": "text", "text": "r"}]},
        {"role": "assistant", "content": "done", "tool_calls": []},
    ]
    conv = conversation(messages, "openai")
    assert conv[0] == {"role": "user", "content": [{"type": "text", "text": "q"}], "name": "ann"}
    assert [c["function"]["arguments"] for c in conv[1]["tool_calls"]] == [{}, {}]
    assert conv[1]["content"] == []
    assert conv[2] == {"role": "tool", "content": "r", "tool_call_id": "1"}
    assert "tool_calls" not in conv[3]
    image = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}
    assert has_media([image]) and not has_media(messages)
    assert conversation([image], "openai")[0]["content"] == [{"type": "image"}]
    with pytest.raises(RouterError):
        conversation([{"role": "user", "content": [{"type": "bogus"}]}], "string")


def test_chat_template_kwargs(local_tokenizer: LocalTokenizer) -> None:
    messages = [{"role": "user", "content": "think"}]
    base = {"messages": messages, "chat_template": KWARGS_TEMPLATE}
    on = local_tokenizer.render_chat(_req({**base, "chat_template_kwargs": {"enable_thinking": 1}}))
    assert on.endswith("<|im_start|>assistant\n<think>")
    # A kwarg the template never reads is dropped, as vLLM drops it (same text).
    off = local_tokenizer.render_chat(_req({**base, "chat_template_kwargs": {"unused_knob": 1}}))
    assert off == local_tokenizer.render_chat(_req(base))
    assert off.endswith("<|im_start|>assistant\n")
    # reasoning_effort turns enable_thinking on unless the request says otherwise.
    effort = local_tokenizer.render_chat(_req({**base, "reasoning_effort": "low"}))
    assert effort.endswith("<think>")
    with pytest.raises(RouterError) as err:
        local_tokenizer.render_chat(_req({**base, "chat_template_kwargs": {"tokenize": True}}))
    assert err.value.status == 400


def test_truncate_prompt_tokens_keeps_the_last_tokens(
    local_tokenizer: LocalTokenizer, hf_tokenizer
) -> None:
    messages = [{"role": "user", "content": "one two three four five six seven eight nine"}]
    full = local_tokenizer.encode_sync(_req({"messages": messages}))
    assert len(full) > 8
    cut = local_tokenizer.encode_sync(_req({"messages": messages, "truncate_prompt_tokens": 5}))
    assert cut == full[-5:]
    right = _req({"messages": messages, "truncate_prompt_tokens": 5, "truncation_side": "right"})
    assert local_tokenizer.encode_sync(right) == full[:5]
    whole = _req({"messages": messages, "truncate_prompt_tokens": -1})
    assert local_tokenizer.encode_sync(whole, max_model_len=6) == full[-6:]
    prompt = _req({"prompt": [1, 2, 3, 4, 5], "truncate_prompt_tokens": 2}, "completion")
    assert local_tokenizer.encode_sync(prompt) == [4, 5]
    text = "alpha beta gamma delta epsilon zeta eta theta"
    done = local_tokenizer.encode_sync(
        _req({"prompt": text, "truncate_prompt_tokens": 3}, "completion")
    )
    assert done == _ids(hf_tokenizer, text, special=True)[-3:]
    assert truncate_ids([1, 2, 3], 0, None, None) == []
    assert truncate_ids([1, 2, 3], -1, None, None) == [1, 2, 3]


def test_truncate_prompt_tokens_must_be_an_integer() -> None:
    with pytest.raises(RouterError) as err:
        _req({"messages": [{"role": "user", "content": "x"}], "truncate_prompt_tokens": "5"})
    assert err.value.status == 400 and err.value.param == "truncate_prompt_tokens"
    with pytest.raises(RouterError):
        _req({"prompt": "x", "truncate_prompt_tokens": -2}, "completion")
