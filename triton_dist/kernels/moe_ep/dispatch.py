"""MoE dispatch: every token goes once to each rank that owns one of its experts, and lands there grouped by
local expert (``moe_ep/__init__.py`` describes the receive layout).

    ep_dispatch_kernel (one launch; on sm_90+ it starts while the layout launch runs)
      every program   waits for every rank's counts -> group offsets (``_group_offsets``)
      SENDERS         [0, n_push), chunk after chunk from a counter (``_send_chunk``): positions from the chunk's
                      prefix; for each token and REMOTE rank d it has experts on, ONE row crosses the link to the
                      token's first slot row on d, with a record of its slot rows and weights; rows for this rank
                      go straight into all their slot rows; then the chunk's span and its flags
      RECEIVERS       the others: the rows' expert ids (``_mark_expert_ids``), then (chunk, column part) units in
                      order from a counter (``_receive_unit``): wait for the chunk of every peer, copy each arrived
                      row into the token's other slot rows (duplicates never cross the link). On a GPU the senders
                      join them once their chunks are out.

EVICT ("evict_first" or ""): the L2 policy of the copies that touch a row once (loads of ``x`` and of arrived rows,
stores into slot rows), so that rows arriving over the link (plain stores) may keep their L2 lines until read.
FP8 (``quant="fp8"``): a sender quantises each tile of a token (1x128 groups, ``fp8.quantize_groups``) as it
loads it, and the FP8 tile and its scales travel together (half the bytes of bf16 plus 1/64 for scales).
"""

import torch
import triton
import triton.language as tl

from ... import hardware, shmem
from ... import language as dl
from ...hardware import cdiv, next_power_of_2
from ..fp8 import quantize_groups
from ..launcher import Launcher
from ..replay import GraphCache
from . import protocol
from .buffers import EpDispatchResult, EpHandle, buffers, check_fp8, check_inputs
from .config import DispatchConfig, check_timeline, dispatch_config, register_cap, senders_help, tail
from .layout import BIG, column, ep_layout_kernel, layout_in_order, route
from .protocol import MAX_CHUNKS, TL_CHUNK, TL_PROGRAM


# ----------------------------------------------------------------------------------------------------- device side
@triton.jit
def _store_rows(recv_x, tile, slots, skip, hh, H, K: tl.constexpr, K_PAD: tl.constexpr, EVICT: tl.constexpr):
    """Store a [BT, BH] tile of token rows into each token's slot rows ``slots`` [BT, K_PAD] (-1: none), except
    row ``skip`` [BT] (the one the tile came from; -1: none)."""
    kk = tl.arange(0, K_PAD)
    for j in tl.static_range(K):
        row = column(slots, j, kk)
        tl.store(recv_x + row[:, None].to(tl.int64) * H + hh[None, :], tile,
                 mask=((row >= 0) & (row != skip))[:, None] & (hh[None, :] < H), eviction_policy=EVICT)


@triton.jit
def _tile_groups(h0, H, BH: tl.constexpr):
    """FP8: the 1x128 scale groups of columns [h0, h0 + BH) (BH a multiple of 128) and the groups per row."""
    return h0 // 128 + tl.arange(0, BH // 128), tl.cdiv(H, 128)


@triton.jit
def _group_offsets(all_counts, counts_ready, expert_counts, expert_offsets, align, parity, epoch, pid, me, world,
                   ev, dv, ctx, timeline, EL: tl.constexpr, EL_PAD: tl.constexpr, W_PAD: tl.constexpr,
                   TIMELINE: tl.constexpr):
    """Wait for every rank's counts of this call. Returns ``base`` [EP]: where this rank's rows of each padded
    expert start on its owner; and this rank's group starts and row counts per local expert ([EL_PAD] each),
    which program 0 stores (``expert_counts``, ``expert_offsets``)."""
    EP: tl.constexpr = W_PAD * EL_PAD
    dl.wait(counts_ready + dv, epoch, ctx, mask=dv < world)
    protocol.stamp(timeline, TL_PROGRAM + 4 * pid + 1, TIMELINE)
    counts = tl.load(all_counts + (parity * world + dv[:, None]) * EP + ev[None, :], mask=dv[:, None] < world,
                     other=0)  # [source rank, padded expert]
    total = tl.sum(counts, axis=0)
    padded = tl.reshape(tl.cdiv(total, align) * align, (W_PAD, EL_PAD))
    group_start_2d = tl.cumsum(padded, axis=1) - padded  # within each owner rank
    base = tl.reshape(group_start_2d, (EP,)) + tl.sum(tl.where(dv[:, None] < me, counts, 0), axis=0)
    mine = dv[:, None] == me
    my_start = tl.sum(tl.where(mine, group_start_2d, 0), axis=0)  # [EL_PAD]
    my_count = tl.sum(tl.where(mine, tl.reshape(total, (W_PAD, EL_PAD)), 0), axis=0)
    lv = tl.arange(0, EL_PAD)
    if pid == 0:
        tl.store(expert_counts + lv, my_count, mask=lv < EL)
        tl.store(expert_offsets + lv, my_start, mask=lv < EL)
        tl.store(expert_offsets + EL, tl.sum(tl.where(lv < EL, tl.sum(tl.where(mine, padded, 0), axis=0), 0)))
    return base, my_start, my_count


@triton.jit
def _send_tokens(t0, c1, carry_e, carry_r, base, pending, ev, dv, kk, x, topk_idx, topk_weights, H, E, max_tokens,
                 recv_x, recv_slots, recv_w, recv_weights, token_pos, arrived, epoch, me, world, ctx, timeline,
                 K: tl.constexpr, EL: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr, K_PAD: tl.constexpr,
                 EL_PAD: tl.constexpr, W_PAD: tl.constexpr, MAXC: tl.constexpr, TIMELINE: tl.constexpr,
                 EVICT: tl.constexpr, x_scales=None, recv_scales=None, FP8: tl.constexpr = ""):
    """A sender's step: tokens [t0, t0 + BT) of a chunk that ends at c1. ``carry_e`` [EP] / ``carry_r`` [W_PAD]:
    the positions taken before them per padded expert / destination; returned advanced, with the pending chunk
    (flagged here: its stores drained while this block was routed). FP8 ("quantize": x's tiles quantised here,
    "given": x FP8 with ``x_scales``): each row's 1x128 group scales go with it, into ``recv_scales``."""
    EP: tl.constexpr = W_PAD * EL_PAD
    t = t0 + tl.arange(0, BT)
    tm = t < c1
    ep, owner = route(topk_idx, t0, c1, E, K, EL, BT, K_PAD, EL_PAD)
    hit = tl.reshape((ep[:, :, None] == ev[None, None, :]).to(tl.int32), (BT * K_PAD, EP))
    before = tl.cumsum(hit, axis=0) - hit + (carry_e + base)[None, :]
    slot = tl.reshape(tl.sum(before * hit, axis=1), (BT, K_PAD))
    slot = tl.where(ep >= 0, slot, -1)  # row of (token, slot) on its owner rank
    carry_e += tl.sum(hit, axis=0)
    at = owner[:, :, None] == dv[None, None, :]
    goes = tl.max(at.to(tl.int32), axis=1)  # [BT, W_PAD]: token goes to rank d
    rpos = tl.cumsum(goes, axis=0) - goes + carry_r[None, :]
    carry_r += tl.sum(goes, axis=0)
    first = tl.min(tl.where(at, slot[:, :, None], BIG), axis=1)  # [BT, W_PAD]
    pending = protocol.flag_pending(arrived, pending, epoch, ctx, timeline, MAXC, TIMELINE)
    tl.store(token_pos + t[:, None] * world + dv[None, :], tl.where(goes > 0, rpos, -1),
             mask=tm[:, None] & (dv[None, :] < world))
    kmask = tm[:, None] & (kk[None, :] < K)
    w = tl.load(topk_weights + t[:, None] * K + kk[None, :], mask=kmask, other=0.0).to(tl.float32)
    here = tl.where(owner == me, slot, -1)
    tl.store(recv_weights + here, w, mask=here >= 0)
    for i in range(world):
        d = (me + 1 + i) % world  # peers first, this rank last
        go_d = column(goes, d, dv) > 0
        rec = (me * max_tokens + column(rpos, d, dv)) * K
        m = go_d[:, None] & (kk[None, :] < K)
        dl.put(recv_slots + rec[:, None] + kk[None, :], tl.where(owner == d, slot, -1), d, ctx, mask=m)
        dl.put(recv_w + rec[:, None] + kk[None, :], w, d, ctx, mask=m)
    src = x + t[:, None].to(tl.int64) * H
    for h0 in range(0, H, BH):
        hh = h0 + tl.arange(0, BH)
        hm = hh[None, :] < H
        if FP8 == "quantize":
            tile, sc = quantize_groups(tl.load(src + hh[None, :], mask=tm[:, None] & hm, other=0.0,
                                               eviction_policy=EVICT), BT, BH)
        else:
            tile = tl.load(src + hh[None, :], mask=tm[:, None] & hm, eviction_policy=EVICT)
        if FP8 == "given":
            gg, G = _tile_groups(h0, H, BH)
            sc = tl.load(x_scales + t[:, None].to(tl.int64) * G + gg[None, :], mask=tm[:, None] & (gg < G)[None, :])
        for i in range(world - 1):
            d = (me + 1 + i) % world
            row = column(first, d, dv)
            dst = recv_x + row[:, None].to(tl.int64) * H + hh[None, :]
            dl.put(dst, tile, d, ctx, mask=(row < BIG)[:, None] & hm)
            if FP8 != "":
                gg, G = _tile_groups(h0, H, BH)
                dl.put(recv_scales + row[:, None].to(tl.int64) * G + gg[None, :], sc, d, ctx,
                       mask=(row < BIG)[:, None] & (gg < G)[None, :])
        _store_rows(recv_x, tile, here, -1, hh, H, K, K_PAD, EVICT)
        if FP8 != "":
            gg, G = _tile_groups(h0, H, BH)
            _store_rows(recv_scales, sc, here, -1, gg, G, K, K_PAD, EVICT)
    return carry_e, carry_r, pending


@triton.jit
def _send_chunk(c, pending, chunk, base, ev, dv, kk, x, topk_idx, topk_weights, T, H, E, max_tokens, recv_x, recv_slots,
                recv_w, recv_span, recv_weights, token_pos, chunk_prefix, arrived, epoch, me, world, ctx, timeline,
                K: tl.constexpr, EL: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr, K_PAD: tl.constexpr,
                EL_PAD: tl.constexpr, W_PAD: tl.constexpr, MAXC: tl.constexpr, TIMELINE: tl.constexpr,
                DEFER_SIGNAL: tl.constexpr, EVICT: tl.constexpr,
                x_scales=None, recv_scales=None, FP8: tl.constexpr = ""):
    """A sender's chunk ``c``: its tokens block by block, then its span of positions on every rank and its
    flags (or, DEFER_SIGNAL, they are left pending). Returns the pending chunk."""
    EP: tl.constexpr = W_PAD * EL_PAD
    ROW: tl.constexpr = EP + W_PAD
    c0 = tl.minimum(c * chunk, T)
    c1 = tl.minimum(c0 + chunk, T)
    carry_e = tl.load(chunk_prefix + c * ROW + ev)
    carry_r = tl.load(chunk_prefix + c * ROW + EP + dv)
    r_first = carry_r
    for t0 in range(c0, c1, BT):
        carry_e, carry_r, pending = _send_tokens(
            t0, c1, carry_e, carry_r, base, pending, ev, dv, kk, x, topk_idx, topk_weights, H, E, max_tokens, recv_x,
            recv_slots, recv_w, recv_weights, token_pos, arrived, epoch, me, world, ctx, timeline, K, EL, BT, BH,
            K_PAD, EL_PAD, W_PAD, MAXC, TIMELINE, EVICT, x_scales, recv_scales, FP8)
    span = tl.arange(0, 2)
    for i in range(world):
        d = (me + 1 + i) % world
        ends = tl.where(span == 0, tl.sum(tl.where(dv == d, r_first, 0)), tl.sum(tl.where(dv == d, carry_r, 0)))
        dl.put(recv_span + (me * MAXC + c) * 2 + span, ends, d, ctx)
    return protocol.chunk_sent(arrived, c, pending, epoch, ctx, timeline, MAXC, TIMELINE, DEFER_SIGNAL)


@triton.jit
def _mark_expert_ids(q, n_recv, max_rows, my_start, my_count, lv, recv_expert_ids, recv_weights, EL: tl.constexpr,
                     RB: tl.constexpr):
    """Receiver ``q`` of ``n_recv``: the local expert of every row in its stripe (-1 = padding, weight 0);
    ``lv``: arange(EL_PAD)."""
    stripe = tl.cdiv(max_rows, n_recv)
    r_end = tl.minimum(q * stripe + stripe, max_rows)
    for r0 in range(q * stripe, r_end, RB):
        r = r0 + tl.arange(0, RB)
        inside = (r[:, None] >= my_start[None, :]) & (r[:, None] < my_start[None, :] + my_count[None, :]) & \
            (lv[None, :] < EL)
        eid = tl.max(tl.where(inside, lv[None, :], -1), axis=1)
        tl.store(recv_expert_ids + r, eid, mask=r < r_end)
        tl.store(recv_weights + r, tl.zeros([RB], dtype=tl.float32), mask=(r < r_end) & (eid < 0))


@triton.jit
def _receive_unit(u, dv, kk, n_chunks, h_parts, tail, tail_parts, H, max_tokens, recv_x, recv_slots, recv_w, recv_span,
                  recv_weights, arrived, epoch, me, world, ctx, timeline, K: tl.constexpr, BT: tl.constexpr,
                  BH: tl.constexpr, K_PAD: tl.constexpr, W_PAD: tl.constexpr, MAXC: tl.constexpr,
                  TIMELINE: tl.constexpr, EVICT: tl.constexpr, recv_scales=None, FP8: tl.constexpr = ""):
    """Receiver unit ``u`` (chunk, column part): wait until the chunk of every peer has landed, then copy each
    arrived row (in the token's first slot row; FP8: with its scales) into the token's other slot rows here."""
    c, h_first, h_end = protocol.receiver_unit(u, n_chunks, h_parts, tail, tail_parts, H, BH)
    dl.wait(arrived + dv * MAXC + c, epoch, ctx, mask=(dv < world) & (dv != me))
    protocol.stamp(timeline, TL_CHUNK + 4 * c + 1, TIMELINE)
    for i in range(world - 1):
        s = (me + 1 + i) % world
        p0 = tl.load(recv_span + (s * MAXC + c) * 2)
        p1 = tl.load(recv_span + (s * MAXC + c) * 2 + 1)
        for q0 in range(p0, p1, BT):
            pos = q0 + tl.arange(0, BT)
            m = (pos[:, None] < p1) & (kk[None, :] < K)
            rec = (s * max_tokens + pos[:, None]) * K + kk[None, :]
            slots = tl.load(recv_slots + rec, mask=m, other=-1)
            if h_first == 0:  # one part stores the rows' weights
                tl.store(recv_weights + slots, tl.load(recv_w + rec, mask=m, other=0.0), mask=slots >= 0)
            first = tl.min(tl.where(slots >= 0, slots, BIG), axis=1)
            has = first < BIG
            for h0 in range(h_first, h_end, BH):
                hh = h0 + tl.arange(0, BH)
                hm = hh[None, :] < H
                tile = tl.load(recv_x + first[:, None].to(tl.int64) * H + hh[None, :], mask=has[:, None] & hm,
                               eviction_policy=EVICT)
                _store_rows(recv_x, tile, slots, first, hh, H, K, K_PAD, EVICT)
                if FP8 != "":
                    gg, G = _tile_groups(h0, H, BH)
                    sc = tl.load(recv_scales + first[:, None].to(tl.int64) * G + gg[None, :],
                                 mask=has[:, None] & (gg < G)[None, :])
                    _store_rows(recv_scales, sc, slots, first, gg, G, K, K_PAD, EVICT)
    protocol.stamp(timeline, TL_CHUNK + 4 * c + 2, TIMELINE)


@triton.jit
def ep_dispatch_kernel(x, topk_idx, topk_weights, T, H, E, align, max_tokens, max_rows, n_chunks, h_parts, tail,
                       tail_parts, n_push, recv_x, recv_slots, recv_w, recv_span, all_counts, counts_ready,
                       arrived, recv_expert_ids, recv_weights, expert_counts, expert_offsets, token_pos,
                       chunk_prefix, claims, state, ctx, timeline,
                       K: tl.constexpr, EL: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr,
                       K_PAD: tl.constexpr, EL_PAD: tl.constexpr, W_PAD: tl.constexpr, RB: tl.constexpr,
                       MAXC: tl.constexpr, FUSED_LAYOUT: tl.constexpr, TB: tl.constexpr, CG: tl.constexpr,
                       SENDERS_HELP: tl.constexpr, TIMELINE: tl.constexpr, PDL: tl.constexpr,
                       DEFER_SIGNAL: tl.constexpr, EVICT: tl.constexpr, x_scales=None, recv_scales=None,
                       FP8: tl.constexpr = ""):
    """Programs [0, n_push) send chunks (``claims[1]``), the others receive (``claims[0]``); see the module
    docstring. FUSED_LAYOUT: no layout launch, program 0 counts (``layout_in_order``, TB tokens of CG chunks at a
    time) and publishes the totals itself. FP8: see ``_send_tokens``."""
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    protocol.stamp(timeline, TL_PROGRAM + 4 * pid, TIMELINE)
    me = dl.rank(ctx)
    world = dl.num_ranks(ctx)
    EP: tl.constexpr = W_PAD * EL_PAD  # padded expert space: rank d's local expert e sits at d * EL_PAD + e
    epoch = dl.call_epoch(state)
    parity = epoch % 2
    ev = tl.arange(0, EP)
    dv = tl.arange(0, W_PAD)
    kk = tl.arange(0, K_PAD)
    chunk = tl.cdiv(T, n_chunks)
    if FUSED_LAYOUT:
        if pid == 0:
            layout_in_order(topk_idx, chunk_prefix, all_counts, counts_ready, T, E, n_chunks, epoch, ctx, K, EL, TB,
                            K_PAD, EL_PAD, W_PAD, CG)
    base, my_start, my_count = _group_offsets(all_counts, counts_ready, expert_counts, expert_offsets, align,
                                              parity, epoch, pid, me, world, ev, dv, ctx, timeline, EL, EL_PAD,
                                              W_PAD, TIMELINE)
    lv = tl.arange(0, EL_PAD)
    if pid < n_push:
        dl.wait_prior_kernel(PDL)  # the layout launch's chunk_prefix (it started early: launched with launch_pdl)
        c = protocol.next_claim(claims + 1)
        pending = tl.full((), -1, tl.int32)  # DEFER_SIGNAL: the sent chunk whose flags are not raised yet
        while c < n_chunks:
            pending = _send_chunk(c, pending, chunk, base, ev, dv, kk, x, topk_idx, topk_weights, T, H, E,
                                  max_tokens, recv_x, recv_slots, recv_w, recv_span, recv_weights, token_pos,
                                  chunk_prefix, arrived, epoch, me, world, ctx, timeline, K, EL, BT, BH, K_PAD,
                                  EL_PAD, W_PAD, MAXC, TIMELINE, DEFER_SIGNAL, EVICT,
                                  x_scales, recv_scales, FP8)
            c = protocol.next_claim(claims + 1)
        protocol.flag_pending(arrived, pending, epoch, ctx, timeline, MAXC, TIMELINE)
        protocol.end_claims(claims + 1, c, n_chunks, n_push)
        protocol.stamp(timeline, TL_PROGRAM + 4 * pid + 2, TIMELINE)
    else:
        _mark_expert_ids(pid - n_push, n_prog - n_push, max_rows, my_start, my_count, lv, recv_expert_ids,
                         recv_weights, EL, RB)
        protocol.stamp(timeline, TL_PROGRAM + 4 * pid + 2, TIMELINE)
    n_units = protocol.count_units(n_chunks, h_parts, tail, tail_parts)
    u, claimers = protocol.first_claim(claims, pid, n_prog, n_push, n_units, SENDERS_HELP)
    while u < n_units:
        _receive_unit(u, dv, kk, n_chunks, h_parts, tail, tail_parts, H, max_tokens, recv_x, recv_slots, recv_w,
                      recv_span, recv_weights, arrived, epoch, me, world, ctx, timeline, K, BT, BH, K_PAD, W_PAD,
                      MAXC, TIMELINE, EVICT, recv_scales, FP8)
        u = protocol.next_claim(claims)
    protocol.end_claims(claims, u, n_units, claimers)
    protocol.stamp(timeline, TL_PROGRAM + 4 * pid + 3, TIMELINE)
    dl.finish_call(state, epoch, n_prog)


# ----------------------------------------------------------------------------------------------------- launcher
_GRAPHS = GraphCache("moe_ep")  # eager dispatches replayed from CUDA graphs (``DispatchConfig.eager_graph``)
_PLANS = shmem.Plans("ep_dispatch")  # a call's layout -> its _DispatchPlan


class _DispatchPlan:
    """What a dispatch needs that follows from its inputs' layout, sizes and config alone: the workspace, the
    launch geometry, the two launches bound (``Launcher``) with their fixed arguments, and the result's views.
    Built on the first call of a layout (after its checks), so a repeated call costs the look-up and the launches."""

    def __init__(self, x, topk_idx, num_experts, max_tokens, align, group, fp8_mode, dtype, cfg, team, timed):
        T, H = x.shape
        K = topk_idx.shape[1]
        dev = x.device
        ws = self.ws = buffers(num_experts, K, max_tokens, H, dtype, align, group, "fp8" if fp8_mode else None)
        self.cfg, self.fp8_mode, self.num_tokens = cfg, fp8_mode, T
        n_chunks, n_prog, n_push = int(cfg.num_chunks), int(cfg.num_programs), int(cfg.push_programs)
        self.n_chunks, self.n_prog = n_chunks, n_prog
        k_pad = next_power_of_2(K)
        ep = ws.w_pad * ws.el_pad
        bt = min(int(cfg.block_tokens), 8192 // (k_pad * ep), cdiv(max_tokens, n_chunks))
        bt = next_power_of_2(max(1, bt))
        # layout programs (or the fused layout's steps): cg chunks each, counted tb tokens of every chunk at a time
        # (at most 4096 tokens per step)
        tb_layout = min(next_power_of_2(cdiv(max_tokens, n_chunks)), 256)
        cg = min(next_power_of_2(min(int(cfg.layout_chunks), n_chunks)), 4096 // tb_layout)
        fused = bool(cfg.fused_layout)
        if fused:  # program 0 of the dispatch launch counts: its [cg, EP] histograms within that kernel's registers
            cg = min(cg, max(1, 1024 // ep))
        n_groups = cdiv(n_chunks, cg)
        bh = min(next_power_of_2(int(cfg.block_h)), next_power_of_2(H))
        if fp8_mode:  # whole 1x128 groups per tile
            bh = max(bh, 128)
        common = dict(K=K, EL=ws.local, K_PAD=k_pad, EL_PAD=ws.el_pad, W_PAD=ws.w_pad)
        pdl = not fused and hardware.pdl_capable(dev) and bool(cfg.pdl)
        ctx = team.ctx
        # T = 0: the kernels get real pointers, of which nothing is read
        self.empty = None if T else (
            torch.zeros((1, H), dtype=x.dtype, device=dev), torch.full((1, K), -1, dtype=torch.int32, device=dev),
            torch.zeros((1, K), dtype=torch.float32, device=dev),
            torch.ones((1, cdiv(H, 128)), device=dev) if fp8_mode == "given" else None)
        self.layout = None if fused else Launcher(
            ep_layout_kernel, (n_groups,), TB=tb_layout, CG=cg,
            QB=min(next_power_of_2(n_groups), 128 if dev.type == "cuda" else 4), TIMELINE=timed, PDL=pdl,
            num_warps=4, **common)
        self.layout_args = (ws.chunk_counts, ws.chunk_prefix, ws.counted, ws.all_counts, ws.counts_ready, ws.state,
                            T, num_experts, n_chunks, ctx)
        self.dispatch = Launcher(
            ep_dispatch_kernel, (n_prog,), BT=bt, BH=bh, RB=128 if dev.type == "cuda" else 16, MAXC=MAX_CHUNKS,
            FUSED_LAYOUT=fused, TB=tb_layout, CG=cg, SENDERS_HELP=senders_help(n_prog, x), TIMELINE=timed, PDL=pdl,
            DEFER_SIGNAL=bool(cfg.defer_signal), EVICT="evict_first" if cfg.stream_hints else "",
            num_warps=int(cfg.num_warps), **({"launch_pdl": True} if pdl else {}), **register_cap(cfg, x), **common,
            **({"FP8": fp8_mode} if fp8_mode else {}))
        self.dispatch_args = (T, H, num_experts, align, max_tokens, ws.max_rows, n_chunks, cfg.h_parts,
                              *tail(cfg, n_chunks), n_push, ws.recv_x, ws.recv_slots, ws.recv_w, ws.recv_span,
                              ws.all_counts, ws.counts_ready, ws.arrived, ws.expert_ids, ws.weights, ws.expert_counts,
                              ws.expert_offsets, ws.token_pos, ws.chunk_prefix, ws.dispatch_claims, ws.state, ctx)
        self.token_pos = ws.token_pos[:T]
        rows = ws.max_rows  # the results: views of the workspace, whichever way the kernels ran
        self.views = (ws.recv_x[:rows], ws.expert_ids[:rows], ws.weights[:rows], ws.expert_counts,
                      ws.expert_offsets)
        self.scales = ws.recv_scales[:rows] if fp8_mode else None
        self.graph_key = (ws.key, T, x.dtype, topk_idx.dtype, cfg)

    def launch(self, x, idx, wts, x_scales=None, timeline=None, checked=True):
        """The layout and dispatch launches on these inputs (``checked``: through the launchers' argument check;
        else the bound launch, for inputs whose pointers are 16-byte aligned like the plan's)."""
        ws = self.ws
        stamps = ws.state if timeline is None else timeline
        fp8 = dict(x_scales=x_scales, recv_scales=ws.recv_scales) if self.fp8_mode else {}
        if checked:
            if self.layout is not None:
                self.layout(idx, *self.layout_args, stamps)
            self.dispatch(x, idx, wts, *self.dispatch_args, stamps, **fp8)
        else:
            if self.layout is not None:
                self.layout.run(idx, *self.layout_args, stamps)
            self.dispatch.run(x, idx, wts, *self.dispatch_args, stamps, **fp8)
        return ws.recv_x

    def __call__(self, x, idx, wts, x_scales, timeline):
        if self.empty is not None:
            x, idx, wts, dummy_scales = self.empty
            x_scales = None if x_scales is None else dummy_scales
        # every input read where it is: contiguous (the layout said so) or copied
        x, idx, wts = x.contiguous(), idx.contiguous(), wts.contiguous()
        inputs = (x, idx, wts) if x_scales is None else (x, idx, wts, x_scales.contiguous())
        if self.cfg.eager_graph and timeline is None and \
                _GRAPHS.run(self.graph_key, self.launch, inputs, clone=False) is not None:
            return
        aligned = timeline is None and x.is_cuda and not (x.data_ptr() | idx.data_ptr() | wts.data_ptr() | (
            0 if x_scales is None else inputs[3].data_ptr())) % 16
        self.launch(*inputs, timeline=timeline, checked=not aligned)


def _config_key(config):
    """``config`` as part of a plan's key: None, a DispatchConfig, or a dict's items."""
    if config is None or isinstance(config, DispatchConfig):
        return config
    if not isinstance(config, dict):
        raise TypeError(f"config must be a DispatchConfig or a dict, got {type(config).__name__}")
    key = tuple(config.items())
    try:
        hash(key)
    except TypeError:
        raise TypeError(f"config values must be plain values (ints, bools), got {config}") from None
    return key


def ep_dispatch(x, topk_idx, topk_weights, *, num_experts, max_tokens, align=1, exact=False, check_ids=None,
                config=None, timeline=None, group=None, quant=None, x_scales=None):
    """Send every token to the ranks owning its top-k experts (once per rank), grouped by local expert there.

    ``x`` [T, H] (bf16/fp16/fp32), ``topk_idx`` [T, K] int (global expert ids, -1 = unused slot),
    ``topk_weights`` [T, K]. ``num_experts``, ``max_tokens`` (>= T on every rank), ``align``, K, H and the dtype
    must be the same on every rank. ``exact``: sync once and trim the outputs to the rows in use.
    ``check_ids``: verify ids on the host (ValueError; on GPU that is a device sync). Default: on CPU only, so
    that a GPU call never syncs. The kernels check them too, without a sync: an id outside [-1, E) drops its
    slot and raises ``DeviceIndexError`` at the next op call (or ``check_errors()``).
    ``timeline``: optional int64 GPU tensor [TIMELINE_SLOTS] that receives the phase timeline (see TL_PROGRAM).
    ``group``: the expert-parallel group (default: the heap's); experts are split over its ranks.
    ``quant="fp8"``: the senders quantise every token per 1x128 group (``kernels/fp8.py``'s rule) and its rows
    cross the link and arrive as float8_e4m3fn with fp32 scales (``EpDispatchResult.scales``, [rows,
    ceil(H/128)]: what an FP8 grouped GEMM takes); x already FP8 (float8_e4m3fn with ``x_scales`` [T,
    ceil(H/128)]) travels as it is. ep_combine stays in x's dtype (bfloat16 for FP8 x).
    Returns an ``EpDispatchResult``; its tensors are views valid until the next dispatch of the same shapes."""
    for name, t in (("x", x), ("topk_idx", topk_idx), ("topk_weights", topk_weights)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    team = shmem.op_team("ep_dispatch", group, lambda: dict(
        H=x.shape[1:], K=topk_idx.shape[1:], dtype=str(x.dtype), num_experts=num_experts, max_tokens=max_tokens,
        align=align, exact=exact, config=config, quant=quant))
    if check_ids is None:
        check_ids = x.device.type == "cpu"
    # a repeated layout skips the checks its first call passed (types, shapes, devices, sizes, config)
    key = (x.shape, x.stride(), x.dtype, x.device, topk_idx.shape, topk_idx.stride(), topk_idx.dtype,
           topk_idx.device, topk_weights.shape, topk_weights.stride(), topk_weights.dtype, topk_weights.device,
           num_experts, max_tokens, align, type(num_experts) is type(max_tokens) is type(align) is int, quant,
           None if x_scales is None else (type(x_scales), getattr(x_scales, "shape", None),
                                          getattr(x_scales, "dtype", None), getattr(x_scales, "device", None)),
           team, _config_key(config), timeline is None)
    plan = _PLANS.find(key)
    if plan is None:
        check_inputs(x, topk_idx, topk_weights, num_experts, max_tokens, align, team.size)
        fp8_mode, dtype = check_fp8(x, quant, x_scales)
        cfg = dispatch_config(max_tokens, x.shape[1], x.device.type, config)
        check_timeline(timeline, x.device, int(cfg.num_programs))
        plan = _PLANS.get(key, lambda: _DispatchPlan(x, topk_idx, num_experts, max_tokens, align, group, fp8_mode,
                                                     dtype, cfg, team, timeline is not None))
    elif timeline is not None:
        check_timeline(timeline, x.device, plan.n_prog)
    if check_ids and topk_idx.numel() and bool(((topk_idx < -1) | (topk_idx >= num_experts)).any()):
        bad = topk_idx[(topk_idx < -1) | (topk_idx >= num_experts)][0].item()
        raise ValueError(f"topk_idx holds expert id {bad}, outside [0, {num_experts}) (-1 marks an unused slot)")
    shmem.raise_pending_errors()
    plan(x, topk_idx, topk_weights, x_scales, timeline)
    ws = plan.ws
    ws.calls += 1
    handle = EpHandle(ws, ws.calls, plan.num_tokens, plan.n_chunks, plan.token_pos)
    ws.last = handle
    if exact:
        rows = int(ws.expert_offsets[ws.local].item())
        return EpDispatchResult(ws.recv_x[:rows], ws.expert_ids[:rows], ws.weights[:rows], ws.expert_counts,
                                ws.expert_offsets, handle, ws.recv_scales[:rows] if plan.fp8_mode else None)
    return EpDispatchResult(*plan.views, handle, plan.scales)
