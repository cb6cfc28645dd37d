#!/usr/bin/env bash
# run158 (1 GPU; prepared 2026-12-07, not yet run). GIT_COMMIT=<sha> bash steps.sh t|p|tp|s|ps
#   t  (~370 s) the whole GPU tier at 6 workers (run157's t had 4 failures: three pools out of memory, fixed by
#      6b3c8f8 and passed in run157 v; the W = 1 A layout of fused_all_gather_matmul, fixed in aeed5e2, not yet
#      run on a GPU: test_async_tp_ops_bf16_on_gpus[1])
#   p  (~150 s) ring_probe.py: the block-scale 128 tile at 4 and 5 slots, A's scales row-major vs K-major, three
#      rounds in turn, medians (run157's single round left both within its spread)
#   s  (~60 s) split_probe.py: bf16 split-K's reduction spread over a tile's splits (shipped since 2026-12-07)
#      against one split summing the whole tile ("one": the reduction before); one process each
source benchmarks/steps_lib.sh
case "${1:-t}" in
t|tp)
  step gpu_tier 560 python -m pytest -m gpu -n 6 -p no:cacheprovider -v --timeout 200 -rf --durations=25 tests
  grep -E "FAILED|passed|failed" "$OUT/gpu_tier.log" | cut -c1-250 | tail -14 ;;&
p|tp|ps)
  step ring_probe 200 torchrun --nproc-per-node=1 benchmarks/results/2026-12-07_h100x1_run158/ring_probe.py
  grep MEDIAN "$OUT/ring_probe.log" | cut -c1-200 | tail -40 ;;&
s|ps)
  for v in shipped one nowait old; do
    step split_probe_$v 60 torchrun --nproc-per-node=1 benchmarks/results/2026-12-07_h100x1_run158/split_probe.py $v
    grep -E "split-k|Error" "$OUT/split_probe_$v.log" | cut -c1-260
  done ;;
esac
true
