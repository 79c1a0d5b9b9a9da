"""The router's token ids are exactly vLLM's: the precondition of every prefix hit.

Three views of the same fact, each against the real replica's ``POST /tokenize``:
the router's tokenizer class run here on the served model, the running router's own count
(``/debug/route``), and the router's built-in self-check (``/debug/tokenizer_check``).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from kvroute.deploy.local_fleet import LocalFleet
from tests.e2e.helpers import debug_route, words

pytestmark = pytest.mark.vllm

SYSTEM = "You are kvroute's test assistant. " + words(40, "tok-system")
CASES: dict[str, dict[str, Any]] = {
    "completion": {"prompt": "Once upon a time, " + words(60, "tok-prompt")},
    "completion-special": {"prompt": "<|im_start|>user\nhi<|im_end|>\n" + words(10, "tok-sp")},
    "chat-one-turn": {"messages": [{"role": "user", "content": "Hello there! " + words(20, "u1")}]},
    "chat-system": {
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "What is a prefix cache? " + words(15, "u2")},
        ]
    },
    "chat-several-turns": {
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "first question " + words(12, "t1")},
            {"role": "assistant", "content": "first answer " + words(9, "a1")},
            {"role": "user", "content": "second question, with punctuation: ok?  yes!"},
            {"role": "assistant", "content": "second answer\nwith a newline " + words(7, "a2")},
            {"role": "user", "content": "third question " + words(11, "t3")},
        ]
    },
    "chat-no-system-multi": {
        "messages": [
            {"role": "user", "content": "ciao " + words(5, "n1")},
            {"role": "assistant", "content": "salut " + words(5, "n2")},
            {"role": "user", "content": "déjà vu, naïve café — ünïcödé " + words(5, "n3")},
        ]
    },
}


def vllm_tokenize(fleet: LocalFleet, case: dict[str, Any]) -> list[int]:
    """The replica's ids, asked the way vLLM's own chat/completions paths tokenize."""
    if "messages" in case:
        body = {
            "model": fleet.served_model_name,
            "messages": case["messages"],
            "add_generation_prompt": True,
            "add_special_tokens": False,
        }
    else:
        body = {"model": fleet.served_model_name, "prompt": case["prompt"]}
    return fleet.replicas[0].post("/tokenize", body)["tokens"]


@pytest.mark.parametrize("case_name", sorted(CASES))
def test_router_tokens_equal_vllm_tokenize(fleet: LocalFleet, case_name: str) -> None:
    from kvroute.router.tokens.requests import parse_body
    from kvroute.router.tokens.tokenization import LocalTokenizer

    case = CASES[case_name]
    theirs = vllm_tokenize(fleet, case)
    body = {"model": fleet.served_model_name, **case}
    kind = "chat" if "messages" in case else "completion"

    ours = asyncio.run(
        LocalTokenizer(fleet.model).encode(parse_body(json.dumps(body).encode(), kind))
    )
    assert ours == theirs

    decision = debug_route(fleet, body)
    assert decision["prompt_tokens"] == len(theirs)

    resp = httpx.post(fleet.router_url + "/debug/tokenizer_check", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    check = resp.json()
    assert check["ok"] is True, check
    assert len(check["results"]) == len(fleet.replicas)  # one verdict per replica


def test_router_self_check_on_its_own_samples(fleet: LocalFleet) -> None:
    resp = httpx.get(fleet.router_url + "/debug/tokenizer_check", timeout=60)
    assert resp.status_code == 200, resp.text
    check = resp.json()
    assert check["ok"] is True, check
    kinds = {r["kind"] for result in check["results"] for r in result["results"]}
    assert kinds == {"chat", "completion"}


def test_self_check_rejects_a_bad_body_in_openai_schema(fleet: LocalFleet) -> None:
    resp = httpx.post(
        fleet.router_url + "/debug/tokenizer_check",
        json={"model": fleet.served_model_name, "messages": "not a list"},
        timeout=30,
    )
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert error["message"] and error["type"]
