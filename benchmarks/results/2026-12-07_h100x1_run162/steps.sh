#!/usr/bin/env bash
# run162 (1 GPU; 2026-12-07). GIT_COMMIT=<sha> bash steps.sh STEP [STEP ...]  (steps: b g m n o s t v k r)
#   b  (~150 s) bench_gemm FP8 at issue 34's four shapes: with the tuner's 50 ms spans (6b8b818) and without the
#      sixth slot (3aab19d), do the picks match the probe's best (per-tensor/rowwise 256 s3, block K-major s5)?
#   g  (~120 s) bench_backward --only moe --fp8 row,block --fp8-grads: the MoE layer's FP8-grads step, never
#      timed (issue 35), against HF's block and our bf16 layer
#   m  (~200 s) split-K's GPU test, then bench_gemm --only small: b2e22b2 (split-K's last share adds its own
#      partial from registers) at 1024x1024x16384 / 256x1024x8192 (run156: 0.87x cuBLAS)
#   n  (~120 s) ncu with per-instruction stall sampling (SourceCounters, WarpStateStats) of the Gluon mainloop
#      per-tensor vs block K-major, 4096x6144x4096, 128 s5 (ncu_source.py); the SASS lines with the most samples
#   o  (~90 s) scale_order.py: the block-scaled K step with its scales read after the wgmmas ("late": the four
#      QGMMAs then issue back to back, as per-tensor's do; the shipped kernel puts the scales' FMULs between the
#      first and second) and "mid", against the shipped kernel, 128 s5 K-major, issue 34's four shapes, 5 rounds
#   s  (~120 s) ncu of bf16 GEMMs at small M (128x4096x8192, 512x4096x8192, 1024x1024x8192): the tuner's pick
#      and torch.matmul side by side (ncu_small.py): DRAM throughput, waves, stall reasons (run158: 0.73-0.82x)
#   t  (~150 s) the GPU tests of this session's change alone (what a short budget allows): the split tail's
#      (row-major block scales copied K-major among them) and test_fp8_gemm's tuner / every-candidate tests
#   v  (~400 s) the Gluon mainloop on bf16 / fp16 operands (new): its GPU tests, then bench_gemm --only small with
#      TRITON_DIST_GLUON_MAINLOOP=all (the tuner also times it; 'all knobs' lists each Gluon candidate) beside m's
#   k / r  the GPU tier in two calls (tests/kernels ~430 s; the rest ~270 s): every commit since run160's 18df711
source benchmarks/steps_lib.sh
HERE=benchmarks/results/2026-12-07_h100x1_run162
for s in "$@"; do
case "$s" in
b)
  BENCH_DIR=$OUT step bench_gemm_fp8 250 torchrun --nproc-per-node=1 benchmarks/bench_gemm.py --only fp8 \
    --fp8-shapes 8192x8192x8192,8192x28672x8192,4096x6144x4096,2048x8192x8192
  grep -E "^\||Error|error" "$OUT/bench_gemm_fp8.log" | cut -c1-400 | head -24 ;;
g)
  BENCH_DIR=$OUT step bench_backward_moe 250 torchrun --nproc-per-node=1 benchmarks/bench_backward.py --only moe \
    --fp8 row,block --fp8-grads
  grep -E "^\||Error|error" "$OUT/bench_backward_moe.log" | cut -c1-300 | head -20 ;;
m)
  step split_k_tests 120 python -m pytest -m gpu -p no:cacheprovider -v --timeout 100 -rf tests/kernels/test_gemm.py \
    -k "split_k or eager_plans"
  grep -E "FAILED|passed|failed" "$OUT/split_k_tests.log" | cut -c1-250 | tail -4
  BENCH_DIR=$OUT step bench_gemm_small 250 torchrun --nproc-per-node=1 benchmarks/bench_gemm.py --only small
  grep -E "^\|" "$OUT/bench_gemm_small.log" | cut -d'|' -f2-4,5,6,7,8,11,12,13 | head -13 ;;
n)
  for mode in tensor block; do
    NCU_MODES=$mode step ncu_$mode 150 ncu --clock-control none -k regex:gemm_fp8_sm90 --launch-skip 1 \
      --launch-count 1 --section WarpStateStats --section SourceCounters --section SchedulerStats \
      --import-source yes -o "$OUT/ncu_$mode" -f python $HERE/ncu_source.py
    ncu --import "$OUT/ncu_$mode.ncu-rep" --page source --csv --print-source sass > "$OUT/src_$mode.csv" 2>&1
    ncu --import "$OUT/ncu_$mode.ncu-rep" --page details > "$OUT/details_$mode.txt" 2>&1
    grep -E "Duration|Warp Cycles Per Issued|Issued Warp|No Eligible" "$OUT/details_$mode.txt" | head -6
  done
  python $HERE/ncu_source_summary.py "$OUT/src_tensor.csv" "$OUT/src_block.csv" 30 > "$OUT/ncu_summary.txt" 2>&1
  head -c 7000 "$OUT/ncu_summary.txt" ;;
o)
  step scale_order 200 torchrun --nproc-per-node=1 $HERE/scale_order.py
  grep -E "MEDIAN|Error" "$OUT/scale_order.log" | cut -c1-220 | tail -20 ;;
s)
  step ncu_small 200 ncu --clock-control none --profile-from-start off --section SpeedOfLight \
    --section MemoryWorkloadAnalysis --section LaunchStats --section Occupancy --section WarpStateStats \
    --section SchedulerStats -o "$OUT/ncu_small" -f python $HERE/ncu_small.py
  ncu --import "$OUT/ncu_small.ncu-rep" --page details > "$OUT/details_small.txt" 2>&1
  grep -E "rel err|Error" "$OUT/ncu_small.log" | head -6
  keys="^  [a-zA-Z_].*\(|Duration|DRAM Throughput|Memory Throughput|Waves Per SM|Achieved Occupancy"
  grep -E "$keys|Warp Cycles Per Issued|No Eligible|Registers Per|Grid Size" "$OUT/details_small.txt" | cut -c1-150 | head -70 ;;
t)
  step changed_tests 220 python -m pytest -m gpu -n 4 -p no:cacheprovider -v --timeout 200 -rf \
    tests/kernels/test_gemm_sm90.py tests/kernels/test_fp8_gemm.py -k "split_tail or candidate or tuner"
  grep -E "FAILED|passed|failed" "$OUT/changed_tests.log" | cut -c1-250 | tail -8 ;;
v)
  step gluon_16bit_tests 260 python -m pytest -m gpu -n 2 -p no:cacheprovider -v --timeout 240 -rf \
    tests/kernels/test_gemm_sm90.py -k 16bit
  grep -E "FAILED|passed|failed|Error" "$OUT/gluon_16bit_tests.log" | cut -c1-300 | tail -6
  mkdir -p "$OUT/gluon16"
  TRITON_DIST_GLUON_MAINLOOP=all BENCH_DIR=$OUT/gluon16 step bench_gemm_small_gluon16 300 torchrun \
    --nproc-per-node=1 benchmarks/bench_gemm.py --only small
  grep -E "^\|" "$OUT/bench_gemm_small_gluon16.log" | cut -d'|' -f2-4,5,6,7,8,11,12,13 | head -13 ;;
k)
  step gpu_tier_kernels 570 python -m pytest -m gpu -n 6 -p no:cacheprovider -v --timeout 200 -rf --durations=25 \
    tests/kernels
  grep -E "FAILED|passed|failed" "$OUT/gpu_tier_kernels.log" | cut -c1-250 | tail -14 ;;
r)
  step gpu_tier_rest 400 python -m pytest -m gpu -n 6 -p no:cacheprovider -v --timeout 200 -rf --durations=15 \
    tests --ignore=tests/kernels
  grep -E "FAILED|passed|failed" "$OUT/gpu_tier_rest.log" | cut -c1-250 | tail -14 ;;
esac
done
true
