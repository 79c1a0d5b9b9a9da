"""Replay a trace in the Mooncake format: the public traces Dynamo's and llm-d's benchmarks use.

A trace is JSON Lines, one request a line, in time order::

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, 1, 2]}

``timestamp`` is the arrival in milliseconds; ``hash_ids`` has one id per 512-token block of
the prompt (the last block may be partial), and equal ids mean equal content. A trace carries
no text, so we build prompts from the ids: each id stands for a block of words that are one
token each in the fleet's tokenizer, chosen from a generator seeded by the id (its first
words spell the id itself, so two ids never give the same block). Equal ids therefore give
equal tokens and unequal ids differ from their first token on, which is exactly the prefix
structure the trace records, and the prompt's length is the trace's ``input_length`` (scaled
by ``block_tokens / 512`` when the blocks are shrunk to fit a small fleet).

A trace's clock can be sped up (``speedup``) and cut to its first requests (``limit``); the
cheap checks (every line's shape, time order, lengths that agree with ``hash_ids``) run on the
whole file before anything starts, so a bad trace fails at once and names its line.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvroute.bench.workloads.base import Session, Turn, Workload

__all__ = [
    "MAX_INPUT_TOKENS",
    "MAX_OUTPUT_TOKENS",
    "MOONCAKE_BLOCK_TOKENS",
    "TRACE_WORKLOAD",
    "BlockText",
    "TraceError",
    "TraceRequest",
    "add_arguments",
    "build_workload",
    "load_from_args",
    "parse_line",
    "read_trace",
    "single_token_words",
    "trace_sizes",
    "workload_from_args",
]

MOONCAKE_BLOCK_TOKENS = 512
# Beyond these a length is a broken trace rather than a long request: the longest context
# windows served today are about a million tokens, and no server generates 128k tokens at once.
MAX_INPUT_TOKENS = 1_048_576
MAX_OUTPUT_TOKENS = 131_072
# Hash ids are spelt in the first words of their block: this many words, in base len(words).
_ID_WORDS = 6
_MIN_WORDS = 64  # 64**6 ids: far more than any public trace's
_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


class TraceError(ValueError):
    """A trace that cannot be replayed as it is; the message names the file and line."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One line of a trace (``line`` counts from 1, as editors do)."""

    line: int
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def _int_field(obj: dict[str, Any], key: str, where: str, bound: int) -> int:
    value = obj[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise TraceError(f"{where}: {key} must be an integer, got {value!r}")
    if value < 0:
        raise TraceError(f"{where}: {key} is negative ({value})")
    if value > bound:
        raise TraceError(f"{where}: {key} {value} is beyond {bound:,} tokens: not a real request")
    return value


def parse_line(
    text: str, line: int, *, source: str = "trace", block_tokens: int = MOONCAKE_BLOCK_TOKENS
) -> TraceRequest:
    """One trace line, checked: fields present and typed, lengths sane and in agreement with
    ``hash_ids`` (``ceil(input_length / block_tokens)`` ids: one per block, the last partial)."""
    where = f"{source} line {line}"
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{where}: not JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: a line must be a JSON object, got {type(obj).__name__}")
    missing = [k for k in _FIELDS if k not in obj]
    if missing:
        raise TraceError(f"{where}: missing {', '.join(missing)} (a Mooncake line has {_FIELDS})")
    ts = obj["timestamp"]
    if isinstance(ts, bool) or not isinstance(ts, int | float) or not math.isfinite(ts) or ts < 0:
        raise TraceError(f"{where}: timestamp must be a finite number of ms >= 0, got {ts!r}")
    input_length = _int_field(obj, "input_length", where, MAX_INPUT_TOKENS)
    output_length = _int_field(obj, "output_length", where, MAX_OUTPUT_TOKENS)
    if input_length == 0:
        raise TraceError(f"{where}: input_length is 0: a request has at least one prompt token")
    ids = obj["hash_ids"]
    if not isinstance(ids, list) or any(
        isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids
    ):
        raise TraceError(f"{where}: hash_ids must be a list of integers >= 0")
    expected = math.ceil(input_length / block_tokens)
    if len(ids) != expected:
        raise TraceError(
            f"{where}: {len(ids)} hash_ids for input_length {input_length}: one id per "
            f"{block_tokens}-token block means {expected}"
        )
    return TraceRequest(line, float(ts), input_length, output_length, tuple(ids))


def read_trace(
    path: Path | str,
    *,
    limit: int | None = None,
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
) -> list[TraceRequest]:
    """Every request of the file (the first ``limit`` if given), checked line by line; blank
    lines are skipped. Timestamps must not go backwards: a trace is replayed in file order."""
    path = Path(path)
    if limit is not None and limit < 1:
        raise TraceError(f"--limit must be >= 1, got {limit}")
    try:
        handle = path.open(encoding="utf-8")
    except OSError as exc:
        raise TraceError(f"cannot read trace {path}: {exc.strerror or exc}") from None
    out: list[TraceRequest] = []
    with handle:
        try:
            for n, text in enumerate(handle, start=1):
                if not text.strip():
                    continue
                req = parse_line(text, n, source=str(path), block_tokens=block_tokens)
                if out and req.timestamp_ms < out[-1].timestamp_ms:
                    raise TraceError(
                        f"{path} line {n}: timestamp {req.timestamp_ms:g} ms is before line "
                        f"{out[-1].line}'s {out[-1].timestamp_ms:g} ms: a trace must be in "
                        "time order"
                    )
                out.append(req)
                if limit is not None and len(out) >= limit:
                    break
        except UnicodeDecodeError as exc:
            raise TraceError(f"{path}: not UTF-8 text ({exc.reason})") from None
    if not out:
        raise TraceError(f"{path}: no requests (an empty trace)")
    return out


def single_token_words(tokenizer: Any) -> list[str]:
    """The words that are one token each with a space before them, in the Hugging Face
    ``tokenizer``'s vocabulary (sorted): text made of them has exactly one token per word
    whatever surrounds it, which is what lets a block of the trace be an exact token count."""
    words = []
    for piece in tokenizer.get_vocab():
        word = piece[1:]
        if (
            piece.startswith("\u0120")
            and word.isascii()
            and word.isalpha()
            and len(tokenizer.encode(" " + word, add_special_tokens=False)) == 1
        ):
            words.append(word)
    return sorted(set(words))


class BlockText:
    """The text of each hash id's block, the same for the same id in every run and process."""

    def __init__(
        self, words: Sequence[str], *, block_tokens: int = MOONCAKE_BLOCK_TOKENS, seed: int = 0
    ) -> None:
        if len(set(words)) < _MIN_WORDS:
            raise ValueError(
                f"the tokenizer has {len(set(words))} single-token words; prompts need "
                f"{_MIN_WORDS} to spell hash ids"
            )
        if block_tokens < 2 * _ID_WORDS:
            raise ValueError(f"block_tokens must be >= {2 * _ID_WORDS}, got {block_tokens}")
        self.words = sorted(set(words))
        self.block_tokens = block_tokens
        self.seed = seed
        self._cache: dict[int, list[str]] = {}

    def block(self, hash_id: int) -> list[str]:
        """``block_tokens`` words: the id spelt in base len(words), then seeded words."""
        got = self._cache.get(hash_id)
        if got is None:
            base = len(self.words)
            if hash_id >= base**_ID_WORDS:
                raise TraceError(f"hash id {hash_id} is beyond {base**_ID_WORDS - 1}")
            digits, rest = [], hash_id
            for _ in range(_ID_WORDS):
                rest, d = divmod(rest, base)
                digits.append(self.words[d])
            rng = random.Random(f"mooncake/{self.seed}/{hash_id}")
            got = digits + rng.choices(self.words, k=self.block_tokens - _ID_WORDS)
            self._cache[hash_id] = got
        return got

    def prompt_tokens(self, req: TraceRequest, trace_block_tokens: int) -> int:
        """The prompt's length in tokens: the trace's, scaled to this object's blocks."""
        tail = req.input_length - trace_block_tokens * (len(req.hash_ids) - 1)
        scaled_tail = math.ceil(tail * self.block_tokens / trace_block_tokens)
        return self.block_tokens * (len(req.hash_ids) - 1) + max(_ID_WORDS, scaled_tail)

    def prompt(self, req: TraceRequest, trace_block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> str:
        """The request's prompt: its blocks' words, the last block cut to the trace's partial
        length (never below the words that spell its id, so unequal ids still differ)."""
        words: list[str] = []
        for hash_id in req.hash_ids:
            words.extend(self.block(hash_id))
        del words[self.prompt_tokens(req, trace_block_tokens) :]
        return "".join(" " + w for w in words)


def build_workload(
    requests: Iterable[TraceRequest],
    words: Sequence[str],
    *,
    speedup: float = 1.0,
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
    trace_block_tokens: int = MOONCAKE_BLOCK_TOKENS,
    seed: int = 0,
    name: str = "trace",
) -> Workload:
    """One single-turn session per trace request, sent at its timestamp (relative to the
    first, divided by ``speedup``) with ``max_tokens`` its ``output_length`` (at least 1: the
    client measures the first token)."""
    if not (speedup > 0 and math.isfinite(speedup)):
        raise TraceError(f"--speedup must be a positive number, got {speedup}")
    text = BlockText(words, block_tokens=block_tokens, seed=seed)
    reqs = list(requests)
    if not reqs:
        raise TraceError("no requests to replay")
    t0 = reqs[0].timestamp_ms
    sessions = [
        Session(
            id=f"line-{r.line}",
            start_s=(r.timestamp_ms - t0) / 1000.0 / speedup,
            turns=[
                Turn(content=text.prompt(r, trace_block_tokens), max_tokens=max(1, r.output_length))
            ],
        )
        for r in reqs
    ]
    span_s = sessions[-1].start_s
    params: dict[str, object] = dict(
        requests=len(reqs),
        speedup=speedup,
        block_tokens=block_tokens,
        span_s=round(span_s, 3),
        distinct_hash_ids=len({i for r in reqs for i in r.hash_ids}),
        input_tokens_mean=round(sum(r.input_length for r in reqs) / len(reqs), 1),
        seed=seed,
    )
    return Workload(name, sessions, params)


TRACE_WORKLOAD = "trace"


def add_arguments(parser: Any) -> None:
    """The routing benchmark's trace flags (``kvroute bench routing --trace FILE``)."""
    parser.add_argument(
        "--trace",
        type=Path,
        default=None,
        metavar="FILE",
        help="replay a Mooncake-format trace (JSONL: timestamp ms, input_length, "
        "output_length, hash_ids) instead of the preset's workloads",
    )
    parser.add_argument(
        "--limit", type=int, default=None, help="--trace: replay only its first N requests"
    )
    parser.add_argument(
        "--speedup",
        type=float,
        default=1.0,
        help="--trace: divide the trace's inter-arrival times by this (2: twice the rate)",
    )
    parser.add_argument(
        "--trace-block-tokens",
        type=int,
        default=MOONCAKE_BLOCK_TOKENS,
        help="--trace: tokens each of the trace's 512-token blocks becomes in the prompts "
        "(fewer shrinks every prompt alike, to fit a long trace on a small fleet)",
    )


def load_from_args(args: Any) -> list[TraceRequest] | None:
    """The trace ``--trace`` names, read and checked (None without ``--trace``), before any
    process starts: a bad file costs nothing but its message."""
    if getattr(args, "trace", None) is None:
        return None
    if args.workloads:
        raise TraceError("--trace replaces --workloads: give one or the other")
    if args.rate_scale != 1.0:
        raise TraceError("--trace runs at the trace's own rate: scale it with --speedup")
    if not (args.speedup > 0 and math.isfinite(args.speedup)):
        raise TraceError(f"--speedup must be a positive number, got {args.speedup}")
    if args.trace_block_tokens < 2 * _ID_WORDS:
        raise TraceError(f"--trace-block-tokens must be >= {2 * _ID_WORDS}")
    return read_trace(args.trace, limit=args.limit)


def trace_sizes(args: Any, requests: list[TraceRequest]) -> dict[str, Any]:
    """What a trace run's rows carry as their ``sizes``."""
    return {
        "trace": str(args.trace),
        "limit": args.limit,
        "speedup": args.speedup,
        "block_tokens": args.trace_block_tokens,
        "requests": len(requests),
        "span_s": (requests[-1].timestamp_ms - requests[0].timestamp_ms) / 1000.0 / args.speedup,
    }


def workload_from_args(args: Any, requests: list[TraceRequest], tokenizer: Any) -> Workload:
    """The trace as a workload, its prompts in words of the fleet's ``tokenizer``."""
    return build_workload(
        requests,
        single_token_words(tokenizer),
        speedup=args.speedup,
        block_tokens=args.trace_block_tokens,
        seed=args.seed,
        name=TRACE_WORKLOAD,
    )
