#!/usr/bin/env bash
# run154 (1 GPU; prepared 2026-12-06). GIT_COMMIT=<sha> bash steps.sh
#   (~300 s) the GPU tests run153 b's tier left failed or unfinished (the weight-cache test after its fix, the
#   shared-GPU worlds' training tests at 3 workers), then bench_backward's MLP in block FP8 with fp8_grads and
#   KERNEL_PROFILE=1: where the FP8 backward's ~2.5 ms beyond its GEMMs go (run153: 0.97x HF with fp8_grads)
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/benchmarks
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
step() { local name=$1 limit=$2; shift 2; local t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "== $name: exit $? in $(( $(date +%s) - t0 )) s"; }
echo "commit $GIT_COMMIT" > "$OUT/node.log"
nvidia-smi --query-gpu=name,memory.total,power.limit --format=csv,noheader >> "$OUT/node.log"; cat "$OUT/node.log"
T=tests/nn/test_training.py
step rerun 220 python -m pytest -m gpu -n 3 -p no:cacheprovider -v --timeout 200 -rf \
  tests/nn/test_fp8_training.py::test_fp8_weight_cache_on_one_gpu "tests/language/test_primitives.py::test_gpu_primitives[8]" \
  "$T::test_mlp_layer_gradients_bf16_on_gpus[1-517-True]" "$T::test_mlp_layer_gradients_bf16_on_gpus[2-1024-False]" \
  "$T::test_mlp_layer_gradients_bf16_on_gpus[4-517-True]" "$T::test_mlp_layer_gradients_bf16_on_gpus[2-517-False]" \
  "$T::test_mlp_layer_gradients_bf16_on_gpus[4-1024-False]" "$T::test_moe_layer_gradients_bf16_on_gpus[4-333-False]" \
  "$T::test_moe_layer_gradients_bf16_on_gpus[4-333-True]"
grep -E "PASSED|FAILED|passed|failed" "$OUT/rerun.log" | cut -c1-200 | tail -12
mkdir -p /tmp/bench
KERNEL_PROFILE=1 BENCH_DIR=/tmp/bench step bench_backward 100 torchrun --nproc-per-node=1 benchmarks/bench_backward.py \
  --only mlp --fp8 block --fp8-grads
grep -E "^\||WRONG" "$OUT/bench_backward.log" | head -12
cp /tmp/bench/*.json "$OUT/" 2>/dev/null
true
