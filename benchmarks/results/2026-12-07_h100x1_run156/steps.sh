#!/usr/bin/env bash
# run156 (1 GPU; prepared 2026-12-07). GIT_COMMIT=<sha> bash steps.sh s|m|sm|h
#   s  (~150 s) bench_gemm --only small: the split-K sweep's paired tiles (2e067cf: one warpgroup's tiles two to an
#      SM, twice the splits), every candidate's device time per shape (run143b: bf16 1024x1024x16384 0.88x,
#      256x1024x8192 0.82x cuBLAS)
#   m  (~200 s) bench_backward's MoE block with FP8 backward GEMMs (f983679; never timed: row and block, kept too)
#   h  (~60 s) bench_host with its profile, a split-K gemm among its rows (run143b: split-K shapes 8-15 us slower
#      than cuBLAS eager)
source benchmarks/steps_lib.sh
case "${1:-sm}" in
s|sm)
  BENCH_DIR=/tmp/bench step bench_gemm_small 200 torchrun --nproc-per-node=1 benchmarks/bench_gemm.py --only small
  grep -E "^\|" "$OUT/bench_gemm_small.log" | cut -d'|' -f2-4,5,6,7,8,11,12,13 | head -13 ;;&
m|sm)
  BENCH_DIR=/tmp/bench step bench_backward_moe 240 torchrun --nproc-per-node=1 benchmarks/bench_backward.py \
    --only moe --fp8 row,block --fp8-grads
  grep -E "^\||WRONG" "$OUT/bench_backward_moe.log" | head -14 ;;
h)
  HOST_PROFILE=1 BENCH_DIR=/tmp/bench step bench_host 90 torchrun --nproc-per-node=1 benchmarks/bench_host.py
  grep -E "NOT MET|ok$" "$OUT/bench_host.log" | head -16 ;;
esac
cp /tmp/bench/*.json "$OUT/" 2>/dev/null
true
