"""A full garbage collection with the router's text cache at its cap: the ids cached as lists
(the code before ``frozen_ids``) against tuples, one process, the same texts, the start-up heap
frozen as ``kvroute serve`` freezes it. Run from the repository root with kvroute installed."""

import gc
import json
import os
import random
import statistics
import time

from kvroute.router.tokens import tokenization
from kvroute.router.tokens.tokenization import LocalTokenizer

PATH = os.path.expanduser("~/.cache/kvroute/bench/tiny-model")  # kvroute bench proxy builds it
WORDS = [
    *("alpha", "beta", "gamma", "delta", "cache"),
    *("router", "token", "prefix", "replica", "query"),
]


def main() -> None:
    rng = random.Random(0)
    texts = [
        " ".join(rng.choice(WORDS) + str(rng.randrange(100)) for _ in range(700))
        for _ in range(1200)
    ]
    out = {}
    for label, keep in (("lists", list), ("tuples", tuple), ("lists2", list), ("tuples2", tuple)):
        tokenization.frozen_ids = keep  # what the cache keeps
        tok = LocalTokenizer(PATH)
        gc.collect()
        gc.freeze()  # as kvroute serve does once started (router/service.py)
        for text in texts:
            tok.encode_text(text, False)
        ids = sum(len(v[0]) for v in tok._text_cache._data.values())
        gc.collect()
        times = []
        for _ in range(7):
            started = time.perf_counter()
            gc.collect()
            times.append(time.perf_counter() - started)
        out[label] = {
            "cached_ids": ids,
            "entries": len(tok._text_cache),
            "full_collect_ms": round(1e3 * statistics.median(times), 2),
        }
        del tok
        gc.unfreeze()
        gc.collect()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
