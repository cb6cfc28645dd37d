#!/usr/bin/env bash
# run143b (the call after run143; it came on a fresh 1x H100, GPU image, 2026-12-05, 462b503): the small-M GEMM
# table alone (run143's was cut by its limit while tuning), cuBLAS timed in the same run.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/benchmarks; mkdir -p /tmp/bench; echo "commit 462b503" > $OUT/node.log
BENCH_DIR=/tmp/bench timeout 200 torchrun --nproc-per-node=1 benchmarks/bench_gemm.py --only small > $OUT/bench_gemm_small.log 2>&1
cp /tmp/bench/*.json $OUT/ 2>/dev/null
