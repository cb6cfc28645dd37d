"""Backward formulas of the zoo's ops, registered on ``torch.ops.triton_dist.*`` (``torch.library.
register_autograd``), so that they work eagerly, under ``torch.compile`` and with activation checkpointing. The
public functions route a call whose inputs require grad through its op (``library.needs_grad``).

Every gradient is that of the SUM of every rank's loss (as ``torch.distributed.nn``'s collectives): an output
that every rank holds a copy of sends each copy's gradient back. Layers that keep activations replicated on every
rank (one loss, copied) undo that where they split and gather rows (``nn/sharding.py``).

    ag_gemm    out = all_gather(a) @ w.T                grad_a = gemm_rs(grad_out, w.T)      (reduce-scatter)
                                                        grad_w = grad_out.T @ all_gather(a) (the gather
                                                        started before grad_a's GEMM, which hides it)
               silu_gate: h = all_gather(a) @ w.T again (one overlapped ag_gemm), d h from silu(gate) * up
    gemm       out = a @ w.T                            grad_a = grad_out @ w, grad_w = grad_out.T @ a (torch's
                                                        GEMMs on the saved tensors as they are: no transposed copy)
    gemm_rs    out = rows_r(sum_s a_s @ w_s.T)          G = every rank's grad_out rows, gathered:
                                                        grad_a = ag_gemm(grad_out, w.T) = G @ w, grad_w = G.T @ a
    all_gather out = cat_s x_s                          grad_x = rows_r(sum_s grad_s)
    all_reduce out = sum_s x_s                          grad_x = all_reduce(grad_out)
    gemm_ar    out = sum_s a_s @ w_s.T                  G = all_reduce(grad_out): grad_a = G @ w, grad_w = G.T @ a
    all_reduce_rmsnorm  new_res = res + sum_s x_s,      d new_res = grad_new_res + the norm's backward of grad_normed:
               normed = rmsnorm(new_res) * weight       grad_res = d new_res, grad_x = all_reduce(d new_res),
                                                        grad_weight = sum over rows of grad_normed * rmsnorm(new_res)
    grouped_gemm  out[g_e] = x[g_e] @ w[e].T            grad_x[g_e] = grad[g_e] @ w[e] (the grouped GEMM with
                                                        w_layout "kn" on the same w; zeros outside the groups),
                                                        grad_w[e] = grad[g_e].T @ x[g_e] (grouped_weight_grad)
                  ("kn": out[g_e] = x[g_e] @ w[e], the layouts' roles swapped)

The sums run in fixed orders (the ops' own), so gradients are bitwise the same run to run. In a group of one
(nothing to reduce or gather) ag_gemm's and gemm_rs's high-precision backward is torch's GEMMs on the saved tensors
as they are, not the fused ops on a transposed copy of the weight.

FP8 training: ag_gemm / gemm_rs / grouped_gemm called with ``quantize=`` (high-precision a and w quantised inside
the op, the FP8 product forward) have the same backward, on the saved unquantised a and w: straight-through,
gradients in a's dtype. A direct call of the torch op with silu_gate and quantize differentiates the gate at the high-precision
pre-activation it computes again (the public call keeps the FP8 one).

With ``fp8_grads=True`` as well (DeepSeek-V3's recipe, e4m3 throughout) both backward GEMMs are FP8, each operand
quantised by ``fp8.quantize_operands`` in the forward's mode along that GEMM's reduction dimension (laid out as
[rows, reduction], contiguous; "block": the first operand in 1x128 groups, the second in 128x128 blocks):

    ag_gemm    grad_a = gemm_rs(grad_out, w.T, quantize)    (grad_out, w.T quantised along N)
               grad_w = Q(grad_out.T) @ Q(x.T).T            (along the W*m gathered rows; x gathered again)
    gemm_rs    grad_a = ag_gemm(grad_out, w.T, quantize)    (each rank's rows of G, and w.T, along N)
               grad_w = Q(G.T) @ Q(a.T).T                   (along the M rows; G gathered on its own, unquantised)
    grouped_gemm  grad_x = grouped_gemm(grad, w, other layout, quantize)   (grad along N over the rows inside the
                                                        groups, each expert's w.T along N: w's other layout's copy)
               grad_w = grouped_weight_grad(grad, x, quantize)  (along each expert's tokens: a scale per column,
                                                        "block" per 128-row step of the expert, in the kernel)

(Q: e4m3 with its scales; Q(t.T) read from t as it lies: ``fp8.quantize_fp8(transposed=True)``, no high-precision
transposed copy). The input gradients run the overlapped ops on FP8 operands (``_times_weight``: grad_out
quantised as their ``quantize=`` does, w.T's copy from ``fp8.quantize_weight``, kept per optimizer step by an open
``fp8.weight_cache``, in a compiled backward too), the weights' the FP8 GEMM core
(``fp8_weight_grad``, a torch op under torch.compile); gradients in a's dtype, the same fixed orders.
"""

import torch

from .. import hardware, shmem
from . import fp8, library
from .allgather import gathered
from .allgather_gemm import ag_gemm, start_gather
from .allreduce import all_reduce
from .allreduce.ops import rmsnorm_backward
from .gemm import gemm
from .gemm_reducescatter import gemm_rs, rows_of_rank
from .grouped_gemm import group_rows, grouped_gemm, grouped_weight_grad
from .silu_gate import silu_gate_backward


def _own_rows(full, group):
    """This rank's ``tensor_split`` rows of ``full``."""
    start, count = rows_of_rank(full.shape[0], shmem.world_size(group), shmem.rank(group))
    return full[start:start + count]


def _reduce_scatter(t, group):
    """This rank's rows of the sum over the ranks of ``t`` (every rank's equal-shaped ``t``)."""
    return _own_rows(all_reduce(t.contiguous(), group=group), group).contiguous()


def fp8_weight_grad(g, x, mode):
    """``g.T @ x`` of FP8 training's backward (``fp8_grads``): the weights' gradient of a product whose output
    gradient is ``g`` [rows, N] and input ``x`` [rows, K] (high precision), each quantised in ``mode`` along the
    rows (``fp8.quantize_fp8(transposed=True)``: g.T as the GEMM's first operand, x.T as its second, read as they
    lie), the FP8 GEMM core's product in g's dtype. Under torch.compile: ``torch.ops.triton_dist.fp8_weight_grad``."""
    if hardware.compiling():
        return torch.ops.triton_dist.fp8_weight_grad(g, x, mode)
    # (block mode: g.T's group scales K-major, the layout gemm reads fastest; the same product bit for bit)
    g8, scale_g = fp8.quantize_fp8(g, fp8.a_scaling(mode), transposed=True, k_major=mode == "block")
    x8, scale_x = fp8.quantize_fp8(x, mode, transposed=True)
    return gemm(g8, x8, scale_a=scale_g, scale_w=scale_x, scaling=mode, out_dtype=g.dtype)


library.define("fp8_weight_grad(Tensor g, Tensor x, str mode) -> Tensor", fp8_weight_grad,
               lambda g, x, mode: g.new_empty((g.shape[1], x.shape[1])))


def _times_weight(op, g, w, mode, group_name):
    """``op(g, w.T)`` (``op``: "gemm_rs" or "ag_gemm"; the input's gradient ``g @ w``) in FP8 ``mode`` (``fp8_grads``):
    the op on g quantised as its ``quantize=`` would and on w.T's FP8 copy from ``fp8.quantize_weight``, which an
    open ``fp8.weight_cache`` keeps across an optimizer step's micro-batches: bitwise the op's ``quantize=`` on
    ``w.T.contiguous()``, a fresh tensor that no cache keeps. Traced: ``torch.ops.triton_dist.fp8_times_weight``,
    which gets w itself (the parameter) at run time, so a compiled backward takes the kept copies too;
    differentiated (a backward with create_graph): the op's own ``quantize=`` on w.T."""
    if library.needs_grad(g, w):
        return _TIMES_WEIGHT[op](g.contiguous(), w.T.contiguous(), group=shmem.group_named(group_name),
                                 quantize=mode)
    if hardware.compiling():
        return torch.ops.triton_dist.fp8_times_weight(g.contiguous(), w, op, mode, group_name)
    return _fp8_times_weight(g, w, op, mode, group_name)


def _fp8_times_weight(g, w, op, mode, group_name=None):
    g8, w8, scales = fp8.quantize_operands(g.contiguous(), w, mode, transposed=True)
    return _TIMES_WEIGHT[op](g8, w8, group=shmem.group_named(group_name), scale_a=scales.a, scale_w=scales.w,
                             scaling=scales.mode, out_dtype=g.dtype)


def _fp8_times_weight_fake(g, w, op, mode, group_name=None):
    group = shmem.group_named(group_name)
    world = shmem.world_size(group)
    rows = world * g.shape[0] if op == "ag_gemm" else rows_of_rank(g.shape[0], world, shmem.rank(group))[1]
    return g.new_empty((rows, w.shape[1]))


_TIMES_WEIGHT = {"ag_gemm": ag_gemm, "gemm_rs": gemm_rs}
library.define("fp8_times_weight(Tensor g, Tensor w, str op, str mode, str? group_name=None) -> Tensor",
               _fp8_times_weight, _fp8_times_weight_fake)


def _weight_grad(g, x, mode):
    """``g.T @ x`` (the weights' gradient of a product whose output gradient is ``g`` [rows, N] and input ``x``
    [rows, K]): torch's in g's dtype, or (``mode``: ``fp8_grads``) ``fp8_weight_grad``."""
    return g.T @ x if mode is None else fp8_weight_grad(g, x, mode)


# ----------------------------------------------------------------------------------------------- ag_gemm
def _columns(w, activation):
    return w.shape[0] // 2 if activation == "silu_gate" else w.shape[0]


def _ag_gemm_setup(ctx, inputs, output):
    a, w, return_gathered, activation, group_name, quantize, fp8_grads = inputs
    ctx.activation, ctx.group_name = activation, group_name
    ctx.grads_mode = quantize if fp8_grads else None  # the backward's GEMMs in FP8 (this mode) or not (None)
    ctx.set_materialize_grads(False)  # an unused gathered output: None, not a tensor of zeros to reduce
    ctx.save_for_backward(a, w, output[1] if return_gathered else None)


def _ag_gemm_backward(ctx, grad_out, grad_gathered):
    a, w, kept = ctx.saved_tensors
    group = shmem.group_named(ctx.group_name)
    if grad_out is None:
        grad_out = a.new_zeros((shmem.world_size(group) * a.shape[0], _columns(w, ctx.activation)))
    if ctx.activation == "silu_gate":  # the pre-activation again: one overlapped ag_gemm (or a GEMM of what is kept)
        h, x = (kept @ w.T, kept) if kept is not None else ag_gemm(a, w, return_gathered=True, group=group)
        grad_out = silu_gate_backward(h, grad_out)
    else:
        x = kept
    grad_a = grad_w = None
    alone = shmem.world_size(group) == 1 and ctx.grads_mode is None  # a group of one: nothing to reduce or gather
    # the re-gather (unless the gathered input was kept) starts now: grad_a's GEMM runs while it travels
    regathered = _regather(a, group) if ctx.needs_input_grad[1] and x is None else None
    if ctx.needs_input_grad[0]:
        if alone:  # torch's GEMM on the weight as it is: no transposed copy of it
            grad_a = grad_out @ w
        elif ctx.grads_mode is not None:
            grad_a = _times_weight("gemm_rs", grad_out, w, ctx.grads_mode, ctx.group_name)
        else:
            grad_a = gemm_rs(grad_out.contiguous(), w.T, group=group)  # w read as it lies (no transposed copy)
        if grad_gathered is not None:
            grad_a = grad_a + _reduce_scatter(grad_gathered, group)
    if ctx.needs_input_grad[1]:
        grad_w = _weight_grad(grad_out, x if regathered is None else regathered(), ctx.grads_mode)
    return grad_a, grad_w, None, None, None, None, None


def _regather(rows, group):
    """all_gather(rows) for a weight gradient, started now by the copy engines (``start_gather``): returns the
    finish, which gives the gathered rows, so that GPU work queued before it hides the transfer. A group of one:
    the rows; traced (torch.compile): the all_gather op, at the finish."""
    if shmem.world_size(group) == 1:
        return lambda: rows
    return (lambda: gathered(rows, group)) if hardware.compiling() else start_gather(rows, group)


# ----------------------------------------------------------------------------------------------- gemm_rs
def _gemm_rs_setup(ctx, inputs, output):
    a, w, group_name, quantize, fp8_grads = inputs
    ctx.group_name = group_name
    ctx.grads_mode = quantize if fp8_grads else None  # the backward's GEMMs in FP8 (this mode) or not (None)
    ctx.save_for_backward(a, w)


def _gemm_rs_backward(ctx, grad_out):
    a, w = ctx.saved_tensors
    group = shmem.group_named(ctx.group_name)
    world, m = shmem.world_size(group), a.shape[0]
    if grad_out is None:
        return None, None, None, None, None
    if world == 1 and ctx.grads_mode is None:  # a group of one: torch's GEMMs on the tensors as they are
        return _local_grads(ctx, grad_out, a, w) + (None,) * 3
    shard = -(-m // world)  # every rank's rows padded to the largest share: ag_gemm takes equal shapes
    if grad_out.shape[0] == shard:  # every share equal: no padding
        padded = grad_out.contiguous()
    else:
        padded = grad_out.new_zeros((shard, grad_out.shape[1]))
        padded[:grad_out.shape[0]] = grad_out
    mode = ctx.grads_mode
    if mode is None:
        # w read as it lies (no transposed copy): w.T is the transposed view of a contiguous w, or w's own
        # contiguous [K, N] (w a transposed view); ag_gemm takes no other strides, which the forward copied
        wt = w.T if w.is_contiguous() or w.T.is_contiguous() else w.contiguous().T
        out, g = ag_gemm(padded, wt, return_gathered=True, group=group)
    else:  # FP8 rows cross in ag_gemm: the weights' gradient gathers G on its own, behind grad_a's GEMM
        g = _regather(padded, group) if ctx.needs_input_grad[1] else None
        out = _times_weight("ag_gemm", padded, w, mode, ctx.group_name) if ctx.needs_input_grad[0] else None
        g = g if g is None else g()
    if shard * world != m:  # drop every rank's padding rows
        keep = torch.cat([torch.arange(r * shard, r * shard + rows_of_rank(m, world, r)[1], device=a.device)
                          for r in range(world)])
        out, g = (t if t is None else t[keep] for t in (out, g))
    return (out if ctx.needs_input_grad[0] else None), \
        (_weight_grad(g, a, mode) if ctx.needs_input_grad[1] else None), None, None, None


# ----------------------------------------------------------------------------------------------- gemm
def _gemm_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], inputs[1])


def _gemm_backward(ctx, grad_out):
    return _local_grads(ctx, grad_out, *ctx.saved_tensors) + (None,) * 5


def _local_grads(ctx, g, a, w):
    """(grad_a, grad_w) of ``a @ w.T`` for the output gradient ``g``: torch's GEMMs on the tensors as they are
    (None where autograd wants none)."""
    return (g @ w if ctx.needs_input_grad[0] else None), (g.T @ a if ctx.needs_input_grad[1] else None)


# ----------------------------------------------------------------------------------------------- collectives
def _all_gather_setup(ctx, inputs, output):
    ctx.group_name = inputs[1]


def _all_gather_backward(ctx, grad_out):
    return _reduce_scatter(grad_out, shmem.group_named(ctx.group_name)), None


def _all_reduce_setup(ctx, inputs, output):
    ctx.algo, ctx.group_name = inputs[1], inputs[2]


def _all_reduce_backward(ctx, grad_out):
    return all_reduce(grad_out.contiguous(), algo=ctx.algo, group=shmem.group_named(ctx.group_name)), None, None


def _gemm_ar_setup(ctx, inputs, output):
    ctx.group_name = inputs[2]
    ctx.save_for_backward(inputs[0], inputs[1])


def _gemm_ar_backward(ctx, grad_out):
    a, w = ctx.saved_tensors
    g = all_reduce(grad_out.contiguous(), group=shmem.group_named(ctx.group_name))
    return _local_grads(ctx, g, a, w) + (None,)


def _rmsnorm_setup(ctx, inputs, output):
    x, residual, weight, eps, out_fp8, algo, group_name = inputs
    ctx.eps, ctx.algo, ctx.group_name = eps, algo, group_name
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(output[1], weight)  # new_residual: what the norm was taken of


def _rmsnorm_backward(ctx, grad_normed, grad_residual, _):
    new_residual, weight = ctx.saved_tensors
    d_res, grad_weight = rmsnorm_backward(new_residual, weight, ctx.eps, grad_normed)
    if grad_residual is not None:
        d_res = d_res + grad_residual.float()
    grad_x = all_reduce(d_res.to(new_residual.dtype).contiguous(), algo=ctx.algo,
                        group=shmem.group_named(ctx.group_name)) if ctx.needs_input_grad[0] else None
    return (grad_x, d_res.to(new_residual.dtype) if ctx.needs_input_grad[1] else None,
            grad_weight.to(weight.dtype) if ctx.needs_input_grad[2] else None, None, None, None, None)


# ----------------------------------------------------------------------------------------------- grouped_gemm
def _grouped_setup(ctx, inputs, output):  # (quantize alone: the same backward, straight-through; FP8 x / w need none)
    x, w, offsets, counts, activation, w_layout, quantize, *_, fp8_grads = inputs
    ctx.activation, ctx.w_layout = activation, w_layout
    ctx.grads_mode = quantize if fp8_grads else None  # the backward's GEMMs in FP8 (this mode) or not (None)
    ctx.save_for_backward(x, w, offsets, counts)


def _grouped_backward(ctx, grad):
    x, w, offsets, counts = ctx.saved_tensors
    grad, mode = grad.contiguous(), ctx.grads_mode
    if ctx.activation == "silu_gate":  # the pre-activation again (its rows outside the groups are never read)
        grad = silu_gate_backward(grouped_gemm(x, w, offsets, counts), grad)
    grad_x = grad_w = None
    if ctx.needs_input_grad[0]:  # the other layout on the same weight, no transposed copy; zeros outside the groups
        # (fp8_grads: that layout's quantize=, grad along N and the FP8 copy of w's other layout, kept by
        # fp8.weight_cache)
        other = "kn" if ctx.w_layout == "nk" else "nk"
        if hardware.compiling() or library.needs_grad(grad, w):
            inside = group_rows(x.shape[0], offsets, counts, x.device)[:, None]
            grad_x = torch.where(inside, grouped_gemm(grad, w, offsets, counts, w_layout=other, quantize=mode), 0)
        else:
            grad_x = grouped_gemm(grad, w, offsets, counts, out=torch.zeros_like(x), w_layout=other, quantize=mode)
    if ctx.needs_input_grad[1]:  # dw[e] = grad[g].T @ x[g] ("nk"), x[g].T @ grad[g] ("kn"); FP8 along the tokens
        dy, inputs = (grad, x) if ctx.w_layout == "nk" else (x, grad)
        grad_w = grouped_weight_grad(dy, inputs, offsets, counts, w.shape[0], mode)
    return grad_x, grad_w, None, None, None, None, None, None, None, None, None, None, None


# ----------------------------------------------------------------------------------------------- silu_gate
def _silu_gate_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _silu_gate_grad(ctx, grad):
    return silu_gate_backward(ctx.saved_tensors[0], grad)


for _name, _backward, _setup in (("gemm", _gemm_backward, _gemm_setup),
                                 ("ag_gemm", _ag_gemm_backward, _ag_gemm_setup),
                                 ("silu_gate", _silu_gate_grad, _silu_gate_setup),
                                 ("gemm_rs", _gemm_rs_backward, _gemm_rs_setup),
                                 ("all_gather", _all_gather_backward, _all_gather_setup),
                                 ("all_reduce", _all_reduce_backward, _all_reduce_setup),
                                 ("grouped_gemm", _grouped_backward, _grouped_setup),
                                 ("gemm_ar", _gemm_ar_backward, _gemm_ar_setup),
                                 ("all_reduce_rmsnorm", _rmsnorm_backward, _rmsnorm_setup)):
    torch.library.register_autograd(f"triton_dist::{_name}", _backward, setup_context=_setup)
