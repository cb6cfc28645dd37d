#!/usr/bin/env bash
# run108 (1x H200, GPU image; the session's last GPU seconds): after the split tiles' one-accumulator twins in the
# FP8 candidates: the FP8 GEMM's every-candidate GPU tests, then tuned_probe.py (autotuned promoted rowwise FP8 vs
# _scaled_mm) on the idle GPU. Logs under $OUT.
export PYTHONUNBUFFERED=1
D=$(dirname "$0")
step() { local name=$1 limit=$2; shift 2; local t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "== $name: exit $? in $(( $(date +%s) - t0 )) s"; }
echo "commit $GIT_COMMIT" > "$OUT/node.log"
python -c "import triton_dist" 2>/dev/null || step setup 60 python -m pip install --no-build-isolation --no-index -e ".[test]"
PYTHONPATH=$PWD step gpu_tests 75 python -m pytest -m gpu -n 2 -p no:cacheprovider -v -rs \
  tests/kernels/test_fp8_gemm.py -k every_candidate
tail -1 "$OUT/gpu_tests.log"
PYTHONPATH=$PWD step tuned_probe 100 python "$D/tuned_probe.py" "$OUT"
cut -c1-160 "$OUT/tuned_probe.log"
true
