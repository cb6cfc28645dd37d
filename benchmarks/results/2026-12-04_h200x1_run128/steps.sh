#!/usr/bin/env bash
# run128 (1x H200, GPU image): the probes planned in runs 125 / 126 (whose GPU time ran out): the all-gather GPU
# tests and bench_host at W = 1 (all_gather's layout plans), split_m_probe.py (a promoted FP8 tile as two
# accumulators split along M); and the FP8 grouped quantize= GPU test as rewritten after run127.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/benchmarks
step() { local name=$1 limit=$2; shift 2; local t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "== $name: exit $? in $(( $(date +%s) - t0 )) s"; }
echo "commit $GIT_COMMIT" > "$OUT/node.log"
step gpu_tests 90 python -m pytest -m gpu -n 4 -p no:cacheprovider -rs -q tests/kernels/test_allgather.py \
  tests/kernels/test_fp8_grouped_gemm.py
grep -E "passed|failed|FAILED|assert" "$OUT/gpu_tests.log" | tail -8
mkdir -p /tmp/bench
BENCH_DIR=/tmp/bench step bench_host 60 torchrun --nproc-per-node=1 benchmarks/bench_host.py
grep -E "NOT MET|ok$" "$OUT/bench_host.log" | head -20
step split_m_probe 240 python benchmarks/results/2026-12-03_h200x1_run126/split_m_probe.py "$OUT"
tail -30 "$OUT/split_m_probe.log"
cp /tmp/bench/*.json "$OUT/" 2>/dev/null
true
