"""A full garbage collection with the burst hints at their default cap (500,000): the layout
before (``hints_before.py``: a dict of (key, replica) tuples and a deque) against
router/routing/hints.py, one process, the start-up heap frozen as kvroute serve freezes it.
Also the time to record them (5,000 requests of 100 blocks over 8 replicas). Run from the
repository root with kvroute installed."""

import gc
import importlib.util
import json
import random
import statistics
import time
from pathlib import Path

from kvroute.router.routing.hints import BurstHints


def _before() -> type:
    path = Path(__file__).with_name("hints_before.py")
    spec = importlib.util.spec_from_file_location("hints_before", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
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
