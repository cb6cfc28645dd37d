#!/usr/bin/env bash
# run106 (1x H200, GPU image): split_probe.py (FP8 128x256 tiles as two 128-wide accumulators) on the idle GPU, then
# issue 33's shared-GPU tiers: every GPU test at W = 2 and W = 4 ranks on the one GPU (MPS), side by side, until
# the call's time is up (logs say which tests ran). Logs under $OUT.
export PYTHONUNBUFFERED=1
D=$(dirname "$0")
step() { local name=$1 limit=$2; shift 2; local t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "== $name: exit $? in $(( $(date +%s) - t0 )) s"; }
echo "commit $GIT_COMMIT" > "$OUT/node.log"
T0=$(date +%s)
python -c "import triton_dist" 2>/dev/null || step setup 60 python -m pip install --no-build-isolation --no-index -e ".[test]"
PYTHONPATH=$PWD step split_probe 120 python "$D/split_probe.py" "$OUT"
cut -c1-130 "$OUT/split_probe.log"
LEFT=$(( 585 - ($(date +%s) - T0) ))
mkdir -p /tmp/shared; OUT=/tmp/shared SUITE_GPU_TIER=0 SUITE_REST=0 SUITE_SKIP_BENCH=1 SUITE_SHARED_WORLDS="2 4" \
  SUITE_STEP_TIMEOUT=$LEFT bash scripts/gpu_suite.sh > /dev/null 2>&1
cp /tmp/shared/shared_w2.log /tmp/shared/shared_w4.log "$OUT/"
for w in 2 4; do echo "W=$w: $(grep -c ' PASSED' "$OUT/shared_w$w.log") passed, $(grep -c ' FAILED' "$OUT/shared_w$w.log") failed"; tail -2 "$OUT/shared_w$w.log"; done
[ -d /tmp/triton_dist_mps_pipe ] && CUDA_MPS_PIPE_DIRECTORY=/tmp/triton_dist_mps_pipe bash -c 'echo quit | nvidia-cuda-mps-control'
true
