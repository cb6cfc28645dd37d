#!/usr/bin/env bash
# run129 (1x H200, GPU image): ExpertParallelMoE(fp8=...) first run: its GPU tests (bf16 vs the recipe in fp64, each
# mode); bench_backward's MLP and MoE training steps with the FP8 (rowwise) layers beside the bf16 ones and HF;
# bench_host with HOST_PROFILE=1 (where the host time of gemm / ep_dispatch / ep_combine / sp_flash_decode goes).
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/benchmarks
step() { local name=$1 limit=$2; shift 2; local t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "== $name: exit $? in $(( $(date +%s) - t0 )) s"; }
echo "commit $GIT_COMMIT" > "$OUT/node.log"
step gpu_tests 120 python -m pytest -m gpu -n 3 -p no:cacheprovider -rs -q tests/nn/test_fp8_training.py -k moe
grep -E "passed|failed|FAILED|assert" "$OUT/gpu_tests.log" | tail -8
mkdir -p /tmp/bench
BENCH_DIR=/tmp/bench step bench_backward 150 torchrun --nproc-per-node=1 benchmarks/bench_backward.py --only mlp,moe
grep -E "^\||WRONG" "$OUT/bench_backward.log" | head -14
HOST_PROFILE=1 BENCH_DIR=/tmp/bench step bench_host_profile 80 torchrun --nproc-per-node=1 benchmarks/bench_host.py
grep -E "NOT MET|ok$" "$OUT/bench_host_profile.log" | head -14
cp /tmp/bench/*.json "$OUT/" 2>/dev/null
true
