#!/usr/bin/env bash
# run135 (1x H200, GPU image, 2026-12-04 ~17:13 UTC): the FP8 MoE training step with both FP8 modes after
# the block quantiser's 16 warps (bench_backward --only moe --fp8 row,block), the FP8 GEMM core against
# _scaled_mm again (bench_gemm --only fp8: issue 34's 0.95x / 0.85x targets), bench_host on another host; first the
# GPU tests of 5d6164c (grouped_gemm's quantize= step moved into _grouped_gemm after run134's tier).
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/benchmarks
step() { local name=$1 limit=$2; shift 2; local t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "== $name: exit $? in $(( $(date +%s) - t0 )) s"; }
echo "commit $GIT_COMMIT" > "$OUT/node.log"
step gpu_tests 150 python -m pytest -m gpu -n 4 -p no:cacheprovider -rs -q tests/kernels/test_fp8_grouped_gemm.py \
  tests/kernels/test_grouped_gemm.py tests/nn/test_fp8_training.py
grep -E "passed|failed|FAILED" "$OUT/gpu_tests.log" | tail -4
mkdir -p /tmp/bench
BENCH_DIR=/tmp/bench step bench_backward 150 torchrun --nproc-per-node=1 benchmarks/bench_backward.py --only moe --fp8 row,block
grep -E "^\||WRONG" "$OUT/bench_backward.log" | head -10
BENCH_DIR=/tmp/bench step bench_gemm_fp8 200 torchrun --nproc-per-node=1 benchmarks/bench_gemm.py --only fp8
grep -E "^\|" "$OUT/bench_gemm_fp8.log" | head -24
BENCH_DIR=/tmp/bench step bench_host 60 torchrun --nproc-per-node=1 benchmarks/bench_host.py
grep -E "NOT MET|ok$" "$OUT/bench_host.log" | head -14
cp /tmp/bench/*.json "$OUT/" 2>/dev/null
true
