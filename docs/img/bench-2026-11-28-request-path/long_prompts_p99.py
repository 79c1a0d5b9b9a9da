"""Long prompts through one router (pinned to core 1, the upstream and this load on core 0):
500 distinct ~2,900-token completions, which fit the text cache, c16 closed loop for 15 s
after every prompt was tokenized once. Prints the load's figures (p50/p99, requests/s).
Run from the repository root with kvroute installed, once per code version, alternating."""

import json
import os
import random
import sys

import uvloop

from kvroute.bench import proxy_bench
from kvroute.deploy.processes import ChildProcess, free_port
from kvroute.deploy.router_process import ReplicaEndpoint, RouterProcess

TOKENIZER = os.path.expanduser("~/.cache/kvroute/bench/tiny-model")
WORDS = [
    *("alpha", "beta", "gamma", "delta", "cache"),
    *("router", "token", "prefix", "replica", "query"),
]


def main(seconds: float) -> None:
    port = free_port()
    upstream = ChildProcess("upstream")
    serve = f"from kvroute.bench.proxy_bench import serve_upstream; serve_upstream({port})"
    upstream.start([sys.executable, "-c", serve], cpus={0})
    upstream.wait_http(f"http://127.0.0.1:{port}/health", 30)
    router = RouterProcess(
        name="router",
        policy="kvroute",
        replicas=[ReplicaEndpoint(name="upstream", url=f"http://127.0.0.1:{port}")],
        tokenizer=TOKENIZER,
        extra_args=["--log-level", "warning", "--no-tokenizer-check"],
        cpus={1},
        start_timeout_s=60,
    )
    router.start()
    os.sched_setaffinity(0, {0})
    rng = random.Random(0)
    bodies = [
        json.dumps(
            {
                "model": "bench",
                "prompt": " ".join(rng.choice(WORDS) + str(rng.randrange(100)) for _ in range(700)),
                "max_tokens": 1,
            }
        ).encode()
        for _ in range(500)
    ]
    try:
        uvloop.run(proxy_bench._load(router.port, bodies, 3000, 16, 60))  # every prompt cached
        result = uvloop.run(proxy_bench._load(router.port, bodies, 10**7, 16, seconds))
        print(json.dumps(result), flush=True)
    finally:
        router.stop()
        upstream.stop()


if __name__ == "__main__":
    main(float(sys.argv[1]) if len(sys.argv) > 1 else 15.0)
