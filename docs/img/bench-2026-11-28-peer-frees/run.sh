#!/bin/bash
# docs/benchmarks.md, "Several routers on this preset": two routers sharing the traffic
# against one router beside an idle one, on the small_device preset, seeds 0-3, with peers
# telling when their requests' device blocks free (kv_frees). Writes to $OUT.
OUT=${OUT:-/tmp/mr2}
mkdir -p "$OUT"
for s in 0 1 2 3; do
  for mode in two one; do
    if [ $mode = two ]; then o=(--routers 2); else o=(--routers 1 --idle-routers 1); fi
    kvroute bench routing --json --preset small_device --policies kvroute --seed $s --no-plots \
      --records --warm-up "${o[@]}" --out-dir "$OUT/$mode-$s" > "$OUT/small_device-$mode-router-seed$s.json"
  done
done
# The same with homes shared between the routers (homes-shared-*.json), and an A/B of two
# routers with homes shared and not (ab-homes-{share,noshare}-seed*.json), the latter run
# with a local switch that left the peers' homes unapplied (not committed).
