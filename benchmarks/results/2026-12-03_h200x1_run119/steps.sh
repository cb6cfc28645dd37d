#!/usr/bin/env bash
# run119 (1x H200, GPU image): first GPU run of fa57368 (review mends: ep_combine_grad's gradient layout, grouped
# GEMM group checks). gpu_tier: README's GPU tier; fp8_tp_mlp: the FP8 TP-MLP example at W = 1 (FP8 vs bf16).
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/benchmarks
step() { local name=$1 limit=$2; shift 2; local t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "== $name: exit $? in $(( $(date +%s) - t0 )) s"; }
echo "commit $GIT_COMMIT" > "$OUT/node.log"
step gpu_tier 320 python -m pytest -m gpu -n 8 -p no:cacheprovider -rs -q --durations=5 tests
grep -E "passed|failed|FAILED" "$OUT/gpu_tier.log" | tail -6
step fp8_tp_mlp 120 torchrun --nproc-per-node=1 examples/fp8_tp_mlp.py
tail -15 "$OUT/fp8_tp_mlp.log"
true
