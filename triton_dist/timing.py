"""Timing an op that talks to other ranks, the one safe way.

Every rank runs the same fixed number of iterations (never ``triton.testing.do_bench``: it picks counts per rank
and the collectives deadlock); each call is timed with CUDA events; a rank reports its median and the figure is
the max over ranks. Used by the examples and the benchmarks. Where ranks share a GPU (the ``shared-gpu``
backend) no figure means anything — they share its SMs and memory bandwidth — and the timers refuse.
"""

import math
import statistics
import time

import torch
import torch.distributed as dist


class SharedGpuTimingError(RuntimeError):
    """A timing asked for where several ranks share one GPU."""


def _ranks_share_a_gpu():
    from . import shmem

    return shmem.is_initialized() and shmem.backend() == "shared-gpu"


def timeable():
    """Whether speed figures mean something here: a GPU with one rank per GPU."""
    return torch.cuda.is_available() and not _ranks_share_a_gpu()


def check_timeable():
    if _ranks_share_a_gpu():
        raise SharedGpuTimingError("no speed figures where ranks share a GPU (backend 'shared-gpu'): they share its "
                                   "SMs and memory bandwidth; time on one rank per GPU")


def max_over_ranks(value, group=None):
    """The max of ``value`` over the ranks of ``group`` (every one of them must call)."""
    t = torch.tensor([value], dtype=torch.float64, device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def warm_up(fn, calls, span_us=0.0, group=None, collective=True):
    """``calls`` calls of ``fn``, then more until about ``span_us`` of them have run: a power-capped GPU that
    just ran something light (communication) has headroom for a while, and a short warm-up lets the next op
    borrow it. ``collective``: the extra count is the max over the ranks of ``group`` (collective ops stay in
    step); every rank of it must call."""
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    if span_us <= 0:
        return
    per_call = (time.perf_counter() - t0) * 1e6 / max(calls, 1)
    extra = math.ceil(max(span_us - per_call * calls, 0.0) / max(per_call, 1.0))
    if collective and dist.is_initialized():
        extra = max_over_ranks(extra, group)
    for _ in range(int(extra)):
        fn()
    torch.cuda.synchronize()


def median_us(fn, iters=20, warmup=5, warmup_us=0.0, group=None, collective=True):
    """This rank's median µs of ``fn()`` over ``iters`` calls, each timed with CUDA events, after ``warm_up``.
    ``collective``: the ranks of ``group`` start timing together (a barrier): every one of them must call."""
    check_timeable()
    warm_up(fn, warmup, warmup_us, group, collective)
    if collective and dist.is_initialized():
        dist.barrier(group=group)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) * 1000.0 for s, e in events)


def time_us(fn, iters=20, warmup=5, warmup_us=0.0):
    """Median µs of ``fn()`` over ``iters`` timed calls on this rank, max over ranks (GPU ranks), after
    ``warmup`` calls and more up to ``warmup_us`` of warm-up (``warm_up``)."""
    return max_over_ranks(median_us(fn, iters, warmup, warmup_us))


def graph_of(fn, calls=1):
    """A CUDA graph of ``calls`` back-to-back ``fn()``, captured after one eager call (which compiles, tunes and
    builds workspaces outside the capture). Replaying it times device work without host launch cost."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    torch.cuda.synchronize()
    return graph


def graph_us(fn, calls=1, **kwargs):
    """``time_us`` of replays of a CUDA graph of ``fn``: device time, no Python launch cost. With ``calls`` > 1
    the graph holds that many calls back to back and the figure is per call: the graph's own launch latency
    (several µs, the same for any graph) is then spread out, as inside a model's graph."""
    return time_us(graph_of(fn, calls).replay, **kwargs) / calls


def time_us_or_nan(fn, what, **kwargs):
    """``time_us``, or NaN (reported by rank 0) when ``fn`` fails, so one failing variant keeps a sweep going."""
    return _or_nan(time_us, fn, what, **kwargs)


def graph_us_or_nan(fn, what, **kwargs):
    """``graph_us``, or NaN (reported by rank 0) when capturing or replaying ``fn`` fails."""
    return _or_nan(graph_us, fn, what, **kwargs)


def _or_nan(timer, fn, what, **kwargs):
    try:
        return timer(fn, **kwargs)
    except SharedGpuTimingError:
        raise
    except Exception as exc:
        if dist.get_rank() == 0:
            print(f"{what} failed: {type(exc).__name__}: {exc}", flush=True)
        return float("nan")
