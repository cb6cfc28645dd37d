# Sourced by a GPU run's steps.sh (benchmarks/results/<run>/steps.sh): the environment of every step and `step`,
# which runs one command under a time limit into $OUT/<name>.log and says how it ended; node.log names the tree.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/benchmarks
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # never multicast
step() { local name=$1 limit=$2; shift 2; local t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "== $name: exit $? in $(( $(date +%s) - t0 )) s"; }
echo "commit $GIT_COMMIT" > "$OUT/node.log"
nvidia-smi --query-gpu=name,memory.total,power.limit --format=csv,noheader >> "$OUT/node.log"; cat "$OUT/node.log"
mkdir -p /tmp/bench
