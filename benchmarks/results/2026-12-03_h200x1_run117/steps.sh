#!/usr/bin/env bash
# run117 (1x H200, GPU image): after the grouped GEMM's backward without transposed weight copies (w_layout "kn")
# and the persistent TMA weight-gradient kernel (run116: the MoE step's backward spent ~18 ms of 46 on copying
# both experts' weights transposed). gpu_tests: the grouped GEMM, autograd, nn; bench_grouped_gemm (forward,
# dgrad, wgrad vs torch grouped_mm); bench_backward moe at W = 1; the MoE step's profile again.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/benchmarks
step() { local name=$1 limit=$2; shift 2; local t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "== $name: exit $? in $(( $(date +%s) - t0 )) s"; }
echo "commit $GIT_COMMIT" > "$OUT/node.log"
step gpu_tests 180 python -m pytest -m gpu -n 8 -p no:cacheprovider -rs -q tests/kernels/test_grouped_gemm.py \
  tests/kernels/test_autograd.py tests/nn
grep -E "passed|failed|FAILED" "$OUT/gpu_tests.log" | tail -6
mkdir -p /tmp/bench
BENCH_DIR=/tmp/bench step bench_grouped_gemm 100 python benchmarks/bench_grouped_gemm.py --rounds 3
grep -E "^\|" "$OUT/bench_grouped_gemm.log" | cut -c1-230 | head -20
BENCH_DIR=/tmp/bench step bench_backward 90 torchrun --nproc-per-node=1 benchmarks/bench_backward.py --only moe
grep -E "^\|" "$OUT/bench_backward.log" | head -12
step moe_profile 70 torchrun --nproc-per-node=1 benchmarks/results/2026-12-03_h200x1_run116/moe_profile.py "$OUT"
cut -c1-95,185-230 "$OUT/moe_profile.txt" | grep -v "^-\|^$" | sed -n '/== ours/,$p'
true
