#!/usr/bin/env bash
# run139 (1x H200, GPU image, 2026-12-04): the GPU tests after the session's last changes (fp8.keywords_given,
# the weight cache's test with checkpointing and torch.compile), and the MoE training step with block FP8 kept.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/benchmarks
step() { local name=$1 limit=$2; shift 2; local t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "== $name: exit $? in $(( $(date +%s) - t0 )) s"; }
echo "commit $GIT_COMMIT" > "$OUT/node.log"
step gpu_tests 230 python -m pytest -m gpu -n 8 -p no:cacheprovider -rs -q tests/nn/test_fp8_training.py \
  tests/kernels/test_fp8_gemm.py tests/kernels/test_fp8_grouped_gemm.py tests/kernels/test_grouped_gemm.py \
  tests/kernels/test_fp8_ag_gemm.py tests/kernels/test_fp8_gemm_rs.py
grep -E "passed|failed|FAILED" "$OUT/gpu_tests.log" | tail -6
mkdir -p /tmp/bench
BENCH_DIR=/tmp/bench step bench_backward 150 torchrun --nproc-per-node=1 benchmarks/bench_backward.py --only moe --fp8 block
grep -E "^\||WRONG" "$OUT/bench_backward.log" | head -10
cp /tmp/bench/*.json "$OUT/" 2>/dev/null
true
