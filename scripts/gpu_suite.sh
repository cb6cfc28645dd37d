#!/usr/bin/env bash
# The whole GPU suite in one call: the GPU tier and the rest of the tests, then every benchmark.
# Writes $OUT/suite.log, $OUT/results.json (every benchmark) and $OUT/table.md (short tables).
#   usage: OUT=/some/dir GIT_COMMIT=$(git rev-parse --short HEAD) bash scripts/gpu_suite.sh [test paths / pytest args]
# (GIT_COMMIT expanded in YOUR checkout: a copy of the tree on a lent machine may carry a stale .git; run62
# recorded the session's first commit that way.)
# Tests: the GPU tier (`python -m pytest -m gpu`, in SUITE_WORKERS xdist workers), then the rest of README's test
# command (`-m "not gpu"`, SUITE_CPU_WORKERS workers; SUITE_REST=0 skips it); on several GPUs also as torchrun ranks.
# Set SUITE_SKIP_TESTS=1 or SUITE_SKIP_BENCH=1 to run half of it; SUITE_BENCH="allgather gemm_rs:120 ..." to pick
# benchmarks (with an optional time limit each; SUITE_STEP_TIMEOUT is the default limit of every step).
# Tests print their names (-v): a run cut by a time limit still shows which test was running.
# Durations: benchmarks/results/ (each run's suite.log has every step's time).
set -u -o pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1   # never NVLink multicast
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_DIST_EARLY_TRACEBACKS=1  # a failure's traceback when it happens (tests/conftest.py)
OUT=${OUT:-benchmarks/results/latest}
mkdir -p "$OUT"
export BENCH_DIR=$(mktemp -d)
NGPU=${NGPU:-$(python3 -c 'import torch; print(torch.cuda.device_count())')}
LOG="$OUT/suite.log"
status=0
{
  echo "== node"; nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv; nvidia-smi topo -m
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
} >"$LOG" 2>&1
run() {  # run "label" cmd...: log it, keep going, remember failures
  local label=$1; shift
  echo "== $label: $*" | tee -a "$LOG"
  local t0=$(date +%s)
  timeout "${SUITE_STEP_TIMEOUT:-900}" "$@" >>"$LOG" 2>&1
  local rc=$?
  echo "== $label: exit $rc in $(( $(date +%s) - t0 )) s" | tee -a "$LOG"
  [ $rc -eq 0 ] || status=1
}
TR="torchrun --nproc-per-node=$NGPU --master-port=29517"
if [ "${SUITE_SKIP_TESTS:-0}" != 1 ]; then
  # The GPU tier (README): every GPU test and every example on the local GPUs, in xdist workers that share them
  # (their compiles run in parallel); its own autotune cache, so the benchmarks tune on an idle GPU.
  if [ "${SUITE_GPU_TIER:-1}" = 1 ]; then  # SUITE_GPU_TIER=0: only the shared-GPU worlds below
    TRITON_DIST_CACHE_DIR=$(mktemp -d) run "tests[gpu tier]" python3 -m pytest -m gpu -n "${SUITE_WORKERS:-12}" \
      --dist load -p no:cacheprovider -v -rs --durations=25 "${@:-tests}"
  fi
  # Several ranks on each GPU (the shared-gpu backend, under MPS): the multi-rank GPU tests at the worlds of
  # SUITE_SHARED_WORLDS (default on one GPU: 2 and 4; "" skips), side by side (their calls take rank shares of the
  # GPU: launch.shared_gpu_ranks), each world's log in $OUT/shared_w<W>.log, appended to the suite's log after
  pids=()
  for w in ${SUITE_SHARED_WORLDS-$([ "$NGPU" -eq 1 ] && echo 2 4)}; do
    ( LOG="$OUT/shared_w$w.log"; : >"$LOG"; status=0
      TRITON_DIST_GPU_WORLD=$w TRITON_DIST_CACHE_DIR=$(mktemp -d) run "tests[gpu tier] W=$w" python3 -m pytest -m gpu \
        -n "${SUITE_SHARED_WORKERS:-3}" --dist load -p no:cacheprovider -v -rs --durations=15 "${@:-tests}"
      exit $status ) &
    pids+=("$!:$w")
  done
  for p in "${pids[@]}"; do
    wait "${p%%:*}" || status=1
    cat "$OUT/shared_w${p#*:}.log" >>"$LOG"
  done
  if [ "${SUITE_REST:-1}" = 1 ]; then  # the rest of README's test command: CPU ranks, sm_90 compiles
    run "tests[not gpu]" python3 -m pytest -m "not gpu" -n "${SUITE_CPU_WORKERS:-8}" --dist loadfile \
      -p no:cacheprovider -rs --durations=15 "${@:-tests}"
  fi
  if [ "$NGPU" -gt 1 ]; then  # the GPU tests as torchrun ranks, on each GPU backend
    for be in ${SUITE_BACKENDS:-cuda nvshmem}; do
      TRITON_DIST_BACKEND=$be run "tests[$be] x$NGPU" $TR -m pytest -v -p no:cacheprovider -rs --durations=15 \
        "${@:-tests}"
    done
  fi
fi
if [ "${SUITE_SKIP_BENCH:-0}" != 1 ]; then
  for b in ${SUITE_BENCH:-$(ls benchmarks/bench_*.py | sed 's#benchmarks/bench_##; s#\.py##')}; do
    name=${b%%:*}  # "name" or "name:seconds" (a per-benchmark time limit)
    if [ ! -f "benchmarks/bench_$name.py" ]; then
      echo "== bench $name: no benchmarks/bench_$name.py" | tee -a "$LOG"; status=1; continue
    fi
    if [ "$name" != "$b" ]; then
      SUITE_STEP_TIMEOUT=${b#*:} run "bench $name x$NGPU" $TR "benchmarks/bench_$name.py"
    else
      run "bench $name x$NGPU" $TR "benchmarks/bench_$name.py"
    fi
  done
fi
MPS_PIPE=${TMPDIR:-/tmp}/triton_dist_mps_pipe
if [ -d "$MPS_PIPE" ]; then  # the MPS daemon the shared-gpu pools started (launch.start_mps): stop it
  CUDA_MPS_PIPE_DIRECTORY=$MPS_PIPE bash -c 'echo quit | nvidia-cuda-mps-control' >/dev/null 2>&1 || true
fi
python3 - "$BENCH_DIR" "$OUT" <<'PY'
import glob, json, os, sys
sys.path.insert(0, "benchmarks")
from harness import format_table
docs = [json.load(open(p)) for p in sorted(glob.glob(os.path.join(sys.argv[1], "*.json")))]
json.dump(docs, open(os.path.join(sys.argv[2], "results.json"), "w"), indent=1)
open(os.path.join(sys.argv[2], "table.md"), "w").write("\n\n".join(format_table(d) for d in docs) + "\n")
PY
grep -E "^== |passed|failed|FAILED|error" "$LOG" | tail -40
cat "$OUT/table.md"
exit $status
