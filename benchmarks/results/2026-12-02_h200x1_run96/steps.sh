#!/usr/bin/env bash
# run96 (1x H200, GPU image): several ranks on the one GPU, what run95 left: at W = 2 its four failures (now with
# their tracebacks as they happen) and the tests its time limit cut; at W = 4 the tests run95 did not reach
# (w4_rest.txt), both at once (rank shares of 1/8 of the GPU). Logs under $OUT.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD TRITON_DIST_EARLY_TRACEBACKS=1
D=$(dirname "$0")
step() { local name=$1 limit=$2; shift 2; local t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "== $name: exit $? in $(( $(date +%s) - t0 )) s"; }
P="python3 -m pytest -m gpu --dist load -p no:cacheprovider -v -rs --tb=short --durations=15"
echo "commit $GIT_COMMIT" > "$OUT/node.log"
TRITON_DIST_GPU_WORLD=2 TRITON_DIST_CACHE_DIR=$(mktemp -d) step B_shared_w2 ${B_LIMIT:-200} $P -n 3 $(cat $D/w2_rest.txt) &
TRITON_DIST_GPU_WORLD=4 TRITON_DIST_CACHE_DIR=$(mktemp -d) step C_shared_w4 ${C_LIMIT:-390} $P -n 4 $(cat $D/w4_rest.txt) &
wait
[ -d /tmp/triton_dist_mps_pipe ] && CUDA_MPS_PIPE_DIRECTORY=/tmp/triton_dist_mps_pipe bash -c 'echo quit | nvidia-cuda-mps-control'
for f in "$OUT"/*.log; do echo "--- $f"; grep -E "passed|failed|FAILED|Error" "$f" | tail -14; grep -cE "PASSED" "$f"; done
