#!/usr/bin/env bash
# run104 (1x H200, GPU image; the session's last GPU seconds): the FP8 promotion probe, then beside it
# tests/shmem/test_misuse.py (-m "not gpu": the file whose warm-up call timed out on the loaded machine of run102,
# after its fix). Logs under $OUT.
export PYTHONUNBUFFERED=1
D=$(dirname "$0")
step() { local name=$1 limit=$2; shift 2; local t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "== $name: exit $? in $(( $(date +%s) - t0 )) s"; }
echo "commit $GIT_COMMIT" > "$OUT/node.log"
python -c "import triton_dist" 2>/dev/null || step setup 60 python -m pip install --no-build-isolation --no-index -e ".[test]"
step misuse 140 python -m pytest -m "not gpu" -n 6 -p no:cacheprovider -rs tests/shmem/test_misuse.py &
step promotion_probe 130 python "$D/promotion_probe.py" "$OUT"
wait
tail -1 "$OUT/misuse.log"; cut -c1-120 "$OUT/promotion_probe.log"
