"""Workloads are reproducible traces of the documented shape; the infinite-cache bound is
computed right on traces whose answer is known."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvroute.bench.sim.tokenizer import SimTokenizer, ensure_model_dir
from kvroute.bench.workloads import BUILDERS, TextSource
from kvroute.bench.workloads.runner import RequestRecord
from kvroute.bench.workloads.upper_bound import infinite_cache_hit_rate


@pytest.fixture(scope="module")
def tokenizer() -> SimTokenizer:
    return SimTokenizer(ensure_model_dir())


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_same_seed_same_trace(name: str) -> None:
    a = BUILDERS[name](TextSource(7), seed=7)
    b = BUILDERS[name](TextSource(7), seed=7)
    c = BUILDERS[name](TextSource(8), seed=8)
    assert a == b
    assert a != c
    starts = [s.start_s for s in a.sessions]
    assert starts == sorted(starts) and starts[0] > 0


def test_text_lengths_are_calibrated_in_tokens(tokenizer: SimTokenizer) -> None:
    text = TextSource(0, count_tokens=lambda s: len(tokenizer.encode(s)))
    counts = [len(tokenizer.encode(text.text(1000))) for _ in range(5)]
    assert all(850 < c < 1150 for c in counts), counts


def test_shapes() -> None:
    text = TextSource(0)
    sp = BUILDERS["shared_prefix"](text, groups=5, questions=3)
    assert sp.num_requests == 15
    assert len({s.system for s in sp.sessions}) == 5
    chat = BUILDERS["chat"](text, users=4, rounds=3)
    assert len({s.system for s in chat.sessions}) == 1
    assert all(len(s.turns) == 3 and s.turns[0].think_s == 0 for s in chat.sessions)
    assert all(t.think_s > 0 for s in chat.sessions for t in s.turns[1:])
    docs = BUILDERS["doc_qa"](text, documents=3, questions=4)
    heads = {s.turns[0].content.split("\n\nQuestion:")[0] for s in docs.sessions}
    assert len(heads) == 3 and docs.num_requests == 12
    agents = BUILDERS["agentic"](text, agents=2, steps=5)
    assert all([t.role for t in s.turns] == ["user"] + ["tool"] * 4 for s in agents.sessions)


def _rec(
    messages: list[dict[str, str]], sent: float, done: float, prompt_tokens: int
) -> RequestRecord:
    return RequestRecord(
        session="s",
        turn=0,
        messages=messages,
        max_tokens=4,
        sent=sent,
        first_token=sent + 0.1,
        done=done,
        prompt_tokens=prompt_tokens,
        completion_tokens=4,
    )


def test_upper_bound_on_a_known_trace(tokenizer: SimTokenizer) -> None:
    bs = 16
    system = {"role": "system", "content": "shared instructions " * 40}
    a = [system, {"role": "user", "content": "first question"}]
    b = [system, {"role": "user", "content": "second question"}]
    na, nb = len(tokenizer.encode_chat(a)), len(tokenizer.encode_chat(b))
    shared = 0
    for x, y in zip(tokenizer.encode_chat(a), tokenizer.encode_chat(b), strict=False):
        if x != y:
            break
        shared += 1
    records = [_rec(a, 0.0, 1.0, na), _rec(b, 2.0, 3.0, nb), _rec(a, 4.0, 5.0, na)]
    ub = infinite_cache_hit_rate(records, tokenizer, bs)
    # b reuses the shared blocks; the repeat of a reuses all its full blocks but the last token.
    expected = (shared // bs) * bs + ((na - 1) // bs) * bs
    assert ub.hit_tokens == expected
    assert ub.prompt_tokens == 2 * na + nb
    assert ub.token_mismatches == 0
    assert ub.hit_rate == pytest.approx(expected / (2 * na + nb))
    # Sent before the first finished: its prompt blocks count (cached at scheduling) ...
    overlapping = [_rec(a, 0.0, 10.0, na), _rec(a, 1.0, 11.0, na)]
    assert infinite_cache_hit_rate(overlapping, tokenizer, bs).hit_tokens == ((na - 1) // bs) * bs
    # ... and a wrong prompt_tokens is reported as a tokenization mismatch.
    assert infinite_cache_hit_rate([_rec(a, 0.0, 1.0, na + 1)], tokenizer, bs).token_mismatches == 1


def test_model_dir_is_reused(tmp_path: Path) -> None:
    first = ensure_model_dir(tmp_path / "m", max_model_len=2048)
    stamp = (first / "kvroute_build.json").stat().st_mtime_ns
    assert ensure_model_dir(tmp_path / "m", max_model_len=2048) == first
    assert (first / "kvroute_build.json").stat().st_mtime_ns == stamp


def test_chat_user_history_is_private_and_opens_the_conversation(tokenizer: SimTokenizer) -> None:
    """production-stack's --user-history-prompt: each user's own context, in the first turn
    only (later turns carry it as history), never shared between users."""
    count = lambda s: len(tokenizer.encode(s))  # noqa: E731
    plain = BUILDERS["chat"](TextSource(3, count_tokens=count), seed=3, users=3, rounds=2)
    rich = BUILDERS["chat"](
        TextSource(3, count_tokens=count), seed=3, users=3, rounds=2, history_tokens=800
    )
    assert rich.params["history_tokens"] == 800
    firsts = [s.turns[0].content for s in rich.sessions]
    heads = {c.split("\n\n")[0] for c in firsts}
    assert len(heads) == 3  # private to each user
    assert all(700 < count(h) < 900 for h in heads)
    assert all("\n\n" not in t.content for s in rich.sessions for t in s.turns[1:])
    assert all("\n\n" not in s.turns[0].content for s in plain.sessions)
    assert [s.start_s for s in plain.sessions] == [s.start_s for s in rich.sessions]


def test_tenants_ramp_and_share_only_their_prefix() -> None:
    w = BUILDERS["tenants"](
        TextSource(0), tenants=4, users=3, prefix_tokens=200, stages=[(10, 2.0), (10, 8.0)]
    )
    first = [s for s in w.sessions if s.start_s < 10]
    second = [s for s in w.sessions if s.start_s >= 10]
    assert 0 < len(first) < len(second) <= 10 * 8 * 2  # the rate ramps up
    assert all(s.start_s < 20 for s in w.sessions)
    systems = {s.system for s in w.sessions}
    assert len(systems) <= 4 and all(len(s.turns) == 1 for s in w.sessions)
    assert len({s.turns[0].content for s in w.sessions}) == len(w.sessions)
    with pytest.raises(ValueError, match="stages"):
        BUILDERS["tenants"](TextSource(0), stages=[(10, 0)])
