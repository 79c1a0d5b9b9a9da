#!/bin/bash
# The shared-storage calibration arms (docs/benchmarks.md, "Fixed later the same day"):
# run.sh LABEL ROUND writes LABEL-{true,x10,x01}-ROUND.json to $OUT (default /tmp/cal).
# The old code's rounds ran with the change stashed (git stash), the new code's with it.
OUT=${OUT:-/tmp/cal}
mkdir -p "$OUT"
for arm in true x10 x01; do
  case $arm in
    true) opts=();;
    x10) opts=(--router-option cost.prefill_s_per_token=0.00125 --router-option cost.load_s_per_token_cpu=0.0001 --router-option cost.load_s_per_token_storage=0.0005);;
    x01) opts=(--router-option cost.prefill_s_per_token=0.0000125 --router-option cost.load_s_per_token_cpu=0.000001 --router-option cost.load_s_per_token_storage=0.000005);;
  esac
  timeout 300 kvroute bench routing --json --scenario shared_storage --preset quick \
    --scenario-arms kvroute_shared --no-plots "${opts[@]}" --out "$OUT/$1-$arm-$2.json" \
    > "$OUT/$1-$arm-$2.log" 2>&1
done
