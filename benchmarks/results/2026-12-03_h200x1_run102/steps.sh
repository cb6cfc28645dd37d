#!/usr/bin/env bash
# run102 (1x H200, GPU image), after the FP8 fold (FP8 a mode of gemm / ag_gemm / gemm_rs) and the promoted FP8 tiles
# that fit the registers (gemm.fp8_tiles): README's set-up, then the second half of README's test command
# (`-m "not gpu"`: CPU ranks, sm_90 compiles) in 14 workers, beside it the FP8 tile probe (device time from CUDA-graph
# replays: little disturbed by the CPU work beside it), then the host probe (where an eager gemm call's time goes;
# its absolute figures are inflated by the CPU work beside it). Logs under $OUT.
export PYTHONUNBUFFERED=1
D=$(dirname "$0")
step() { local name=$1 limit=$2; shift 2; local t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "== $name: exit $? in $(( $(date +%s) - t0 )) s"; }
echo "commit $GIT_COMMIT" > "$OUT/node.log"; nvidia-smi --query-gpu=name,clocks.max.sm --format=csv >> "$OUT/node.log"
step setup 60 python -m pip install --no-build-isolation --no-index -e ".[test]"
( step fp8_probe 300 python "$D/fp8_probe.py" "$OUT"; step host_probe 90 python "$D/host_probe.py" "$OUT" ) &
step not_gpu 530 python -m pytest -m "not gpu" -n 14 --dist loadfile -p no:cacheprovider -rs --durations=15 tests
wait
grep -E "passed|failed|error" "$OUT/not_gpu.log" | tail -3
grep -E "^8192x8192x8192|^2048" "$OUT/fp8_probe.log" | cut -c1-110 | head -40
grep "per call" "$OUT/host_probe.log"
