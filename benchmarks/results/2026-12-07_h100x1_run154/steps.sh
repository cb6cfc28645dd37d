#!/usr/bin/env bash
# run154's call as it ran (tree dd2e0ab): GIT_COMMIT=<sha> bash steps.sh a. Its other modes (q, t, t1, t2) did not
# run; the next run's steps: ../2026-12-07_h100x1_run155/steps.sh (block_check.py moved there, fixed).
#   a  (~400 s) GPU tests of the Gluon mainloop (5509864: 64-column pieces), the FP8 grouped GEMM (5910d93) and
#      FP8 training, block_check.py (blockwise vs per-tensor cuBLAS timed in turn, device time and J per call), then
#      bench_backward's MLP in block FP8 with fp8_grads and KERNEL_PROFILE=1: where the FP8 backward's time goes
#      (run153: 0.97x HF with fp8_grads)
source benchmarks/steps_lib.sh
step sm90_tests 150 python -m pytest -m gpu -n 4 -p no:cacheprovider -v --timeout 140 -rf --durations=10 \
  tests/kernels/test_gemm_sm90.py tests/kernels/test_fp8_grouped_gemm.py tests/nn/test_fp8_training.py
grep -E "FAILED|passed|failed" "$OUT/sm90_tests.log" | cut -c1-200 | tail -8
step block_check 130 python benchmarks/results/2026-12-06_gpu_run154/block_check.py
cut -c1-230 "$OUT/block_check.log" | tail -30
KERNEL_PROFILE=1 BENCH_DIR=/tmp/bench step bench_backward 90 torchrun --nproc-per-node=1 \
  benchmarks/bench_backward.py --only mlp --fp8 block --fp8-grads
grep -E "^\||WRONG" "$OUT/bench_backward.log" | head -12
cp /tmp/bench/*.json "$OUT/" 2>/dev/null
true
