#!/usr/bin/env bash
# run98/99 (1x H200, GPU image): several ranks sharing the one GPU (shared-gpu backend under MPS): the multi-rank
# GPU tests at the worlds and test paths of SHARED ("W:paths;W:paths", side by side; their calls take rank
# shares of the GPU), with REST=1 the not-gpu half of README's test command beside them, and first README's
# offline set-up as a new user runs it. Logs under $OUT.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
export TRITON_DIST_EARLY_TRACEBACKS=1
step() { local name=$1 limit=$2; shift 2; local t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "== $name: exit $? in $(( $(date +%s) - t0 )) s"; }
{ nvidia-smi --query-gpu=name,memory.total --format=csv; python3 -c 'import torch, triton; print(torch.__version__, triton.__version__)'; echo "commit $GIT_COMMIT"; } > "$OUT/node.log" 2>&1
[ "${SETUP:-1}" = 1 ] && step 0_setup 60 bash -c 'which -a pip python python3; python -m pip install --no-build-isolation --no-index -e ".[test]" && python examples/allgather.py'
P="python3 -m pytest -m gpu --dist load -p no:cacheprovider -v -rs --tb=short --durations=15"
IFS=';' read -ra parts <<< "${SHARED:-2:tests}"
for part in "${parts[@]}"; do
  w=${part%%:*}; paths=${part#*:}
  TRITON_DIST_GPU_WORLD=$w TRITON_DIST_CACHE_DIR=$(mktemp -d) step "shared_w$w" "${LIMIT:-540}" $P -n "${WORKERS:-3}" $paths &
done
[ "${REST:-0}" = 1 ] && step not_gpu "${LIMIT:-540}" python3 -m pytest -m "not gpu" -n "${REST_WORKERS:-10}" --dist loadfile -p no:cacheprovider -rs --tb=short --durations=15 tests &
wait
[ -d /tmp/triton_dist_mps_pipe ] && CUDA_MPS_PIPE_DIRECTORY=/tmp/triton_dist_mps_pipe bash -c 'echo quit | nvidia-cuda-mps-control'
for f in "$OUT"/*.log; do echo "--- $f"; grep -E "passed|failed|FAILED|Error" "$f" | tail -12; done
