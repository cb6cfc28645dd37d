#!/usr/bin/env bash
# run160 (1 GPU; ran 2026-12-07 on 18df711: README.md). GIT_COMMIT=<sha> bash steps.sh k, then rb (two calls: the
# whole tier took 532 s in run158 and has more FP8 tests since, too close to a call's 600 s)
#   k  (~400 s on an H100) the GPU tier's tests/kernels at 6 workers: proves 152542a (K-major A block scales)
#      beyond the 68 FP8 GPU tests run159 ran (12 K-major ones passed, 56 others before its step limit),
#      8eb1c10 (quantize_fp8 k_major: test_quantize_fp8_every_scaling_matches_torch_on_gpu) and 37978e5
#      (test_scaled_gemm_gpu_every_candidate[block]: the A_SCALES_K_MAJOR candidates)
#   r  (~250 s) the rest of the tier (nn layers and training, FP8-grads weight gradients with K-major scales,
#      examples, language, shmem)
#   b  (~160 s) bench_gemm FP8 at issue 34's four shapes (block scales row-major and K-major, each tuned), the
#      column of the K-major ratio fixed after run159; row-major callers' tuning now also times copying A's
#      scales K-major first (37978e5: "A scales to k-major" in the config column when chosen)
#   p  (~150 s) group_probe.py: the Gluon mainloop's GROUP_M 4-32 at 4 / 5 slots (block, A scales K-major) and
#      per-tensor, 3 rounds in turn (is the tile order worth a tuner knob?)
#   g  (~150 s) bench_backward --only mlp --fp8 block --fp8-grads: FP8 training with K-major weight-gradient
#      scales (8eb1c10) against run155's 5779 / 5288 us (fp8-block grads / kept)
source benchmarks/steps_lib.sh
case "${1:-k}" in
k)
  step gpu_tier_kernels 570 python -m pytest -m gpu -n 6 -p no:cacheprovider -v --timeout 200 -rf --durations=25 \
    tests/kernels
  grep -E "FAILED|passed|failed" "$OUT/gpu_tier_kernels.log" | cut -c1-250 | tail -14 ;;
r|rb)
  step gpu_tier_rest 330 python -m pytest -m gpu -n 6 -p no:cacheprovider -v --timeout 200 -rf --durations=15 \
    tests --ignore=tests/kernels
  grep -E "FAILED|passed|failed" "$OUT/gpu_tier_rest.log" | cut -c1-250 | tail -14 ;;&
b|rb)
  BENCH_DIR=$OUT step bench_gemm_fp8 250 torchrun --nproc-per-node=1 benchmarks/bench_gemm.py --only fp8 \
    --fp8-shapes 8192x8192x8192,8192x28672x8192,4096x6144x4096,2048x8192x8192
  grep -E "^\||Error|error" "$OUT/bench_gemm_fp8.log" | cut -c1-400 | head -24 ;;
esac
case "${1:-k}" in
p|pg)
  step group_probe 200 torchrun --nproc-per-node=1 benchmarks/results/2026-12-07_h100x1_run160/group_probe.py
  grep -E "MEDIAN|Error" "$OUT/group_probe.log" | cut -c1-200 | tail -44 ;;&
g|pg)
  BENCH_DIR=$OUT step bench_backward 250 torchrun --nproc-per-node=1 benchmarks/bench_backward.py --only mlp \
    --fp8 block --fp8-grads
  grep -E "^\||Error|error" "$OUT/bench_backward.log" | cut -c1-300 | head -20 ;;
esac
true
