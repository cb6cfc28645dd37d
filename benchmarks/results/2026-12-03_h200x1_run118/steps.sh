#!/usr/bin/env bash
# run118 (1x H200, GPU image): after the grouped GEMM with grad keeps the SiLU gate's pre-activation (run117: MoE
# fwd+bwd 22.8 ms vs HF grouped_mm 24.4; the backward recomputed the gate_up GEMM). gpu_tests: the grouped GEMM,
# autograd, nn; bench_backward mlp + moe at W = 1; the MoE step's profile.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/benchmarks
step() { local name=$1 limit=$2; shift 2; local t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "== $name: exit $? in $(( $(date +%s) - t0 )) s"; }
echo "commit $GIT_COMMIT" > "$OUT/node.log"
step gpu_tests 180 python -m pytest -m gpu -n 8 -p no:cacheprovider -rs -q tests/kernels/test_grouped_gemm.py \
  tests/kernels/test_autograd.py tests/nn
grep -E "passed|failed|FAILED" "$OUT/gpu_tests.log" | tail -6
mkdir -p /tmp/bench
BENCH_DIR=/tmp/bench step bench_backward 150 torchrun --nproc-per-node=1 benchmarks/bench_backward.py --only mlp,moe
grep -E "^\|" "$OUT/bench_backward.log" | head -12
step moe_profile 70 torchrun --nproc-per-node=1 benchmarks/results/2026-12-03_h200x1_run116/moe_profile.py "$OUT"
cut -c1-95,185-230 "$OUT/moe_profile.txt" | grep -v "^-\|^$" | sed -n '/== ours/,$p' | head -14
true
