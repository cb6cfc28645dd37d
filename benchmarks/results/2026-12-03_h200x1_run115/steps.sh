#!/usr/bin/env bash
# run115 (1x H200, GPU image): after the nn layers' group-of-one shortcuts (no slices, padding, gathers, copies at
# W = 1). gpu_tests: tests/nn; bench_backward mlp + moe at W = 1; bench_host with HOST_PROFILE=1 (cProfile of
# every op's eager calls: where ag_gemm, all_gather, ep_dispatch / ep_combine, sp_flash_decode spend host time).
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
step() { local name=$1 limit=$2; shift 2; local t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "== $name: exit $? in $(( $(date +%s) - t0 )) s"; }
echo "commit $GIT_COMMIT" > "$OUT/node.log"
step gpu_tests 200 python -m pytest -m gpu -n 8 -p no:cacheprovider -rs -q tests/nn
grep -E "passed|failed|FAILED" "$OUT/gpu_tests.log" | tail -6
mkdir -p /tmp/bench
BENCH_DIR=/tmp/bench step bench_backward 120 torchrun --nproc-per-node=1 benchmarks/bench_backward.py --only mlp,moe
grep -E "^\|" "$OUT/bench_backward.log" | head -12
HOST_PROFILE=1 BENCH_DIR=/tmp/bench step bench_host 150 torchrun --nproc-per-node=1 benchmarks/bench_host.py
grep -E "^\|" "$OUT/bench_host.log" | head -30
true
