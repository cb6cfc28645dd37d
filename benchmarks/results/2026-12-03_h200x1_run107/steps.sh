#!/usr/bin/env bash
# run107 (1x H200, GPU image): after SPLIT_N (promoted FP8 128x256 tiles as two accumulators) and the Launcher's
# named runtime arguments (FP8 gemm launches bound): the GPU tests of the changed code (`-m gpu -n 8`: the GEMM core,
# FP8 gemm / ag_gemm / gemm_rs, the launcher, the layers incl. FP8), then on the idle GPU core_probe.py (SPLIT_N
# on / off vs _scaled_mm, device time) and run102's host probe (per-call host time of eager gemm). Logs under $OUT.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
D=$(dirname "$0")
step() { local name=$1 limit=$2; shift 2; local t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "== $name: exit $? in $(( $(date +%s) - t0 )) s"; }
echo "commit $GIT_COMMIT" > "$OUT/node.log"
python -c "import triton_dist" 2>/dev/null || step setup 60 python -m pip install --no-build-isolation --no-index -e ".[test]"
TRITON_DIST_CACHE_DIR=$(mktemp -d) PYTHONPATH=$PWD step gpu_tests 260 python -m pytest -m gpu -n 8 -p no:cacheprovider \
  -v -rs --durations=10 tests/kernels/test_gemm.py tests/kernels/test_fp8_gemm.py tests/kernels/test_fp8_ag_gemm.py \
  tests/kernels/test_fp8_gemm_rs.py tests/kernels/test_launcher.py tests/nn/test_layers.py tests/nn/test_fp8_training.py
tail -1 "$OUT/gpu_tests.log"; grep -E "FAILED|Error" "$OUT/gpu_tests.log" | head -5
PYTHONPATH=$PWD step core_probe 100 python "$D/core_probe.py" "$OUT"
cut -c1-140 "$OUT/core_probe.log"
PYTHONPATH=$PWD step host_probe 60 python "$D/../2026-12-03_h200x1_run102/host_probe.py" "$OUT"
grep "per call" "$OUT/host_probe.log"
true
