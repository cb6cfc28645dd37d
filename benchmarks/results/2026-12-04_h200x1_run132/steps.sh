#!/usr/bin/env bash
# run132 (1x H200, GPU image): quantize_probe2.py (rowwise tiles / warps, blockwise warps, what the rule costs).
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/benchmarks
echo "commit $GIT_COMMIT" > "$OUT/node.log"
timeout 120 python benchmarks/results/2026-12-04_h200x1_run132/quantize_probe2.py "$OUT" > "$OUT/quantize_probe2.log" 2>&1
echo "exit $?"; tail -20 "$OUT/quantize_probe2.log"
