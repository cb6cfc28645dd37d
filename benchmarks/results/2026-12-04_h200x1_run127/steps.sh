#!/usr/bin/env bash
# run127 (1x H200, GPU image): the session's first call. gpu_tier: README's GPU tier on every commit since run123
# (ce003f6, af33731, 22b43de: parallelize's MLP-by-form, OLMoE / GLM-4-MoE; 60ba837: grouped_gemm's FP8 mode,
# stack-aware fp8 amax / quantize kernels) with the new FP8 grouped GPU tests; bench_grouped_gemm's FP8 rows
# (ours FP8 rowwise / blockwise vs our bf16, torch grouped_mm bf16 and torch._scaled_grouped_mm).
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/benchmarks
step() { local name=$1 limit=$2; shift 2; local t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "== $name: exit $? in $(( $(date +%s) - t0 )) s"; }
echo "commit $GIT_COMMIT" > "$OUT/node.log"
step gpu_tier 400 python -m pytest -m gpu -n 8 -p no:cacheprovider -rs -q --durations=8 tests
grep -E "passed|failed|FAILED|Error" "$OUT/gpu_tier.log" | tail -12
mkdir -p /tmp/bench
BENCH_DIR=/tmp/bench step bench_grouped_fp8 130 python benchmarks/bench_grouped_gemm.py --what fp8 --rounds 3
tail -20 "$OUT/bench_grouped_fp8.log"
cp /tmp/bench/*.json "$OUT/" 2>/dev/null
true
