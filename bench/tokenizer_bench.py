"""``kvroute bench tokenizer``: what tokenizing a chat costs a router, alone and among several.

Every chat request is rendered with the chat template and encoded, as vLLM does, before the
index can be asked anything. The router caches rendered texts and the pieces between added
tokens (router/tokens/tokenization.py), so a returning conversation encodes only its new turn; but
among N routers behind a load balancer each one sees a conversation's turns at random and
encodes the history it missed. This benchmark replays the full preset's chat trace (the
routing benchmark's conversations, in the order their turns arrive) through N local
tokenizers, each request to the router the routing benchmark would send it to
(``pick_router``), and reports the render and encode time per request:

- ``routers``: 1 and ``--routers``, so the cost of first-seen history shows as a ratio;
- ``encode``: ``direct`` (the Rust tokenizer called directly, the router's default where its
  load-time probe allows) and ``transformers`` (the same tokenizer through transformers'
  call), measured in the same run, in alternating order, with the ids checked equal.

Assistant turns are filler of the trace's answer length (the simulator's replies are words
too). The figure to read is a ratio within one run; the absolute times depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from kvroute.bench.routing_presets import PRESETS
from kvroute.bench.workloads import BUILDERS, TextSource
from kvroute.bench.workloads.runner import pick_router
from kvroute.router.tokens.requests import ParsedRequest, parse_body
from kvroute.router.tokens.tokenization import LocalTokenizer

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-dir", help="tokenizer dir (default: the simulator's model)")
    parser.add_argument("--routers", type=int, default=4, help="routers sharing the trace")
    parser.add_argument("--users", type=int, default=30, help="chat users (the trace's first N)")
    parser.add_argument("--repeats", type=int, default=3, help="passes per configuration")
    parser.add_argument("--seed", type=int, default=0)


def _trace(tokenizer: Any, users: int, seed: int) -> list[tuple[str, int, ParsedRequest]]:
    """The chat requests in arrival order of their turns (round by round)."""
    sizes = dict(PRESETS["full"]["sizes"]["chat"], users=users)
    text = TextSource(seed, count_tokens=lambda s: len(tokenizer.encode(s)))
    workload = BUILDERS["chat"](text, seed=seed, **sizes)
    answer = " ".join(["words"] * int(sizes["answer_tokens"]))
    requests: list[tuple[str, int, ParsedRequest]] = []
    for session in workload.sessions:
        history: list[dict[str, str]] = []
        if session.system:
            history.append({"role": "system", "content": session.system})
        for turn_no, turn in enumerate(session.turns):
            history.append({"role": turn.role, "content": turn.content})
            body = {"model": "m", "messages": list(history), "max_tokens": turn.max_tokens}
            requests.append((session.id, turn_no, parse_body(json.dumps(body).encode(), "chat")))
            history.append({"role": "assistant", "content": answer})
    requests.sort(key=lambda r: (r[1], r[0]))
    return requests


def _pass(
    model_dir: str, requests: list[tuple[str, int, ParsedRequest]], routers: int, direct: bool
) -> tuple[dict[str, float], list[list[int]]]:
    """One pass over the trace with fresh (empty-cache) tokenizers."""
    names = [str(i) for i in range(routers)]
    toks = {n: LocalTokenizer(model_dir, direct_encode=direct) for n in names}
    if direct and not all(t.stats()["direct_encode"] for t in toks.values()):
        raise SystemExit(f"kvroute bench tokenizer: {model_dir} cannot be encoded directly")
    render = encode = 0.0
    ids: list[list[int]] = []
    for session, turn, req in requests:
        tok = toks[pick_router(names, session, turn)]
        t0 = time.perf_counter()
        text = tok.render_chat(req)
        t1 = time.perf_counter()
        ids.append(tok.encode_text(text, req.add_special_tokens))
        t2 = time.perf_counter()
        render += t1 - t0
        encode += t2 - t1
    n = len(requests)
    return {"render_ms": 1e3 * render / n, "encode_ms": 1e3 * encode / n}, ids


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.routers < 1 or args.users < 1 or args.repeats < 1:
        raise SystemExit("kvroute bench tokenizer: --routers, --users, --repeats must be >= 1")
    if args.model_dir:
        model_dir = str(args.model_dir)
    else:
        from kvroute.bench.sim.tokenizer import ensure_model_dir

        model_dir = str(ensure_model_dir())
    try:
        reference_tokenizer = LocalTokenizer(model_dir)
    except OSError as exc:  # no such directory, or no tokenizer files in it
        raise SystemExit(f"kvroute bench tokenizer: cannot load {model_dir}: {exc}") from exc
    requests = _trace(reference_tokenizer.tok, args.users, args.seed)
    counts = sorted({1, args.routers})
    _pass(model_dir, requests, 1, True)  # warm-up: imports, template compilation, allocator
    samples: dict[tuple[int, str], list[dict[str, float]]] = {}
    reference: list[list[int]] | None = None
    identical = True
    for repeat in range(args.repeats):
        modes = ["direct", "transformers"] if repeat % 2 == 0 else ["transformers", "direct"]
        for routers in counts:
            for mode in modes:
                figures, ids = _pass(model_dir, requests, routers, mode == "direct")
                samples.setdefault((routers, mode), []).append(figures)
                if reference is None:
                    reference = ids
                identical = identical and ids == reference
    rows = []
    for (routers, mode), runs in sorted(samples.items()):
        rows.append(
            {
                "routers": routers,
                "encode": mode,
                "render_ms_per_request": statistics.median(r["render_ms"] for r in runs),
                "encode_ms_per_request": statistics.median(r["encode_ms"] for r in runs),
                "encode_ms_runs": [round(r["encode_ms"], 4) for r in runs],
            }
        )

    def encode_ms(routers: int, mode: str) -> float:
        return next(
            r["encode_ms_per_request"]
            for r in rows
            if r["routers"] == routers and r["encode"] == mode
        )

    n = args.routers
    return {
        "bench": "tokenizer",
        "model_dir": model_dir,
        "requests": len(requests),
        "mean_prompt_tokens": statistics.mean(len(i) for i in reference or [[]]),
        "routers": n,
        "repeats": args.repeats,
        "ids_identical": identical,
        "rows": rows,
        "direct_over_transformers": {
            str(r): encode_ms(r, "direct") / encode_ms(r, "transformers") for r in counts
        },
        f"routers_{n}_over_1": {
            mode: encode_ms(n, mode) / encode_ms(1, mode) for mode in ("direct", "transformers")
        },
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    print(json.dumps(run(parser.parse_args(argv)), indent=2))


if __name__ == "__main__":
    main()
