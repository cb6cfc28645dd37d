#!/usr/bin/env bash
# run147 (1 GPU, GPU image), 2026-12-06: the Gluon FP8 mainloop once ptxas keeps its wgmmas asynchronous.
#   GIT_COMMIT=<sha> bash steps.sh   (~500 s) its GPU tests, the probe (against fp64, _scaled_mm and the Triton
#       core), then the rest of the GPU tests run146 could not finish in its 180 s (run144's failures).
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/benchmarks
here=benchmarks/results/2026-12-06_h100x1_run147
step() { local name=$1 limit=$2; shift 2; local t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "== $name: exit $? in $(( $(date +%s) - t0 )) s"; }
echo "commit $GIT_COMMIT" > "$OUT/node.log"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >> "$OUT/node.log"
mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
workers=$(( mem > 100000 ? 12 : 6 ))
step gluon_tests 90 python -m pytest -m gpu -n 4 -p no:cacheprovider -q -rs tests/kernels/test_gemm_sm90.py
grep -E "passed|failed|FAILED|Error" "$OUT/gluon_tests.log" | cut -c1-300 | tail -12
step mainloop_probe 170 python $here/mainloop_probe.py "$OUT"
grep -vE "^triton_dist autotune|^  \[" "$OUT/mainloop_probe.log" | cut -c1-250 | head -40
step gpu_failed 200 python -m pytest -m gpu -n $workers -p no:cacheprovider -q -rs --durations=20 -k "fp8_grads_moe_layer or grouped_gemm_gpu or mlp_layer_gradients or moe_layer_gradients or gpu_primitives or fp8_layers_bf16 or every_op_at_world_size or tp_groups_beside or eager_dispatch_replays or gemm_rs_graph_path or gemm_rs_cuda_graph or scaled_gemm_gpu or fp8_ag_gemm_gpu or fp8_gemm_rs_gpu or gemm_gpu_every_candidate or example_runs or wait_times_out"
grep -E "passed|failed|FAILED|Error" "$OUT/gpu_failed.log" | cut -c1-200 | tail -20
true
