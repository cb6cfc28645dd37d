#!/usr/bin/env bash
# run122 (1x H200, GPU image): the all-reduce ops' bound launches (run121's profile: Launcher's argument check
# 13 us of all_reduce_rmsnorm's 48); the whole-model case of bench_layers (a parallelised LlamaForCausalLM vs the
# original at W = 1) and its MLP case; bench_host at W = 1 again.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/benchmarks
step() { local name=$1 limit=$2; shift 2; local t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "== $name: exit $? in $(( $(date +%s) - t0 )) s"; }
echo "commit $GIT_COMMIT" > "$OUT/node.log"
step gpu_tests 150 python -m pytest -m gpu -n 8 -p no:cacheprovider -rs -q tests/kernels/test_allreduce.py \
  tests/nn/test_benchmarks.py
grep -E "passed|failed|FAILED" "$OUT/gpu_tests.log" | tail -6
mkdir -p /tmp/bench
BENCH_DIR=/tmp/bench step bench_layers 150 torchrun --nproc-per-node=1 benchmarks/bench_layers.py --only llama,mlp
grep -E "^\|" "$OUT/bench_layers.log" | head -8
BENCH_DIR=/tmp/bench step bench_host 60 torchrun --nproc-per-node=1 benchmarks/bench_host.py
grep -E "NOT MET|ok$" "$OUT/bench_host.log" | head -20
true
