"""PyTorch async-TP's fused ops, with its schemas and semantics, on the zoo's overlapped kernels: what torchtitan's
tensor parallelism (torch.compile's micro-pipeline TP) calls, forward and backward.

    fused_all_gather_matmul(A_shard, Bs, gather_dim, group_name, *, return_A=True) -> (A?, [A @ B for B in Bs])
        A = all_gather(A_shard) along gather_dim (any batch dims; gather_dim the last: K is gathered)
    fused_matmul_reduce_scatter(A, B, reduce_op, scatter_dim, group_name) -> reduce_scatter(A @ B, scatter_dim)
        reduce_op "sum" or "avg"; scatter_dim any dim of the result (its size divisible by the ranks)

How they map onto the zoo: the gathered (scattered) dim moves to the front and every other leading dim folds into
rows, so that one rank's block of rows is one rank's slice; the Bs ([K, N] each, views of weights [N, K] as torch
passes them) are stacked into one weight, so that ONE ag_gemm serves them all. Gathering K (the last dim) needs
the all-gather and a local product. Scattering N: the transposed product, ``B.T @ A.T``, is reduce-scattered by
rows. The results come out in the layouts (strides) of
torch's fallbacks. Both are CompositeImplicitAutograd: the backward is the ops' own (``kernels/autograd.py``), and
torch.compile traces them down to ``triton_dist::ag_gemm`` / ``gemm_rs``. ``use_for_torch_async_tp()`` makes
``torch.ops.symm_mem.fused_all_gather_matmul`` / ``fused_matmul_reduce_scatter`` (what the micro-pipeline TP pass
emits) run these.
"""

import torch

from .. import shmem
from . import library
from . import autograd  # noqa: F401  (the backward of the ops these decompose into)


def _rows_first(t, dim):
    """``t`` with ``dim`` moved to the front and every other leading dim folded into rows: [t.shape[dim] * rest,
    K] (a copy only when that layout is not already there)."""
    moved = t.movedim(dim, 0)
    return moved.reshape(-1, t.shape[-1]).contiguous(), moved.shape


def _check(A, Bs, dim, what, k_factor=1):
    """``dim`` as a non-negative index, or ValueError; ``k_factor``: B's rows per column of A (the ranks when A's
    K is gathered)."""
    if not isinstance(A, torch.Tensor) or A.dim() < 2:
        raise ValueError(f"{what}: A must be a tensor of at least 2 dims, got "
                         f"{list(A.shape) if isinstance(A, torch.Tensor) else type(A).__name__}")
    if not -A.dim() <= dim < A.dim():
        raise ValueError(f"{what}: dim {dim} is not a dim of A {list(A.shape)}")
    dim %= A.dim()
    k = A.shape[-1] * (k_factor if dim == A.dim() - 1 else 1)
    for B in Bs:
        if not isinstance(B, torch.Tensor) or B.dim() != 2 or B.shape[0] != k or B.dtype != A.dtype:
            raise ValueError(f"{what}: every B must be a [K={k}, N] {A.dtype} matrix, got "
                             f"{list(B.shape) if isinstance(B, torch.Tensor) else type(B).__name__}")
    return dim


# ----------------------------------------------------------------------------------------------- all-gather + matmul
def fused_all_gather_matmul(A_shard, Bs, gather_dim, group_name=None, return_A=True):
    """``all_gather(A_shard, gather_dim)`` and its product with each of ``Bs`` (async-TP's op; see the module
    docstring). ``group_name``: the c10d name of the group (None: the heap's)."""
    world = shmem.world_size(shmem.group_named(group_name))
    dim = _check(A_shard, Bs, gather_dim, "fused_all_gather_matmul", k_factor=world)
    if not Bs:
        raise ValueError("fused_all_gather_matmul: Bs is empty")
    ops = torch.ops.triton_dist
    widths = [B.shape[1] for B in Bs]
    w = torch.cat([B.t() for B in Bs]) if len(Bs) > 1 else Bs[0].t()  # [sum N, K]: one ag_gemm for every B
    if dim == A_shard.dim() - 1:  # K gathered: the gathered rows, then this rank's product
        k = A_shard.shape[-1]
        flat = A_shard.reshape(-1, k).contiguous()
        parts = ops.all_gather(flat, group_name).view(world, *flat.shape)
        gathered = parts.permute(1, 0, 2).reshape(*A_shard.shape[:-1], world * k)
        out = gathered @ w.t()
        return (gathered if return_A else None), [o.contiguous() for o in out.split(widths, dim=-1)]
    rows, moved = _rows_first(A_shard, dim)  # [g * rest, K]
    out, gathered = ops.ag_gemm(rows, w.contiguous(), return_A, "none", group_name)
    shape = (world * moved[0], *moved[1:-1])
    outs = [o.contiguous().view(*shape, o.shape[-1]).movedim(0, dim) for o in out.split(widths, dim=-1)]
    return (gathered.view(*shape, A_shard.shape[-1]).movedim(0, dim) if return_A else None), outs


# ----------------------------------------------------------------------------------------------- matmul + reduce-scatter
def fused_matmul_reduce_scatter(A, B, reduce_op, scatter_dim, group_name=None):
    """``reduce_scatter(A @ B, reduce_op, scatter_dim)`` (async-TP's op; see the module docstring): rank r gets the
    r-th of W equal slices of ``scatter_dim`` of the sum (``"avg"``: the mean) over the ranks of ``A @ B``."""
    dim = _check(A, [B], scatter_dim, "fused_matmul_reduce_scatter")
    if reduce_op not in ("sum", "avg"):
        raise ValueError(f"fused_matmul_reduce_scatter: reduce_op must be 'sum' or 'avg', got {reduce_op!r}")
    world = shmem.world_size(shmem.group_named(group_name))
    size = B.shape[1] if dim == A.dim() - 1 else A.shape[dim]
    if size % world:
        raise ValueError(f"fused_matmul_reduce_scatter: dim {scatter_dim} of A @ B has {size} entries, not "
                         f"divisible by the {world} ranks")
    if dim == A.dim() - 1:  # N scattered: the rows of (A @ B).T = B.T @ A.T, reduce-scattered
        flat = A.reshape(-1, A.shape[-1]).contiguous()
        out = torch.ops.triton_dist.gemm_rs(B.t().contiguous(), flat, group_name).t()
        out = out.reshape(*A.shape[:-1], size // world)
    else:
        rows, moved = _rows_first(A, dim)
        out = torch.ops.triton_dist.gemm_rs(rows, B.t().contiguous(), group_name)
        out = out.view(moved[0] // world, *moved[1:-1], B.shape[1]).movedim(0, dim)
    out = out.contiguous()  # (torch's fallback returns it contiguous)
    return out / world if reduce_op == "avg" else out


library.define_composite("fused_all_gather_matmul(Tensor A, Tensor[] Bs, int gather_dim, str? group_name, *, "
                         "bool return_A=True) -> (Tensor?, Tensor[])", fused_all_gather_matmul)
library.define_composite("fused_matmul_reduce_scatter(Tensor A, Tensor B, str reduce_op, int scatter_dim, "
                         "str? group_name) -> Tensor", fused_matmul_reduce_scatter)


_ROUTED = []


def use_for_torch_async_tp(device_types=("CUDA",)):
    """Run ``torch.ops.symm_mem.fused_all_gather_matmul`` and ``fused_matmul_reduce_scatter`` on triton_dist's
    kernels (for tensors of ``device_types``): what torch.compile's micro-pipeline TP pass
    (``torch._inductor.config._micro_pipeline_tp = True``) emits then runs here. Once per process; the groups
    must be on triton_dist's heap (``triton_dist.init``)."""
    import warnings

    import torch.distributed._symmetric_memory  # noqa: F401  (defines the symm_mem ops)

    if _ROUTED:
        return
    lib = torch.library.Library("symm_mem", "IMPL")
    with warnings.catch_warnings():  # overriding torch's own kernels is the point
        warnings.simplefilter("ignore")
        for key in device_types:
            lib.impl("fused_all_gather_matmul", lambda A, Bs, gather_dim, group_name, return_A=True:
                     fused_all_gather_matmul(A, Bs, gather_dim, group_name, return_A), key)
            lib.impl("fused_matmul_reduce_scatter", fused_matmul_reduce_scatter, key)
    _ROUTED.append(lib)


__all__ = ["fused_all_gather_matmul", "fused_matmul_reduce_scatter", "use_for_torch_async_tp"]
