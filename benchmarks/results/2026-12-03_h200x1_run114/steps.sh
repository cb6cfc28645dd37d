#!/usr/bin/env bash
# run114 (1x H200, GPU image): after the silu_gate op (Triton forward / backward kernels, differentiable; the
# training path of ag_gemm's SiLU gate). gpu_tier: README's GPU tier; bench_backward / bench_layers mlp at W = 1
# (run112: fwd+bwd 0.86x of HF); run113's profile of the training step again.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
step() { local name=$1 limit=$2; shift 2; local t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "== $name: exit $? in $(( $(date +%s) - t0 )) s"; }
echo "commit $GIT_COMMIT" > "$OUT/node.log"
step gpu_tier 380 python -m pytest -m gpu -n 8 -p no:cacheprovider -rs -q --durations=10 tests
grep -E "passed|failed|FAILED" "$OUT/gpu_tier.log" | tail -8
mkdir -p /tmp/bench
BENCH_DIR=/tmp/bench step bench_backward 60 torchrun --nproc-per-node=1 benchmarks/bench_backward.py --only mlp
grep -E "^\|" "$OUT/bench_backward.log" | head -8
BENCH_DIR=/tmp/bench step bench_layers 50 torchrun --nproc-per-node=1 benchmarks/bench_layers.py --only mlp
grep -E "^\|" "$OUT/bench_layers.log" | head -8
step bwd_profile 50 torchrun --nproc-per-node=1 benchmarks/results/2026-12-03_h200x1_run113/bwd_profile.py "$OUT"
grep -E "Name|elementwise|Fill|Memcpy|silu|all_gather|CUDA time total" "$OUT/bwd_profile.txt" | cut -c1-75,170-200
true
