#!/usr/bin/env bash
# run150 (1 GPU, GPU image): the warp-specialized Gluon FP8 mainloop in gemm_sm90.py, offered to the tuner.
#   GIT_COMMIT=<sha> bash steps.sh proof  (~420 s) its GPU tests (every configuration, BLOCK_N 128 and 256, against
#       fp64), then bench_gemm's FP8 table (each row names the configuration the tuner chose), every candidate's
#       tuning time kept (the autotune cache's _timings_us).
#   GIT_COMMIT=<sha> bash steps.sh tier   (~560 s) README's GPU tier (6 workers per 80 GB, 12 on an H200), then
#       bench_host (HOST_PROFILE=1).
#   GIT_COMMIT=<sha> bash steps.sh final  (~480 s) after the last kernel change: its GPU tests, the tier's one failure
#       (a 4-rank pool's start) again, bench_gemm's FP8 table, bench_host.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/benchmarks TRITON_DIST_CACHE_DIR=$OUT/autotune
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
step() { local name=$1 limit=$2; shift 2; local t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "== $name: exit $? in $(( $(date +%s) - t0 )) s"; }
echo "commit $GIT_COMMIT" > "$OUT/node.log"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >> "$OUT/node.log"
mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
workers=$(( mem > 100000 ? 12 : 6 ))
echo "workers $workers" >> "$OUT/node.log"; cat "$OUT/node.log"
mkdir -p /tmp/bench
if [ "${1:-proof}" = proof ]; then
  step gluon_tests 150 python -m pytest -m gpu -n 6 -p no:cacheprovider -q -rs tests/kernels/test_gemm_sm90.py
  grep -E "passed|failed|FAILED|Error" "$OUT/gluon_tests.log" | cut -c1-300 | tail -12
  BENCH_DIR=/tmp/bench step bench_gemm_fp8 270 torchrun --nproc-per-node=1 benchmarks/bench_gemm.py --only fp8
  grep -E "^\|" "$OUT/bench_gemm_fp8.log" | head -14
elif [ "$1" = final ]; then
  step gluon_tests 120 python -m pytest -m gpu -n 6 -p no:cacheprovider -q -rs tests/kernels/test_gemm_sm90.py
  grep -E "passed|failed|FAILED|Error" "$OUT/gluon_tests.log" | cut -c1-300 | tail -12
  step mlp_grads 120 python -m pytest -m gpu -n 3 -p no:cacheprovider -q -rs tests/nn/test_training.py -k mlp_layer_gradients_bf16_on_gpus
  grep -E "passed|failed|FAILED|Error" "$OUT/mlp_grads.log" | cut -c1-300 | tail -12
  BENCH_DIR=/tmp/bench step bench_gemm_fp8 270 torchrun --nproc-per-node=1 benchmarks/bench_gemm.py --only fp8
  grep -E "^\|" "$OUT/bench_gemm_fp8.log" | head -14
  HOST_PROFILE=1 BENCH_DIR=/tmp/bench step bench_host 60 torchrun --nproc-per-node=1 benchmarks/bench_host.py
  grep -E "NOT MET|scaled_gemm|gemm 128" "$OUT/bench_host.log" | head -12
else
  step gpu_tier 480 python -m pytest -m gpu -n $workers -p no:cacheprovider -q -rs --durations=15
  grep -E "passed|failed|FAILED|Error" "$OUT/gpu_tier.log" | cut -c1-200 | tail -25
  HOST_PROFILE=1 BENCH_DIR=/tmp/bench step bench_host 80 torchrun --nproc-per-node=1 benchmarks/bench_host.py
  grep -E "NOT MET|^\|" "$OUT/bench_host.log" | head -30
fi
cp /tmp/bench/*.json "$OUT/" 2>/dev/null
true
