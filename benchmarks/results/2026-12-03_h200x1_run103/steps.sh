#!/usr/bin/env bash
# run103 (1x H200, GPU image): the GPU tier at the commit in node.log (`python -m pytest -m gpu -n 8`, README's first
# half; with run102's `-m "not gpu"` half: README's test command), then the ag_gemm test files at W = 2 and W = 4
# on the shared GPU side by side until the call's time is up. Logs under $OUT.
export PYTHONUNBUFFERED=1
step() { local name=$1 limit=$2; shift 2; local t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "== $name: exit $? in $(( $(date +%s) - t0 )) s"; }
mps_quit() { [ -d /tmp/triton_dist_mps_pipe ] && CUDA_MPS_PIPE_DIRECTORY=/tmp/triton_dist_mps_pipe bash -c 'echo quit | nvidia-cuda-mps-control'; }
echo "commit $GIT_COMMIT" > "$OUT/node.log"
T0=$(date +%s)
python -c "import triton_dist" 2>/dev/null || step setup 60 python -m pip install --no-build-isolation --no-index -e ".[test]"
mkdir -p /tmp/tier; OUT=/tmp/tier SUITE_REST=0 SUITE_SHARED_WORLDS= SUITE_SKIP_BENCH=1 SUITE_STEP_TIMEOUT=380 \
  bash scripts/gpu_suite.sh > /dev/null 2>&1; cp /tmp/tier/suite.log "$OUT/gpu_tier.log"
grep -E "^== |passed|failed" "$OUT/gpu_tier.log" | tail -4
mps_quit
LEFT=$(( 575 - ($(date +%s) - T0) ))
for w in 2 4; do
  step shared_w$w $LEFT env TRITON_DIST_GPU_WORLD=$w TRITON_DIST_SHARED_GPU_RANKS=8 TRITON_DIST_EARLY_TRACEBACKS=1 \
    PYTHONPATH=$PWD python -m pytest -m gpu -n 4 -p no:cacheprovider -v -rs --durations=10 \
    tests/kernels/test_allgather_gemm.py tests/kernels/test_fp8_ag_gemm.py &
done
wait; mps_quit
for w in 2 4; do echo "W=$w: $(grep -c PASSED "$OUT/shared_w$w.log") passed, $(grep -c FAILED "$OUT/shared_w$w.log") failed"; done
