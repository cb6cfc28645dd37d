#!/usr/bin/env bash
# run152 call c (1 GPU, ~350 s): ep_dispatch's fused layout as the GPU decode default (config.py) proven: the
# moe_ep GPU tests and the MoE layers' at W = 1, bench_host, then the moe_ep GPU tests in the shared-GPU worlds
# W = 2 and 4 (MPS) side by side for the time left. GIT_COMMIT=<sha> bash steps_c.sh
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
step() { local name=$1 limit=$2; shift 2; local t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "== $name: exit $? in $(( $(date +%s) - t0 )) s"; }
T0=$(date +%s)
echo "commit $GIT_COMMIT" > "$OUT/node.log"
MOE="tests/kernels/test_moe_ep.py tests/kernels/test_fp8_moe_ep.py"
step moe_w1 110 python -m pytest -m gpu -n 6 -p no:cacheprovider -v --timeout 120 $MOE tests/nn/test_layers.py tests/nn/test_training.py -k "not mlp"
grep -E "FAILED|passed|failed" "$OUT/moe_w1.log" | cut -c1-250 | tail -6
mkdir -p /tmp/bench; BENCH_DIR=/tmp/bench step bench_host 50 torchrun --nproc-per-node=1 benchmarks/bench_host.py
grep -E "NOT MET|ok$" "$OUT/bench_host.log" | head -16
LEFT=$(( 340 - ($(date +%s) - T0) ))
mkdir -p /tmp/shared; OUT=/tmp/shared SUITE_GPU_TIER=0 SUITE_REST=0 SUITE_SKIP_BENCH=1 SUITE_SHARED_WORLDS="2 4" \
  SUITE_STEP_TIMEOUT=$LEFT bash scripts/gpu_suite.sh $MOE > /dev/null 2>&1
cp /tmp/shared/shared_w2.log /tmp/shared/shared_w4.log "$OUT/"
for w in 2 4; do echo "W=$w: $(grep -c ' PASSED' "$OUT/shared_w$w.log") passed, $(grep -c ' FAILED' "$OUT/shared_w$w.log") failed, $(grep -c ' SKIPPED' "$OUT/shared_w$w.log") skipped"; grep FAILED "$OUT/shared_w$w.log" | head -5; tail -1 "$OUT/shared_w$w.log"; done
[ -d /tmp/triton_dist_mps_pipe ] && CUDA_MPS_PIPE_DIRECTORY=/tmp/triton_dist_mps_pipe bash -c 'echo quit | nvidia-cuda-mps-control'
true
