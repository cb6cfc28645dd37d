#!/usr/bin/env bash
# run118 (1x H200, GPU image): after the grouped GEMM with grad keeps the SiLU gate's pre-activation (run117: MoE
# fwd+bwd 22.8 ms vs HF grouped_mm 24.4; the backward recomputed the gate_up GEMM) and the host's grid arithmetic
# without Triton's constexpr functions (run115's profiles: 10-17 calls of ~5 us per ep_dispatch / ep_combine).
# gpu_tier: README's GPU tier; bench_backward moe at W = 1; bench_host at W = 1.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/benchmarks
step() { local name=$1 limit=$2; shift 2; local t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "== $name: exit $? in $(( $(date +%s) - t0 )) s"; }
echo "commit $GIT_COMMIT" > "$OUT/node.log"
step gpu_tier 300 python -m pytest -m gpu -n 8 -p no:cacheprovider -rs -q --durations=5 tests
grep -E "passed|failed|FAILED" "$OUT/gpu_tier.log" | tail -6
mkdir -p /tmp/bench
BENCH_DIR=/tmp/bench step bench_backward 90 torchrun --nproc-per-node=1 benchmarks/bench_backward.py --only moe
grep -E "^\|" "$OUT/bench_backward.log" | head -8
BENCH_DIR=/tmp/bench step bench_host 45 torchrun --nproc-per-node=1 benchmarks/bench_host.py
grep -E "NOT MET|ok$" "$OUT/bench_host.log" | head -14
true
