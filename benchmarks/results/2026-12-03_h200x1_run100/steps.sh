#!/usr/bin/env bash
# (the probe: run99's probe_epochs.py, its cases named; this run used a copy of it at the commit in node.log)
# run100 (1x H200, GPU image): README's set-up as a new user types it, then README's whole test command in its two
# halves side by side (the GPU tier `-m gpu -n 8` and the rest `-m "not gpu"`), then the epoch probe of the
# shared-GPU ag_gemm timeouts (probe_epochs.py, after the tier: both start MPS). Logs under $OUT.
export PYTHONUNBUFFERED=1
D=$(dirname "$0")
step() { local name=$1 limit=$2; shift 2; local t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "== $name: exit $? in $(( $(date +%s) - t0 )) s"; }
echo "commit $GIT_COMMIT" > "$OUT/node.log"; nvidia-smi >> "$OUT/node.log" 2>&1
step setup 120 bash -c 'python -m pip install --no-build-isolation --no-index -e ".[test]" && python examples/allgather.py'
tail -3 "$OUT/setup.log"
T0=$(date +%s)
step not_gpu 500 python -m pytest -m "not gpu" -n 6 --dist loadfile -p no:cacheprovider -rs --tb=short --durations=15 tests &
( mkdir -p /tmp/tier; OUT=/tmp/tier SUITE_REST=0 SUITE_SHARED_WORLDS= SUITE_SKIP_BENCH=1 SUITE_STEP_TIMEOUT=330 \
    bash scripts/gpu_suite.sh > /dev/null 2>&1; cp /tmp/tier/suite.log "$OUT/gpu_tier.log"
  echo "== gpu tier done at $(( $(date +%s) - T0 )) s"
  step probe $(( 495 - ($(date +%s) - T0) )) env TRITON_DIST_SHARED_GPU_RANKS=8 PYTHONPATH=$PWD python3 "$D/../2026-12-02_h200x1_run99/probe_epochs.py" fp8_row unbound_fp8_row bf16_w4 unbound_bf16_w4 bf16_w2
  [ -d /tmp/triton_dist_mps_pipe ] && CUDA_MPS_PIPE_DIRECTORY=/tmp/triton_dist_mps_pipe bash -c 'echo quit | nvidia-cuda-mps-control' ) &
wait
grep -E "^== |passed|failed|FAILED" "$OUT/gpu_tier.log" | tail -12; grep -E "passed|failed|FAILED" "$OUT/not_gpu.log" | tail -8
cut -c1-1200 "$OUT/probe.log" | tail -50
