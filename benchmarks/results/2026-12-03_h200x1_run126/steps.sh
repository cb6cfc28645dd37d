#!/usr/bin/env bash
# run126 (1x H200, GPU image; planned for the next session): split_m_probe.py, a promoted FP8 tile as two
# accumulators split along M (256x128 as two 128-row halves) next to split along N and single accumulators, vs
# torch._scaled_mm. On sm_90a (triton 3.6, `python split_m_probe.py --registers`, no GPU needed): 128x256 one
# accumulator 255 registers, 124 B spilled; 128x256 split-n 208, 0; 256x128 one 254, 0; 256x128 split-m 208, 0
# (s3 and s4); 128x128 142, 0. Splits keep two wgmma groups in flight (wait_group 2), single accumulators one.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/benchmarks
step() { local name=$1 limit=$2; shift 2; local t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "== $name: exit $? in $(( $(date +%s) - t0 )) s"; }
echo "commit $GIT_COMMIT" > "$OUT/node.log"
step split_m_probe 240 python benchmarks/results/2026-12-03_h200x1_run126/split_m_probe.py "$OUT"
cat "$OUT/split_m_probe.log" | tail -30
true
