#!/usr/bin/env bash
# run109 (1x H200, GPU image; planned for the next session): first run of dd40abf (block scales as A's column times
# one scalar per W block, 239 -> 170 registers at 128x128) and of the MoE ops' autograd under torch.compile.
#   call 1: PART=tier  the GPU tier (`python -m pytest -m gpu -n 8`, ~330 s)
#   call 2: PART=fp8   run102's FP8 tile probe (per-tensor / rowwise / block vs _scaled_mm, device time), then
#                      bench_gemm --only fp8 (tuned, in turn) until the call's time is up
# Logs under $OUT.
export PYTHONUNBUFFERED=1
D=$(dirname "$0")
step() { local name=$1 limit=$2; shift 2; local t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "== $name: exit $? in $(( $(date +%s) - t0 )) s"; }
echo "commit $GIT_COMMIT part $PART" > "$OUT/node.log"
python -c "import triton_dist" 2>/dev/null || step setup 60 python -m pip install --no-build-isolation --no-index -e ".[test]"
if [ "$PART" = tier ]; then
  mkdir -p /tmp/tier; OUT=/tmp/tier SUITE_REST=0 SUITE_SHARED_WORLDS= SUITE_SKIP_BENCH=1 SUITE_STEP_TIMEOUT=420 \
    bash scripts/gpu_suite.sh > /dev/null 2>&1; cp /tmp/tier/suite.log "$OUT/gpu_tier.log"
  grep -E "^== |passed|failed" "$OUT/gpu_tier.log" | tail -4
else
  PYTHONPATH=$PWD step fp8_probe 300 python "$D/../2026-12-03_h200x1_run102/fp8_probe.py" "$OUT"
  grep -E "block" "$OUT/fp8_probe.log" | cut -c1-120 | head -20
  BENCH_DIR=$OUT step bench_gemm_fp8 240 torchrun --nproc-per-node=1 benchmarks/bench_gemm.py --only fp8
  tail -30 "$OUT/bench_gemm_fp8.log"
fi
true
