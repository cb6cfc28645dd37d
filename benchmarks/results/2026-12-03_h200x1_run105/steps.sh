#!/usr/bin/env bash
# run105 (1x H200, GPU image): the GPU tier at the commit in node.log (`python -m pytest -m gpu -n 8`, README's first
# half) with tests/shmem/test_misuse.py (-m "not gpu", after its timeout fix) beside it, then run104's FP8
# promotion probe on the idle GPU. Logs under $OUT.
export PYTHONUNBUFFERED=1
D=$(dirname "$0")
step() { local name=$1 limit=$2; shift 2; local t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "== $name: exit $? in $(( $(date +%s) - t0 )) s"; }
echo "commit $GIT_COMMIT" > "$OUT/node.log"
python -c "import triton_dist" 2>/dev/null || step setup 60 python -m pip install --no-build-isolation --no-index -e ".[test]"
step misuse 200 python -m pytest -m "not gpu" -n 4 -p no:cacheprovider -rs tests/shmem/test_misuse.py &
mkdir -p /tmp/tier; OUT=/tmp/tier SUITE_REST=0 SUITE_SHARED_WORLDS= SUITE_SKIP_BENCH=1 SUITE_STEP_TIMEOUT=380 \
  bash scripts/gpu_suite.sh > /dev/null 2>&1; cp /tmp/tier/suite.log "$OUT/gpu_tier.log"
grep -E "^== |passed|failed" "$OUT/gpu_tier.log" | tail -4
wait
tail -1 "$OUT/misuse.log"
step promotion_probe 130 python "$D/../2026-12-03_h200x1_run104/promotion_probe.py" "$OUT"
cut -c1-120 "$OUT/promotion_probe.log"
