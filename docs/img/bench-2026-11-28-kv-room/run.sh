#!/bin/bash
# The runs behind docs/benchmarks.md, "Small device caches" (2026-11-28). Each file here is
# the routing.json of one run (--out-dir), named by the series below.
set -e
b="kvroute bench routing --json --no-plots --records --warm-up"
for s in 0 1 2; do
  $b --preset small_device --policies least_loaded,kvroute --seed $s --out-dir g2-sd_$s
  $b --preset small_device --policies kvroute --router-option cost.kv_room=false --seed $s --out-dir ab-off_$s
  $b --preset small_device --policies kvroute --routers 1 --idle-routers 1 --seed $s --out-dir fin-one_$s
  $b --preset small_device --policies kvroute --routers 2 --seed $s --out-dir p2-two_$s
done
# fin-two_*: two routers before the peers' holdings were priced as freeing over one answer
for s in 0 1 2 3; do
  $b --preset quick --workloads shared_prefix --policies kvroute --seed $s --out-dir qsp_on_$s
  $b --preset quick --workloads shared_prefix --policies kvroute --router-option cost.kv_room=false --seed $s --out-dir qsp_off_$s
done
for s in 0 1; do
  $b --preset quick --workloads chat --policies least_loaded,kvroute --seed $s --out-dir fin-qchat_$s
done
# ungated-*: the room priced in every decision (before waits_to_price), quick preset
