#!/usr/bin/env bash
# run155 (1 GPU; prepared 2026-12-07). GIT_COMMIT=<sha> bash steps.sh v|b|t|t1|t2|p
#   v  (~270 s) what run154 left unproven: the block-scale GPU tests of the Gluon mainloop (4 failed in run154:
#      a tile of several pieces freed its slot before its last piece read the scales; fixed in 4c3c4ec), the
#      transposed quantiser's stack axis (aa7be69) and the quantisers bitwise against torch, bench_backward's
#      block MLP with fp8_grads (w.T's FP8 copy in one sweep, 1c7565e; run154: 0.95x HF, torch's FP8 transpose
#      1.25 ms a step) and its "kept" contenders really kept (their empty cache was dropped before this commit)
#   b  (~130 s) block_check.py: blockwise vs per-tensor cuBLAS timed in turn, in device time and J per call, with
#      the 256-wide tile in 64-column pieces (offer it to the tuner if it beats the 128 tile)
#   t  (~560 s) the whole GPU tier at 6 workers; t1 / t2 its halves (tests/kernels; the rest)
#   p  (~190 s) v's benchmark and b (after t, which runs v's tests): bench_backward's block MLP, block_check
source benchmarks/steps_lib.sh
case "${1:-v}" in
v)
  step block_tests 100 python -m pytest -m gpu -n 4 -p no:cacheprovider -v --timeout 90 -rf -k block \
    tests/kernels/test_gemm_sm90.py
  grep -E "FAILED|passed|failed|^E " "$OUT/block_tests.log" | cut -c1-300 | tail -12
  step quantize_tests 60 python -m pytest -m gpu -n 2 -p no:cacheprovider -v --timeout 50 -rf \
    -k "transposes or every_scaling_matches_torch_on_gpu" tests/kernels/test_fp8_grouped_gemm.py \
    tests/kernels/test_fp8_gemm.py
  grep -E "FAILED|passed|failed|^E " "$OUT/quantize_tests.log" | cut -c1-300 | tail -8 ;;&
v|p)
  BENCH_DIR=/tmp/bench step bench_backward 60 torchrun --nproc-per-node=1 benchmarks/bench_backward.py \
    --only mlp --fp8 block --fp8-grads
  grep -E "^\||WRONG" "$OUT/bench_backward.log" | head -12 ;;&
b|p)
  step block_check 130 torchrun --nproc-per-node=1 benchmarks/results/2026-12-07_h100x1_run155/block_check.py
  cut -c1-230 "$OUT/block_check.log" | tail -26 ;;
t)
  step gpu_tier 560 python -m pytest -m gpu -n 6 -p no:cacheprovider -v --timeout 200 -rf --durations=25 tests
  grep -E "FAILED|passed|failed" "$OUT/gpu_tier.log" | cut -c1-250 | tail -14 ;;
t1)
  step gpu_tier_kernels 550 python -m pytest -m gpu -n 6 -p no:cacheprovider -v --timeout 200 -rf --durations=20 \
    tests/kernels
  grep -E "FAILED|passed|failed" "$OUT/gpu_tier_kernels.log" | cut -c1-250 | tail -12 ;;
t2)
  step gpu_tier_rest 550 python -m pytest -m gpu -n 4 -p no:cacheprovider -v --timeout 250 -rf --durations=20 \
    tests --ignore=tests/kernels
  grep -E "FAILED|passed|failed" "$OUT/gpu_tier_rest.log" | cut -c1-250 | tail -12 ;;
esac
cp /tmp/bench/*.json "$OUT/" 2>/dev/null
true
