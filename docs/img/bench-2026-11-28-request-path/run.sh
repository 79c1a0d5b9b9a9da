#!/bin/bash
# docs/benchmarks.md, "The request path and the lookup's per-replica work (2026-11-28,
# evening)". OLD is the commit before the changes (68eeabe); each pair checks out OLD's
# router/ (and, for the lookups, indexer/index/lookup.py and indexer/native/core.cpp with
# `python setup.py build_ext --inplace`), measures, then HEAD's, and measures again.
OUT=${OUT:-/tmp/request-path}
DIR=docs/img/bench-2026-11-28-request-path  # run from the repository root
mkdir -p "$OUT"
for i in 1 2; do
  git checkout -q 68eeabe -- router
  kvroute bench proxy --json --no-overload --out "$OUT/proxy_old$i.json" > /dev/null
  git checkout -q HEAD -- router
  kvroute bench proxy --json --no-overload --out "$OUT/proxy_new$i.json" > /dev/null
done
for i in 1 2; do
  git checkout -q 68eeabe -- indexer/index/lookup.py indexer/native/core.cpp
  python setup.py -q build_ext --inplace && echo "old$i $(python $DIR/lookup_ab.py)" >> "$OUT/lookup_ab.txt"
  git checkout -q HEAD -- indexer/index/lookup.py indexer/native/core.cpp
  python setup.py -q build_ext --inplace && echo "new$i $(python $DIR/lookup_ab.py)" >> "$OUT/lookup_ab.txt"
done
kvroute bench indexer --json --out "$OUT/indexer_native_vs_python.json" > /dev/null
python $DIR/gc_token_cache.py > "$OUT/gc_token_cache.json"
python $DIR/gc_hints.py > "$OUT/gc_hints.json"
# $DIR/long_prompts_p99.py: once per code version (git stash of router/ for the old), alternating
