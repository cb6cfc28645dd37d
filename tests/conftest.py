"""Multi-rank tests without a launcher.

A test calls ``ranks(world, fn, *args)``: ``fn(*args)`` runs on every rank and its per-rank results come back.
* CPU (plain ``pytest``): ranks are processes of a pool started once per session (Triton interpreter, heap in
  /dev/shm); ``world`` can be anything.
* GPU (``torchrun --nproc-per-node=N -m pytest ...``, see ``scripts/gpu_suite.sh``): this process *is* a rank;
  ``fn`` runs here when ``world == N`` (results gathered from all ranks) and the test is skipped otherwise.
"""

import os

import pytest
import torch

ON_GPU_RANKS = torch.cuda.is_available() and "LOCAL_RANK" in os.environ

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

gpu_only = pytest.mark.skipif(not ON_GPU_RANKS, reason="needs GPUs: run under torchrun (scripts/gpu_suite.sh)")
cpu_only = pytest.mark.skipif(ON_GPU_RANKS, reason="exercises the CPU (interpreter) backend")


@pytest.fixture(scope="session")
def _pools():
    pools = {}
    yield pools
    for pool in pools.values():
        pool.close()


@pytest.fixture
def ranks(_pools):
    if ON_GPU_RANKS:  # initialised before the test body runs: a test may ask td.world_size() first
        import triton_dist as td

        if not td.shmem.is_initialized():
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
            td.init(backend=os.environ.get("TRITON_DIST_BACKEND", "auto"))
            td.shmem.set_wait_timeout(20)

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
        from triton_dist.launch import RankPool

        if world not in _pools:
            _pools[world] = RankPool(world)
        return _pools[world].run(fn, *args, timeout=timeout, **kwargs)

    return run


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
