#!/usr/bin/env bash
# run143 (1 GPU, GPU image, 2026-12-05): the small-M GEMM table with the decode tiles (7f001cf and after), then
# README's GPU tier (12 workers: run142's 8 did not finish in 320 s) with the slowest tests listed.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/benchmarks
step() { local name=$1 limit=$2; shift 2; local t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "== $name: exit $? in $(( $(date +%s) - t0 )) s"; }
echo "commit $GIT_COMMIT" > "$OUT/node.log"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >> "$OUT/node.log"
mkdir -p /tmp/bench
BENCH_DIR=/tmp/bench step bench_gemm_small 120 torchrun --nproc-per-node=1 benchmarks/bench_gemm.py --only small
grep -E "^\|" "$OUT/bench_gemm_small.log" | cut -d'|' -f2-4,5,8,9,10,11,12,13 | head -13
step gpu_tier 390 python -m pytest -m gpu -n 12 -p no:cacheprovider -rs -q --durations=30
grep -E "passed|failed|FAILED|Error" "$OUT/gpu_tier.log" | tail -12
cp /tmp/bench/*.json "$OUT/" 2>/dev/null
true
