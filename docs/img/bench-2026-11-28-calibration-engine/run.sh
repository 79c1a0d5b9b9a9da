#!/bin/bash
# The calibration runs of docs/benchmarks.md, "Calibration: the engine's own intercept, loads
# above the noise" (2026-11-28): the quick chat and shared-prefix workloads with the priors
# 10x high, 10x low and true, in both orders, then the shared-storage scenario's three arms
# twice (../bench-2026-11-28-storage-rate/run.sh; its new-*.json are storage-new-*.json here).
# Writes to $OUT (default /tmp/calrun).
set -e
OUT=${OUT:-/tmp/calrun}
mkdir -p "$OUT"
cd "$(dirname "$0")/../../.."
kvroute bench routing --json --preset quick --workloads chat,shared_prefix --warm-up \
  --policies kvroute~x10,kvroute~x0.1,kvroute --no-plots --out-dir "$OUT/oa" > "$OUT/quick-a.json"
kvroute bench routing --json --preset quick --workloads chat,shared_prefix --warm-up \
  --policies kvroute,kvroute~x0.1,kvroute~x10 --no-plots --out-dir "$OUT/ob" > "$OUT/quick-b.json"
for round in 1 2; do OUT="$OUT" bash docs/img/bench-2026-11-28-storage-rate/run.sh new "$round"; done
# A few hundred requests: 96 users (288 requests), past the fleet's capacity.
kvroute bench routing --json --preset quick --workloads chat --size chat.users=96 --warm-up \
  --policies kvroute~x10,kvroute~x0.1,kvroute --no-plots --out-dir "$OUT/o288" > "$OUT/chat-288.json"
