#!/usr/bin/env bash
# run149 (1 GPU, GPU image): prepared 2026-12-06, not yet run. The warp-specialized FP8 probe (ws_probe.py,
# compile-checked only): against fp64 in every mode, then timed against _scaled_mm, the Triton core and
# gemm_sm90's kernel. A wrong mbarrier phase would hang: the timeout ends it.
#   GIT_COMMIT=<sha> bash steps.sh   (~300 s)
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
here=benchmarks/results/2026-12-06_h200x1_run149
echo "commit $GIT_COMMIT" > "$OUT/node.log"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >> "$OUT/node.log"
timeout 280 python $here/gpu_check.py > "$OUT/gpu_check.log" 2>&1; echo "== gpu_check: exit $?"
grep -vE "^triton_dist autotune|^  \[" "$OUT/gpu_check.log" | cut -c1-300 | tail -60
true
