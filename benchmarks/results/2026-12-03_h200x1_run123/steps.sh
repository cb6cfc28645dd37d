#!/usr/bin/env bash
# run123 (1x H200, GPU image): the session's last call, after every host change of runs 120-122 and
# all_reduce_rmsnorm's checked layouts. gpu_tier: README's GPU tier; llama_profile.py: why the parallelised Llama
# ran at 0.98x the original at W = 1 in run122 while its MLP layer alone ran at 1.05x; bench_host at W = 1;
# bench_layers' llama case again.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/benchmarks
step() { local name=$1 limit=$2; shift 2; local t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "== $name: exit $? in $(( $(date +%s) - t0 )) s"; }
echo "commit $GIT_COMMIT" > "$OUT/node.log"
step gpu_tier 320 python -m pytest -m gpu -n 8 -p no:cacheprovider -rs -q --durations=5 tests
grep -E "passed|failed|FAILED" "$OUT/gpu_tier.log" | tail -6
R=benchmarks/results/2026-12-03_h200x1_run123
step llama_profile 100 torchrun --nproc-per-node=1 $R/llama_profile.py "$OUT"
head -4 "$OUT/llama_profile.log"
mkdir -p /tmp/bench
BENCH_DIR=/tmp/bench step bench_host 50 torchrun --nproc-per-node=1 benchmarks/bench_host.py
grep -E "NOT MET|ok$" "$OUT/bench_host.log" | head -20
BENCH_DIR=/tmp/bench step bench_layers 60 torchrun --nproc-per-node=1 benchmarks/bench_layers.py --only llama
grep -E "^\| llama" "$OUT/bench_layers.log" | head -3
true
