#!/usr/bin/env bash
# run102 (1x H200, GPU image), after the FP8 fold (FP8 a mode of gemm / ag_gemm / gemm_rs): README's set-up, then the
# second half of README's test command (`-m "not gpu"`: CPU ranks, sm_90 compiles) alone, in 15 workers. Logs under $OUT.
export PYTHONUNBUFFERED=1
step() { local name=$1 limit=$2; shift 2; local t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "== $name: exit $? in $(( $(date +%s) - t0 )) s"; }
echo "commit $GIT_COMMIT" > "$OUT/node.log"
step setup 60 python -m pip install --no-build-isolation --no-index -e ".[test]"
step not_gpu 520 python -m pytest -m "not gpu" -n 15 --dist loadfile -p no:cacheprovider -rs --durations=15 tests
grep -E "passed|failed|error" "$OUT/not_gpu.log" | tail -3
