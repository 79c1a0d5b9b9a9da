"""Full garbage collection with a router's text cache full: ids cached as lists (the old code)
against tuples (frozen_ids), same process, same texts."""
import gc, os, random, statistics, time, json
from kvroute.router.tokens import tokenization
from kvroute.router.tokens.tokenization import LocalTokenizer
path = os.path.expanduser("~/.cache/kvroute/bench/tiny-model")
rng = random.Random(0)
words = ["alpha", "beta", "gamma", "delta", "cache", "router", "token", "prefix", "replica", "query"]
texts = [" ".join(rng.choice(words) + str(rng.randrange(100)) for _ in range(700)) for _ in range(1200)]
out = {}
for label, freeze in (("lists", list), ("tuples", tuple), ("lists2", list), ("tuples2", tuple)):
    tokenization.frozen_ids = freeze
    tok = LocalTokenizer(path)
    gc.collect(); gc.freeze()  # as kvroute serve does once started (router/service.py)
    for t in texts:
        tok.encode_text(t, False)
    n = sum(len(v[0]) for v in tok._text_cache._data.values())
    gc.collect()
    times = []
    for _ in range(7):
        s = time.perf_counter(); gc.collect(); times.append(time.perf_counter() - s)
    out[label] = {"cached_ids": n, "entries": len(tok._text_cache), "full_collect_ms": round(1e3 * statistics.median(times), 2)}
    del tok; gc.unfreeze(); gc.collect()
print(json.dumps(out, indent=1))
