#!/usr/bin/env bash
# run157 (1 GPU; ran 2026-12-07 ~14:52 on one H100: README.md). GIT_COMMIT=<sha> bash steps.sh g|gm|gh|gp|gph|p
#   g  (~150 s) the GPU tests added or changed after run155: the async-TP ops in bf16 at W = 1 and 2 ranks sharing
#      the GPU (test_async_tp_ops_bf16_on_gpus; the ops had no GPU test), the primitives at 8 shared ranks with
#      test pools' heaps capped at 8 GiB together (run155: out of memory beside five other workers), the Gluon
#      mainloop's and scaled_gemm's tests (dc01cf6: block scales at BLOCK_N 256 in 128-column pieces without
#      spills, tuner-offered)
#   p  (~150 s) probe.py: the 256-wide block-scale tile in 128-column pieces against the 128 tile; where bf16
#      1024x1024x16384's split-K items lose their ~13 us (the same items without the split); scale_probe.py:
#      do A's block scales (a row apart in memory) cost blockwise its 7-12 % (K-major scales; none)
#   m, h: run156's modes that did not run (the MoE block with FP8 backward GEMMs; bench_host with a split-K row):
#      bash benchmarks/results/2026-12-07_h100x1_run156/steps.sh m  (or h), after g on the same machine
#   v  (~200 s) after 6b3c8f8 (rank pools return their cached GPU memory after each task; test_async_tp's gather
#      at W = 1 on a GPU): the tests t's tier failed, beside the Gluon mainloop's (memory pressure) at 6 workers
source benchmarks/steps_lib.sh
case "${1:-g}" in
v)
  step verify 260 python -m pytest -m gpu -n 6 -p no:cacheprovider -v --timeout 200 -rf tests/nn/test_training.py \
    tests/language/test_primitives.py tests/kernels/test_async_tp.py tests/kernels/test_gemm_sm90.py
  grep -E "FAILED|passed|failed|^E .*Error" "$OUT/verify.log" | cut -c1-300 | tail -12 ;;
g|gm|gh|gp|gph)
  step gpu_tests 260 python -m pytest -m gpu -n 6 -p no:cacheprovider -v --timeout 200 -rf \
    tests/kernels/test_async_tp.py tests/language/test_primitives.py tests/kernels/test_gemm_sm90.py \
    tests/kernels/test_fp8_gemm.py
  grep -E "FAILED|passed|failed|^E " "$OUT/gpu_tests.log" | cut -c1-300 | tail -12 ;;&
gp|gph|p)
  step probe 200 torchrun --nproc-per-node=1 benchmarks/results/2026-12-07_h100x1_run157/probe.py
  cut -c1-200 "$OUT/probe.log" | tail -30
  step scale_probe 150 torchrun --nproc-per-node=1 benchmarks/results/2026-12-07_h100x1_run157/scale_probe.py
  cut -c1-200 "$OUT/scale_probe.log" | tail -22 ;;&
gm)
  bash benchmarks/results/2026-12-07_h100x1_run156/steps.sh m ;;
gh|gph)
  bash benchmarks/results/2026-12-07_h100x1_run156/steps.sh h ;;
esac
true
