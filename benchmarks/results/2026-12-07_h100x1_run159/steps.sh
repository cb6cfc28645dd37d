#!/usr/bin/env bash
# run159 (1 GPU; prepared 2026-12-07). GIT_COMMIT=<sha> bash steps.sh kb|k|b
#   k  (~120 s) the GPU tests of the FP8 GEMM core and the Gluon mainloop, K-major A block scales included
#   b  (~250 s) bench_gemm FP8 at issue 34's four shapes: block scales row-major and K-major (each tuned on its
#      own) against cuBLAS per-tensor, in turn (run158's ring_probe: K-major at 5 slots 3-6 % faster at three)
source benchmarks/steps_lib.sh
case "${1:-kb}" in
k|kb)
  step gpu_fp8_tests 170 python -m pytest -m gpu -n 4 -p no:cacheprovider -q --timeout 160 -rf \
    tests/kernels/test_gemm_sm90.py tests/kernels/test_fp8_gemm.py
  grep -E "FAILED|passed|failed" "$OUT/gpu_fp8_tests.log" | cut -c1-250 | tail -8 ;;&
b|kb)
  BENCH_DIR=$OUT step bench_gemm_fp8 280 torchrun --nproc-per-node=1 benchmarks/bench_gemm.py --only fp8 \
    --fp8-shapes 8192x8192x8192,8192x28672x8192,4096x6144x4096,2048x8192x8192
  grep -E "^\||Error|error" "$OUT/bench_gemm_fp8.log" | cut -c1-400 | head -24 ;;
esac
true
