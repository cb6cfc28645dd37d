"""Multi-rank tests without a launcher.

A test calls ``ranks(world, fn, *args)``: ``fn(*args)`` runs on every rank and its per-rank results come back.
* ``python -m pytest`` (CPU or GPU machine): ranks are processes of pools started once per session. Tests run on
  CPU ranks (Triton interpreter, heap in /dev/shm), any ``world``; tests marked ``gpu`` (``gpu_only``) on GPU
  ranks, one per local GPU, or, where the machine has fewer GPUs than ``world``, several ranks per GPU (the
  ``shared-gpu`` backend, under MPS; skipped with no GPU). This process interprets kernels: a single-GPU test runs
  its body through ``ranks.on_one_gpu(fn, *args)``.
* ``TRITON_DIST_GPU_WORLD=W python -m pytest -m gpu``: the GPU tests that take ``ranks.gpu_world`` run at world W
  (on a 1-GPU machine: W ranks sharing it), the single-GPU ones (``on_one_gpu``) are skipped (the plain run has
  them).
* ``torchrun --nproc-per-node=N -m pytest ...`` (``scripts/gpu_suite.sh``): this process *is* a GPU rank; ``fn``
  runs here when ``world == N`` (results gathered from all ranks), the test is skipped otherwise, and CPU-only
  tests are skipped. ``ranks.gpu_world``: the world size GPU tests get (N here, the GPU count in pools).
"""

import os
import sys
import time

import pytest
import torch

ON_GPU_RANKS = torch.cuda.is_available() and "LOCAL_RANK" in os.environ
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
GPU_WORLD = int(os.environ["TRITON_DIST_GPU_WORLD"]) if os.environ.get("TRITON_DIST_GPU_WORLD") else None

if not ON_GPU_RANKS:  # this process runs the CPU tests' kernels (GPU tests go to GPU rank processes)
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TRITON_DIST_CHECK_CALLS", "1")  # every op call's signature compared across ranks
if os.environ.get("PYTEST_XDIST_WORKER"):  # parallel workers: their calls of ranks sharing a GPU run side by side,
    os.environ.setdefault("TRITON_DIST_SHARED_GPU_RANKS", "8")  # each rank on 1/8 of it (launch.shared_gpu_ranks)

gpu_only = pytest.mark.gpu  # the GPU tier: python -m pytest -m gpu (README)
cpu_only = pytest.mark.skipif(ON_GPU_RANKS, reason="exercises the CPU (interpreter) backend")
GPU_WAIT_TIMEOUT_S = 20
SHARED_GPU_WAIT_TIMEOUT_S = 180
SHARED_GPU_HEAPS = 8 << 30  # the symmetric heaps of a pool of ranks sharing one GPU, together


POOL_RANK_BYTES = 1 << 30  # what a GPU rank holds beside its heap (context, workspaces, a test's tensors)
GPU_MEMORY_WAIT_S = 90  # (well inside the tier's per-test timeout)


def _wait_for_gpu_memory(need, timeout_s=GPU_MEMORY_WAIT_S, poll_s=2.0):
    """Wait (at most ``timeout_s``) until every GPU has ``need`` bytes free (NVML: no CUDA context here), then
    return either way: the tier's parallel workers share the GPUs, and a pool started while another worker's
    test holds most of the memory fails its heap allocation (run160: 4 ranks of 2 GiB beside a 21 GiB test)."""
    try:
        import pynvml
        pynvml.nvmlInit()
    except Exception:  # no NVML (nvidia-ml-py): start at once
        return
    try:
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(GPUS)]
        deadline = time.monotonic() + timeout_s
        while min(pynvml.nvmlDeviceGetMemoryInfo(h).free for h in handles) < need and time.monotonic() < deadline:
            time.sleep(poll_s)
    finally:
        pynvml.nvmlShutdown()


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs GPUs (runs on GPU ranks: pools, or torchrun); the GPU tier")
    config.addinivalue_line("markers", "long: takes a minute or more; started first, so parallel workers end together")


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: item.get_closest_marker("long") is None)  # stable: otherwise in collection order
    if GPUS == 0:
        skip = pytest.mark.skip(reason="needs a GPU: run on a GPU machine (python -m pytest, or torchrun: "
                                       "scripts/gpu_suite.sh)")
        for item in items:
            if item.get_closest_marker("gpu"):
                item.add_marker(skip)


def pytest_runtest_logreport(report):
    """TRITON_DIST_EARLY_TRACEBACKS=1 (scripts/gpu_suite.sh): a failure's traceback as soon as it is reported, not
    at the session's end, so a run cut by its time limit still says why a test failed."""
    if report.failed and os.environ.get("TRITON_DIST_EARLY_TRACEBACKS") == "1" \
            and not os.environ.get("PYTEST_XDIST_WORKER"):  # once, from the controller
        sys.stderr.write(f"\n--- {report.nodeid} ({report.when}) failed:\n{report.longreprtext}\n")
        sys.stderr.flush()


@pytest.fixture(scope="session")
def _pools():
    pools = {}
    yield pools
    for pool in pools.values():
        pool.close()


@pytest.fixture
def ranks(_pools, request):
    on_gpu = request.node.get_closest_marker("gpu") is not None
    if ON_GPU_RANKS:  # initialised before the test body runs: a test may ask td.world_size() first
        import triton_dist as td

        if not td.shmem.is_initialized():
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
            td.init(backend=os.environ.get("TRITON_DIST_BACKEND", "auto"))
            td.shmem.set_wait_timeout(GPU_WAIT_TIMEOUT_S)

    def run(world, fn, *args, timeout=600, **kwargs):
        if ON_GPU_RANKS:
            import triton_dist as td

            if world != td.world_size():
                pytest.skip(f"needs {world} ranks, this run has {td.world_size()}")
            try:
                result = fn(*args, **kwargs)
                td.shmem.barrier()
                td.shmem.check_errors()
            except BaseException:
                td.shmem.reset()  # peers time out too; resynchronise signals so later tests start clean
                raise
            results = [None] * world
            torch.distributed.all_gather_object(results, result)
            return results
        return pool(on_gpu, world).run(fn, *args, timeout=timeout, **kwargs)

    def pool(gpu, world):
        """The session's pool of ``world`` GPU (or CPU) ranks, started on first use. GPU ranks share the GPUs
        where there are fewer than ``world``; a process keeps one such pool (MPS serves a limited number of
        processes, and test workers run side by side)."""
        shared = gpu and world > GPUS
        key = ("shared-gpu" if shared else "gpu" if gpu else "cpu", world)
        if key not in _pools:
            from triton_dist.launch import RankPool

            if shared:
                for other in [k for k in _pools if k[0] == "shared-gpu"]:
                    _pools.pop(other).close()
                backend = "shared-gpu"
            else:
                backend = os.environ.get("TRITON_DIST_BACKEND", "auto") if gpu else "cpu"
            # ranks sharing a GPU also share the host's cores: one may still be compiling a kernel while its
            # peers already wait on it, so their waits get longer
            timeout_s = None if not gpu else SHARED_GPU_WAIT_TIMEOUT_S if shared else GPU_WAIT_TIMEOUT_S
            from triton_dist.shmem.heap import DEFAULT_HEAP_BYTES

            # ranks sharing a GPU: their heaps together at most SHARED_GPU_HEAPS (8 ranks of 2 GiB beside the other
            # test workers' pools ran an 80 GB H100 out of memory, run155)
            heap = None
            if shared and not os.environ.get("TRITON_DIST_HEAP_SIZE"):
                heap = min(DEFAULT_HEAP_BYTES["gpu"], SHARED_GPU_HEAPS // world)
            if gpu:  # other workers' tests come and go on the same GPU: start once their memory leaves room
                per_rank = (heap or DEFAULT_HEAP_BYTES["gpu"]) + POOL_RANK_BYTES
                _wait_for_gpu_memory(per_rank * -(-world // max(GPUS, 1)))
            _pools[key] = RankPool(world, backend=backend, heap_size=heap, wait_timeout_s=timeout_s)
        return _pools[key]

    def on_one_gpu(fn, *args, timeout=600, **kwargs):
        """``fn(*args)`` on one GPU, alone: here under torchrun (each rank on its own), else on a GPU rank of a
        pool of one (this process interprets kernels). Its result."""
        if ON_GPU_RANKS:
            return fn(*args, **kwargs)
        if GPUS < 1:
            pytest.skip("needs a GPU")
        if GPU_WORLD is not None:
            pytest.skip(f"a single-GPU test (TRITON_DIST_GPU_WORLD={GPU_WORLD} runs the multi-rank ones)")
        return pool(True, 1).run(fn, *args, timeout=timeout, **kwargs)[0]

    run.gpu_world = int(os.environ.get("WORLD_SIZE", 1)) if ON_GPU_RANKS else GPU_WORLD or GPUS
    run.on_one_gpu = on_one_gpu
    return run


def collective_outcome(call):
    """``call()`` and then a barrier, on each rank of a misuse test: (the type name of what it raised, or None; the
    message; the seconds until then)."""
    import triton_dist as td

    t0 = time.monotonic()
    try:
        call()
        td.shmem.barrier()
        return None, "", time.monotonic() - t0
    except Exception as exc:  # noqa: BLE001 - what each rank raised is the result
        return type(exc).__name__, str(exc), time.monotonic() - t0


def error_names(calls):
    """Call each of ``calls``; what each raised: "TypeError" / "ValueError" (the clear errors every public op owes
    bad input), None when nothing was raised, "other:<type>:<message>" for anything else."""
    names = []
    for call in calls:
        try:
            call()
            names.append(None)
        except (TypeError, ValueError) as exc:
            names.append(type(exc).__name__)
        except Exception as exc:  # noqa: BLE001 - report what else came out
            names.append(f"other:{type(exc).__name__}:{exc}")
    return names
