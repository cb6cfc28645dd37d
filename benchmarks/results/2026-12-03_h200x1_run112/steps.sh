#!/usr/bin/env bash
# run112 (1x H200, GPU image): after 3935545 (ag_gemm's fallback / group-of-one SiLU gate by the fused core),
# 60f0971 (ag_gemm / gemm_rs backward in a group of one: torch's GEMMs, no copies) and the FP8-gradient commits
# (fp8_grads=). gpu_tests: the GPU tests of what changed; bench_layers / bench_backward at W = 1 (TP-MLP vs HF).
# Few files come back: logs only.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
step() { local name=$1 limit=$2; shift 2; local t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "== $name: exit $? in $(( $(date +%s) - t0 )) s"; }
echo "commit $GIT_COMMIT" > "$OUT/gpu_tests.log"
step gpu_tests 230 python -m pytest -m gpu -n 8 -p no:cacheprovider -rs -q tests/kernels/test_allgather_gemm.py \
  tests/kernels/test_autograd.py tests/nn/test_training.py tests/nn/test_layers.py tests/nn/test_fp8_training.py \
  tests/kernels/test_gemm_reducescatter.py
grep -E "passed|failed|Error|FAILED" "$OUT/gpu_tests.log" | tail -8
mkdir -p /tmp/bench
BENCH_DIR=/tmp/bench step bench_layers 110 torchrun --nproc-per-node=1 benchmarks/bench_layers.py --only mlp
grep -E "^\|" "$OUT/bench_layers.log" | head -12
BENCH_DIR=/tmp/bench step bench_backward 110 torchrun --nproc-per-node=1 benchmarks/bench_backward.py --only mlp
grep -E "^\|" "$OUT/bench_backward.log" | head -12
true
