#!/usr/bin/env bash
# (the probe: run99's probe_epochs.py, its cases named; this run used a copy of it at the commit in node.log)
# run101 (1x H200, GPU image), after "ag_gemm: no side streams where peers share the GPU": the epoch probe's bf16
# W = 4 case (failed in runs 99 and 100), then the GPU tier alone (`-m gpu -n 8`, README's first half), then the
# ag_gemm test files at W = 2 and W = 4 on the shared GPU side by side until the call's time is up. Logs under $OUT.
export PYTHONUNBUFFERED=1
D=$(dirname "$0")
step() { local name=$1 limit=$2; shift 2; local t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "== $name: exit $? in $(( $(date +%s) - t0 )) s"; }
mps_quit() { [ -d /tmp/triton_dist_mps_pipe ] && CUDA_MPS_PIPE_DIRECTORY=/tmp/triton_dist_mps_pipe bash -c 'echo quit | nvidia-cuda-mps-control'; }
echo "commit $GIT_COMMIT" > "$OUT/node.log"
T0=$(date +%s)
step setup 60 python -m pip install --no-build-isolation --no-index -e ".[test]"
step probe 100 env TRITON_DIST_SHARED_GPU_RANKS=8 PYTHONPATH=$PWD python3 "$D/../2026-12-02_h200x1_run99/probe_epochs.py" bf16_w4
cut -c1-600 "$OUT/probe.log" | grep -v "^   rank" | tail -6
mps_quit
mkdir -p /tmp/tier; OUT=/tmp/tier SUITE_REST=0 SUITE_SHARED_WORLDS= SUITE_SKIP_BENCH=1 SUITE_STEP_TIMEOUT=345 \
  bash scripts/gpu_suite.sh > /dev/null 2>&1; cp /tmp/tier/suite.log "$OUT/gpu_tier.log"
grep -E "^== |passed|failed" "$OUT/gpu_tier.log" | tail -4
LEFT=$(( 570 - ($(date +%s) - T0) ))
for w in 2 4; do
  step shared_w$w $LEFT env TRITON_DIST_GPU_WORLD=$w TRITON_DIST_SHARED_GPU_RANKS=8 TRITON_DIST_EARLY_TRACEBACKS=1 \
    PYTHONPATH=$PWD python -m pytest -m gpu -n 4 -p no:cacheprovider -v -rs --durations=10 \
    tests/kernels/test_allgather_gemm.py tests/kernels/test_fp8_ag_gemm.py &
done
wait; mps_quit
for w in 2 4; do echo "W=$w: $(grep -c PASSED "$OUT/shared_w$w.log") passed, $(grep -c FAILED "$OUT/shared_w$w.log") failed"; grep -E "passed|failed" "$OUT/shared_w$w.log" | tail -2; done
