#!/usr/bin/env bash
# run131 (1x H200, GPU image): quantize_probe.py, the weight quantisation kernels against one-pass / wider variants.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/benchmarks
echo "commit $GIT_COMMIT" > "$OUT/node.log"
timeout 120 python benchmarks/results/2026-12-04_h200x1_run131/quantize_probe.py "$OUT" > "$OUT/quantize_probe.log" 2>&1
echo "exit $?"; tail -20 "$OUT/quantize_probe.log"
