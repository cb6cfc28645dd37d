"""The kernel zoo: each op lives in its own file (kernels -> launcher -> torch op). Importing this package
registers every ``torch.ops.triton_dist.*`` op. ``triton_dist.kernels.gemm`` is the op (the GEMM core's other
names: ``from triton_dist.kernels.gemm import gemm_config, ...``)."""

from .allgather import all_gather  # noqa: F401
from .allgather_gemm import ag_gemm, scaled_ag_gemm  # noqa: F401
from .allreduce import all_reduce, all_reduce_rmsnorm, gemm_ar  # noqa: F401
from .fp8 import quantize_fp8  # noqa: F401
from .gemm import gemm, scaled_gemm  # noqa: F401,E402  (the op, in place of its module's name)
from .flash_decode import local_flash_decode, sp_flash_decode  # noqa: F401
from .gemm_reducescatter import gemm_rs, scaled_gemm_rs  # noqa: F401
from .grouped_gemm import grouped_gemm  # noqa: F401
from .moe_ep import ep_combine, ep_dispatch  # noqa: F401
from .pingpong import ping_pong  # noqa: F401
from .silu_gate import silu_gate  # noqa: F401
from . import autograd  # noqa: F401,E402  (the ops' backward formulas, registered on torch.ops.triton_dist)
from .async_tp import fused_all_gather_matmul, fused_matmul_reduce_scatter, use_for_torch_async_tp  # noqa: F401

__all__ = ["ag_gemm", "all_gather", "all_reduce", "all_reduce_rmsnorm", "ep_combine", "ep_dispatch",
           "fused_all_gather_matmul", "fused_matmul_reduce_scatter", "gemm", "gemm_ar", "gemm_rs", "grouped_gemm",
           "local_flash_decode", "ping_pong", "quantize_fp8", "scaled_ag_gemm", "scaled_gemm", "scaled_gemm_rs",
           "silu_gate", "sp_flash_decode", "use_for_torch_async_tp"]
