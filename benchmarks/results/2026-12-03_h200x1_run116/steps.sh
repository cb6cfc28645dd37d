#!/usr/bin/env bash
# run116 (1x H200, GPU image): where the MoE training step's time goes at W = 1 (run115: ours fwd+bwd 46.5 ms vs
# HF grouped_mm 24.6; backward 40.7 vs 16.1).
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/benchmarks
echo "commit $GIT_COMMIT" > "$OUT/node.log"
mkdir -p /tmp/bench
BENCH_DIR=/tmp/bench timeout 200 torchrun --nproc-per-node=1 benchmarks/results/2026-12-03_h200x1_run116/moe_profile.py "$OUT" > "$OUT/moe_profile.log" 2>&1
echo "exit $?"; tail -3 "$OUT/moe_profile.log"
cut -c1-95,185-230 "$OUT/moe_profile.txt" | grep -v "^-\|^$"
true
