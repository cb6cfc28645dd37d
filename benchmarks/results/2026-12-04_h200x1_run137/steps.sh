#!/usr/bin/env bash
# run137 (1x H200, GPU image, 2026-12-04): after fp8_weight_cache (8dd97dc) and the block-scaled tuner candidates
# of one warpgroup, two programs per SM: their GPU tests, the MoE and MLP training steps with the FP8 weights kept
# (bench_backward's "kept" contenders), the FP8 core against _scaled_mm (blockwise with the new candidates).
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/benchmarks
step() { local name=$1 limit=$2; shift 2; local t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "== $name: exit $? in $(( $(date +%s) - t0 )) s"; }
echo "commit $GIT_COMMIT" > "$OUT/node.log"
step gpu_tests 170 python -m pytest -m gpu -n 4 -p no:cacheprovider -rs -q tests/nn/test_fp8_training.py \
  tests/kernels/test_fp8_gemm.py tests/kernels/test_fp8_grouped_gemm.py tests/kernels/test_grouped_gemm.py
grep -E "passed|failed|FAILED" "$OUT/gpu_tests.log" | tail -6
mkdir -p /tmp/bench
BENCH_DIR=/tmp/bench step bench_backward 200 torchrun --nproc-per-node=1 benchmarks/bench_backward.py --only moe,mlp --fp8 row
grep -E "^\||WRONG" "$OUT/bench_backward.log" | head -16
BENCH_DIR=/tmp/bench step bench_gemm_fp8 180 torchrun --nproc-per-node=1 benchmarks/bench_gemm.py --only fp8
grep -E "^\|" "$OUT/bench_gemm_fp8.log" | head -12
cp /tmp/bench/*.json "$OUT/" 2>/dev/null
true
