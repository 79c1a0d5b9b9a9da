"""Index work for an instruction count (docs/benchmarks.md, "The cache engines' truth").

Ingest, then lookups, through the bench's own code paths on the native core; run each under
``valgrind --tool=callgrind`` in a fresh ``python -S`` with the code to measure on
``PYTHONPATH``. ``import`` stops after the imports: the baseline subtracted.
"""

import argparse
import random
import sys

from kvroute.bench import indexer_bench as b

if sys.argv[1] == "import":
    raise SystemExit(0)
args = argparse.Namespace(
    block_size=16,
    replicas=8,
    entries=40_000,
    ingest_blocks=20_000,
    ingest_replicas=1,
    lookups=20,
    seed=0,
    ingest_rounds=1,
)
rng = random.Random(0)
if sys.argv[1] == "ingest":
    b._ingest(args, rng, ["native"])
if sys.argv[1] == "lookup":
    b._lookup(args, rng, ["native"], 20)
