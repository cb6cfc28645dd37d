#!/usr/bin/env bash
# run153 (1 GPU; prepared 2026-12-06, not run). GIT_COMMIT=<sha> bash steps.sh a|b
#   a (~560 s): the transposed FP8 quantiser (the FP8 backward's weight gradients, no high-precision transposes)
#      under its GPU tests and bench_backward's MLP; 633b4e2 (hardware.capturing asks torch.cuda.is_initialized first) under the GPU tests that capture
#      graphs (gemm split-K / eager / replay), bench_host with its profile; ncu of the Gluon kernel per-tensor vs
#      blockwise with source-level stall sampling (where block mode's consumers stall: run152 found the data and,
#      run151, the scale loads' latency not to be the cause)
#   b (~560 s): the GPU tier at 6 workers (8 ran out of memory on an H100 in run152)
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/benchmarks
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
step() { local name=$1 limit=$2; shift 2; local t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "== $name: exit $? in $(( $(date +%s) - t0 )) s"; }
echo "commit $GIT_COMMIT" > "$OUT/node.log"
nvidia-smi --query-gpu=name,memory.total,power.limit --format=csv,noheader >> "$OUT/node.log"; cat "$OUT/node.log"
mkdir -p /tmp/bench
if [ "${1:-a}" = a ]; then
step capture_tests 120 python -m pytest -m gpu -n 4 -p no:cacheprovider -v --timeout 100 tests/kernels/test_gemm.py \
  tests/kernels/test_replay.py tests/kernels/test_launcher.py -k "eager or split_k or graph or replay or bound"
grep -E "FAILED|passed|failed" "$OUT/capture_tests.log" | cut -c1-250 | tail -6
step fp8_grads_tests 120 python -m pytest -m gpu -n 4 -p no:cacheprovider -v --timeout 120 \
  tests/kernels/test_fp8_gemm.py tests/nn/test_fp8_training.py -k "quantize_fp8 or fp8_grads"
grep -E "FAILED|passed|failed" "$OUT/fp8_grads_tests.log" | cut -c1-250 | tail -6
BENCH_DIR=/tmp/bench step bench_backward 120 torchrun --nproc-per-node=1 benchmarks/bench_backward.py --only mlp \
  --fp8 row,block --fp8-grads
grep -E "^\||WRONG" "$OUT/bench_backward.log" | head -16
HOST_PROFILE=1 BENCH_DIR=/tmp/bench step bench_host 60 torchrun --nproc-per-node=1 benchmarks/bench_host.py
grep -E "NOT MET|ok$" "$OUT/bench_host.log" | head -16
step ncu_source 200 ncu --clock-control none -k regex:gemm_fp8_sm90 --launch-skip 1 --launch-count 2 --set full \
  --import-source yes -o "$OUT/block" python benchmarks/results/2026-12-06_h100x1_run152/ncu_block.py  # run152's launches
ncu --import "$OUT/block.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu_sass.csv" 2>&1  # per instruction: stall samples
ncu --import "$OUT/block.ncu-rep" --section WarpStateStats 2>/dev/null | grep -i "stall\|Duration" | head -30
else
step gpu_tier 560 python -m pytest -m gpu -n 6 -p no:cacheprovider -v --timeout 200 -rf tests
grep -E "FAILED|passed|failed" "$OUT/gpu_tier.log" | cut -c1-250 | tail -12
fi
cp /tmp/bench/*.json "$OUT/" 2>/dev/null
true
