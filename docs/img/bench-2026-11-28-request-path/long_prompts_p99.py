import sys, time, asyncio, os, json, random
from kvroute.bench import proxy_bench as pb
from kvroute.deploy.processes import ChildProcess, free_port
from kvroute.deploy.router_process import ReplicaEndpoint, RouterProcess
tok = os.path.expanduser("~/.cache/kvroute/bench/tiny-model")
secs = float(sys.argv[1]) if len(sys.argv) > 1 else 15
port = free_port()
up = ChildProcess("up"); up.start([sys.executable, "-c", f"from kvroute.bench.proxy_bench import serve_upstream; serve_upstream({port})"], cpus={0})
up.wait_http(f"http://127.0.0.1:{port}/health", 30)
r = RouterProcess(name="r", policy="kvroute", replicas=[ReplicaEndpoint(name="upstream", url=f"http://127.0.0.1:{port}")], tokenizer=tok, extra_args=["--log-level","warning","--no-tokenizer-check"], cpus={1}, start_timeout_s=60)
r.start()
os.sched_setaffinity(0, {0})
rng = random.Random(0)
words = ["alpha", "beta", "gamma", "delta", "cache", "router", "token", "prefix", "replica", "query"]
bodies = [json.dumps({"model": "bench", "prompt": " ".join(rng.choice(words) + str(rng.randrange(100)) for _ in range(700)), "max_tokens": 1}).encode() for _ in range(500)]
import uvloop
uvloop.run(pb._load(r.port, bodies, 3000, 16, 60))  # warm: every prompt tokenized, the cache full
res = uvloop.run(pb._load(r.port, bodies, 10**7, 16, secs))
print(json.dumps(res), flush=True)
r.stop(); up.stop()
