"""A full garbage collection with the burst hints at their default cap (500,000): the layout
before (router/routing/hints.py at 68eeabe, read from git: a dict of (key, replica) tuples
and a deque) against the current one, one process, the start-up heap frozen as kvroute
serve freezes it. Also the time to record them (5,000 requests of 100 blocks over 8
replicas). Run from the repository root (a git checkout) with kvroute installed."""

import gc
import json
import random
import statistics
import subprocess
import time
import types

from kvroute.router.routing.hints import BurstHints


def _before() -> type:
    source = subprocess.run(
        ["git", "show", "68eeabe:router/routing/hints.py"], check=True, capture_output=True
    ).stdout
    module = types.ModuleType("hints_before")
    exec(compile(source, "hints_before.py", "exec"), module.__dict__)
    return module.BurstHints


def main() -> None:
    gc.collect()
    gc.freeze()
    out = {}
    for label, cls in (("before", _before()), ("now", BurstHints)) * 2:
        rng = random.Random(0)
        batches = [[rng.getrandbits(63) for _ in range(100)] for _ in range(5000)]
        hints = cls(ttl_s=60.0, max_keys=500_000)
        started = time.perf_counter()
        for i, keys in enumerate(batches):
            hints.record(f"r{i % 8}", keys, now=1000.0)
        recorded = time.perf_counter() - started
        del batches  # this harness's own lists of keys: not what is measured
        gc.collect()
        gc.collect()
        times = []
        for _ in range(7):
            started = time.perf_counter()
            gc.collect()
            times.append(time.perf_counter() - started)
        out.setdefault(label, []).append(
            {
                "hints": len(hints),
                "record_us_per_block": round(1e6 * recorded / 500_000, 3),
                "full_collect_ms": round(1e3 * statistics.median(times), 2),
            }
        )
        del hints
        gc.collect()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
