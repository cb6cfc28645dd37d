#!/usr/bin/env bash
# run138 (1x H200, GPU image, 2026-12-04): README's GPU tier after the session's last code change (fp8_weight_cache,
# the block-scaled candidates of one warpgroup two programs per SM, programs_per_sm a config key).
export PYTHONUNBUFFERED=1
echo "commit $GIT_COMMIT" > "$OUT/node.log"
t0=$(date +%s)
timeout 540 python -m pytest -m gpu -n 8 -p no:cacheprovider -rs -q > "$OUT/gpu_tier.log" 2>&1
echo "== gpu_tier: exit $? in $(( $(date +%s) - t0 )) s"
grep -E "passed|failed|FAILED|ERROR" "$OUT/gpu_tier.log" | tail -12
true
