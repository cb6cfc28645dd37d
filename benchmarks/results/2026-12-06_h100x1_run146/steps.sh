#!/usr/bin/env bash
# run146 (1 GPU, GPU image): prepared 2026-12-06, not run that session (no machine could be started).
#   GIT_COMMIT=<sha> bash steps.sh proof   (~480 s) the Gluon FP8 mainloop's GPU tests and probe (promotion adds
#       overlapping the next wgmmas, against _scaled_mm and the Triton core), gemm_rs's transposed-weight GPU test,
#       then the GPU tests that failed in run144 (memory: 12 workers on an H100) again at 6 workers per 80 GB (12
#       on an H200).
#   GIT_COMMIT=<sha> bash steps.sh bench   (~420 s) bench_gemm's FP8 rows with the Gluon mainloop offered (each row
#       names the configuration that ran), bench_host with HOST_PROFILE=1 (sp_flash_decode's host cost), the MLP
#       training step with FP8 grads.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/benchmarks TRITON_DIST_GLUON_MAINLOOP=1  # the tuner offers it
step() { local name=$1 limit=$2; shift 2; local t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "== $name: exit $? in $(( $(date +%s) - t0 )) s"; }
echo "commit $GIT_COMMIT" > "$OUT/node.log"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >> "$OUT/node.log"
mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
workers=$(( mem > 100000 ? 12 : 6 ))
echo "workers $workers" >> "$OUT/node.log"
mkdir -p /tmp/bench
if [ "${1:-proof}" = proof ]; then
  step gluon_tests 80 python -m pytest -m gpu -n 4 -p no:cacheprovider -q -rs tests/kernels/test_gemm_sm90.py
  grep -E "passed|failed|FAILED|Error" "$OUT/gluon_tests.log" | cut -c1-300 | tail -12
  step kn_tests 60 python -m pytest -m gpu -n 2 -p no:cacheprovider -q -rs tests/kernels/test_gemm_reducescatter.py \
    -k weight_as_it_lies  # gemm_rs reading w.T as it lies (448f2b3)
  grep -E "passed|failed|FAILED|Error" "$OUT/kn_tests.log" | cut -c1-300 | tail -6
  step gluon_probe 150 python benchmarks/results/2026-12-06_h100x1_run146/gluon_probe.py "$OUT"
  grep -vE "^triton_dist autotune|^  \[" "$OUT/gluon_probe.log" | cut -c1-220 | head -40
  step gpu_failed 180 python -m pytest -m gpu -n $workers -p no:cacheprovider -q -rs --durations=20 -k "fp8_grads_moe_layer or grouped_gemm_gpu or mlp_layer_gradients or moe_layer_gradients or gpu_primitives or fp8_layers_bf16 or every_op_at_world_size or tp_groups_beside or eager_dispatch_replays or gemm_rs_graph_path or gemm_rs_cuda_graph or scaled_gemm_gpu or fp8_ag_gemm_gpu or fp8_gemm_rs_gpu or gemm_gpu_every_candidate or example_runs or wait_times_out"
  grep -E "passed|failed|FAILED|Error" "$OUT/gpu_failed.log" | cut -c1-200 | tail -20
else
  BENCH_DIR=/tmp/bench step bench_gemm_fp8 200 torchrun --nproc-per-node=1 benchmarks/bench_gemm.py --only fp8
  grep -E "^\|" "$OUT/bench_gemm_fp8.log" | head -12
  HOST_PROFILE=1 BENCH_DIR=/tmp/bench step bench_host 70 torchrun --nproc-per-node=1 benchmarks/bench_host.py
  grep -E "NOT MET|sp_flash" "$OUT/bench_host.log" | head -8
  BENCH_DIR=/tmp/bench step bench_backward 130 torchrun --nproc-per-node=1 benchmarks/bench_backward.py --only mlp --fp8 row,block --fp8-grads
  grep -E "^\||WRONG" "$OUT/bench_backward.log" | head -16
fi
cp /tmp/bench/*.json "$OUT/" 2>/dev/null
true
