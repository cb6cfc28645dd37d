#!/usr/bin/env bash
# run161 (1 GPU; prepared 2026-12-07, not yet run). GIT_COMMIT=<sha> bash steps.sh s|p|sp|b|g|m|k|r
#   s  (~150 s) the Gluon mainloop's GPU tests (test_gemm_sm90: every candidate at 7 shapes, EPILOGUE_SUBTILE's
#      sixth block-scale slot and fp32 results' among them) and test_fp8_gemm's every-candidate tests: proves
#      5c88ec8 (not yet on a GPU) and the split tail (TAIL_SPLIT: test_gluon_mainloop_split_tail_matches_fp64)
#   p  (~90 s) subtile_probe.py: the sixth slot (block scales, K-major and row-major A scales) against five, and
#      what the two-half epilogue costs (per-tensor s6 with and without), and tma_scales.py's variant (the block
#      scales by TMA with the tiles, no cp.async; probe only) at 5 and 6 slots, and the last round's tiles split
#      along K (TAIL_SPLIT 4 / 8: "tail" rows, where a shape has a tail to split), 3 rounds in turn
#   b  (~150 s) bench_gemm FP8 at issue 34's four shapes: does the tuner pick the sixth slot?
#   g  (~120 s) bench_backward --only moe --fp8 row,block --fp8-grads: the MoE layer's FP8-grads step, never
#      timed (issue 35), against HF's block and our bf16 layer
#   m  (~200 s) split-K's GPU test, then bench_gemm --only small: b2e22b2 (split-K's last share adds its own
#      partial from registers) at 1024x1024x16384 / 256x1024x8192 (run156: 0.87x cuBLAS)
#   k / r  the GPU tier in two calls (tests/kernels ~430 s; the rest ~270 s), if the budget allows
source benchmarks/steps_lib.sh
HERE=benchmarks/results/2026-12-07_h100x1_run161
case "${1:-sp}" in
s|sp)
  step gluon_tests 300 python -m pytest -m gpu -n 4 -p no:cacheprovider -v --timeout 250 -rf \
    tests/kernels/test_gemm_sm90.py tests/kernels/test_fp8_gemm.py -k "gluon or candidate or kmajor"
  grep -E "FAILED|passed|failed" "$OUT/gluon_tests.log" | cut -c1-250 | tail -14 ;;&
p|sp)
  step subtile_probe 200 torchrun --nproc-per-node=1 $HERE/subtile_probe.py
  grep -E "MEDIAN|Error" "$OUT/subtile_probe.log" | cut -c1-220 | tail -44 ;;
b)
  BENCH_DIR=$OUT step bench_gemm_fp8 250 torchrun --nproc-per-node=1 benchmarks/bench_gemm.py --only fp8 \
    --fp8-shapes 8192x8192x8192,8192x28672x8192,4096x6144x4096,2048x8192x8192
  grep -E "^\||Error|error" "$OUT/bench_gemm_fp8.log" | cut -c1-400 | head -24 ;;
g)
  BENCH_DIR=$OUT step bench_backward_moe 250 torchrun --nproc-per-node=1 benchmarks/bench_backward.py --only moe \
    --fp8 row,block --fp8-grads
  grep -E "^\||Error|error" "$OUT/bench_backward_moe.log" | cut -c1-300 | head -20 ;;
m)
  step split_k_tests 120 python -m pytest -m gpu -p no:cacheprovider -v --timeout 100 -rf tests/kernels/test_gemm.py \
    -k "split_k or eager_plans"
  grep -E "FAILED|passed|failed" "$OUT/split_k_tests.log" | cut -c1-250 | tail -4
  BENCH_DIR=$OUT step bench_gemm_small 250 torchrun --nproc-per-node=1 benchmarks/bench_gemm.py --only small
  grep -E "^\|" "$OUT/bench_gemm_small.log" | cut -d'|' -f2-4,5,6,7,8,11,12,13 | head -13 ;;
k)
  step gpu_tier_kernels 570 python -m pytest -m gpu -n 6 -p no:cacheprovider -v --timeout 200 -rf --durations=25 \
    tests/kernels
  grep -E "FAILED|passed|failed" "$OUT/gpu_tier_kernels.log" | cut -c1-250 | tail -14 ;;
r)
  step gpu_tier_rest 400 python -m pytest -m gpu -n 6 -p no:cacheprovider -v --timeout 200 -rf --durations=15 \
    tests --ignore=tests/kernels
  grep -E "FAILED|passed|failed" "$OUT/gpu_tier_rest.log" | cut -c1-250 | tail -14 ;;
esac
true
