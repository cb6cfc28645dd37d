#!/usr/bin/env bash
# run93 (1x H200): the shared-GPU W = 2 tests run92 did not reach: primitives at 4 and 8 ranks and the wait that
# times out (several ranks on one GPU), then the layers' backward at W = 2 and 4.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD TRITON_DIST_GPU_WORLD=2
P="python3 -m pytest -m gpu -p no:cacheprovider -v -rs --tb=short --durations=10"
timeout 80 $P -n 2 tests/language > "$OUT/E_shared_primitives.log" 2>&1; echo "E exit $?"
timeout 100 $P -n 3 tests/nn/test_training.py > "$OUT/F_shared_training.log" 2>&1; echo "F exit $?"
[ -d /tmp/triton_dist_mps_pipe ] && CUDA_MPS_PIPE_DIRECTORY=/tmp/triton_dist_mps_pipe bash -c 'echo quit | nvidia-cuda-mps-control'
for f in "$OUT"/*.log; do echo "--- $f"; grep -E "PASSED|FAILED|passed|failed" "$f" | sed 's/.*\(PASSED\|FAILED\)/\1/' | tail -12; done
