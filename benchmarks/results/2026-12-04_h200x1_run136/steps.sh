#!/usr/bin/env bash
# run136 (1x H200, GPU image, 2026-12-04): pingpong_probe.py, single-warpgroup FP8 tiles two or three programs per
# SM (the promotion / block scaling of one overlapping the other's wgmmas) against the core's 8-warp tiles and
# _scaled_mm (issue 34's 0.95x / 0.85x targets).
export PYTHONUNBUFFERED=1
echo "commit $GIT_COMMIT" > "$OUT/node.log"
timeout 420 python benchmarks/results/2026-12-04_h200x1_run136/pingpong_probe.py "$OUT" > "$OUT/pingpong_probe.log" 2>&1
echo "== pingpong_probe: exit $?"
grep -vE "^$" "$OUT/pingpong_probe.log" | tail -80
true
