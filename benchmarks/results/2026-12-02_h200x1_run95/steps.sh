#!/usr/bin/env bash
# run95 (1x H200, GPU image): the GPU tier again (slow tests first, the HF example built on the GPU, shared-GPU
# calls side by side on 1/8 of the GPU per rank), then the shared-GPU tiers at W = 2 and W = 4 at the same time
# (their calls take rank shares of one GPU: at most 8 ranks at once). Logs under $OUT.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
step() { local name=$1 limit=$2; shift 2; local t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "== $name: exit $? in $(( $(date +%s) - t0 )) s"; }
P="python3 -m pytest -m gpu --dist load -p no:cacheprovider -v -rs --tb=short"
{ nvidia-smi --query-gpu=name,memory.total --format=csv; python3 -c 'import torch, triton; print(torch.__version__, triton.__version__)'; echo "commit $GIT_COMMIT"; } > "$OUT/node.log" 2>&1
TRITON_DIST_CACHE_DIR=$(mktemp -d) step A_gpu_tier ${A_LIMIT:-330} $P -n 8 --durations=30 tests
TRITON_DIST_GPU_WORLD=2 TRITON_DIST_CACHE_DIR=$(mktemp -d) step B_shared_w2 ${B_LIMIT:-230} $P -n 4 --durations=20 tests &
TRITON_DIST_GPU_WORLD=4 TRITON_DIST_CACHE_DIR=$(mktemp -d) step C_shared_w4 ${B_LIMIT:-230} $P -n 3 --durations=20 tests &
wait
[ -d /tmp/triton_dist_mps_pipe ] && CUDA_MPS_PIPE_DIRECTORY=/tmp/triton_dist_mps_pipe bash -c 'echo quit | nvidia-cuda-mps-control'
for f in "$OUT"/*.log; do echo "--- $f"; grep -E "passed|failed|FAILED|Error" "$f" | tail -12; grep -cE "PASSED" "$f"; done
