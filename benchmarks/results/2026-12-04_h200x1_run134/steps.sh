#!/usr/bin/env bash
# run134 (1x H200, GPU image): the session's last call, after its last kernel change (fp8.quantize_blocks at 16
# warps) and the FP8 MoE layer: README's GPU tier.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/benchmarks
step() { local name=$1 limit=$2; shift 2; local t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "== $name: exit $? in $(( $(date +%s) - t0 )) s"; }
echo "commit $GIT_COMMIT" > "$OUT/node.log"
step gpu_tier 430 python -m pytest -m gpu -n 8 -p no:cacheprovider -rs -q --durations=8 tests
grep -E "passed|failed|FAILED|Error" "$OUT/gpu_tier.log" | tail -12
true
