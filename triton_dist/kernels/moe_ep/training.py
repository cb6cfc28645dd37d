"""Autograd for MoE dispatch and combine: each is the other's backward, the top-k weights' gradient included.

    recv = ep_dispatch(x, topk_idx, topk_weights, ...)       rows of x, and the weight of each row (recv.weights)
    y = ep_combine(expert_out, recv.handle)                   y[t] = sum_j w[t, j] * expert_out[row of (t, j)]

    combine's backward    the output's gradient g dispatched like x (the same routing, so the same rows):
                              grad expert_out[row] = w[row] * g[t(row)]
                              grad w[row] = <g[t(row)], expert_out[row]>          (on the expert's rank)
    dispatch's backward   grad x[t] = sum_j grad rows[row of (t, j)]: a combine with unit weights
                          grad topk_weights[t, j] = grad w[row of (t, j)]: the rows' scalars sent back to their
                          tokens' ranks (one all-to-all of [W, max_tokens, K] scalars)

Combine's backward dispatches g with unit weights, so the handle it leaves is the one dispatch's backward combines
with (another dispatch of the same shapes in between, or no combine at all: it dispatches zeros to get one). The
forward keeps copies of the rows, their weights, the routing and the records (later dispatches of the same
shapes reuse the workspace). Rows outside every expert group (padding) carry no gradient. Sums run in the
kernels' fixed orders: bitwise reproducible. Eager and activation checkpointing; under torch.compile they run
eagerly between the compiled graphs (the handle is host state; fullgraph=True cannot take them); the FP8 dispatch
has no backward.
"""

import functools

import torch
import torch.distributed as dist

from .. import library
from . import combine as _combine
from . import dispatch as _dispatch
from .buffers import EpDispatchResult


def _unit_handle(handle):
    """A handle of this routing whose records carry unit weights, current in the workspace."""
    ws, unit = handle.workspace, getattr(handle, "unit", None)
    if unit is not None and unit.call == ws.calls:
        return unit
    t = handle.topk_idx
    r = _dispatch.ep_dispatch(torch.zeros((t.shape[0], ws.hidden), dtype=ws.dtype, device=t.device), t,
                              torch.ones(t.shape, dtype=torch.float32, device=t.device), **handle.dispatch_args)
    return r.handle


def _scalars_home(row_values, slots, token_pos, group):
    """[T, K]: the value of the row of every (token, slot) of this rank's tokens, from ``row_values`` [rows] of
    every rank (``slots`` [W, max_tokens, K]: this rank's rows of each rank's received tokens, -1: none)."""
    # (records past what a rank sent are stale memory: clamped here, and never picked at home, where only the
    # positions a token took are read)
    ok = (slots >= 0) & (slots < row_values.shape[0])
    mine = torch.where(ok, row_values[torch.where(ok, slots, 0).long()], 0.0)  # [W (their rank), max_tokens, K]
    theirs = torch.empty_like(mine)  # [W (the expert's rank), max_tokens, K]
    if mine.shape[0] > 1:
        dist.all_to_all_single(theirs, mine.contiguous(), group=group)
    else:
        theirs.copy_(mine)
    at = token_pos.long()  # [T, W]: my token t's position in rank d's list
    picked = theirs.permute(1, 0, 2)[at.clamp(min=0), torch.arange(at.shape[1], device=at.device)]  # [T, W, K]
    return torch.where((at >= 0)[:, :, None], picked, 0.0).sum(dim=1)


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topk_idx, topk_weights, args, holder):
        recv = _dispatch.ep_dispatch(x, topk_idx, topk_weights, **args)
        ws, handle = recv.handle.workspace, recv.handle
        holder["handle"] = handle
        handle.topk_idx, handle.dispatch_args = topk_idx.clone(), args
        ctx.handle, ctx.group = handle, ws.team.group
        ctx.slots, ctx.token_pos = ws.recv_slots.clone(), handle.token_pos.clone()
        ctx.valid = recv.expert_ids >= 0
        ctx.x_dtype, ctx.w_dtype = x.dtype, topk_weights.dtype
        ids, counts, offsets = recv.expert_ids.clone(), recv.expert_counts.clone(), recv.expert_offsets.clone()
        ctx.mark_non_differentiable(ids, counts, offsets)
        return recv.x.clone(), recv.weights.clone(), ids, counts, offsets

    @staticmethod
    def backward(ctx, grad_rows, grad_weights, *_):
        grad_x = grad_w = None
        if ctx.needs_input_grad[0] and grad_rows is not None:
            rows = torch.where(ctx.valid[:, None], grad_rows, 0).to(ctx.x_dtype).contiguous()
            grad_x = _combine.ep_combine(rows, _unit_handle(ctx.handle))
        if ctx.needs_input_grad[2] and grad_weights is not None:
            grad_w = _scalars_home(torch.where(ctx.valid, grad_weights.float(), 0.0), ctx.slots, ctx.token_pos,
                                   ctx.group).to(ctx.w_dtype)
        return grad_x, None, grad_w, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, expert_out, weights, handle, args):
        ctx.handle = handle
        ctx.save_for_backward(expert_out, weights)
        return _combine.ep_combine(expert_out, handle, **args)

    @staticmethod
    def backward(ctx, grad):
        expert_out, weights = ctx.saved_tensors
        handle = ctx.handle
        t = handle.topk_idx
        unit = _dispatch.ep_dispatch(grad.contiguous(), t, torch.ones(t.shape, dtype=torch.float32, device=t.device),
                                     **handle.dispatch_args)
        handle.unit = unit.handle  # what the dispatch's backward combines with
        valid = (unit.expert_ids >= 0)[:, None]
        g_rows = unit.x[:expert_out.shape[0]]
        grad_out = torch.where(valid[:expert_out.shape[0]], g_rows.float() * weights[:expert_out.shape[0], None], 0)
        grad_w = None
        if ctx.needs_input_grad[1]:
            dots = (g_rows.float() * expert_out.float()).sum(dim=1)
            grad_w = torch.zeros_like(weights)
            grad_w[:expert_out.shape[0]] = torch.where(valid[:expert_out.shape[0], 0], dots, 0.0)
        return grad_out.to(expert_out.dtype), grad_w, None, None


@functools.wraps(_dispatch.ep_dispatch)
def ep_dispatch(x, topk_idx, topk_weights, *, num_experts, max_tokens, align=1, exact=False, check_ids=None,
                config=None, timeline=None, group=None, quant=None, x_scales=None):
    kwargs = dict(num_experts=num_experts, max_tokens=max_tokens, align=align, exact=exact, check_ids=check_ids,
                  config=config, timeline=timeline, group=group, quant=quant, x_scales=x_scales)
    if not (isinstance(x, torch.Tensor) and isinstance(topk_weights, torch.Tensor)
            and library.needs_grad(x, topk_weights)):
        return _dispatch.ep_dispatch(x, topk_idx, topk_weights, **kwargs)
    if quant is not None or x_scales is not None or exact:
        raise ValueError("ep_dispatch: the FP8 dispatch and exact=True have no backward (call it under "
                         "torch.no_grad(), or without them)")
    return _dispatch_with_grad(x, topk_idx, topk_weights,
                               {k: v for k, v in kwargs.items() if k not in ("quant", "x_scales", "exact")})


@torch.compiler.disable  # (host state: under torch.compile the differentiable MoE ops run eagerly, a graph break)
def _dispatch_with_grad(x, topk_idx, topk_weights, args):
    holder = {}
    rows, weights, ids, counts, offsets = _Dispatch.apply(x, topk_idx, topk_weights, args, holder)
    handle = holder["handle"]
    handle.weights = weights  # the differentiable weights ep_combine applies (their values: the handle's records)
    return EpDispatchResult(rows, ids, weights, counts, offsets, handle)


@functools.wraps(_combine.ep_combine)
def ep_combine(expert_out, handle, out=None, config=None, timeline=None):
    weights = getattr(handle, "weights", None)
    if not (isinstance(expert_out, torch.Tensor) and (library.needs_grad(expert_out) or
                                                      (weights is not None and library.needs_grad(weights)))):
        return _combine.ep_combine(expert_out, handle, out=out, config=config, timeline=timeline)
    if out is not None:
        raise ValueError("ep_combine: out= is for calls without grad (under torch.no_grad())")
    return _combine_with_grad(expert_out, weights, handle, dict(config=config, timeline=timeline))


@torch.compiler.disable
def _combine_with_grad(expert_out, weights, handle, args):
    return _Combine.apply(expert_out, weights, handle, args)
