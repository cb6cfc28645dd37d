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
rows. The results come out in the layouts (strides) of torch's fallbacks. Both are CompositeImplicitAutograd:
the backward is the ops' own (``kernels/autograd.py``), and torch.compile traces them down to
``triton_dist::ag_gemm`` / ``gemm_rs``. ``use_for_torch_async_tp()`` makes ``torch.ops.symm_mem.
fused_all_gather_matmul`` / ``fused_matmul_reduce_scatter`` (what the micro-pipeline TP pass emits) run these.

The FP8 ops, ``fused_all_gather_scaled_matmul`` and ``fused_scaled_matmul_reduce_scatter``, map the same way onto
``scaled_ag_gemm`` / ``scaled_gemm_rs`` (per-tensor, row-wise — A's sharded or replicated — and, an extension,
128-blockwise scales; an FP8 result where out_dtype is None). No bias, no result scale; no backward.
"""

import math

import torch

from .. import shmem
from . import library
from . import autograd  # noqa: F401  (the backward of the ops these decompose into)
from .allgather_gemm import scaled_ag_gemm
from .gemm import is_kn
from .gemm_reducescatter import scaled_gemm_rs


def _rows(t):
    """``t`` [..., K] as [rows, K] (the rows counted, not inferred: K may be 0)."""
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1])


def _rows_first(t, dim):
    """``t`` with ``dim`` moved to the front and every other leading dim folded into rows: [t.shape[dim] * rest,
    K] (a copy only when that layout is not already there)."""
    moved = t.movedim(dim, 0)
    return _rows(moved).contiguous(), moved.shape


def _gathered_a(gathered, shape, A_shard, dim, world):
    """The gathered rows ([world * shape[0] * ..., K], gathered dim first) as torch's fallback returns A: ``dim``
    back in place; in a group of one the shard's own layout (torch's flatten of one rank's rows is a view)."""
    a = gathered.view(*shape, A_shard.shape[-1]).movedim(0, dim)
    return a.contiguous() if world == 1 else a


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


def _as_read(w):
    """A weight [N, K] as the ops take it: as it lies where their kernels read it so (contiguous, or the transposed
    view of a contiguous [K, N] B: ``gemm.is_kn``), else a contiguous copy."""
    return w if w.is_contiguous() or is_kn(w) else w.contiguous()


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
        flat = _rows(A_shard).contiguous()
        parts = ops.all_gather(flat, group_name).view(world, *flat.shape)
        gathered = parts.permute(1, 0, 2).reshape(*A_shard.shape[:-1], world * k)
        out = gathered @ w.t()
        return (gathered if return_A else None), [o.contiguous() for o in out.split(widths, dim=-1)]
    rows, moved = _rows_first(A_shard, dim)  # [g * rest, K]
    out, gathered = ops.ag_gemm(rows, _as_read(w), return_A, "none", group_name)
    shape = (world * moved[0], *moved[1:-1])
    outs = [o.contiguous().view(*shape, o.shape[-1]).movedim(0, dim) for o in out.split(widths, dim=-1)]
    return (_gathered_a(gathered, shape, A_shard, dim, world) if return_A else None), outs


# ------------------------------------------------------------------------------------------- matmul + reduce-scatter
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
        flat = _rows(A).contiguous()
        out = torch.ops.triton_dist.gemm_rs(B.t().contiguous(), flat, group_name).t()
        out = out.reshape(*A.shape[:-1], size // world)
    else:
        rows, moved = _rows_first(A, dim)
        out = torch.ops.triton_dist.gemm_rs(rows, _as_read(B.t()), group_name)
        out = out.view(moved[0] // world, *moved[1:-1], B.shape[1]).movedim(0, dim)
    out = out.contiguous()  # (torch's fallback returns it contiguous)
    return out / world if reduce_op == "avg" else out


library.define_composite("fused_all_gather_matmul(Tensor A, Tensor[] Bs, int gather_dim, str? group_name, *, "
                         "bool return_A=True) -> (Tensor?, Tensor[])", fused_all_gather_matmul)
library.define_composite("fused_matmul_reduce_scatter(Tensor A, Tensor B, str reduce_op, int scatter_dim, "
                         "str? group_name) -> Tensor", fused_matmul_reduce_scatter)


# ----------------------------------------------------------------------------------------------- FP8 (scaled)
SCALAR_TYPES = {5: torch.float16, 6: torch.float32, 15: torch.bfloat16}  # c10::ScalarType numbers in a list


def _dtype(d, fp8_dtype):
    """A ``ScalarType?`` argument as a dtype (lists of them may arrive as c10::ScalarType numbers); None: the
    operands' FP8 dtype (an FP8 result, as ``torch._scaled_mm``)."""
    d = SCALAR_TYPES.get(d, d) if isinstance(d, int) else d
    return fp8_dtype if d is None else d


def _row_scales(scale, lead, dim, what):
    """``scale`` of a tensor whose leading dims are ``lead`` ([*lead, 1] row-wise, or one value) as the rows of
    ``_rows_first``: [rows, 1], or the single value [1]."""
    if scale.numel() == 1:
        return scale.reshape(1).float()
    if list(scale.shape) != list(lead) + [1]:
        raise ValueError(f"{what}: row-wise scales must be {list(lead) + [1]}, got {list(scale.shape)}")
    return scale.movedim(dim, 0).reshape(-1, 1).contiguous()


def _b_scales(Bs, B_scales, what):
    """W's scales for each B ([K, N] = W.t()): one value, [1, N] (per output column) or [K/128, N/128] (blocks):
    as W's, [1] / [N, 1] / [N/128, K/128]."""
    out = []
    for B, sb in zip(Bs, B_scales):
        if sb.numel() == 1:
            out.append(sb.reshape(1).float())
        elif tuple(sb.shape) == (1, B.shape[1]):
            out.append(sb.t().contiguous())
        elif sb.dim() == 2 and sb.shape[0] * 128 >= B.shape[0] and sb.shape[1] * 128 >= B.shape[1] > 1:
            out.append(sb.t().contiguous())
        else:
            raise ValueError(f"{what}: B scale {list(sb.shape)} fits no scaling mode of B {list(B.shape)}")
    return out


def _scaled_products(rows, rows_scale, ws, w_scales, out_dtypes, fast, run):
    """Every B's product of ``rows`` (FP8 [R, K], scales [R, 1] or [1]) by ``ws`` ([N_b, K] each, scales as
    ``_b_scales``) through ``run(a, w, scale_a, scale_w, mode, out_dtype, fast_accum)``; per-tensor or row-wise
    scales of every B with one fast_accum: ONE call over the stacked weights (scales as rows), fp32 when the Bs
    want different dtypes; block scales (or differing fast_accum): a call per B. Returns the list of products."""
    blocks = any(sw.dim() == 2 and sw.shape[1] > 1 for sw in w_scales)
    if len(ws) > 1 and not blocks and len(set(fast)) == 1:
        w = torch.cat(ws).contiguous()
        sw = torch.cat([sw.expand(wi.shape[0], 1) if sw.numel() == 1 else sw for sw, wi in zip(w_scales, ws)])
        sa = rows_scale.expand(rows.shape[0], 1).contiguous() if rows_scale.numel() == 1 else rows_scale
        common = out_dtypes[0] if len(set(out_dtypes)) == 1 and out_dtypes[0] in (torch.bfloat16, torch.float16,
                                                                                 torch.float32) else torch.float32
        out = run(rows, w, sa, sw.contiguous(), "row", common, fast[0])
        return [o.to(d) for o, d in zip(out.split([wi.shape[0] for wi in ws], dim=-1), out_dtypes)]
    outs = []
    for w, sw, d, f in zip(ws, w_scales, out_dtypes, fast):
        mode = "block" if sw.dim() == 2 and sw.shape[1] > 1 else ("tensor" if rows_scale.numel() == 1 and
                                                                   sw.numel() == 1 else "row")
        sa = rows_scale.expand(rows.shape[0], 1).contiguous() if mode == "row" and rows_scale.numel() == 1 else \
            rows_scale
        sw = sw.expand(w.shape[0], 1).contiguous() if mode == "row" and sw.numel() == 1 else sw
        native = d in (torch.bfloat16, torch.float16, torch.float32)
        outs.append(run(rows, w.contiguous(), sa, sw, mode, d if native else torch.float32, f).to(d))
    return outs


def _no_extras(biases, result_scales, what):
    if any(b is not None for b in biases) or any(r is not None for r in result_scales):
        raise ValueError(f"{what}: biases and result scales are not supported")


def fused_all_gather_scaled_matmul(A_shard, Bs, A_scale, B_scales, gather_dim, group_name, biases, result_scales,
                                   out_dtypes, use_fast_accum):
    """Async-TP's FP8 all-gather + matmuls on ``scaled_ag_gemm``: ``A`` = all_gather(A_shard, gather_dim) (FP8, any
    batch dims, gather_dim one of A's leading dims) times each B ([K, N] FP8, a view of a weight [N, K]), scaled:
    A's scales one value, row-wise of this rank's rows ([*A_shard.shape[:-1], 1]) or of every rank's (the
    gathered shape, "replicated"), or 1x128 groups of a 2-D A; B's one value, [1, N] or 128x128 blocks. out_dtypes
    per B (None: FP8, as torch._scaled_mm). Returns (A, [products]) in torch's fallback's layout."""
    what = "fused_all_gather_scaled_matmul"
    group = shmem.group_named(group_name)
    world, rank = shmem.world_size(group), shmem.rank(group)
    dim = _check(A_shard, Bs, gather_dim, what)
    if not Bs or not len(Bs) == len(B_scales) == len(out_dtypes):
        raise ValueError(f"{what}: one B scale and out dtype per B, got {len(Bs)} Bs, {len(B_scales)} scales, "
                         f"{len(out_dtypes)} dtypes")
    if dim == A_shard.dim() - 1:
        raise ValueError(f"{what}: gather_dim must be a leading dim of A (row scales do not survive gathering K)")
    _no_extras(biases, result_scales, what)
    rows, moved = _rows_first(A_shard, dim)
    lead, full = list(A_shard.shape[:-1]), list(A_shard.shape[:-1])
    full[dim] *= world
    if A_scale.dim() == 2 and A_shard.dim() == 2 and A_scale.shape[1] > 1:  # 1x128 groups of a 2-D A
        scale_rows = A_scale
    elif A_scale.numel() > 1 and list(A_scale.shape[:-1]) == full and full != lead:  # replicated row-wise
        scale_rows = _row_scales(A_scale.narrow(dim, rank * lead[dim], lead[dim]), lead, dim, what)
    else:
        scale_rows = _row_scales(A_scale, lead, dim, what)
    dtypes = [_dtype(d, A_shard.dtype) for d in out_dtypes]
    fast = [bool(f) for f in (use_fast_accum or [False] * len(Bs))]
    gathered = []

    def run(a, w, sa, sw, mode, out_dtype, fast_accum):
        out, g = scaled_ag_gemm(a, w, sa, sw, scaling=mode, out_dtype=out_dtype, fast_accum=fast_accum,
                                return_gathered=True, group=group)
        gathered.append(g)
        return out

    outs = _scaled_products(rows, scale_rows, [B.t() for B in Bs], _b_scales(Bs, B_scales, what), dtypes, fast, run)
    shape = (world * moved[0], *moved[1:-1])
    return (_gathered_a(gathered[0], shape, A_shard, dim, world),
            [o.contiguous().view(*shape, o.shape[-1]).movedim(0, dim) for o in outs])


def _fused_ag_scaled_fake(A_shard, Bs, A_scale, B_scales, gather_dim, group_name, biases, result_scales,
                          out_dtypes, use_fast_accum):
    what = "fused_all_gather_scaled_matmul"
    dim = _check(A_shard, Bs, gather_dim, what)
    _no_extras(biases, result_scales, what)
    shape = list(A_shard.shape)
    shape[dim] *= shmem.world_size(shmem.group_named(group_name))
    return A_shard.new_empty(shape), [A_shard.new_empty(shape[:-1] + [B.shape[1]], dtype=_dtype(d, A_shard.dtype))
                                      for B, d in zip(Bs, out_dtypes)]


def fused_scaled_matmul_reduce_scatter(A, B, A_scale, B_scale, reduce_op, orig_scatter_dim,
                                       scatter_dim_after_maybe_reshape, group_name, output_shape, bias=None,
                                       result_scale=None, out_dtype=None, use_fast_accum=False):
    """Async-TP's FP8 matmul + reduce-scatter on ``scaled_gemm_rs``: ``A @ B`` (A FP8 with leading dims, or 2-D
    with ``output_shape`` naming the product's unflattened shape; B [K, N] FP8), scaled (A: one value, row-wise
    [*A.shape[:-1], 1], or 1x128 groups of a 2-D A; B: one value, [1, N] or blocks), reduce-scattered along
    ``orig_scatter_dim`` of the product ("sum" / "avg"); out_dtype None: FP8. Contiguous, as torch's fallback."""
    what = "fused_scaled_matmul_reduce_scatter"
    _no_extras([bias], [result_scale], what)
    if reduce_op not in ("sum", "avg"):
        raise ValueError(f"{what}: reduce_op must be 'sum' or 'avg', got {reduce_op!r}")
    group = shmem.group_named(group_name)
    world = shmem.world_size(group)
    k = A.shape[-1]
    shape = list(output_shape) if output_shape is not None else list(A.shape[:-1]) + [B.shape[1]]
    lead = shape[:-1]
    if shape[-1] != B.shape[1] or A.numel() // max(k, 1) != math.prod(lead):
        raise ValueError(f"{what}: output_shape {shape} is not A @ B's ({list(A.shape)} @ {list(B.shape)})")
    A2 = A.reshape(*lead, k)
    dim = _check(A2, [B], orig_scatter_dim, what)
    size = shape[dim]
    if size % world:
        raise ValueError(f"{what}: dim {orig_scatter_dim} of the product has {size} entries, not divisible by the "
                         f"{world} ranks")
    if A_scale.dim() == 2 and A.dim() == 2 and A_scale.shape[1] > 1:  # 1x128 groups of a 2-D A
        if dim != 0 or len(lead) != 1:
            raise ValueError(f"{what}: block scales take a 2-D product scattered along dim 0")
        scale_rows = A_scale
    else:
        scale_rows = _row_scales(A_scale.reshape(*lead, 1) if A_scale.numel() > 1 else A_scale, lead, dim, what)
    [w_scale] = _b_scales([B], [B_scale], what)
    dtype = _dtype(out_dtype, A.dtype)
    native = dtype in (torch.bfloat16, torch.float16, torch.float32)
    if dim == A2.dim() - 1:  # N scattered: (A @ B).T = B.T @ A.T reduce-scattered by rows, the scales' roles swapped
        if w_scale.dim() == 2 and w_scale.shape[1] > 1:
            raise ValueError(f"{what}: block scales cannot scatter the last dim")
        flat = A2.reshape(-1, k).contiguous()
        sa = scale_rows.expand(flat.shape[0], 1).contiguous() if scale_rows.numel() == 1 else scale_rows
        sw = w_scale.expand(B.shape[1], 1).contiguous() if w_scale.numel() == 1 else w_scale
        out = scaled_gemm_rs(B.t().contiguous(), flat, sw, sa, scaling="row", out_dtype=dtype if native else
                             torch.float32, fast_accum=bool(use_fast_accum), group=group)
        out = out.t().reshape(*lead, size // world)
    else:
        rows, moved = _rows_first(A2, dim)
        def run(a, w, sa, sw, mode, d, f):
            return scaled_gemm_rs(a, w, sa, sw, scaling=mode, out_dtype=d, fast_accum=f, group=group)

        [out] = _scaled_products(rows, scale_rows, [B.t()], [w_scale], [dtype], [bool(use_fast_accum)], run)
        out = out.view(moved[0] // world, *moved[1:-1], B.shape[1]).movedim(0, dim)
    out = out.contiguous()
    if reduce_op == "avg":
        out = (out.float() / world).to(dtype) if not native else out / world
    return out.to(dtype)


def _fused_scaled_rs_fake(A, B, A_scale, B_scale, reduce_op, orig_scatter_dim, scatter_dim_after_maybe_reshape,
                          group_name, output_shape, bias=None, result_scale=None, out_dtype=None, use_fast_accum=False):
    shape = list(output_shape) if output_shape is not None else list(A.shape[:-1]) + [B.shape[1]]
    shape[orig_scatter_dim % len(shape)] //= shmem.world_size(shmem.group_named(group_name))
    return A.new_empty(shape, dtype=_dtype(out_dtype, A.dtype))


library.define("fused_all_gather_scaled_matmul(Tensor A, Tensor[] Bs, Tensor A_scale, Tensor[] B_scales, "
               "int gather_dim, str group_name, Tensor?[] biases, Tensor?[] result_scales, "
               "ScalarType?[] out_dtypes, bool[] use_fast_accum) -> (Tensor, Tensor[])",
               fused_all_gather_scaled_matmul, _fused_ag_scaled_fake)
library.define("fused_scaled_matmul_reduce_scatter(Tensor A, Tensor B, Tensor A_scale, Tensor B_scale, "
               "str reduce_op, int orig_scatter_dim, int scatter_dim_after_maybe_reshape, str group_name, "
               "SymInt[]? output_shape, Tensor? bias=None, Tensor? result_scale=None, ScalarType? out_dtype=None, "
               "bool use_fast_accum=False) -> Tensor", fused_scaled_matmul_reduce_scatter, _fused_scaled_rs_fake)


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
