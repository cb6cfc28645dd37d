"""MoE combine: every token's expert outputs, weighted, summed back on the token's own rank in a FIXED order
(slots in top-k order within a rank, then ranks in order), so y is bitwise identical run to run.

    ep_combine_kernel (one launch)
      SENDERS    [0, n_push), chunk after chunk from a counter (``_send_partials``): for chunk c of every PEER s,
                 partial = sum over the token's slots here of w * out[slot row] (fp32, rounded to the dtype), one
                 row pushed back to s into partials[call parity, (me - s - 1) mod W, pos]; then the chunk's flags
      RECEIVERS  (chunk, column part) units of this rank's tokens from a counter (``_combine_unit``): this rank's
                 own partial in registers (never stored), then wait for every peer's flag of the chunk and
                 y[t] = sum over d = 0..W-1 of partial_d(t) (fp32, rank order). On a GPU the senders join them.

No ready handshake: the partials alternate between two sets by call parity, and rank r writes the set of call n
into s only after its own call n-1 waited for every flag of s's call n-1, so s is done with call n-2, the last
reader of that set (combines may repeat on one dispatch handle). EVICT: the L2 policy of the expert rows' loads
and of y's stores (each touched once), so that partials arriving over the link may stay in L2 until summed.
"""

import torch
import triton
import triton.language as tl

from ... import language as dl
from ... import shmem
from ...hardware import cdiv, next_power_of_2
from ..launcher import Launcher
from . import protocol
from .buffers import EpHandle
from .config import check_timeline, combine_config, register_cap, senders_help, tail
from .layout import column
from .protocol import MAX_CHUNKS, TL_CHUNK, TL_PROGRAM


# ----------------------------------------------------------------------------------------------------- device side
@triton.jit
def _slot_sum(expert_out, slots, w, hh, H, K: tl.constexpr, K_PAD: tl.constexpr, BT: tl.constexpr,
              BH: tl.constexpr, EVICT: tl.constexpr):
    """fp32 [BT, BH] sum over j = 0..K-1, in that FIXED order, of w[:, j] * expert_out[slots[:, j], hh]
    (slots < 0 contribute nothing): a token's partial over the slots one rank holds."""
    kk = tl.arange(0, K_PAD)
    hm = hh[None, :] < H
    acc = tl.zeros([BT, BH], dtype=tl.float32)
    for j in tl.static_range(K):
        row = column(slots, j, kk)
        wj = column(w, j, kk)
        v = tl.load(expert_out + row[:, None].to(tl.int64) * H + hh[None, :], mask=(row >= 0)[:, None] & hm,
                    other=0.0, eviction_policy=EVICT)
        acc += wj[:, None] * v.to(tl.float32)
    return acc


@triton.jit
def _send_partials(c, pending, kk, expert_out, H, max_tokens, recv_slots, recv_w, recv_span, partials, combined,
                   epoch, me, world, ctx, timeline, K: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr,
                   K_PAD: tl.constexpr, MAXC: tl.constexpr, TIMELINE: tl.constexpr, DEFER_SIGNAL: tl.constexpr,
                   EVICT: tl.constexpr):
    """A sender's chunk ``c``: the partial of every token of chunk c of every peer, pushed back to its rank; then
    the chunk's flags (or, DEFER_SIGNAL, they are left pending). Returns the pending chunk."""
    for i in range(world - 1):  # peers only: this rank's own partials are summed by its receivers
        s = (me + 1 + i) % world
        p0 = tl.load(recv_span + (s * MAXC + c) * 2)
        p1 = tl.load(recv_span + (s * MAXC + c) * 2 + 1)
        for q0 in range(p0, p1, BT):
            pos = q0 + tl.arange(0, BT)
            pm = pos < p1
            m = pm[:, None] & (kk[None, :] < K)
            rec = (s * max_tokens + pos[:, None]) * K + kk[None, :]
            slots = tl.load(recv_slots + rec, mask=m, other=-1)
            w = tl.load(recv_w + rec, mask=m, other=0.0)
            block = (me - s - 1 + world) % world  # s keeps one block of partials per peer
            dst = partials + (block * max_tokens + pos[:, None]).to(tl.int64) * H
            for h0 in range(0, H, BH):
                hh = h0 + tl.arange(0, BH)
                hm = hh[None, :] < H
                acc = _slot_sum(expert_out, slots, w, hh, H, K, K_PAD, BT, BH, EVICT)
                # (DEFER_SIGNAL) the previous chunk's pushes drained meanwhile: flag it
                pending = protocol.flag_pending(combined, pending, epoch, ctx, timeline, MAXC, TIMELINE)
                dl.put(dst + hh[None, :], acc.to(partials.dtype.element_ty), s, ctx, mask=pm[:, None] & hm)
    return protocol.chunk_sent(combined, c, pending, epoch, ctx, timeline, MAXC, TIMELINE, DEFER_SIGNAL)


@triton.jit
def _combine_unit(u, dv, kk, chunk, n_chunks, h_parts, tail, tail_parts, T, H, max_tokens, expert_out, y, recv_slots,
                  recv_w, token_pos, partials, combined, epoch, me, world, ctx, timeline, K: tl.constexpr,
                  BT: tl.constexpr, BH: tl.constexpr, K_PAD: tl.constexpr, W_PAD: tl.constexpr, MAXC: tl.constexpr,
                  TIMELINE: tl.constexpr, EVICT: tl.constexpr):
    """Receiver unit ``u`` (chunk c, column part) of this rank's tokens: y = the partials of every rank summed in
    rank order, this rank's computed here, the peers' awaited with the first own tile in hand."""
    c, h_first, h_end = protocol.receiver_unit(u, n_chunks, h_parts, tail, tail_parts, H, BH)
    c0 = tl.minimum(c * chunk, T)
    c1 = tl.minimum(c0 + chunk, T)
    for t0 in range(c0, c1, BT):
        t = t0 + tl.arange(0, BT)
        tm = t < c1
        pos = tl.load(token_pos + t[:, None] * world + dv[None, :], mask=tm[:, None] & (dv[None, :] < world),
                      other=-1)
        p_me = column(pos, me, dv)
        m = (p_me >= 0)[:, None] & (kk[None, :] < K)
        rec = (me * max_tokens + p_me[:, None]) * K + kk[None, :]
        slots = tl.load(recv_slots + rec, mask=m, other=-1)
        w = tl.load(recv_w + rec, mask=m, other=0.0)
        for h0 in range(h_first, h_end, BH):
            hh = h0 + tl.arange(0, BH)
            hm = hh[None, :] < H
            # this rank's partial, rounded like the partials that crossed the link
            own = _slot_sum(expert_out, slots, w, hh, H, K, K_PAD, BT, BH, EVICT).to(partials.dtype.element_ty)
            if (t0 == c0) & (h0 == h_first):
                dl.wait(combined + dv * MAXC + c, epoch, ctx, mask=(dv < world) & (dv != me))
                protocol.stamp(timeline, TL_CHUNK + 4 * c + 1, TIMELINE)
            acc = tl.zeros([BT, BH], dtype=tl.float32)
            for d in range(world):  # FIXED order: rank order
                if d == me:
                    acc += own.to(tl.float32)
                else:
                    pd = column(pos, d, dv)
                    block = (d - me - 1 + world) % world
                    v = tl.load(partials + (block * max_tokens + pd[:, None]).to(tl.int64) * H + hh[None, :],
                                mask=(pd >= 0)[:, None] & hm, other=0.0)
                    acc += v.to(tl.float32)
            tl.store(y + t[:, None].to(tl.int64) * H + hh[None, :], acc.to(y.dtype.element_ty),
                     mask=tm[:, None] & hm, eviction_policy=EVICT)
    if (c0 == c1) & (h_first == 0):  # no tokens here: the flags are still awaited (partials' double buffer)
        dl.wait(combined + dv * MAXC + c, epoch, ctx, mask=(dv < world) & (dv != me))
    protocol.stamp(timeline, TL_CHUNK + 4 * c + 2, TIMELINE)


@triton.jit
def ep_combine_kernel(expert_out, y, T, H, max_tokens, n_chunks, h_parts, tail, tail_parts, n_push, recv_slots,
                      recv_w, recv_span, token_pos, partials, combined, claims, state, ctx, timeline,
                      K: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr, K_PAD: tl.constexpr,
                      W_PAD: tl.constexpr, MAXC: tl.constexpr, SENDERS_HELP: tl.constexpr,
                      TIMELINE: tl.constexpr, DEFER_SIGNAL: tl.constexpr, EVICT: tl.constexpr):
    """Programs [0, n_push) send partials (``claims[1]``), then every program taking part receives
    (``claims[0]``); see the module docstring."""
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    protocol.stamp(timeline, TL_PROGRAM + 4 * pid, TIMELINE)
    me = dl.rank(ctx)
    world = dl.num_ranks(ctx)
    epoch = dl.call_epoch(state)
    dv = tl.arange(0, W_PAD)
    kk = tl.arange(0, K_PAD)
    # this call's set of partials (two sets, so no handshake before pushing)
    partials += (epoch % 2).to(tl.int64) * tl.maximum(world - 1, 1) * max_tokens * H
    if pid < n_push:
        protocol.stamp(timeline, TL_PROGRAM + 4 * pid + 1, TIMELINE)
        c = protocol.next_claim(claims + 1)
        pending = tl.full((), -1, tl.int32)  # DEFER_SIGNAL: the sent chunk whose flags are not raised yet
        while c < n_chunks:
            pending = _send_partials(c, pending, kk, expert_out, H, max_tokens, recv_slots, recv_w, recv_span, partials,
                                     combined, epoch, me, world, ctx, timeline, K, BT, BH, K_PAD, MAXC, TIMELINE,
                                     DEFER_SIGNAL, EVICT)
            c = protocol.next_claim(claims + 1)
        protocol.flag_pending(combined, pending, epoch, ctx, timeline, MAXC, TIMELINE)
        protocol.end_claims(claims + 1, c, n_chunks, n_push)
        protocol.stamp(timeline, TL_PROGRAM + 4 * pid + 2, TIMELINE)
    chunk = tl.cdiv(T, n_chunks)
    n_units = protocol.count_units(n_chunks, h_parts, tail, tail_parts)
    u, claimers = protocol.first_claim(claims, pid, n_prog, n_push, n_units, SENDERS_HELP)
    while u < n_units:
        _combine_unit(u, dv, kk, chunk, n_chunks, h_parts, tail, tail_parts, T, H, max_tokens, expert_out, y,
                      recv_slots, recv_w, token_pos, partials, combined, epoch, me, world, ctx, timeline, K, BT, BH,
                      K_PAD, W_PAD, MAXC, TIMELINE, EVICT)
        u = protocol.next_claim(claims)
    protocol.end_claims(claims, u, n_units, claimers)
    protocol.stamp(timeline, TL_PROGRAM + 4 * pid + 3, TIMELINE)
    dl.finish_call(state, epoch, n_prog)


# ----------------------------------------------------------------------------------------------------- launcher
def ep_combine(expert_out, handle, out=None, config=None, timeline=None):
    """``y[t] = sum_j topk_weights[t, j] * expert_out[row of (t, j)]`` back on every token's own rank, summed in
    a fixed order (slot order within a rank, then rank order): bitwise reproducible.

    ``expert_out`` [>= rows in use, H] in the receive layout of ``ep_dispatch`` (padding rows are never read),
    same dtype as the dispatched x. ``handle``: ``EpDispatchResult.handle`` of the latest dispatch.
    ``config``: a ``CombineConfig`` or a dict of its knobs (see ``config.py``).
    ``timeline``: optional int64 GPU tensor [TIMELINE_SLOTS] for the phase timeline, as in ep_dispatch."""
    if not isinstance(handle, EpHandle):
        raise TypeError(f"handle must be the EpHandle of ep_dispatch, got {type(handle).__name__}")
    ws = handle.workspace
    if handle.call != ws.calls:
        raise ValueError("stale handle: a later ep_dispatch with the same shapes reused its buffers")
    if not isinstance(expert_out, torch.Tensor):
        raise TypeError(f"expert_out must be a torch.Tensor, got {type(expert_out).__name__}")
    if expert_out.dtype != ws.dtype:
        raise TypeError(f"expert_out must be {ws.dtype} like the dispatched x, got {expert_out.dtype}")
    shmem.check_device(expert_out, "expert_out")
    if expert_out.dim() != 2 or expert_out.shape[1] != ws.hidden:
        raise ValueError(f"expert_out must be [rows, {ws.hidden}], got {list(expert_out.shape)}")
    if expert_out.device.type == "cpu":  # free to check there (no device sync)
        need = int(ws.expert_offsets[ws.local])
        if expert_out.shape[0] < need:
            raise ValueError(f"expert_out has {expert_out.shape[0]} rows, the dispatch filled {need}")
    return combine_records(expert_out, ws, handle.token_pos, ws.recv_slots, ws.recv_w, ws.recv_span,
                           handle.num_chunks, out, config, timeline, handle.call)


class _CombinePlan:
    """A combine's launch for one (workspace, token count, chunking, expert rows' layout, config): the geometry and
    the ``Launcher`` with its fixed arguments, so a repeated call costs the look-up and the launch."""

    def __init__(self, expert_out, ws, T, num_chunks, cfg, timed):
        H = ws.hidden
        bh = min(next_power_of_2(int(cfg.block_h)), next_power_of_2(H))
        bt = next_power_of_2(max(1, min(int(cfg.block_tokens), cdiv(ws.max_tokens, num_chunks))))
        n_prog, n_push = int(cfg.num_programs), int(cfg.push_programs)
        self.n_prog, self.ws, self.timed = n_prog, ws, timed
        dev = expert_out.device
        # no rows or no tokens: the kernel gets real pointers, of which nothing is read
        self.no_rows = None if expert_out.shape[0] else torch.zeros((1, H), dtype=ws.dtype, device=dev)
        self.no_tokens = None if T else torch.empty((1, H), dtype=ws.dtype, device=dev)
        self.sizes = (T, H, ws.max_tokens, num_chunks, cfg.h_parts, *tail(cfg, num_chunks), n_push)
        self.fixed = (ws.partials, ws.combined, ws.combine_claims, ws.combine_state, ws.team.ctx)
        self.launcher = Launcher(
            ep_combine_kernel, (n_prog,), K=ws.topk, BT=bt, BH=bh, K_PAD=next_power_of_2(ws.topk), W_PAD=ws.w_pad,
            MAXC=MAX_CHUNKS, SENDERS_HELP=senders_help(n_prog, expert_out), TIMELINE=timed,
            DEFER_SIGNAL=bool(cfg.defer_signal), EVICT="evict_first" if cfg.stream_hints else "",
            num_warps=int(cfg.num_warps), **register_cap(cfg, expert_out))

    def __call__(self, expert_out, y, token_pos, slots, slot_weights, span, timeline):
        if self.no_rows is not None:
            expert_out = self.no_rows
        if self.no_tokens is not None:
            y, token_pos = self.no_tokens, self.ws.token_pos
        args = (expert_out, y, *self.sizes, slots, slot_weights, span, token_pos, *self.fixed,
                self.ws.combine_state if timeline is None else timeline)
        if timeline is None and y.is_cuda and not (expert_out.data_ptr() | y.data_ptr() | token_pos.data_ptr() |
                                                   slots.data_ptr() | slot_weights.data_ptr() | span.data_ptr()) % 16:
            self.launcher.run(*args)  # 16-byte aligned like the bound call's pointers (or better)
        else:
            self.launcher(*args)


_PLANS = shmem.Plans("ep_combine")  # a combine's layout -> its _CombinePlan


def combine_records(expert_out, ws, token_pos, slots, slot_weights, span, num_chunks, out=None, config=None,
                    timeline=None, call=None):
    """The combine launch on a dispatch's records given as tensors (what ``ep_combine`` takes from the workspace;
    the differentiable ops carry copies, ``training.py``): ``token_pos`` [T, W], ``slots`` / ``slot_weights``
    [W, max_tokens, K] (this rank's row and weight of every slot of each rank's tokens), ``span`` [W, MAX_CHUNKS,
    2] and the dispatch's ``num_chunks``. The kernels read the records on this rank only; the workspace ``ws``
    gives the partials and flags."""
    T, H = token_pos.shape[0], ws.hidden
    y = out if out is not None else torch.empty((T, H), dtype=ws.dtype, device=expert_out.device)
    if tuple(y.shape) != (T, H) or y.dtype != ws.dtype or not y.is_contiguous():
        raise ValueError(f"out must be a contiguous {ws.dtype} tensor [{T}, {H}]")
    shmem.op_team("ep_combine", ws.team.group, lambda: dict(H=tuple(expert_out.shape[1:]), call=call,
                                                            config=config))  # (rows: this rank's own)
    cfg = combine_config(ws.max_tokens, H, expert_out.device.type, config)
    expert_out = expert_out.contiguous()
    plan = _PLANS.get((ws, T, num_chunks, cfg, expert_out.shape[0] == 0, timeline is None),
                      lambda: _CombinePlan(expert_out, ws, T, num_chunks, cfg, timeline is not None))
    check_timeline(timeline, expert_out.device, plan.n_prog)
    shmem.raise_pending_errors()
    plan(expert_out, y, token_pos, slots, slot_weights, span, timeline)
    return y
