"""Autograd for MoE dispatch and combine: each is the other's backward, the top-k weights' gradient included.

    recv = ep_dispatch(x, topk_idx, topk_weights, ...)       rows of x, and the weight of each row (recv.weights)
    y = ep_combine(expert_out, recv.handle)                   y[t] = sum_j w[t, j] * expert_out[row of (t, j)]

    combine's backward    the output's gradient g dispatched like x (the same routing, so the same rows):
                              grad expert_out[row] = w[row] * g[t(row)]
                              grad w[row] = <g[t(row)], expert_out[row]>          (on the expert's rank)
                          both in one pass over the rows (``combine_grad_kernel``)
    dispatch's backward   grad x[t] = sum_j grad rows[row of (t, j)]: a combine on the forward's records with unit
                          weights
                          grad topk_weights[t, j] = grad w[row of (t, j)]: the rows' scalars sent back to their
                          tokens' ranks (one all-to-all of [W, max_tokens, K] scalars)

The differentiable path runs through two torch ops with their backward registered on them
(``torch.library.register_autograd``), so it works eagerly, under ``torch.compile(fullgraph=True)`` and with
activation checkpointing:

    torch.ops.triton_dist.ep_dispatch_train(x, topk_idx, topk_weights, num_experts, max_tokens, align, group_name,
        num_chunks) -> (rows, expert_ids, weights, expert_counts, expert_offsets, token_pos, slots, span)
    torch.ops.triton_dist.ep_combine_train(expert_out, weights, topk_idx, token_pos, slots, span, num_experts,
        max_tokens, align, group_name, num_chunks) -> y

(``num_chunks``: the dispatch's token chunks, which its records and so every combine of them follow; 0: the
default configuration's.)

Unlike the zero-copy ``ep_dispatch`` op, whose outputs are views of the workspace that the next dispatch of the
same shapes (the backward's own, another layer's) overwrites, the training dispatch returns new tensors, the
dispatch's records among them: ``token_pos`` [T, W], ``slots`` [W, max_tokens, K] (this rank's row of every slot of
each rank's tokens) and ``span`` [W, MAX_CHUNKS, 2]. The combine reads those records (not the workspace's), and
applies the rows' ``weights`` it is given, so each op is a function of its inputs: nothing of the handle is host
state, and the backward needs no later dispatch's buffers. Rows outside every expert group (padding) carry no
gradient. Sums run in the kernels' fixed orders: bitwise reproducible, eager or compiled.

The Python API (``ep_dispatch`` / ``ep_combine``) takes this path when an input requires grad or under
torch.compile: ``recv.handle`` is then an ``EpRouting`` (the records and the routing as tensors). ``config=`` is
the forward's (eagerly: ``library.with_caller_config``; a dispatch's chunks go to the op as ``num_chunks``, so
both backwards walk them too); ``timeline=``, ``out=``, ``exact=True`` and the FP8 dispatch are for calls
without grad (ValueError otherwise).
"""

import functools
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from ... import hardware, shmem
from ...hardware import cdiv
from .. import library
from . import combine as _combine
from . import dispatch as _dispatch
from .buffers import EpDispatchResult, max_recv_rows
from .config import dispatch_config
from .protocol import MAX_CHUNKS


class EpRouting(NamedTuple):
    """The handle of a differentiable dispatch: what combine and both backwards need, as tensors and ints."""

    topk_idx: torch.Tensor     # [T, K] the routing (combine's backward dispatches the gradient by it)
    token_pos: torch.Tensor    # [T, W] int32 position of token t in rank d's receive list (-1: not sent)
    slots: torch.Tensor        # [W, max_tokens, K] int32 this rank's row of each slot of every rank's tokens
    span: torch.Tensor         # [W, MAX_CHUNKS, 2] int32 each rank's positions per token chunk
    weights: torch.Tensor      # [rows] float32 the rows' weights, differentiable (what combine applies)
    num_experts: int
    max_tokens: int
    align: int
    group_name: Optional[str]
    num_chunks: int = 0        # the dispatch's token chunks (0: the default configuration's)


# ----------------------------------------------------------------------------------------------------- torch ops
def _num_chunks(max_tokens, hidden, device, num_chunks=0):
    """The token chunks of the ops' dispatch (``num_chunks``; 0: its default configuration's): combine walks the
    same ones."""
    return num_chunks or int(dispatch_config(max_tokens, hidden, device.type).num_chunks)


def _dispatch_train_op(x, topk_idx, topk_weights, num_experts, max_tokens, align, group_name=None, num_chunks=0):
    config = library.caller_config("ep_dispatch_train")
    if num_chunks:
        config = {**(config or {}), "num_chunks": num_chunks}
    r = _dispatch.ep_dispatch(x, topk_idx, topk_weights, num_experts=num_experts, max_tokens=max_tokens, align=align,
                              group=shmem.group_named(group_name), config=config)
    ws = r.handle.workspace
    # copies: the backward and later layers dispatch into the same workspace
    return (r.x.clone(), r.expert_ids.clone(), r.weights.clone(), r.expert_counts.clone(), r.expert_offsets.clone(),
            r.handle.token_pos.clone(), ws.recv_slots.clone(), ws.recv_span.clone())


def _dispatch_train_fake(x, topk_idx, topk_weights, num_experts, max_tokens, align, group_name=None, num_chunks=0):
    world = shmem.world_size(shmem.group_named(group_name))
    rows = max_recv_rows(world, num_experts, topk_idx.shape[1], max_tokens, align)
    local = num_experts // world
    i32 = dict(dtype=torch.int32, device=x.device)
    return (x.new_empty((rows, x.shape[1])), torch.empty((rows,), **i32),
            torch.empty((rows,), dtype=torch.float32, device=x.device), torch.empty((local,), **i32),
            torch.empty((local + 1,), **i32), torch.empty((x.shape[0], world), **i32),
            torch.empty((world, max_tokens, topk_idx.shape[1]), **i32), torch.empty((world, MAX_CHUNKS, 2), **i32))


def _combine_train_op(expert_out, weights, topk_idx, token_pos, slots, span, num_experts, max_tokens, align,
                      group_name=None, num_chunks=0):
    group = shmem.group_named(group_name)
    key = (num_experts, topk_idx.shape[1], max_tokens, expert_out.shape[1], expert_out.dtype, align)
    ws = shmem.workspaces.peek("moe_ep", key, group)
    if ws is None:
        raise ValueError(f"ep_combine_train: no ep_dispatch of these shapes (E, K, max_tokens, H, dtype, align) = "
                         f"{key} ran on this group")
    if expert_out.dim() != 2 or weights.dim() != 1 or expert_out.shape[0] > weights.shape[0]:
        raise ValueError(f"ep_combine_train: expected expert_out [rows, H] and weights [>= rows], got "
                         f"{list(expert_out.shape)}, {list(weights.shape)}")
    # each slot's weight from its row's (records past what a rank sent are stale memory, never read: clamped)
    ok = (slots >= 0) & (slots < weights.shape[0])
    slot_weights = torch.where(ok, weights.float()[torch.where(ok, slots, 0).long()], 0.0)
    return _combine.combine_records(expert_out, ws, token_pos, slots, slot_weights, span,
                                    _num_chunks(max_tokens, expert_out.shape[1], expert_out.device, num_chunks),
                                    config=library.caller_config("ep_combine_train"))


def _combine_train_fake(expert_out, weights, topk_idx, token_pos, slots, span, num_experts, max_tokens, align,
                        group_name=None, num_chunks=0):
    return expert_out.new_empty((token_pos.shape[0], expert_out.shape[1]))


@triton.jit
def combine_grad_kernel(g, y, weights, ids, grad_y, grad_w, n, total, H, stride_g, stride_y, ROWS: tl.constexpr,
                        BLOCK_H: tl.constexpr):
    """Combine's backward on ROWS rows per program, one pass over them: ``grad_y[r] = weights[r] * g[r]`` and
    ``grad_w[r] = <g[r], y[r]>`` (fp32) for the rows r < n of some expert group (ids >= 0); zeros for the other
    rows (grad_w: every row < total). What a row outside the groups holds is never read (NaN included)."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    real = rows < n
    valid = real & (tl.load(ids + rows, mask=real, other=-1) >= 0)
    w = tl.load(weights + rows, mask=valid, other=0.0)
    at_g = rows.to(tl.int64)[:, None] * stride_g
    at_y = rows.to(tl.int64)[:, None] * stride_y
    dot = tl.zeros((ROWS,), dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        inside = valid[:, None] & (cols < H)[None, :]
        gv = tl.load(g + at_g + cols[None, :], mask=inside, other=0.0).to(tl.float32)
        yv = tl.load(y + at_y + cols[None, :], mask=inside, other=0.0).to(tl.float32)
        dot += tl.sum(gv * yv, 1)
        tl.store(grad_y + at_y + cols[None, :], (gv * w[:, None]).to(grad_y.dtype.element_ty),
                 mask=real[:, None] & (cols < H)[None, :])
    tl.store(grad_w + rows, dot, mask=rows < total)


def _combine_grad_op(g_rows, expert_out, weights, expert_ids):
    """(grad of expert_out [n, H] in its dtype, grad of weights [rows] fp32) from the dispatched output gradient
    ``g_rows`` [>= n, H] (``combine_grad_kernel``; torch where no kernel runs)."""
    n, hidden = expert_out.shape
    total = weights.shape[0]
    if not (expert_out.is_cuda or hardware.interpreting()):
        valid = (expert_ids >= 0)[:n]
        g = g_rows[:n].float()
        grad_y = torch.where(valid[:, None], g * weights[:n, None].float(), 0.0).to(expert_out.dtype)
        dots = torch.where(valid, (g * expert_out.float()).sum(dim=1), 0.0)
        return grad_y, torch.nn.functional.pad(dots, (0, total - n))
    g_rows, expert_out = g_rows.contiguous(), expert_out.contiguous()
    grad_y = torch.empty_like(expert_out)  # (the kernel indexes it with expert_out's row stride)
    grad_w = torch.empty((total,), dtype=torch.float32, device=expert_out.device)
    if total:
        combine_grad_kernel[(cdiv(total, 4),)](
            g_rows, expert_out, weights.float().contiguous(), expert_ids, grad_y, grad_w, n, total, hidden,
            g_rows.stride(0), expert_out.stride(0), ROWS=4, BLOCK_H=1024, num_warps=4)
    return grad_y, grad_w


def _combine_grad_fake(g_rows, expert_out, weights, expert_ids):
    return torch.empty_like(expert_out), weights.new_empty(weights.shape, dtype=torch.float32)


def _scalars_home(row_values, slots, token_pos, group_name=None):
    """[T, K]: the value of the row of every (token, slot) of this rank's tokens, from ``row_values`` [rows] of
    every rank (``slots`` [W, max_tokens, K]: this rank's rows of each rank's received tokens, -1: none)."""
    # (records past what a rank sent are stale memory: clamped here, and never picked at home, where only the
    # positions a token took are read)
    ok = (slots >= 0) & (slots < row_values.shape[0])
    mine = torch.where(ok, row_values[torch.where(ok, slots, 0).long()], 0.0)  # [W (their rank), max_tokens, K]
    theirs = torch.empty_like(mine)  # [W (the expert's rank), max_tokens, K]
    if mine.shape[0] > 1:
        dist.all_to_all_single(theirs, mine.contiguous(), group=shmem.group_named(group_name))
    else:
        theirs.copy_(mine)
    at = token_pos.long()  # [T, W]: my token t's position in rank d's list
    picked = theirs.permute(1, 0, 2)[at.clamp(min=0), torch.arange(at.shape[1], device=at.device)]  # [T, W, K]
    return torch.where((at >= 0)[:, :, None], picked, 0.0).sum(dim=1)


def _scalars_home_fake(row_values, slots, token_pos, group_name=None):
    return row_values.new_empty((token_pos.shape[0], slots.shape[2]))


library.define("ep_dispatch_train(Tensor x, Tensor topk_idx, Tensor topk_weights, int num_experts, int max_tokens, "
               "int align, str? group_name=None, int num_chunks=0) -> (Tensor, Tensor, Tensor, Tensor, Tensor, "
               "Tensor, Tensor, Tensor)", _dispatch_train_op, _dispatch_train_fake)
library.define("ep_combine_train(Tensor expert_out, Tensor weights, Tensor topk_idx, Tensor token_pos, Tensor slots, "
               "Tensor span, int num_experts, int max_tokens, int align, str? group_name=None, int num_chunks=0) -> "
               "Tensor", _combine_train_op, _combine_train_fake)
library.define("ep_combine_grad(Tensor g_rows, Tensor expert_out, Tensor weights, Tensor expert_ids) -> "
               "(Tensor, Tensor)", _combine_grad_op, _combine_grad_fake)
library.define("ep_scalars_home(Tensor row_values, Tensor slots, Tensor token_pos, str? group_name=None) -> Tensor",
               _scalars_home, _scalars_home_fake)
library.collective("ep_dispatch_train", "ep_combine_train", "ep_scalars_home")


# ----------------------------------------------------------------------------------------------------- backward
def _dispatch_setup(ctx, inputs, output):
    x, topk_idx, topk_weights = inputs[:3]
    _, expert_ids, _, _, _, token_pos, slots, span = output
    ctx.routing = inputs[3:]  # (num_experts, max_tokens, align, group_name, num_chunks): defaults filled in
    ctx.x_dtype, ctx.w_dtype = x.dtype, topk_weights.dtype
    ctx.set_materialize_grads(False)  # an unused output: None, not zeros to send back
    ctx.save_for_backward(topk_idx, expert_ids, token_pos, slots, span)


def _dispatch_backward(ctx, grad_rows, _ids, grad_weights, *_):
    topk_idx, expert_ids, token_pos, slots, span = ctx.saved_tensors
    valid = expert_ids >= 0
    grad_x = grad_w = None
    if ctx.needs_input_grad[0] and grad_rows is not None:  # a combine with unit weights
        rows = torch.where(valid[:, None], grad_rows, 0).to(ctx.x_dtype).contiguous()
        grad_x = torch.ops.triton_dist.ep_combine_train(rows, valid.float(), topk_idx, token_pos, slots, span,
                                                        *ctx.routing)
    if ctx.needs_input_grad[2] and grad_weights is not None:
        grad_w = torch.ops.triton_dist.ep_scalars_home(torch.where(valid, grad_weights.float(), 0.0), slots,
                                                       token_pos, ctx.routing[3]).to(ctx.w_dtype)
    return grad_x, None, grad_w, None, None, None, None, None


def _combine_setup(ctx, inputs, output):
    expert_out, weights, topk_idx = inputs[:3]
    ctx.routing = inputs[6:]  # (num_experts, max_tokens, align, group_name, num_chunks)
    ctx.save_for_backward(expert_out, weights, topk_idx)


def _combine_backward(ctx, grad):
    expert_out, weights, topk_idx = ctx.saved_tensors
    unit = torch.ones(topk_idx.shape, dtype=torch.float32, device=topk_idx.device)
    g_rows, expert_ids = torch.ops.triton_dist.ep_dispatch_train(grad.contiguous(), topk_idx, unit, *ctx.routing)[:2]
    # (expert_out may stop at the rows in use; weights cover every row)
    grad_out, grad_w = torch.ops.triton_dist.ep_combine_grad(g_rows, expert_out, weights, expert_ids)
    return (grad_out if ctx.needs_input_grad[0] else None, grad_w.to(weights.dtype) if ctx.needs_input_grad[1]
            else None, None, None, None, None, None, None, None, None, None)


torch.library.register_autograd("triton_dist::ep_dispatch_train", _dispatch_backward, setup_context=_dispatch_setup)
torch.library.register_autograd("triton_dist::ep_combine_train", _combine_backward, setup_context=_combine_setup)


# ----------------------------------------------------------------------------------------------------- Python API
@functools.wraps(_dispatch.ep_dispatch)
def ep_dispatch(x, topk_idx, topk_weights, *, num_experts, max_tokens, align=1, exact=False, check_ids=None,
                config=None, timeline=None, group=None, quant=None, x_scales=None):
    kwargs = dict(num_experts=num_experts, max_tokens=max_tokens, align=align, exact=exact, check_ids=check_ids,
                  config=config, timeline=timeline, group=group, quant=quant, x_scales=x_scales)
    tensors = isinstance(x, torch.Tensor) and isinstance(topk_weights, torch.Tensor)
    grad = tensors and library.needs_grad(x, topk_weights)
    plain = quant is None and x_scales is None and not exact and timeline is None
    if not (grad or (tensors and plain and config is None and hardware.compiling())):
        return _dispatch.ep_dispatch(x, topk_idx, topk_weights, **kwargs)
    if not plain:
        raise ValueError("ep_dispatch: the FP8 dispatch, exact=True and timeline= are for calls without grad (call "
                         "it under torch.no_grad(), or without them)")
    if not isinstance(topk_idx, torch.Tensor):
        raise TypeError(f"topk_idx must be a torch.Tensor, got {type(topk_idx).__name__}")
    name = shmem.group_name(group)
    # config=: its chunks go to the op (the records, and so both backwards, follow them), its other knobs to the
    # op's forward through the caller (eagerly)
    chunks = 0 if config is None else int(dispatch_config(max_tokens, x.shape[-1], x.device.type, config).num_chunks)
    rows, ids, weights, counts, offsets, token_pos, slots, span = library.with_caller_config(
        "ep_dispatch_train", config, lambda: torch.ops.triton_dist.ep_dispatch_train(
            x, topk_idx, topk_weights, num_experts, max_tokens, align, name, chunks))
    routing = EpRouting(topk_idx, token_pos, slots, span, weights, num_experts, max_tokens, align, name, chunks)
    return EpDispatchResult(rows, ids, weights, counts, offsets, routing)


@functools.wraps(_combine.ep_combine)
def ep_combine(expert_out, handle, out=None, config=None, timeline=None):
    if isinstance(handle, EpRouting):
        if out is not None or timeline is not None:
            raise ValueError("ep_combine: out= and timeline= are for calls without grad (a dispatch under "
                             "torch.no_grad())")
        if not isinstance(expert_out, torch.Tensor):
            raise TypeError(f"expert_out must be a torch.Tensor, got {type(expert_out).__name__}")
        return library.with_caller_config("ep_combine_train", config, lambda: torch.ops.triton_dist.ep_combine_train(
            expert_out, handle.weights, handle.topk_idx, handle.token_pos, handle.slots, handle.span,
            handle.num_experts, handle.max_tokens, handle.align, handle.group_name, handle.num_chunks))
    if isinstance(expert_out, torch.Tensor) and library.needs_grad(expert_out):
        raise ValueError("ep_combine: expert_out requires grad but its dispatch ran without (the backward needs the "
                         "routing): call ep_dispatch with grad enabled and x or topk_weights requiring grad")
    return _combine.ep_combine(expert_out, handle, out=out, config=config, timeline=timeline)
