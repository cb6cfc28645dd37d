"""Low-latency all-reduce for tensor-parallel decode, and the two fusions around it:

    all_reduce(x, out=None, algo="auto")                  sum of x over the group's ranks, in a fixed order
    all_reduce_rmsnorm(x, residual, weight, eps, out_fp8) all-reduce + residual add + RMSNorm (+ FP8) in one kernel
    gemm_ar(a, w)                                         all_reduce(a @ w.T): one persistent kernel (gemm_ar.py)

Data movement per call and rank, W ranks, N bytes of x (the kernel: ``kernels.py``):

    one-shot   x -> staging (local copy; none when x is already a symmetric tensor: zero-copy), then every rank
               reads the W-1 peers' copies over NVLink and sums all W in rank order 0..W-1: (W-1)·N read per rank
    two-shot   rank r sums its 1/W slice the same way and publishes it; every rank reads the W-1 reduced slices:
               2·(W-1)/W·N read per rank, one more signal round

Both need no ready handshake: the staging and reduced buffers are double-buffered by epoch parity, and a rank
finishes call n only after every peer has entered call n (it waits for a flag each peer raises in call n), so a
rank that writes half ``n % 2`` again in call n+2 knows every peer has finished call n, the last that read it.
A zero-copy one-shot call adds a closing signal round instead: the peers read x itself, which the caller may
overwrite as soon as the call returns. Flags carry the call's epoch (``dl.call_epoch``): no resets, no host sync,
CUDA-graph replays just work. ``algo="nccl"`` (and ``"auto"`` where NCCL is faster) runs ``dist.all_reduce``.
"""
from .gemm_ar import gemm_ar, gemm_ar_torch  # noqa: F401
from .ops import all_reduce, all_reduce_nccl, all_reduce_rmsnorm, all_reduce_rmsnorm_torch  # noqa: F401
