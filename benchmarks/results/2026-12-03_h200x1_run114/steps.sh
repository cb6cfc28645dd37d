#!/usr/bin/env bash
# run114 (1x H200, GPU image): after the silu_gate op (Triton forward / backward kernels, differentiable; the
# training path of ag_gemm's SiLU gate). gpu_tests: silu_gate, the MLP / op gradients on the GPU; bench_backward
# mlp at W = 1 (run112: fwd+bwd 0.86x of HF; run113's profile: 5 ms of strided elementwise kernels in 5 steps).
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
step() { local name=$1 limit=$2; shift 2; local t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "== $name: exit $? in $(( $(date +%s) - t0 )) s"; }
echo "commit $GIT_COMMIT" > "$OUT/node.log"
step gpu_tests 110 python -m pytest -m gpu -n 8 -p no:cacheprovider -rs -q tests/kernels/test_silu_gate.py \
  tests/kernels/test_autograd.py tests/nn/test_training.py -k "silu or mlp or op_gradients"
grep -E "passed|failed|Error|FAILED" "$OUT/gpu_tests.log" | tail -6
mkdir -p /tmp/bench
BENCH_DIR=/tmp/bench step bench_backward 60 torchrun --nproc-per-node=1 benchmarks/bench_backward.py --only mlp
grep -E "^\|" "$OUT/bench_backward.log" | head -8
true
