#!/usr/bin/env bash
# run140 (1x H200, GPU image, 2026-12-04 session from ~19:57 UTC): first GPU run of split-K (f88ec10: the gemm
# op's SPLIT_K, the tuner's split-K tiles, dl.arrive_last) and of the last session's host commits (c780fdd, 5bd22bd:
# fp8.weight_cache); then the small-M GEMM table (bench_gemm --only small) and bench_host with and without profiles.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/benchmarks
step() { local name=$1 limit=$2; shift 2; local t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "== $name: exit $? in $(( $(date +%s) - t0 )) s"; }
echo "commit $GIT_COMMIT" > "$OUT/node.log"
step gpu_tests 200 python -m pytest -m gpu -n 8 -p no:cacheprovider -rs -q tests/kernels/test_gemm.py \
  tests/kernels/test_fp8_gemm.py tests/nn/test_fp8_training.py
grep -E "passed|failed|FAILED|Error" "$OUT/gpu_tests.log" | tail -8
mkdir -p /tmp/bench
BENCH_DIR=/tmp/bench step bench_gemm_small 200 torchrun --nproc-per-node=1 benchmarks/bench_gemm.py --only small
grep -E "^\|" "$OUT/bench_gemm_small.log" | head -14
BENCH_DIR=/tmp/bench step bench_host 70 torchrun --nproc-per-node=1 benchmarks/bench_host.py
grep -E "NOT MET|ok$" "$OUT/bench_host.log" | head -14
HOST_PROFILE=1 step bench_host_profile 70 torchrun --nproc-per-node=1 benchmarks/bench_host.py
cp /tmp/bench/*.json "$OUT/" 2>/dev/null
true
