#!/usr/bin/env bash
# run153 (1 GPU; prepared 2026-12-06, not run). GIT_COMMIT=<sha> bash steps.sh a|ncu|b
#   a (~560 s): the Gluon mainloop's block scales through the ring (cp.async into the slot: block_check.py) and the
#      transposed FP8 quantiser (the FP8 backward's weight gradients, no high-precision transposes) under their GPU
#      tests, bench_backward's MLP; 633b4e2 (hardware.capturing asks torch.cuda.is_initialized first) under the GPU
#      tests that capture graphs (gemm split-K / eager / replay), bench_host with its profile
#   ncu (~200 s): the ncu source view of the Gluon kernel per-tensor vs blockwise (if block_check still trails)
#   b (~560 s): examples/fp8_tp_mlp.py at W = 1 (FP8 vs bf16), the GPU tier at 6 workers (8 ran out of memory
#      on an H100 in run152)
source benchmarks/steps_lib.sh
if [ "${1:-a}" = a ]; then
step capture_tests 120 python -m pytest -m gpu -n 4 -p no:cacheprovider -v --timeout 100 tests/kernels/test_gemm.py \
  tests/kernels/test_replay.py tests/kernels/test_launcher.py -k "eager or split_k or graph or replay or bound"
grep -E "FAILED|passed|failed" "$OUT/capture_tests.log" | cut -c1-250 | tail -6
step sm90_fp8_tests 150 python -m pytest -m gpu -n 4 -p no:cacheprovider -v --timeout 140 tests/kernels/test_gemm_sm90.py \
  tests/kernels/test_fp8_gemm.py tests/nn/test_fp8_training.py -k "sm90 or gluon or quantize_fp8 or fp8_grads or candidate"
grep -E "FAILED|passed|failed" "$OUT/sm90_fp8_tests.log" | cut -c1-250 | tail -8
step block_check 120 python benchmarks/results/2026-12-06_gpu_run153/block_check.py
grep -E "x cuBLAS" "$OUT/block_check.log"
BENCH_DIR=/tmp/bench step bench_backward 120 torchrun --nproc-per-node=1 benchmarks/bench_backward.py --only mlp \
  --fp8 row,block --fp8-grads
grep -E "^\||WRONG" "$OUT/bench_backward.log" | head -16
HOST_PROFILE=1 BENCH_DIR=/tmp/bench step bench_host 60 torchrun --nproc-per-node=1 benchmarks/bench_host.py
grep -E "NOT MET|ok$" "$OUT/bench_host.log" | head -16
elif [ "$1" = ncu ]; then
step ncu_source 200 ncu --clock-control none -k regex:gemm_fp8_sm90 --launch-skip 1 --launch-count 2 --set full \
  --import-source yes -o "$OUT/block" python benchmarks/results/2026-12-06_h100x1_run152/ncu_block.py  # run152's launches
ncu --import "$OUT/block.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu_sass.csv" 2>&1  # per instruction: stall samples
ncu --import "$OUT/block.ncu-rep" --section WarpStateStats 2>/dev/null | grep -i "stall\|Duration" | head -30
else
step fp8_tp_mlp 60 torchrun --nproc-per-node=1 examples/fp8_tp_mlp.py
tail -6 "$OUT/fp8_tp_mlp.log"
step gpu_tier 500 python -m pytest -m gpu -n 6 -p no:cacheprovider -v --timeout 200 -rf tests
grep -E "FAILED|passed|failed" "$OUT/gpu_tier.log" | cut -c1-250 | tail -12
fi
cp /tmp/bench/*.json "$OUT/" 2>/dev/null
true
