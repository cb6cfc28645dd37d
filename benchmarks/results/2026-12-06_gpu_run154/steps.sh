#!/usr/bin/env bash
# run154 (1 GPU; prepared 2026-12-06). GIT_COMMIT=<sha> bash steps.sh a|t1|t2
#   a  (~300 s) the GPU tests run153 b's tier left failed or unfinished (the weight-cache test after its fix, the
#      shared-GPU worlds' training tests at 3 workers), then bench_backward's MLP in block FP8 with fp8_grads and
#      KERNEL_PROFILE=1: where the FP8 backward's ~2.5 ms beyond its GEMMs go (run153: 0.97x HF with fp8_grads)
#   t1 (~550 s) the GPU tier's tests/kernels (197 tests)   t2 (~550 s) the rest of the tier (64: nn, examples, ...)
#      (the whole tier at 6 workers ran past 500 s on an H100 in run153: two calls)
source benchmarks/steps_lib.sh
T=tests/nn/test_training.py
case "${1:-a}" in
a)
  step rerun 220 python -m pytest -m gpu -n 3 -p no:cacheprovider -v --timeout 200 -rf \
    tests/nn/test_fp8_training.py::test_fp8_weight_cache_on_one_gpu "tests/language/test_primitives.py::test_gpu_primitives[8]" \
    "$T::test_mlp_layer_gradients_bf16_on_gpus[1-517-True]" "$T::test_mlp_layer_gradients_bf16_on_gpus[2-1024-False]" \
    "$T::test_mlp_layer_gradients_bf16_on_gpus[4-517-True]" "$T::test_mlp_layer_gradients_bf16_on_gpus[2-517-False]" \
    "$T::test_mlp_layer_gradients_bf16_on_gpus[4-1024-False]" "$T::test_moe_layer_gradients_bf16_on_gpus[4-333-False]" \
    "$T::test_moe_layer_gradients_bf16_on_gpus[4-333-True]"
  grep -E "PASSED|FAILED|passed|failed" "$OUT/rerun.log" | cut -c1-200 | tail -12
  KERNEL_PROFILE=1 BENCH_DIR=/tmp/bench step bench_backward 100 torchrun --nproc-per-node=1 \
    benchmarks/bench_backward.py --only mlp --fp8 block --fp8-grads
  grep -E "^\||WRONG" "$OUT/bench_backward.log" | head -12 ;;
t1)
  step gpu_tier_kernels 550 python -m pytest -m gpu -n 6 -p no:cacheprovider -v --timeout 200 -rf --durations=20 \
    tests/kernels
  grep -E "FAILED|passed|failed" "$OUT/gpu_tier_kernels.log" | cut -c1-250 | tail -12 ;;
t2)
  step gpu_tier_rest 550 python -m pytest -m gpu -n 4 -p no:cacheprovider -v --timeout 250 -rf --durations=20 \
    tests --ignore=tests/kernels
  grep -E "FAILED|passed|failed" "$OUT/gpu_tier_rest.log" | cut -c1-250 | tail -12 ;;
esac
cp /tmp/bench/*.json "$OUT/" 2>/dev/null
true
