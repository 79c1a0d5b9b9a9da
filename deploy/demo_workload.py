"""The demo's workload and what one run of it measured (``kvroute demo``, deploy/demo.py).

``Workload`` is the shape of a run: returning users, each with a private document pasted
once and short questions after it, in waves (deploy/demo.py's docstring says why);
``run_workload`` drives it through one router with the official ``openai`` client,
streaming, and returns a ``RunResult``: token-weighted hit rate and client-side TTFT.
"""

from __future__ import annotations

import random
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

__all__ = ["RunResult", "Workload", "merge_results", "run_workload"]

# Words the workload's text is drawn from (any text works; these keep prompts readable).
_WORD_TEXT = (
    "cache router replica prefix token block event index tier memory disk request model "
    "prompt answer question system user assistant history turn policy latency throughput "
    "the a of to and in is for on with as by at from that this it be are was were will "
    "fox dog sea village fisherman morning evening nets home quick brown lazy jumps over "
    "data config json open load file users active created name id order select where "
    "energy light cell glucose chemical stored converts powerhouse summary points risks"
)
_WORDS = tuple(_WORD_TEXT.split())


@dataclass(frozen=True)
class Workload:
    """The shape of a run: ``conversations`` chats of ``turns`` turns each, all sharing one
    system prompt, played in waves (every conversation's turn t, then every turn t+1: users
    return after the others spoke); ``concurrency`` requests in flight at once. An odd number
    of conversations keeps round-robin from sending a user back to the same replica by luck
    of the arithmetic (with an even number, turn t of conversation c would always land on
    replica c mod 2)."""

    conversations: int = 13
    turns: int = 12
    system_words: int = 120
    document_words: int = 560  # pasted in each conversation's first turn
    user_words: int = 6  # each question
    max_tokens: int = 8
    concurrency: int = 2
    seed: int = 0

    def explain(self, replicas: int) -> list[str]:
        """What the run does and why the policies differ, in a few lines for a newcomer."""
        return [
            f"The workload: {self.conversations} users chat with the model, {self.turns} turns "
            f"each, in waves: each user asks once, then waits while the {self.conversations - 1} "
            "others ask.",
            f"Each user pastes a private document (~{self.document_words} words) in their "
            f"first turn, then asks short questions about it; all share one system prompt. "
            f"{replicas} replicas, each with a device cache and a RAM tier that hold about "
            "half of the users' histories.",
            "round_robin deals turns out in order: a returning user lands where their document "
            "is not, or was evicted, and the replica prefills it again.",
            "kvroute knows from the replicas' KV events which replica (and which tier) holds "
            "each history, and sends the user back there: only the new question is prefilled.",
        ]

    def system_prompt(self, tag: str) -> str:
        rng = random.Random(f"{self.seed}-system")
        body = " ".join(rng.choice(_WORDS) for _ in range(self.system_words))
        # The tag leads so that no block of this run's prompts matches another run's.
        return f"[run {tag}] You are a helpful assistant for the kvroute project. {body}"

    def user_message(self, tag: str, conversation: int, turn: int) -> str:
        rng = random.Random(f"{self.seed}-{tag}-{conversation}-{turn}")
        words = " ".join(rng.choice(_WORDS) for _ in range(self.user_words))
        if turn == 0 and self.document_words > 0:
            document = " ".join(rng.choice(_WORDS) for _ in range(self.document_words))
            words = f"here is my document. {document}. My question: {words}"
        return f"Conversation {conversation}, question {turn}: {words}?"


@dataclass
class RunResult:
    policy: str
    requests: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    unreported: int = 0
    ttft_s: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    # Requests each replica finished during the run (its vllm:request_success_total).
    per_replica: dict[str, int] = field(default_factory=dict)
    # Of the cached tokens, those the replicas' device caches gave (vllm:prefix_cache_hits);
    # the rest came through the connector (vllm:external_prefix_cache_hits).
    device_cached_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def device_hit_rate(self) -> float:
        """The share of prompt tokens the device caches served (capped at the hit rate: the
        two counts come from different sources, the replicas' metrics and the responses)."""
        if not self.prompt_tokens:
            return 0.0
        return min(self.hit_rate, self.device_cached_tokens / self.prompt_tokens)

    def ttft(self, q: float) -> float:
        if not self.ttft_s:
            return float("nan")
        values = sorted(self.ttft_s)
        return values[min(len(values) - 1, round(q * (len(values) - 1)))]

    def summary(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "requests": self.requests,
            "errors": self.errors,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "cached_unreported_requests": self.unreported,
            "hit_rate": round(self.hit_rate, 4),
            "device_hit_rate": round(self.device_hit_rate, 4),
            "ttft_mean_s": round(statistics.fmean(self.ttft_s), 4) if self.ttft_s else None,
            "ttft_p50_s": round(self.ttft(0.5), 4),
            "ttft_p90_s": round(self.ttft(0.9), 4),
            "wall_s": round(self.wall_s, 2),
            "requests_per_replica": dict(self.per_replica),
        }


def _chat_turn(
    client: Any, model: str, messages: list[dict[str, str]], max_tokens: int
) -> tuple[str, float, int, int | None]:
    """One streamed chat request: (reply text, TTFT, prompt tokens, cached tokens or None)."""
    start = time.perf_counter()
    ttft: float | None = None
    text: list[str] = []
    usage: Any = None
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
        # Always generate max_tokens: the random-weight model may emit EOS at once.
        extra_body={"ignore_eos": True},
    )
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta and choice.delta.content:
                if ttft is None:
                    ttft = time.perf_counter() - start
                text.append(choice.delta.content)
    if usage is None:
        raise RuntimeError("the stream carried no usage chunk")
    details = getattr(usage, "prompt_tokens_details", None)
    cached = getattr(details, "cached_tokens", None) if details is not None else None
    return (
        "".join(text),
        ttft if ttft is not None else time.perf_counter() - start,
        (usage.prompt_tokens),
        cached,
    )


def run_workload(
    base_url: str, model: str, workload: Workload, *, policy: str, tag: str, progress: Any = None
) -> RunResult:
    """Drive the workload through one router in waves: turn t of every conversation
    (``concurrency`` at a time), then turn t+1; a turn's prompt holds the whole history."""
    from openai import OpenAI

    client = OpenAI(base_url=base_url + "/v1", api_key="kvroute-demo", max_retries=0, timeout=120)
    result = RunResult(policy)
    lock = threading.Lock()
    system = workload.system_prompt(tag)

    histories = [[{"role": "system", "content": system}] for _ in range(workload.conversations)]
    failed: set[int] = set()

    def turn(c: int, t: int) -> None:
        if c in failed:
            return
        messages = histories[c]
        messages.append({"role": "user", "content": workload.user_message(tag, c, t)})
        try:
            reply, ttft, prompt, cached = _chat_turn(client, model, messages, workload.max_tokens)
        except Exception as exc:  # counted and shown; one failure must not end the demo
            with lock:
                result.errors += 1
                failed.add(c)  # the rest of this conversation is not sent
            print(
                f"\n  request failed ({policy}, conversation {c}, turn {t}): {exc!r}",
                file=sys.stderr,
            )
            return
        messages.append({"role": "assistant", "content": reply})
        with lock:
            result.requests += 1
            result.ttft_s.append(ttft)
            result.prompt_tokens += prompt
            if cached is None:
                result.unreported += 1
            else:
                result.cached_tokens += cached
            if progress is not None:
                progress.update(1)

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=workload.concurrency) as pool:
        for t in range(workload.turns):  # a wave: every user once, then every user again
            list(pool.map(lambda c, t=t: turn(c, t), range(workload.conversations)))
    result.wall_s = time.perf_counter() - start
    client.close()
    return result


def merge_results(results: list[RunResult]) -> RunResult:
    merged = RunResult(results[0].policy)
    for r in results:
        merged.requests += r.requests
        merged.errors += r.errors
        merged.prompt_tokens += r.prompt_tokens
        merged.cached_tokens += r.cached_tokens
        merged.unreported += r.unreported
        merged.ttft_s += r.ttft_s
        merged.device_cached_tokens += r.device_cached_tokens
        merged.wall_s += r.wall_s
        for name, n in r.per_replica.items():
            merged.per_replica[name] = merged.per_replica.get(name, 0) + n
    return merged
