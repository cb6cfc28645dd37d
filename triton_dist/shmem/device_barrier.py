"""A cross-rank barrier as a one-program kernel: stream ordered and CUDA-graph capturable."""

import triton

from .. import language as dl


@triton.jit
def barrier_all_kernel(ctx):
    dl.barrier_all(ctx)
