#!/usr/bin/env bash
# run97 (1x H200, GPU image): README's set-up (install, main job) and test command at HEAD on the GPU machine, in its two halves: the GPU tier
# (`python -m pytest -m gpu -n 8`) and the rest (`-m "not gpu"`: CPU ranks, sm_90 compiles). Logs under $OUT.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
export TRITON_DIST_EARLY_TRACEBACKS=1
step() { local name=$1 limit=$2; shift 2; local t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "== $name: exit $? in $(( $(date +%s) - t0 )) s"; }
{ nvidia-smi --query-gpu=name,memory.total --format=csv; python3 -c 'import torch, triton; print(torch.__version__, triton.__version__)'; echo "commit $GIT_COMMIT"; } > "$OUT/node.log" 2>&1
step 0_setup 90 bash -c 'pip install --no-build-isolation --no-index -e ".[test]" && python examples/allgather.py'
TRITON_DIST_CACHE_DIR=$(mktemp -d) step A_gpu_tier ${A_LIMIT:-345} python3 -m pytest -m gpu -n 8 --dist load -p no:cacheprovider -v -rs --tb=short --durations=20 tests
step B_not_gpu ${B_LIMIT:-240} python3 -m pytest -m "not gpu" -n 14 --dist loadfile -p no:cacheprovider -rs --tb=short --durations=15 tests
[ -d /tmp/triton_dist_mps_pipe ] && CUDA_MPS_PIPE_DIRECTORY=/tmp/triton_dist_mps_pipe bash -c 'echo quit | nvidia-cuda-mps-control'
for f in "$OUT"/*.log; do echo "--- $f"; grep -E "passed|failed|FAILED|Error" "$f" | tail -12; done
