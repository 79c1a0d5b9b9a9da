"""The router's token ids equal the replica's (vLLM's rules), and the self-check catches it
when they do not."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvroute.router.errors import RouterError
from kvroute.router.tokens import tokenization
from kvroute.router.tokens.requests import parse_body
from kvroute.router.tokens.tokenization import LocalTokenizer
from tests.router.sim_fleet import make_fleet

THINK_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking %}<think>{% endif %}{% endif %}"
)


def _req(body: dict, kind: str):
    return parse_body(json.dumps({"model": "tiny", **body}).encode(), kind)


def _vllm_chat_ids(hf, messages, **kw) -> list[int]:
    """vLLM's chat path written plainly: render to text, encode without special tokens."""
    text = hf.apply_chat_template(messages, tokenize=False, **kw)
    return list(hf(text, add_special_tokens=False)["input_ids"])


def test_completion_rules(local_tokenizer: LocalTokenizer, hf_tokenizer) -> None:
    text = "Hello <|im_start|> world\n\n  spaced"
    assert local_tokenizer.encode_sync(_req({"prompt": text}, "completion")) == list(
        hf_tokenizer(text, add_special_tokens=True)["input_ids"]
    )
    no_special = _req({"prompt": text, "add_special_tokens": False}, "completion")
    assert local_tokenizer.encode_sync(no_special) == list(
        hf_tokenizer(text, add_special_tokens=False)["input_ids"]
    )
    assert local_tokenizer.encode_sync(_req({"prompt": [5, 6, 7]}, "completion")) == [5, 6, 7]
    assert local_tokenizer.encode_sync(_req({"prompt": [[9, 8], [1]]}, "completion")) == [9, 8]
    batch = _req({"prompt": ["first one", "second"]}, "completion")
    assert local_tokenizer.encode_sync(batch) == list(hf_tokenizer("first one")["input_ids"])


def test_chat_rules(local_tokenizer: LocalTokenizer, hf_tokenizer) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "part two"}],
        },
    ]
    flat = [messages[0], {"role": "user", "content": "part one\npart two"}]
    ours = local_tokenizer.encode_sync(_req({"messages": messages}, "chat"))
    assert ours == _vllm_chat_ids(hf_tokenizer, flat, add_generation_prompt=True)
    prefill = [*messages, {"role": "assistant", "content": "Sure, the answer"}]
    req = _req(
        {"messages": prefill, "add_generation_prompt": False, "continue_final_message": True},
        "chat",
    )
    expected = _vllm_chat_ids(
        hf_tokenizer, [*flat, prefill[-1]], add_generation_prompt=False, continue_final_message=True
    )
    assert local_tokenizer.encode_sync(req) == expected
    req = _req(
        {
            "messages": flat,
            "chat_template": THINK_TEMPLATE,
            "chat_template_kwargs": {"enable_thinking": True},
        },
        "chat",
    )
    expected = _vllm_chat_ids(
        hf_tokenizer,
        flat,
        add_generation_prompt=True,
        chat_template=THINK_TEMPLATE,
        enable_thinking=True,
    )
    assert local_tokenizer.encode_sync(req) == expected
    assert local_tokenizer.encode_sync(req) != local_tokenizer.encode_sync(
        _req({"messages": flat, "chat_template": THINK_TEMPLATE}, "chat")
    )


TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools: {% for t in tools %}{{ t['function']['name'] }} "
    "{% endfor %}<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}call {{ c['function']['name'] }}"
    "({{ c['function']['arguments']['city'] }}){% endfor %}{% else %}{{ m['content'] }}"
    "{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% endif %}"
)


def test_tools_and_tool_call_arguments(local_tokenizer: LocalTokenizer, hf_tokenizer) -> None:
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {}}}]
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "content": "rain", "tool_call_id": "c1"},
    ]
    req = _req({"messages": messages, "tools": tools, "chat_template": TOOLS_TEMPLATE}, "chat")
    ours = local_tokenizer.encode_sync(req)
    parsed = [
        messages[0],
        {
            **messages[1],
            "tool_calls": [
                {
                    **messages[1]["tool_calls"][0],
                    "function": {"name": "weather", "arguments": {"city": "Oslo"}},
                }
            ],
        },
        messages[2],
    ]
    expected = _vllm_chat_ids(
        hf_tokenizer, parsed, tools=tools, chat_template=TOOLS_TEMPLATE, add_generation_prompt=True
    )
    assert ours == expected
    assert "call weather(Oslo)" in local_tokenizer.render_chat(req)
    assert "Tools: weather" in local_tokenizer.render_chat(req)


_text = st.lists(
    st.sampled_from([*list("abc xyz\n\t.,é😀<|>"), "<|im_start|>", "<|im_end|>", " the"]),
    max_size=40,
).map("".join)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    turns=st.lists(
        st.tuples(st.sampled_from(["user", "assistant", "system"]), _text), min_size=1, max_size=6
    )
)
def test_segment_cache_equals_whole_text(
    local_tokenizer: LocalTokenizer, hf_tokenizer, turns
) -> None:
    assert local_tokenizer.segmented
    messages = [{"role": r, "content": c} for r, c in turns]
    ours = local_tokenizer.encode_sync(_req({"messages": messages}, "chat"))
    assert ours == _vllm_chat_ids(hf_tokenizer, messages, add_generation_prompt=True)


def test_multi_turn_history_is_not_retokenized(tiny_model_dir) -> None:
    tok = LocalTokenizer(str(tiny_model_dir))
    history = [{"role": "system", "content": "You are helpful. " * 50}]
    for turn in range(6):
        history.append({"role": "user", "content": f"question number {turn} " * 20})
        before = tok._segment_cache.misses
        tok.encode_sync(_req({"messages": history}, "chat"))
        # Only the new turn's pieces (user text, role header) are encoded; the rest are hits.
        if turn:
            assert tok._segment_cache.misses - before <= 2
        history.append({"role": "assistant", "content": f"answer {turn}"})
    assert tok.stats()["segment_cache"]["hits"] > 20


def test_cached_ids_are_not_walked_by_the_garbage_collector(tiny_model_dir) -> None:
    """The caches keep ids as tuples (``frozen_ids``): once a collection has seen them they are
    untracked, so a full collection does not visit every cached id (measured: 9.7 ms per full
    collection with a text cache of 1.8M ids kept as lists, nothing with tuples). Each caller
    gets a list of its own: changing it does not change what the cache answers next."""
    import gc

    tok = LocalTokenizer(str(tiny_model_dir))
    history = [{"role": "system", "content": "You are helpful. " * 50}]
    history.append({"role": "user", "content": "a question " * 30})
    first = tok.encode_sync(_req({"messages": history}, "chat"))
    text = "plain text " * 40
    ids = tok.encode_text(text, True)
    assert len(tok._text_cache) and len(tok._segment_cache)
    gc.collect()  # untracks the ids' tuples,
    gc.collect()  # then the (ids, weight) tuples holding them
    for cache in (tok._text_cache, tok._segment_cache):
        for entry in cache._data.values():  # (ids, weight)
            assert isinstance(entry[0], tuple)
            assert not gc.is_tracked(entry)
    ids.append(-1)
    again = tok.encode_text(text, True)
    assert -1 not in again and again == ids[:-1]
    assert tok.encode_sync(_req({"messages": history}, "chat")) == first


def test_a_returning_chat_is_encoded_on_the_loop_a_new_long_one_in_a_thread(
    tiny_model_dir, monkeypatch
) -> None:
    """A thread hop waits for the GIL twice behind the event feeds: only text the caches do
    not hold is worth it. The ids are the same either way."""
    tok = LocalTokenizer(str(tiny_model_dir))
    fresh = LocalTokenizer(str(tiny_model_dir))
    hops: list[str] = []
    real = asyncio.to_thread

    async def counting(func, *args, **kwargs):
        hops.append(func.__name__)
        return await real(func, *args, **kwargs)

    monkeypatch.setattr(tokenization.asyncio, "to_thread", counting)
    history = [
        {"role": "system", "content": "You are helpful. " * 400},
        {"role": "user", "content": "a long first question, " * 1500},
    ]

    def encode(messages: list[dict], max_model_len: int | None = None) -> list[int]:
        return asyncio.run(tok.encode(_req({"messages": messages}, "chat"), max_model_len))

    first = encode(history)
    assert hops == ["encode_sync"]  # 41,000 characters never seen: in a thread
    history += [{"role": "assistant", "content": "an answer"}, {"role": "user", "content": "more?"}]
    second = encode(history)
    assert hops == ["encode_sync"]  # only the new turn is uncached: on the loop
    assert second == fresh.encode_sync(_req({"messages": history}, "chat"))
    assert second[: len(first)] == first
    # Longer than the context (8 characters a token): its head is encoded uncached, in a
    # thread, and found too long.
    with pytest.raises(RouterError, match="maximum context length is 1000"):
        encode(history, max_model_len=1000)
    assert hops == ["encode_sync", "encode_sync"]


def test_self_check_matches_replica_and_catches_mismatch(local_tokenizer) -> None:
    with make_fleet(local_tokenizer, n=1) as fleet:
        check = httpx.get(f"{fleet.url}/debug/tokenizer_check").json()
        assert check["ok"] is True
        assert {r["kind"] for r in check["results"][0]["results"]} == {"completion", "chat"}
        custom = httpx.post(
            f"{fleet.url}/debug/tokenizer_check",
            json={"model": "tiny", "messages": [{"role": "user", "content": "custom ünïcode 😀"}]},
        )
        assert custom.json()["ok"] is True
        # A replica whose rules differ (here: it adds a BOS token) must be reported.
        fleet.fakes[0].faults.tokenizer_prefix = [0]
        check = httpx.get(f"{fleet.url}/debug/tokenizer_check").json()
        assert check["ok"] is False
        assert check["results"][0]["results"][0]["first_difference"] == 0
        assert httpx.get(f"{fleet.url}/index/stats").json()["tokenizer_check"]["results"]


def test_remote_mode_uses_replica_tokenize(local_tokenizer) -> None:
    with make_fleet(local_tokenizer, n=2, tokenizer_mode="remote", inject_tokenizer=False) as fleet:
        assert fleet.service.tokenizer.mode == "remote"
        body = {"model": "tiny", "messages": [{"role": "user", "content": "remote please"}]}
        decision = httpx.post(f"{fleet.url}/debug/route", json=body).json()
        expected = local_tokenizer.encode_sync(_req({"messages": body["messages"]}, "chat"))
        assert decision["prompt_tokens"] == len(expected)
        calls = lambda: sum(s.path == "/tokenize" for f in fleet.fakes for s in f.seen)  # noqa: E731
        assert calls() == 1
        assert httpx.post(f"{fleet.url}/v1/chat/completions", json=body).status_code == 200
        assert calls() == 1  # the same conversation is served from the router's cache
        body["messages"].append({"role": "user", "content": "and more"})
        assert httpx.post(f"{fleet.url}/v1/chat/completions", json=body).status_code == 200
        assert calls() == 2


def test_long_prompts_tokenized_off_loop_match(tiny_model_dir, hf_tokenizer) -> None:
    """Long prompts go to worker threads while short ones use the same caches on the loop."""
    import asyncio

    tok = LocalTokenizer(str(tiny_model_dir))
    long_texts = [f"document {i}: " + "lorem ipsum dolor sit amet " * 400 for i in range(12)]
    short_texts = [f"short {i}" for i in range(12)]
    reqs = [_req({"prompt": t}, "completion") for t in long_texts + short_texts]
    reqs += [_req({"messages": [{"role": "user", "content": t}]}, "chat") for t in long_texts]

    async def go() -> list[list[int]]:
        return list(await asyncio.gather(*(tok.encode(r) for r in reqs)))

    results = asyncio.run(go())
    for text, ids in zip(long_texts + short_texts, results, strict=False):
        assert list(ids) == list(hf_tokenizer(text)["input_ids"])
    for text, ids in zip(long_texts, results[24:], strict=True):
        messages = [{"role": "user", "content": text}]
        assert list(ids) == _vllm_chat_ids(hf_tokenizer, messages, add_generation_prompt=True)


@settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=_text, special=st.booleans())
def test_direct_encoding_gives_transformers_ids(
    local_tokenizer: LocalTokenizer, hf_tokenizer, text: str, special: bool
) -> None:
    """The Rust tokenizer called directly (no transformers call around it) gives the ids
    transformers' call gives, with and without special tokens."""
    assert local_tokenizer.stats()["direct_encode"]
    expected = list(hf_tokenizer(text, add_special_tokens=special)["input_ids"])
    assert local_tokenizer._encode_text(text, special) == expected


def test_a_tokenizer_whose_call_differs_keeps_the_transformers_path(tiny_model_dir) -> None:
    """A tokenizer class that changes the call, or changes its result after the Rust encode
    (which only the probe can see), is encoded through transformers, with its own ids."""
    from transformers import AutoTokenizer

    base = type(AutoTokenizer.from_pretrained(str(tiny_model_dir)))

    class Lowercasing(base):  # type: ignore[misc, valid-type]
        def __call__(self, text, *args, **kwargs):  # type: ignore[no-untyped-def]
            return super().__call__(text.lower(), *args, **kwargs)

    class Shifting(base):  # type: ignore[misc, valid-type]
        def _convert_encoding(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            fields, encodings = super()._convert_encoding(*args, **kwargs)
            fields["input_ids"] = [[i + 1 for i in ids] for ids in fields["input_ids"]]
            return fields, encodings

    for cls in (Lowercasing, Shifting):
        hf = cls.from_pretrained(str(tiny_model_dir))
        tok = LocalTokenizer(str(tiny_model_dir), tokenizer=hf)
        assert not tok.stats()["direct_encode"], cls
        text = "Hello World, MIXED case"
        assert tok.encode_sync(_req({"prompt": text}, "completion")) == list(
            hf(text, add_special_tokens=True)["input_ids"]
        )
        messages = [{"role": "user", "content": text}]
        assert tok.encode_sync(_req({"messages": messages}, "chat")) == _vllm_chat_ids(
            hf, messages, add_generation_prompt=True
        )


def test_a_backend_set_to_truncate_keeps_the_transformers_path(tiny_model_dir) -> None:
    """transformers turns the backend's own truncation off on every call; a direct call would
    not, so such a backend is not called directly."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    hf._tokenizer.enable_truncation(4)
    tok = LocalTokenizer(str(tiny_model_dir), tokenizer=hf)
    assert not tok.stats()["direct_encode"]
    text = "one two three four five six seven eight"
    assert len(tok.encode_sync(_req({"prompt": text}, "completion"))) > 4


def test_direct_encoding_lets_other_threads_run(local_tokenizer: LocalTokenizer) -> None:
    """A long prompt is encoded in a worker thread so the event loop keeps serving: the
    direct path must release the GIL while Rust encodes, as transformers' call does."""
    import threading
    import time

    assert local_tokenizer.stats()["direct_encode"]
    text = "lorem ipsum dolor sit amet " * 20000  # 540k characters: a few hundred ms
    ticks = 0
    done = threading.Event()

    def other_thread() -> None:
        nonlocal ticks
        while not done.is_set():
            ticks += 1
            time.sleep(0.001)

    spinner = threading.Thread(target=other_thread)
    spinner.start()
    try:
        started = time.perf_counter()
        local_tokenizer._encode_text(text, False)
        elapsed = time.perf_counter() - started
    finally:
        done.set()
        spinner.join()
    # With the GIL held for the whole encode the other thread gets a handful of turns at most.
    assert elapsed > 0.05, "text too short to tell"
    assert ticks >= 20, (ticks, elapsed)
