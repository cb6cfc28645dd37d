#!/usr/bin/env bash
# run130 (1x H200, GPU image): moe_fp8_profile.py, where the FP8 MoE layer's training forward spends its time.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/benchmarks
step() { local name=$1 limit=$2; shift 2; local t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "== $name: exit $? in $(( $(date +%s) - t0 )) s"; }
echo "commit $GIT_COMMIT" > "$OUT/node.log"
step moe_fp8_profile 150 torchrun --nproc-per-node=1 benchmarks/results/2026-12-04_h200x1_run130/moe_fp8_profile.py "$OUT"
grep -vE "^-+$" "$OUT/moe_fp8_profile.log" | grep -E "==|Name|  [0-9.]+ms|us " | cut -c1-150 | head -60
true
