#!/usr/bin/env bash
# run99 (1x H200, GPU image): the rest of README's test command (`-m "not gpu"`, after the torch-2.11 compiling()
# fix) beside the epoch probe of the shared-GPU ag_gemm timeouts (probe_epochs.py). Logs under $OUT.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD TRITON_DIST_SHARED_GPU_RANKS=8
step() { local name=$1 limit=$2; shift 2; local t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "== $name: exit $? in $(( $(date +%s) - t0 )) s"; }
echo "commit $GIT_COMMIT" > "$OUT/node.log"
step not_gpu "${LIMIT:-480}" python3 -m pytest -m "not gpu" -n 11 --dist loadfile -p no:cacheprovider -rs --tb=short --durations=15 tests &
step probe "${LIMIT:-480}" python3 "$(dirname "$0")/probe_epochs.py" &
wait
[ -d /tmp/triton_dist_mps_pipe ] && CUDA_MPS_PIPE_DIRECTORY=/tmp/triton_dist_mps_pipe bash -c 'echo quit | nvidia-cuda-mps-control'
grep -E "passed|failed|FAILED" "$OUT/not_gpu.log" | tail -8; cat "$OUT/probe.log" | cut -c1-1500 | tail -60
