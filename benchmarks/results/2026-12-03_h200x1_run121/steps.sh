#!/usr/bin/env bash
# run121 (1x H200, GPU image): after the dispatch default without its CUDA graph (run120: 31 vs 61 us), all_gather's
# layout plans (word views, bound launch) and sp_flash_decode's plan look-up first. gpu_tests: the GPU tests of the
# changed ops; bench_host at W = 1, then with cProfile (HOST_PROFILE=1: µs per call per function).
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/benchmarks
step() { local name=$1 limit=$2; shift 2; local t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "== $name: exit $? in $(( $(date +%s) - t0 )) s"; }
echo "commit $GIT_COMMIT" > "$OUT/node.log"
step gpu_tests 200 python -m pytest -m gpu -n 8 -p no:cacheprovider -rs -q tests/kernels/test_moe_ep.py \
  tests/kernels/test_fp8_moe_ep.py tests/kernels/test_flash_decode.py tests/kernels/test_launcher.py \
  tests/kernels/test_allgather.py tests/kernels/test_allgather_gemm.py
grep -E "passed|failed|FAILED" "$OUT/gpu_tests.log" | tail -6
mkdir -p /tmp/bench
BENCH_DIR=/tmp/bench step bench_host 60 torchrun --nproc-per-node=1 benchmarks/bench_host.py
grep -E "NOT MET|ok$|ep_|flash" "$OUT/bench_host.log" | head -20
HOST_PROFILE=1 BENCH_DIR=/tmp/bench step bench_host_profile 60 torchrun --nproc-per-node=1 benchmarks/bench_host.py
true
