#!/usr/bin/env bash
# run133 (1x H200, GPU image): quantize_probe3.py (persistent rowwise and blockwise variants).
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/benchmarks
echo "commit $GIT_COMMIT" > "$OUT/node.log"
timeout 120 python benchmarks/results/2026-12-04_h200x1_run133/quantize_probe3.py "$OUT" > "$OUT/quantize_probe3.log" 2>&1
echo "exit $?"; tail -20 "$OUT/quantize_probe3.log"
