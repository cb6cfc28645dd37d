"""The MoE workspace (sized for the worst case, so nothing waits for the host) and what dispatch returns."""

from dataclasses import dataclass
from typing import Optional

import torch

from ... import language as dl
from ... import shmem
from ...hardware import cdiv, next_power_of_2
from .. import fp8
from .protocol import MAX_CHUNKS

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def max_recv_rows(world, num_experts, topk, max_tokens, align=1):
    """Worst-case rows of a rank's receive buffer: every slot of every token of every rank lands here (K, not
    min(K, EL): a router may repeat an expert id within a token), plus alignment padding."""
    local = num_experts // world
    return world * max_tokens * topk + local * (align - 1)


class Buffers:
    """The workspace of one (E, K, max_tokens, H, dtype, align[, "fp8"]): receive buffers, counts, partials and flags
    (symmetric: peers write them), the per-row outputs and chunk tables (local), and the epoch and work counters.
    ``dtype``: the rows' and combine's; "fp8": the rows arrive as float8_e4m3fn with fp32 scales per 1x128 group
    (``recv_scales``), combine stays in ``dtype``."""

    def __init__(self, num_experts, topk, max_tokens, hidden, dtype, align, group, wire=None):
        w = shmem.world_size(group)
        dev = shmem.device()
        self.team = shmem.team(group)
        self.key = (num_experts, topk, max_tokens, hidden, dtype, align) + ((wire,) if wire else ())
        self.num_experts, self.topk, self.max_tokens, self.hidden, self.dtype, self.align = self.key[:6]
        self.local = num_experts // w
        self.el_pad = max(2, next_power_of_2(self.local))  # (no one-lane axis: dl.rank_lanes)
        self.w_pad = dl.rank_lanes(w)  # (W = 1: two lanes, see dl.rank_lanes)
        self.max_rows = max_recv_rows(w, num_experts, topk, max_tokens, align)
        ep = self.w_pad * self.el_pad
        name = "ep."
        # symmetric: peers write here
        self.recv_x = shmem.empty((self.max_rows, hidden), torch.float8_e4m3fn if wire else dtype, name=name + "recv_x",
                                  group=group)
        self.recv_scales = shmem.empty((self.max_rows, cdiv(hidden, 128)), torch.float32,
                                       name=name + "recv_scales", group=group) if wire else None
        self.recv_slots = shmem.empty((w, max_tokens, topk), torch.int32, name=name + "recv_slots", group=group)
        self.recv_w = shmem.empty((w, max_tokens, topk), torch.float32, name=name + "recv_w", group=group)
        self.recv_span = shmem.zeros((w, MAX_CHUNKS, 2), torch.int32, name=name + "recv_span", group=group)
        self.all_counts = shmem.zeros((2, w, ep), torch.int32, name=name + "counts", group=group)
        # one block per peer (this rank's own partial never leaves the registers of combine's receivers)
        self.partials = shmem.empty((2, max(w - 1, 1), max_tokens, hidden), dtype, name=name + "partials",
                                    group=group)
        self.counts_ready = shmem.signals((w,), name=name + "counts_ready", group=group)
        self.arrived = shmem.signals((w * MAX_CHUNKS,), name=name + "arrived", group=group)
        self.combined = shmem.signals((w * MAX_CHUNKS,), name=name + "combined", group=group)
        # local
        self.expert_ids = torch.full((self.max_rows,), -1, dtype=torch.int32, device=dev)
        self.weights = torch.zeros((self.max_rows,), dtype=torch.float32, device=dev)
        self.expert_counts = torch.zeros((self.local,), dtype=torch.int32, device=dev)
        self.expert_offsets = torch.zeros((self.local + 1,), dtype=torch.int32, device=dev)
        self.token_pos = torch.full((max_tokens, w), -1, dtype=torch.int32, device=dev)
        self.chunk_counts = torch.zeros((MAX_CHUNKS, ep + self.w_pad), dtype=torch.int32, device=dev)
        self.chunk_prefix = torch.zeros_like(self.chunk_counts)
        self.counted = shmem.counters(MAX_CHUNKS, name=name + "counted")  # layout flags (epochs)
        self.state = shmem.counters(2, name=name + "epoch")
        self.combine_state = shmem.counters(2, name=name + "combine_epoch")
        # work counters, [0]: the receivers' next unit, [1]: the senders' next chunk (shmem.counters:
        # td.shmem.reset() zeroes them after a failed call)
        self.combine_claims = shmem.counters(2, name=name + "combine_claims")
        self.dispatch_claims = shmem.counters(2, name=name + "dispatch_claims")
        self.calls = 0  # host count of dispatches: a handle from an older one is stale
        self.last = None  # the EpHandle of the latest dispatch, for the torch op's combine


def buffers(num_experts, topk, max_tokens, hidden, dtype, align, group=None, wire=None):
    """The workspace of these shapes on ``group`` (collective on first use); ``wire="fp8"``: FP8 rows."""
    key = (num_experts, topk, max_tokens, hidden, dtype, align) + ((wire,) if wire else ())
    return shmem.workspace("moe_ep", key, lambda: Buffers(*key[:6], group, wire), group=group)




@dataclass
class EpHandle:
    """What ep_combine needs from a dispatch: the workspace, which call it was, and the token chunking."""

    workspace: Buffers
    call: int
    num_tokens: int
    num_chunks: int
    token_pos: torch.Tensor  # [T, W] int32: position of token t in rank d's receive list (-1: not sent)


@dataclass
class EpDispatchResult:
    x: torch.Tensor               # [rows, H] received rows, grouped by local expert (worst-case rows unless exact)
    expert_ids: torch.Tensor      # [rows] int32 local expert of each row, -1 for padding / unused rows
    weights: torch.Tensor         # [rows] float32 router weight of each row, 0 for padding
    expert_counts: torch.Tensor   # [EL] int32 rows per local expert
    expert_offsets: torch.Tensor  # [EL + 1] int32 first row of each expert's group (multiples of align); [EL]=end
    handle: EpHandle
    scales: Optional[torch.Tensor] = None  # FP8 rows: [rows, ceil(H/128)] fp32, one per 1x128 group of a row


def check_inputs(x, topk_idx, topk_weights, num_experts, max_tokens, align, world):
    for name, t in (("x", x), ("topk_idx", topk_idx), ("topk_weights", topk_weights)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        shmem.check_device(t, name)
    if x.dtype not in DTYPES + (torch.float8_e4m3fn,):
        raise TypeError(f"x must be bfloat16, float16, float32 (or float8_e4m3fn with x_scales), got {x.dtype}")
    if topk_idx.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"topk_idx must be int32 or int64, got {topk_idx.dtype}")
    if not topk_weights.dtype.is_floating_point:
        raise TypeError(f"topk_weights must be a floating tensor, got {topk_weights.dtype}")
    if x.dim() != 2 or topk_idx.dim() != 2 or tuple(topk_weights.shape) != tuple(topk_idx.shape) \
            or topk_idx.shape[0] != x.shape[0]:
        raise ValueError(f"expected x [T, H], topk_idx [T, K], topk_weights [T, K]; got {list(x.shape)}, "
                         f"{list(topk_idx.shape)}, {list(topk_weights.shape)}")
    if not isinstance(num_experts, int) or num_experts <= 0 or num_experts % world:
        raise ValueError(f"num_experts must be a positive multiple of the {world} ranks, got {num_experts}")
    if not isinstance(max_tokens, int) or max_tokens <= 0:
        raise ValueError(f"max_tokens must be a positive int (the same on every rank), got {max_tokens!r}")
    if x.shape[0] > max_tokens:
        raise ValueError(f"{x.shape[0]} tokens exceed max_tokens={max_tokens}")
    if not isinstance(align, int) or align < 1:
        raise ValueError(f"align must be a positive int, got {align!r}")
    k = topk_idx.shape[1]
    if not 1 <= k <= num_experts:
        raise ValueError(f"topk must be in [1, num_experts={num_experts}], got {k}")
    if x.shape[1] == 0:
        raise ValueError("x has no columns")


def check_fp8(x, quant, x_scales):
    """A dispatch's FP8 mode ("": none, "quantize": the senders quantise x, "given": x is FP8 with x_scales) and
    the dtype ep_combine then works in, or TypeError / ValueError."""
    if quant not in (None, "none", "fp8"):
        raise ValueError(f"quant must be None or 'fp8', got {quant!r}")
    if x.dtype == torch.float8_e4m3fn:
        groups = cdiv(x.shape[1], 128)
        if not isinstance(x_scales, torch.Tensor) or x_scales.dtype != torch.float32:
            raise TypeError(f"x in float8_e4m3fn needs x_scales, a float32 tensor [T, {groups}] (one scale per 1x128 "
                            f"group), got {getattr(x_scales, 'dtype', type(x_scales).__name__)}")
        if tuple(x_scales.shape) != (x.shape[0], groups):
            raise ValueError(f"x_scales must be [T, ceil(H/128)] = {[x.shape[0], groups]}, got {list(x_scales.shape)}")
        shmem.check_device(x_scales, "x_scales")
        mode, dtype = "given", torch.bfloat16
    elif x_scales is not None:
        raise ValueError("x_scales go with FP8 x (float8_e4m3fn); quant='fp8' computes them from x")
    else:
        mode, dtype = ("quantize" if quant == "fp8" else ""), x.dtype
    if mode:
        fp8.check_device(x)
    return mode, dtype
