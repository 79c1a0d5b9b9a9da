"""Block keys: chained, deterministic, and separated by everything vLLM separates by."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.indexer.keys import (
    block_extra_keys,
    block_keys,
    event_extra_keys,
    pack_tokens,
    request_extra_keys,
    root_key,
)

tokens_st = st.lists(st.integers(0, 2**32 - 1), max_size=64)


@settings(max_examples=200, deadline=None)
@given(tokens_st, st.integers(1, 8), st.integers(0, 8))
def test_chain_continues_from_any_parent(tokens: list[int], block_size: int, split: int) -> None:
    whole = block_keys(tokens, block_size)
    assert len(whole) == len(tokens) // block_size
    split = min(split, len(whole))
    head = block_keys(tokens[: split * block_size], block_size)
    tail = block_keys(tokens[split * block_size :], block_size, parent=head[-1] if head else None)
    assert head + tail == whole


def test_keys_depend_on_every_token_and_on_the_prefix() -> None:
    a = block_keys([1, 2, 3, 4, 5, 6], 2)
    b = block_keys([1, 2, 3, 4, 5, 7], 2)
    c = block_keys([0, 2, 3, 4, 5, 6], 2)
    assert a[:2] == b[:2] and a[2] != b[2]
    assert all(x != y for x, y in zip(a, c, strict=True))  # a changed first block changes all


def test_block_size_partial_blocks_and_packed_input() -> None:
    assert block_keys([1, 2, 3, 4], 4) != block_keys([1, 2, 3, 4], 2)[1:]
    assert root_key(16) != root_key(32)
    assert block_keys([1, 2, 3], 2) == block_keys([1, 2], 2)
    assert block_keys(pack_tokens([5, 6, 7, 8]), 2) == block_keys([5, 6, 7, 8], 2)
    assert block_keys([1, 2, 3, 4], 2, max_blocks=1) == block_keys([1, 2], 2)


def test_lora_and_cache_salt_separate_keys() -> None:
    tokens = list(range(8))
    plain = block_keys(tokens, 2)
    lora = block_keys(tokens, 2, extra_keys=request_extra_keys(4, lora_name="sql"))
    salted = block_keys(tokens, 2, extra_keys=request_extra_keys(4, cache_salt="s1"))
    salted2 = block_keys(tokens, 2, extra_keys=request_extra_keys(4, cache_salt="s2"))
    assert len({plain[0], lora[0], salted[0], salted2[0]}) == 4
    assert all(p != q for p, q in zip(plain, lora, strict=True))
    # the salt only touches block 0, but the chain carries it to every later block
    assert all(p != q for p, q in zip(plain, salted, strict=True))


def test_request_extra_keys_matches_vllm_event_shape() -> None:
    assert request_extra_keys(3) is None
    assert request_extra_keys(2, lora_name="a", cache_salt="s") == [("a", "s"), ("a",)]
    assert request_extra_keys(2, cache_salt="s") == [("s",), None]
    # an event's extra_keys arrive as msgpack lists: same key as the router's tuples
    assert block_keys([1, 2], 2, extra_keys=[["a", "s"]]) == block_keys(
        [1, 2], 2, extra_keys=[("a", "s")]
    )


@pytest.mark.parametrize("bad", [[-1], [2**32], [1.5], ["a"]])
def test_invalid_tokens_raise_value_error(bad: list) -> None:
    with pytest.raises(ValueError):
        block_keys(bad * 2, 1)


def test_invalid_block_size() -> None:
    with pytest.raises(ValueError):
        block_keys([1], 0)


def test_events_and_requests_get_the_same_extra_keys() -> None:
    """An event that carries no extra keys is keyed with what it names (its LoRA), through the
    same per-block function as a request, so both meet on equal keys."""
    assert block_extra_keys("sql", "s1", [("img", 3)]) == ("sql", ("img", 3), "s1")
    assert block_extra_keys() is None
    from_event = event_extra_keys(None, "sql", 3)
    assert from_event == request_extra_keys(3, lora_name="sql") == [("sql",)] * 3
    carried = [("sql", "s1"), ("sql",)]
    assert event_extra_keys(carried, "sql", 2) is carried  # what vLLM sent is the authority
    assert event_extra_keys(None, None, 2) is None
