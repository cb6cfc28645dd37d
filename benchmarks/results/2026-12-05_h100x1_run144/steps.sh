#!/usr/bin/env bash
# run144 (1 GPU, GPU image, 2026-12-05): README's GPU tier at 95ca650 (first GPU run of the FP8 grouped backward
# 981e22a..73166e4 and of e701b8d, 946d0e4, 4b7a439, 5a8a8c1, 95ca650), run145's FP8 promotion-interval probe of
# the GEMM core (BLOCK_K 256 as config overrides), then
# bench_host (one-launch ep_dispatch row).
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/benchmarks
step() { local name=$1 limit=$2; shift 2; local t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "== $name: exit $? in $(( $(date +%s) - t0 )) s"; }
echo "commit $GIT_COMMIT" > "$OUT/node.log"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >> "$OUT/node.log"
mkdir -p /tmp/bench
step gpu_tier 410 python -m pytest -m gpu -n 12 -p no:cacheprovider -rs -q --durations=30
grep -E "passed|failed|FAILED|Error" "$OUT/gpu_tier.log" | tail -14
step interval_core 110 python benchmarks/results/2026-12-05_h200x1_run145/interval_probe.py "$OUT" core
grep -E "randn|positive|Error" "$OUT/interval_core.log" | cut -c1-150 | head -80
BENCH_DIR=/tmp/bench step bench_host 55 torchrun --nproc-per-node=1 benchmarks/bench_host.py
grep -E "ep_dispatch|NOT MET" "$OUT/bench_host.log" | head -14
cp /tmp/bench/*.json "$OUT/" 2>/dev/null
true
