#!/usr/bin/env bash
# run125 (1x H200, GPU image; planned: the session's GPU time ran out): all_gather's layout plans with the given out's address in the key (its heap check
# once per address; x's device check once per layout): the all-gather GPU tests, bench_host at W = 1.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/benchmarks
step() { local name=$1 limit=$2; shift 2; local t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "== $name: exit $? in $(( $(date +%s) - t0 )) s"; }
echo "commit $GIT_COMMIT" > "$OUT/node.log"
step gpu_tests 60 python -m pytest -m gpu -n 4 -p no:cacheprovider -rs -q tests/kernels/test_allgather.py
grep -E "passed|failed|FAILED" "$OUT/gpu_tests.log" | tail -4
mkdir -p /tmp/bench
BENCH_DIR=/tmp/bench step bench_host 45 torchrun --nproc-per-node=1 benchmarks/bench_host.py
grep -E "NOT MET|ok$" "$OUT/bench_host.log" | head -20
true
