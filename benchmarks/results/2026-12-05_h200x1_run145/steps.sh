#!/usr/bin/env bash
# run145 (1 GPU, GPU image, 2026-12-05): the FP8 promotion-interval probe (BLOCK_K 256 promotes every 256 K
# elements: speed, and error against fp64 beside cuBLAS's), then the MLP's fwd+bwd with FP8 gradients.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/benchmarks
step() { local name=$1 limit=$2; shift 2; local t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "== $name: exit $? in $(( $(date +%s) - t0 )) s"; }
echo "commit $GIT_COMMIT" > "$OUT/node.log"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >> "$OUT/node.log"
mkdir -p /tmp/bench
step interval_probe 240 python benchmarks/results/2026-12-05_h200x1_run145/interval_probe.py "$OUT" plain
grep -E "randn|positive|Error" "$OUT/interval_probe.log" | cut -c1-150 | head -80
BENCH_DIR=/tmp/bench step bench_backward 200 torchrun --nproc-per-node=1 benchmarks/bench_backward.py --only mlp --fp8 row,block --fp8-grads
grep -E "^\||WRONG" "$OUT/bench_backward.log" | cut -c1-200 | head -14
cp /tmp/bench/*.json "$OUT/" 2>/dev/null
true
