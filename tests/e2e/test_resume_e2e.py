"""Stream resumption's wire on real vLLM (router/serving/resume.py).

A greedy streamed answer is asked of one replica as the router asks for it (the client's
body plus ``return_token_ids``) and read through ``StreamResume`` until a few ids came; then
it is dropped, as when that replica dies, and the continuation the router would send
(``/v1/completions`` of vLLM's own prompt ids plus the ids streamed) goes to the other
replica. What the client is shown, the original's events then the continuation's, must be
one answer: the text and usage of an unbroken greedy run, no ids it did not ask for, one id.
The replica's death itself and the router's relay are tested on the simulator
(tests/router/serving/test_disagg.py); here vLLM's own stream shapes and its acceptance of
the continuation are what is checked.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import msgspec
import pytest

from kvroute.deploy.local_fleet import LocalFleet
from kvroute.router.serving.resume import StreamResume
from tests.e2e.helpers import words

pytestmark = pytest.mark.vllm

TOKENS = 12


def _events(url: str, body: bytes) -> Iterator[bytes]:
    with httpx.stream(
        "POST", url, content=body, headers={"content-type": "application/json"}, timeout=120
    ) as response:
        assert response.status_code == 200, response.read()
        buffer = b""
        for chunk in response.iter_raw():
            buffer += chunk
            *events, buffer = buffer.split(b"\n\n")
            yield from events


def _shown(events: list[bytes]) -> list[dict[str, Any]]:
    out = []
    for event in events:
        if event and event != b"data: [DONE]":
            assert event.startswith(b"data: ")
            out.append(msgspec.json.decode(event[6:]))
    return out


def _answer(
    fleet: LocalFleet, kind: str, body: dict[str, Any], path: str, stop_after: int
) -> tuple[list[bytes], StreamResume, int] | None:
    """What the client is shown when the first replica's stream breaks once ``stop_after``
    ids came: (the events, the resumption, how many held-back ids it dropped); None when
    the answer had ended by then (vLLM sends several ids in one chunk when its reader
    lags)."""
    first, other = fleet.replicas[0].url, fleet.replicas[1].url
    resume = StreamResume(
        kind,
        body,
        None,  # vLLM's own ids, from its first chunk
        forwarder=None,  # type: ignore[arg-type]  # nothing is sent through the router here
        registry=None,  # type: ignore[arg-type]
        ranked=[],
        target=path,
        headers=[],
        commit=None,
    )
    shown: list[bytes] = []
    for event in _events(first + path, resume.upstream_body()):
        out, failed = resume._event(event, True)
        assert failed is None
        shown.append(out)
        if len(resume.generated) >= stop_after:
            break  # the replica "dies": its connection is dropped here
    if resume.finished:
        return None
    assert resume.prompt and resume.tracking

    async def detokenize(ids: list[int]) -> str | None:
        async with httpx.AsyncClient(timeout=60) as client:
            answer = await client.post(
                other + "/detokenize", json={"model": body["model"], "tokens": ids}
            )
        return answer.json()["prompt"] if answer.status_code == 200 else None

    dropped = asyncio.run(resume.drop_held_back(detokenize))
    resume.offset = len(resume.generated)
    continuation = resume.continuation_body()
    assert continuation["max_tokens"] == TOKENS - resume.offset
    for event in _events(other + "/v1/completions", msgspec.json.encode(continuation)):
        out, failed = resume._event(event, False)
        assert failed is None
        shown.append(out)
    assert shown[-1] == b"data: [DONE]" and resume.finished and resume.tracking
    return shown, resume, dropped


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_a_greedy_answer_broken_anywhere_goes_on_exactly_on_the_other_replica(
    fleet: LocalFleet, kind: str
) -> None:
    """Broken after each of its ids in turn: the same answer every time. The chat prompt's
    answer has a character split across ids (the tiny model's byte-level vocabulary), so
    one break falls where vLLM holds its text back: those ids are computed again."""
    text = "Continue the story. " + words(40, f"resume-{kind}")
    body: dict[str, Any] = {
        "model": fleet.served_model_name,
        "max_tokens": TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if kind == "chat":
        body["messages"] = [{"role": "user", "content": text}]
        path = "/v1/chat/completions"
    else:
        body["prompt"] = text
        path = "/v1/completions"
    whole = {k: v for k, v in body.items() if k != "stream_options"}
    unbroken = httpx.post(
        fleet.replicas[1].url + path, json={**whole, "stream": False}, timeout=120
    ).json()
    expected = unbroken["choices"][0]["message" if kind == "chat" else "text"]
    if kind == "chat":
        expected = expected["content"]
    held_back = resumed = 0
    for stop_after in range(1, TOKENS):
        answer = _answer(fleet, kind, body, path, stop_after)
        if answer is None:
            continue
        shown, resume, dropped = answer
        held_back, resumed = held_back + dropped, resumed + 1
        chunks = _shown(shown)
        assert {c["id"] for c in chunks} == {chunks[0]["id"]}
        if kind == "chat":
            pieces = [c["choices"][0]["delta"].get("content") for c in chunks if c["choices"]]
            assert chunks[0].get("prompt_token_ids") is None
        else:
            pieces = [c["choices"][0]["text"] for c in chunks if c["choices"]]
        assert "".join(p or "" for p in pieces) == expected, stop_after
        assert all(c["choices"][0].get("token_ids") is None for c in chunks if c["choices"])
        usage = chunks[-1]["usage"]
        assert usage["prompt_tokens"] == unbroken["usage"]["prompt_tokens"] == len(resume.prompt)
        assert usage["completion_tokens"] == TOKENS
    assert resumed >= TOKENS // 2
    if kind == "chat":
        assert held_back > 0
