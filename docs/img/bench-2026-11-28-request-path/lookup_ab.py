"""Lookups at 1,000 replicas on the native core: staircase (2,048 blocks) and chat (264)."""
import argparse, gc, json, random, statistics, sys, time
from kvroute.bench import indexer_bench as ib
from kvroute.indexer.index import InMemoryPrefixIndex
from kvroute.indexer.keys import RequestKeys
args = argparse.Namespace(block_size=16, replicas=1000, entries=1_375_000, seed=0)
out = {}
idx = InMemoryPrefixIndex(core="native")
probe = ib._fill_index(idx, args, random.Random(4))
reps = idx.replicas(); gc.collect(); gc.freeze()
req = RequestKeys(probe); req.keys(16)
ts = []
for _ in range(200):
    t = time.perf_counter(); idx.lookup(req, replicas=reps); ts.append(time.perf_counter() - t)
ts.sort(); out["staircase_p50_us"] = round(1e6 * statistics.median(ts)); out["staircase_p90_us"] = round(1e6 * ts[180])
del idx; gc.unfreeze(); gc.collect()
chat = ib._chat_lookup(argparse.Namespace(block_size=16, replicas=1000), random.Random(5), ["native"])
out["chat_p50_us"] = chat["native"]["chat_lookup_p50_us_264"]; out["chat_p99_us"] = chat["native"]["chat_lookup_p99_us_264"]
print(json.dumps(out))
