#!/usr/bin/env bash
# run92 (1x H200, GPU image): what this call ran, each step under its own time limit; logs under $OUT.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
P="python3 -m pytest -m gpu -p no:cacheprovider -v -rs --tb=short --durations=10"
step() { local name=$1 limit=$2; shift 2; local t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "== $name: exit $? in $(( $(date +%s) - t0 )) s"; }
# A: the backward tests at W = 1 (one rank, one GPU)
step A_backward_w1 150 $P -n 4 tests/kernels/test_autograd.py::test_op_gradients_bf16_on_gpus \
  tests/nn/test_training.py -k "bf16_on_gpus and [1-"
# B: the two W = 4 failures of run91's shared tier, with tracebacks
TRITON_DIST_GPU_WORLD=4 step B_w4_failures 70 $P -n 2 tests/kernels/test_allgather_gemm.py \
  -k "test_ag_gemm_gpu_silu_gate and config4 or test_ag_gemm_gpu_torch_compile"
# C: the W = 2 tests run91's shared tier did not reach (several ranks on the one GPU, under MPS)
TRITON_DIST_GPU_WORLD=2 step C_shared_w2 210 $P -n 4 tests/kernels/test_gemm_reducescatter.py tests/kernels/test_moe_ep.py \
  tests/kernels/test_groups.py tests/language tests/nn tests/kernels/test_autograd.py
# D: forward + backward against torch's, one rank
BENCH_DIR=$OUT step D_bench_backward 140 torchrun --nproc-per-node=1 --master-port=29519 benchmarks/bench_backward.py
[ -d /tmp/triton_dist_mps_pipe ] && CUDA_MPS_PIPE_DIRECTORY=/tmp/triton_dist_mps_pipe bash -c 'echo quit | nvidia-cuda-mps-control'
for f in "$OUT"/*.log; do echo "--- $f"; grep -E "passed|failed|FAILED|Error" "$f" | tail -8; done
