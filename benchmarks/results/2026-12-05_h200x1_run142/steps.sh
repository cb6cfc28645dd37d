#!/usr/bin/env bash
# run142 (1 GPU, GPU image, 2026-12-05): README's GPU tier at 1a4164f (proves 6bb934f multi-call tuner graphs,
# 2716f21 kept descriptor encodings, 72ea9e2, 5d4dccd, 70a7a16, 9b5ea93, b0c0930, 1a4164f, 0f7d89d, 2a52e26 on the
# GPU image), bench_host (eager gemm with kept encodings) and the small-M GEMM table from multi-call graphs.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/benchmarks
step() { local name=$1 limit=$2; shift 2; local t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "== $name: exit $? in $(( $(date +%s) - t0 )) s"; }
echo "commit $GIT_COMMIT" > "$OUT/node.log"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >> "$OUT/node.log"
mkdir -p /tmp/bench
step gpu_tier 320 python -m pytest -m gpu -n 8 -p no:cacheprovider -rs -q
grep -E "passed|failed|FAILED|Error" "$OUT/gpu_tier.log" | tail -12
BENCH_DIR=/tmp/bench step bench_host 60 torchrun --nproc-per-node=1 benchmarks/bench_host.py
grep -E "NOT MET|ok$" "$OUT/bench_host.log" | head -14
BENCH_DIR=/tmp/bench step bench_gemm_small 140 torchrun --nproc-per-node=1 benchmarks/bench_gemm.py --only small
grep -E "^\|" "$OUT/bench_gemm_small.log" | cut -c1-300 | head -14
cp /tmp/bench/*.json "$OUT/" 2>/dev/null
true
