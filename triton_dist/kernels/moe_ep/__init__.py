"""MoE expert parallelism: dispatch tokens to the ranks that own their experts, combine the expert outputs back.

Rank d owns the ``EL = E / W`` experts ``[d * EL, (d + 1) * EL)``. Every rank has tokens ``x[T, H]``, router
choices ``topk_idx[T, K]`` (``-1``: unused slot) and ``topk_weights[T, K]``. The ops compute what this plain program
does, without ever synchronising with the host:

    recv = ep_dispatch(x, topk_idx, topk_weights, num_experts=E, max_tokens=M)
    out = my_experts(recv.x, recv.expert_offsets)          # rows grouped by local expert
    y = ep_combine(out, recv.handle)                       # y[t] = sum_j w[t, j] * expert_{idx[t, j]}(x[t])

Receive layout on rank d: ``recv.x[rows, H]`` holds one row per (token, slot) whose expert lives on d, grouped by
local expert: expert e owns rows ``[expert_offsets[e], expert_offsets[e] + expert_counts[e])``, its group starting
on a multiple of ``align`` (padding rows: ``expert_ids == -1``, ``weights == 0``); inside a group rows go by source
rank, then token, then slot. Buffers are sized for the worst case (``max_tokens`` per rank), so the whole path is
CUDA-graph capturable; ``ep_dispatch(..., exact=True)`` syncs once and trims. Outputs are views of a cached
workspace, valid until the next dispatch with the same shapes.

    layout    (layout.py)     per-chunk counts and where each chunk's rows start; counts pushed to every rank
    dispatch  (dispatch.py)   each token crosses the link once per destination rank, then fans out to its slots
    combine   (combine.py)    one partial per (token, rank) comes back; the sum runs in slot, then rank order
    training  (training.py)   autograd: each the other's backward, the top-k weights' gradient included
    protocol  (protocol.py)   work claims, chunk flags, the no-deadlock rule; knobs: config.py

Flags carry per-call epochs; dispatch's exchange of counts doubles as its ready handshake. docs/design/moe_ep.md.
FP8 dispatch (``quant="fp8"``, or FP8 x with its scales): the rows travel and arrive as FP8 with per-1x128-group
scales (``recv.scales``); combine stays in the activations' dtype. Torch ops: ep_dispatch, ep_dispatch_fp8
(x, x_scales or None, ...: x and its scales first in its results), ep_combine (quant="fp8" after an FP8 dispatch),
zero-copy and forward-only; ep_dispatch_train / ep_combine_train, differentiable (training.py: new tensors, the
records carried as tensors; what the Python API calls with grad or under torch.compile).
"""

import torch

from ... import shmem
from .. import library
from .buffers import EpDispatchResult, EpHandle, max_recv_rows  # noqa: F401
from .combine import ep_combine_kernel  # noqa: F401
from .config import CombineConfig, DispatchConfig, combine_config, dispatch_config  # noqa: F401
from .dispatch import ep_dispatch_kernel  # noqa: F401
from .training import EpRouting, ep_combine, ep_dispatch  # noqa: F401  (the kernels' ops, with autograd: training.py)
from . import combine as _combine, dispatch as _dispatch
from .layout import ep_layout_kernel  # noqa: F401
from .protocol import MAX_CHUNKS, TIMELINE_SLOTS, TL_CHUNK, TL_LAYOUT, TL_PROGRAM  # noqa: F401


# ----------------------------------------------------------------------------------------------------- torch ops
def _fake_rows(num_experts, topk, max_tokens, align, group):
    return max_recv_rows(shmem.world_size(group), num_experts, topk, max_tokens, align)


def _ep_dispatch_op(x, topk_idx, topk_weights, num_experts, max_tokens, align, group_name=None):
    r = _dispatch.ep_dispatch(x, topk_idx, topk_weights, num_experts=num_experts, max_tokens=max_tokens, align=align,
                    check_ids=False, group=shmem.group_named(group_name))
    # zero-copy: views of the workspace (distinct buffers, so no two outputs alias), valid until the next dispatch
    return r.x, r.expert_ids, r.weights, r.expert_counts, r.expert_offsets, r.handle.token_pos


def _ep_dispatch_fake(x, topk_idx, topk_weights, num_experts, max_tokens, align, group_name=None):
    group = shmem.group_named(group_name)
    world = shmem.world_size(group)
    rows = _fake_rows(num_experts, topk_idx.shape[1], max_tokens, align, group)
    local = num_experts // world
    i32 = dict(dtype=torch.int32, device=x.device)
    return (x.new_empty((rows, x.shape[1])), torch.empty((rows,), **i32),
            torch.empty((rows,), dtype=torch.float32, device=x.device), torch.empty((local,), **i32),
            torch.empty((local + 1,), **i32), torch.empty((x.shape[0], world), **i32))


def _ep_dispatch_fp8_op(x, x_scales, topk_idx, topk_weights, num_experts, max_tokens, align, group_name=None):
    r = _dispatch.ep_dispatch(x, topk_idx, topk_weights, num_experts=num_experts, max_tokens=max_tokens, align=align,
                    check_ids=False, group=shmem.group_named(group_name), quant="fp8", x_scales=x_scales)
    return r.x, r.scales, r.expert_ids, r.weights, r.expert_counts, r.expert_offsets, r.handle.token_pos


def _ep_dispatch_fp8_fake(x, x_scales, topk_idx, topk_weights, num_experts, max_tokens, align, group_name=None):
    rx, *rest = _ep_dispatch_fake(x, topk_idx, topk_weights, num_experts, max_tokens, align, group_name)
    scales = torch.empty((rx.shape[0], (x.shape[1] + 127) // 128), dtype=torch.float32, device=x.device)
    return (rx.to(torch.float8_e4m3fn), scales, *rest)


def _ep_combine_op(expert_out, token_pos, num_experts, topk, max_tokens, align, group_name=None, quant="none"):
    key = (num_experts, topk, max_tokens, expert_out.shape[1], expert_out.dtype, align)
    key += ("fp8",) if quant == "fp8" else ()
    ws = shmem.workspaces.peek("moe_ep", key, shmem.group_named(group_name))
    if ws is None or ws.last is None:
        raise ValueError("torch.ops.triton_dist.ep_combine needs an earlier ep_dispatch with the same shapes")
    if token_pos.shape[0] != ws.last.num_tokens:
        raise ValueError(f"token_pos has {token_pos.shape[0]} tokens, the latest dispatch had "
                         f"{ws.last.num_tokens}")
    return _combine.ep_combine(expert_out, ws.last)


def _ep_combine_fake(expert_out, token_pos, num_experts, topk, max_tokens, align, group_name=None, quant="none"):
    return expert_out.new_empty((token_pos.shape[0], expert_out.shape[1]))


library.define("ep_dispatch(Tensor x, Tensor topk_idx, Tensor topk_weights, int num_experts, int max_tokens, "
               "int align, str? group_name=None) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
               _ep_dispatch_op, _ep_dispatch_fake)
library.define("ep_dispatch_fp8(Tensor x, Tensor? x_scales, Tensor topk_idx, Tensor topk_weights, int num_experts, "
               "int max_tokens, int align, str? group_name=None) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, "
               "Tensor)", _ep_dispatch_fp8_op, _ep_dispatch_fp8_fake)
library.define("ep_combine(Tensor expert_out, Tensor token_pos, int num_experts, int topk, int max_tokens, "
               "int align, str? group_name=None, str quant=\"none\") -> Tensor", _ep_combine_op, _ep_combine_fake)
library.collective("ep_dispatch", "ep_dispatch_fp8", "ep_combine")
