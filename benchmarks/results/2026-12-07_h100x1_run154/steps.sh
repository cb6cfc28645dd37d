#!/usr/bin/env bash
# run154 (1 GPU; prepared 2026-12-06, revised 2026-12-07). GIT_COMMIT=<sha> bash steps.sh a|q|t|t1|t2
#   a  (~400 s) GPU tests of the Gluon mainloop (5509864: 64-column pieces), the FP8 grouped GEMM (5910d93) and
#      FP8 training, block_check.py (blockwise vs per-tensor cuBLAS timed in turn, device time and J per call), then
#      bench_backward's MLP in block FP8 with fp8_grads and KERNEL_PROFILE=1: where the FP8 backward's time goes
#      (run153: 0.97x HF with fp8_grads)
#   q  (~250 s, a short budget) block_check first, then the mainloop's GPU tests (a without the FP8 grouped /
#      training tests and bench_backward)
#   v  (~280 s) after a's failures (the multi-piece block tiles freed their slot before reading its scales):
#      the block-scale tests of the mainloop, bench_backward's block MLP (w.T's FP8 copy in one sweep: 1c7565e),
#      then block_check; vt (~100 s) the tests alone
#   t  (~560 s) the whole GPU tier at 6 workers (run153's reached 98 % in 500 s); t1 / t2: its halves
#      (tests/kernels; the rest) when one call cannot hold it
source benchmarks/steps_lib.sh
case "${1:-a}" in
a)
  step sm90_tests 150 python -m pytest -m gpu -n 4 -p no:cacheprovider -v --timeout 140 -rf --durations=10 \
    tests/kernels/test_gemm_sm90.py tests/kernels/test_fp8_grouped_gemm.py tests/nn/test_fp8_training.py
  grep -E "FAILED|passed|failed" "$OUT/sm90_tests.log" | cut -c1-200 | tail -8
  step block_check 130 torchrun --nproc-per-node=1 benchmarks/results/2026-12-06_gpu_run154/block_check.py
  cut -c1-230 "$OUT/block_check.log" | tail -30
  KERNEL_PROFILE=1 BENCH_DIR=/tmp/bench step bench_backward 90 torchrun --nproc-per-node=1 \
    benchmarks/bench_backward.py --only mlp --fp8 block --fp8-grads
  grep -E "^\||WRONG" "$OUT/bench_backward.log" | head -12 ;;
q)
  step block_check 130 torchrun --nproc-per-node=1 benchmarks/results/2026-12-06_gpu_run154/block_check.py
  cut -c1-230 "$OUT/block_check.log" | tail -34
  step sm90_tests 110 python -m pytest -m gpu -n 4 -p no:cacheprovider -v --timeout 100 -rf tests/kernels/test_gemm_sm90.py
  grep -E "FAILED|passed|failed" "$OUT/sm90_tests.log" | cut -c1-200 | tail -8 ;;
v)
  step block_tests 100 python -m pytest -m gpu -n 4 -p no:cacheprovider -v --timeout 90 -rf -k block \
    tests/kernels/test_gemm_sm90.py
  grep -E "FAILED|passed|failed|^E " "$OUT/block_tests.log" | cut -c1-300 | tail -12
  BENCH_DIR=/tmp/bench step bench_backward 60 torchrun --nproc-per-node=1 benchmarks/bench_backward.py \
    --only mlp --fp8 block --fp8-grads
  grep -E "^\||WRONG" "$OUT/bench_backward.log" | head -12
  step block_check 115 torchrun --nproc-per-node=1 benchmarks/results/2026-12-06_gpu_run154/block_check.py
  cut -c1-230 "$OUT/block_check.log" | tail -26 ;;
vt)
  step block_tests 100 python -m pytest -m gpu -n 4 -p no:cacheprovider -v --timeout 90 -rf -k block \
    tests/kernels/test_gemm_sm90.py
  grep -E "FAILED|passed|failed|^E " "$OUT/block_tests.log" | cut -c1-300 | tail -12 ;;
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
