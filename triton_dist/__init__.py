"""triton_dist: compute-communication overlapping kernels in stock Triton.

    import triton_dist as td
    td.init()                                   # from torchrun's environment (or a group you pass)
    x = td.shmem.empty((m, k), torch.bfloat16)  # symmetric tensor
    import triton_dist.language as dl           # tile primitives for your own @triton.jit kernels
"""

import os

import torch

# With no GPU, kernels run under the Triton interpreter; it must be chosen before any @triton.jit is applied.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from .interpreter import patch_language_once, repair_bf16_dot, repair_index  # noqa: E402

repair_index()  # triton <= 3.6 with numpy >= 2.4 (the GPU image's CPU-rank tests)
repair_bf16_dot()  # the interpreter's tl.dot on bf16 bit patterns
patch_language_once()  # CPU ranks: triton.language patched once per launch, not at every device-function call

from . import language, shmem  # noqa: E402,F401
from .shmem import finalize, init, rank, release_workspaces, world_size  # noqa: E402,F401

__version__ = "0.1.0"
