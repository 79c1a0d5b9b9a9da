"""``kvroute bench trace-gen``: write a synthetic trace in the Mooncake format.

No public trace can be downloaded where kvroute's tests run, so we ship one made here
(``bench/workloads/traces/kvroute_small.jsonl``, this module's defaults) with the structure
that makes real traces worth routing: tenants whose conversations open with the tenant's long
system prompt, and conversations of several turns, each turn's prompt the previous prompt plus
its answer plus a new question. Block ids follow the format's rule: a full 512-token block
keeps its id in every later prompt that contains it; a partial last block gets a new id when
the next turn fills it, since its content changed.

Arrivals are a Poisson process of conversations whose rate ramps up linearly from
``start_rate`` to ``end_rate``; a turn follows the previous one after a think time
(exponential), in trace time, not closed-loop: a trace records when requests came.
"""

from __future__ import annotations

import argparse
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvroute.bench.workloads.mooncake_trace import MOONCAKE_BLOCK_TOKENS, read_trace

__all__ = ["SHIPPED_TRACE", "TraceShape", "add_arguments", "generate", "run", "write_trace"]

SHIPPED_TRACE = Path(__file__).resolve().parent / "traces" / "kvroute_small.jsonl"


@dataclass(frozen=True, slots=True)
class TraceShape:
    """What the generator draws from (defaults: the shipped trace)."""

    tenants: int = 6
    conversations: int = 70
    turns: tuple[int, int] = (1, 6)
    system_tokens: tuple[int, int] = (1024, 3072)
    first_message_tokens: tuple[int, int] = (100, 1500)
    question_tokens: tuple[int, int] = (30, 300)
    output_tokens: tuple[int, int] = (16, 200)
    start_rate: float = 0.5
    end_rate: float = 3.0
    think_s: float = 8.0
    seed: int = 0

    def check(self) -> None:
        if self.tenants < 1 or self.conversations < 1:
            raise ValueError("tenants and conversations must be >= 1")
        for name in (
            "turns",
            "system_tokens",
            "first_message_tokens",
            "question_tokens",
            "output_tokens",
        ):
            lo, hi = getattr(self, name)
            if not 0 < lo <= hi:
                raise ValueError(f"{name} wants 0 < low <= high, got ({lo}, {hi})")
        if not (self.start_rate > 0 and self.end_rate > 0 and self.think_s > 0):
            raise ValueError("rates and think time must be > 0")


class _Ids:
    """Fresh block ids, one counter for the whole trace."""

    def __init__(self) -> None:
        self.next = 0

    def take(self, n: int) -> list[int]:
        out = list(range(self.next, self.next + n))
        self.next += n
        return out


def _arrivals(shape: TraceShape, rng: random.Random) -> list[float]:
    """``conversations`` start times (s): the rate ramps linearly over the expected span."""
    mean_rate = (shape.start_rate + shape.end_rate) / 2
    span = shape.conversations / mean_rate
    t, out = 0.0, []
    while len(out) < shape.conversations:
        rate = shape.start_rate + (shape.end_rate - shape.start_rate) * min(1.0, t / span)
        t += rng.expovariate(rate)
        out.append(t)
    return out


def generate(shape: TraceShape = TraceShape()) -> list[dict[str, Any]]:
    """The trace's lines as dicts, sorted by timestamp."""
    shape.check()
    rng = random.Random(shape.seed)
    block = MOONCAKE_BLOCK_TOKENS
    ids = _Ids()
    systems = []
    for _ in range(shape.tenants):
        tokens = rng.randint(*shape.system_tokens)
        systems.append((tokens, ids.take(tokens // block)))  # its full blocks are shared
    lines: list[tuple[float, int, dict[str, Any]]] = []
    for c, start in enumerate(_arrivals(shape, rng)):
        sys_tokens, sys_ids = systems[rng.randrange(shape.tenants)]
        full = list(sys_ids)  # ids of the context's full blocks
        length = sys_tokens  # the context's tokens so far
        t = start
        for turn in range(rng.randint(*shape.turns)):
            ask = rng.randint(*(shape.first_message_tokens if turn == 0 else shape.question_tokens))
            prompt = length + ask
            hash_ids = full + ids.take(math.ceil(prompt / block) - len(full))
            out = rng.randint(*shape.output_tokens)
            line = {
                "timestamp": round(t * 1000),
                "input_length": prompt,
                "output_length": out,
                "hash_ids": hash_ids,
            }
            lines.append((t, c, line))
            # The next turn holds this prompt and its answer: the prompt's full blocks stay.
            full = hash_ids[: prompt // block]
            length = prompt + out
            t += rng.expovariate(1.0 / shape.think_s)
    lines.sort(key=lambda x: (x[0], x[1]))
    return [line for _, _, line in lines]


def write_trace(path: Path, lines: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(line, separators=(", ", ": ")) + "\n" for line in lines))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = TraceShape()
    parser.add_argument("--output", type=Path, default=Path("trace.jsonl"), help="file to write")
    parser.add_argument("--tenants", type=int, default=d.tenants)
    parser.add_argument("--conversations", type=int, default=d.conversations)
    parser.add_argument("--start-rate", type=float, default=d.start_rate, help="conversations/s")
    parser.add_argument("--end-rate", type=float, default=d.end_rate, help="conversations/s")
    parser.add_argument("--think-s", type=float, default=d.think_s)
    parser.add_argument("--seed", type=int, default=d.seed)


def run(args: argparse.Namespace) -> dict[str, Any]:
    shape = TraceShape(
        tenants=args.tenants,
        conversations=args.conversations,
        start_rate=args.start_rate,
        end_rate=args.end_rate,
        think_s=args.think_s,
        seed=args.seed,
    )
    lines = generate(shape)
    write_trace(args.output, lines)
    read_trace(args.output)  # what we write, we can read
    return {
        "path": str(args.output),
        "requests": len(lines),
        "span_s": lines[-1]["timestamp"] / 1000,
        "input_tokens_mean": round(sum(x["input_length"] for x in lines) / len(lines), 1),
        "distinct_blocks": len({i for x in lines for i in x["hash_ids"]}),
    }
