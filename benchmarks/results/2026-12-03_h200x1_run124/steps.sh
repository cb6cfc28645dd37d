#!/usr/bin/env bash
# run124 (1x H200, GPU image): run123's tier was cut at its 320 s limit at ~99 % with 0 failures (the slowest tests
# last); here the longest GPU test files again (the ops on groups, the primitives at 2-8 ranks, the examples,
# the parallelised HF models), same commit's code.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/benchmarks
step() { local name=$1 limit=$2; shift 2; local t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "== $name: exit $? in $(( $(date +%s) - t0 )) s"; }
echo "commit $GIT_COMMIT" > "$OUT/node.log"
step gpu_long 200 python -m pytest -m gpu -n 8 -p no:cacheprovider -rs -q --durations=8 tests/kernels/test_groups.py \
  tests/language/test_primitives.py tests/test_examples.py tests/nn/test_parallelize.py
grep -E "passed|failed|FAILED" "$OUT/gpu_long.log" | tail -6
true
