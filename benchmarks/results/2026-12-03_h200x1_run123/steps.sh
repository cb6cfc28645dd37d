#!/usr/bin/env bash
# run123 (1x H200, GPU image): why the parallelised Llama runs at 0.98x the original at W = 1 (run122) while the
# MLP layer alone runs at 1.05x: llama_profile.py. Then bench_host at W = 1 with cProfile (all_reduce_rmsnorm's
# checked layouts).
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/benchmarks
step() { local name=$1 limit=$2; shift 2; local t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "== $name: exit $? in $(( $(date +%s) - t0 )) s"; }
echo "commit $GIT_COMMIT" > "$OUT/node.log"
R=benchmarks/results/2026-12-03_h200x1_run123
step llama_profile 120 torchrun --nproc-per-node=1 $R/llama_profile.py "$OUT"
head -8 "$OUT/llama_profile.log"
mkdir -p /tmp/bench
HOST_PROFILE=1 BENCH_DIR=/tmp/bench step bench_host_profile 60 torchrun --nproc-per-node=1 benchmarks/bench_host.py
grep -E "NOT MET|ok$" "$OUT/bench_host_profile.log" | head -20
true
