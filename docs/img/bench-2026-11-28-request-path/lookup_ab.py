"""Lookups at 1,000 replicas on the native core: the indexer bench's staircase (2,048 blocks,
200 lookups) and chat-shaped probe (264 blocks, 50 lookups). Prints p50s (µs). Run from the
repository root with kvroute installed, once per code version (rebuild the extension)."""

import argparse
import gc
import json
import random
import statistics
import time

from kvroute.bench import indexer_bench
from kvroute.indexer.index import InMemoryPrefixIndex
from kvroute.indexer.keys import RequestKeys


def main() -> None:
    out = {}
    args = argparse.Namespace(block_size=16, replicas=1000, entries=1_375_000, seed=0)
    index = InMemoryPrefixIndex(core="native")
    probe = indexer_bench._fill_index(index, args, random.Random(4))
    replicas = index.replicas()
    gc.collect()
    gc.freeze()
    request = RequestKeys(probe)
    request.keys(16)
    times = []
    for _ in range(200):
        started = time.perf_counter()
        index.lookup(request, replicas=replicas)
        times.append(time.perf_counter() - started)
    times.sort()
    out["staircase_p50_us"] = round(1e6 * statistics.median(times))
    out["staircase_p90_us"] = round(1e6 * times[180])
    del index
    gc.unfreeze()
    gc.collect()
    scale = argparse.Namespace(block_size=16, replicas=1000)
    chat = indexer_bench._chat_lookup(scale, random.Random(5), ["native"])["native"]
    out["chat_p50_us"] = chat["chat_lookup_p50_us_264"]
    out["chat_p99_us"] = chat["chat_lookup_p99_us_264"]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
