#!/usr/bin/env bash
# run152 (1 GPU; prepared 2026-12-06, not run), two calls:
#   GIT_COMMIT=<sha> bash steps.sh a   (~530 s) power_check.py, ncu of the Gluon kernel per-tensor vs blockwise, the
#       GPU tests of the CPU-only changes since run150, bench_host
#   GIT_COMMIT=<sha> bash steps.sh b   (~420 s) bench_gemm's bf16 table (issue 34's mid shapes among them),
#       bench_backward
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/benchmarks
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
here=benchmarks/results/2026-12-06_gpu_run152
step() { local name=$1 limit=$2; shift 2; local t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "== $name: exit $? in $(( $(date +%s) - t0 )) s"; }
echo "commit $GIT_COMMIT" > "$OUT/node.log"
nvidia-smi --query-gpu=name,memory.total,power.limit --format=csv,noheader >> "$OUT/node.log"; cat "$OUT/node.log"
mkdir -p /tmp/bench
if [ "${1:-a}" = a ]; then
# the CPU-only changes since run150: gemm_rs's operands through describe_operands (792f6d2) and grouped_gemm's
# "kn" layout through the core's B_KN (its PTX differs from run150's only in the order of the A / W TMA copies):
# their GPU tests, W = 1 and shared-GPU W = 2 / 4; the Gluon mainloop's new GPU cases (e5m2, M = 3)
step changed_tests 220 python -m pytest -m gpu -n 6 -p no:cacheprovider -q tests/kernels/test_gemm_sm90.py tests/kernels/test_gemm_reducescatter.py tests/kernels/test_fp8_gemm_rs.py tests/kernels/test_grouped_gemm.py tests/kernels/test_fp8_grouped_gemm.py tests/nn/test_training.py tests/kernels/test_launcher.py
# b3bc37f: the eager gemm plans launch with described operands (Launcher(described=))
step eager_tests 120 python -m pytest -m gpu -n 4 -p no:cacheprovider -q tests/kernels/test_gemm.py -k "eager or split_k"
grep -E "passed|failed|FAILED|Error" "$OUT/eager_tests.log" | cut -c1-300 | tail -8
grep -E "passed|failed|FAILED|Error" "$OUT/changed_tests.log" | cut -c1-300 | tail -8
HOST_PROFILE=1 BENCH_DIR=/tmp/bench step bench_host 60 torchrun --nproc-per-node=1 benchmarks/bench_host.py
grep -E "NOT MET|ok$" "$OUT/bench_host.log" | head -16
step power_check 90 python $here/power_check.py
cut -c1-200 "$OUT/power_check.log" | grep -v "^triton_dist autotune\|^  \[" | tail -14
# where blockwise's cycles go (the launches: tensor #2, block #1, block #2 after skipping tensor #1)
step ncu_block 120 ncu --clock-control none -k regex:gemm_fp8_sm90 --launch-skip 1 --launch-count 3 \
  --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \
  python $here/ncu_block.py
grep -E "Duration|SM Frequency|Issue Slots Busy|Warp Cycles Per Issued|Stall|L1/TEX Hit|L2 Hit|Memory Throughput" "$OUT/ncu_block.log" | head -40
else
BENCH_DIR=/tmp/bench step bench_gemm_bf16 300 torchrun --nproc-per-node=1 benchmarks/bench_gemm.py --only bf16
grep -E "^\|" "$OUT/bench_gemm_bf16.log" | cut -d'|' -f1-8 | head -14
BENCH_DIR=/tmp/bench step bench_backward 120 torchrun --nproc-per-node=1 benchmarks/bench_backward.py --only mlp --fp8 row,block --fp8-grads
grep -E "^\||WRONG" "$OUT/bench_backward.log" | head -16
fi
cp /tmp/bench/*.json "$OUT/" 2>/dev/null
true
