#!/bin/bash
# docs/benchmarks.md, "Small device caches", the tail on every preset: kvroute (device-cache
# room counted) against least_loaded, same run, on the full and llmd presets (seed 0) and the
# quick preset (seeds 0-2). Writes to $OUT.
OUT=${OUT:-/tmp/tail}
mkdir -p "$OUT"
kvroute bench routing --json --preset full --policies least_loaded,kvroute --seed 0 --no-plots \
  --warm-up --out-dir "$OUT/o" > "$OUT/full-seed0.json"
kvroute bench routing --json --preset llmd --policies least_loaded,kvroute --seed 0 --no-plots \
  --warm-up --out-dir "$OUT/ol" > "$OUT/llmd-seed0.json"
for s in 0 1 2; do
  kvroute bench routing --json --preset quick --policies least_loaded,kvroute --seed $s \
    --no-plots --warm-up --out-dir "$OUT/oq$s" > "$OUT/quick-seed$s.json"
done
# small_device with the final code (the scrape read over its window), seeds 0-2
for s in 0 1 2; do
  kvroute bench routing --json --preset small_device --policies least_loaded,kvroute --seed $s \
    --no-plots --warm-up --out-dir "$OUT/osd$s" > "$OUT/small_device-seed$s.json"
done
