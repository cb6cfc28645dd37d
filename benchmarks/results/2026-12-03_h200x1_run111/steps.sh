#!/usr/bin/env bash
# run111 (1x H200, GPU image): after 1ac833b (eager gemm plans, descriptors without Triton's re-validation) and the
# quantiser fix. gpu_tests: the GPU tests of what changed (gemm plans, quantize_fp8 bitwise, FP8 layers in every
# mode, launcher, grouped_gemm / gemm_rs / gemm_ar descriptors); host_probe: run102's per-call host time and
# cProfile; mlp_probe: the fused SiLU-gate GEMM at W = 1 vs HF / fallback; tile_probe: 16-warp FP8 tiles; bench_host W=1 (every op's eager host time vs its baseline); bench_gemm --only fp8 (tuned, in turn).
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
D=$(dirname "$0")
step() { local name=$1 limit=$2; shift 2; local t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "== $name: exit $? in $(( $(date +%s) - t0 )) s"; }
echo "commit $GIT_COMMIT" > "$OUT/node.log"; nvidia-smi --query-gpu=name,clocks.max.sm --format=csv >> "$OUT/node.log"
step gpu_tests 170 python -m pytest -m gpu -n 8 -p no:cacheprovider -rs tests/kernels/test_gemm.py \
  tests/kernels/test_fp8_gemm.py tests/kernels/test_launcher.py tests/nn/test_fp8_training.py \
  tests/kernels/test_grouped_gemm.py tests/kernels/test_gemm_reducescatter.py tests/kernels/test_allreduce.py
grep -E "passed|failed|Error" "$OUT/gpu_tests.log" | tail -5
step host_probe 60 python "$D/../2026-12-03_h200x1_run102/host_probe.py" "$OUT"
grep "per call" "$OUT/host_probe.log"
BENCH_DIR=$OUT step bench_host 90 torchrun --nproc-per-node=1 benchmarks/bench_host.py
grep -E "x |target|ours" "$OUT/bench_host.log" | tail -14
step tile_probe 90 python "$D/tile_probe.py" "$OUT"
grep -E " row | block " "$OUT/tile_probe.log" | cut -c1-110
step mlp_probe 60 python "$D/mlp_probe.py" "$OUT"
cat "$OUT/mlp_probe.log" | cut -c1-400
BENCH_DIR=$OUT step bench_gemm_fp8 120 torchrun --nproc-per-node=1 benchmarks/bench_gemm.py --only fp8
tail -14 "$OUT/bench_gemm_fp8.log"
true
