#!/usr/bin/env bash
# run151 (1 GPU): block scales a step ahead in the Gluon mainloop: its block-mode GPU tests, then block_check.py.
#   GIT_COMMIT=<sha> bash steps.sh   (~150 s)
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/benchmarks
here=benchmarks/results/2026-12-06_h100x1_run151
echo "commit $GIT_COMMIT" > "$OUT/node.log"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader >> "$OUT/node.log"; cat "$OUT/node.log"
timeout 75 python -m pytest -m gpu -n 6 -p no:cacheprovider -q tests/kernels/test_gemm_sm90.py -k block > "$OUT/tests.log" 2>&1
echo "== tests: exit $?"; tail -3 "$OUT/tests.log" | cut -c1-300
timeout 70 python $here/block_check.py > "$OUT/block_check.log" 2>&1; echo "== block_check: exit $?"
cat "$OUT/block_check.log" | cut -c1-400
true
