#!/usr/bin/env bash
# run141 (1x H200, GPU image, 2026-12-04): README's GPU tier after the direct launch (4391320: every op's bound
# launches call Triton 3.6's C launch function) and the split-K tiles of one warpgroup (8d59470); bench_host with
# profiles and the small-M GEMM table again.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/benchmarks
step() { local name=$1 limit=$2; shift 2; local t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "== $name: exit $? in $(( $(date +%s) - t0 )) s"; }
echo "commit $GIT_COMMIT" > "$OUT/node.log"
mkdir -p /tmp/bench
BENCH_DIR=/tmp/bench step bench_host 70 torchrun --nproc-per-node=1 benchmarks/bench_host.py
grep -E "NOT MET|ok$" "$OUT/bench_host.log" | head -14
HOST_PROFILE=1 step bench_host_profile 70 torchrun --nproc-per-node=1 benchmarks/bench_host.py
step gpu_tier 330 python -m pytest -m gpu -n 8 -p no:cacheprovider -rs -q
grep -E "passed|failed|FAILED|Error" "$OUT/gpu_tier.log" | tail -12
BENCH_DIR=/tmp/bench step bench_gemm_small 150 torchrun --nproc-per-node=1 benchmarks/bench_gemm.py --only small
grep -E "^\|" "$OUT/bench_gemm_small.log" | cut -c1-400 | head -14
cp /tmp/bench/*.json "$OUT/" 2>/dev/null
true
