#!/usr/bin/env bash
# run94 (1x H200, GPU image): the GPU tier at HEAD (README: python -m pytest -m gpu, now with the multi-rank GPU tests
# on the shared GPU and the backward tests), then bench_backward at W = 1. Logs under $OUT.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
step() { local name=$1 limit=$2; shift 2; local t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "== $name: exit $? in $(( $(date +%s) - t0 )) s"; }
{ nvidia-smi --query-gpu=name,memory.total --format=csv; python3 -c 'import torch, triton; print(torch.__version__, triton.__version__)'; echo "commit $GIT_COMMIT"; } > "$OUT/node.log" 2>&1
TRITON_DIST_CACHE_DIR=$(mktemp -d) step A_gpu_tier 430 python3 -m pytest -m gpu -n 8 --dist load -p no:cacheprovider -v -rs \
  --tb=short --durations=30 tests
BENCH_DIR=$OUT step B_bench_backward 125 torchrun --nproc-per-node=1 --master-port=29519 benchmarks/bench_backward.py
[ -d /tmp/triton_dist_mps_pipe ] && CUDA_MPS_PIPE_DIRECTORY=/tmp/triton_dist_mps_pipe bash -c 'echo quit | nvidia-cuda-mps-control'
for f in "$OUT"/*.log; do echo "--- $f"; grep -E "passed|failed|FAILED|Error" "$f" | tail -12; done
