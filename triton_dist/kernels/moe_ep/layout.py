"""Routing and the layout launch of MoE dispatch: where every (token, slot) row lands, computed on the device.

Experts are spread over ranks: rank d owns the EL = E / W experts [d * EL, (d + 1) * EL). In the kernels an
expert is a *padded* index d * EL_PAD + local (powers of two, so that per-expert histograms are plain vectors).

    ep_layout_kernel (NC / CG programs)   program g counts the experts and destination ranks of its CG token
                                          chunks at once (histograms keyed by chunk), stores the group's totals
                                          and raises counted[g]; then it sums the totals of the programs before
                                          it (a parallel look-back, earlier programs only) = where each of its
                                          chunks starts (chunk_prefix); the last program pushes the call's totals,
                                          counts[me, :], to every rank and raises counts_ready[me] there.
    layout_in_order (FUSED_LAYOUT)        the same count by the dispatch launch's program 0, group after group,
                                          before it publishes the totals: one launch instead of two (what an
                                          eager call at decode sizes waits for is the host's launches)
"""

import triton
import triton.language as tl

from ... import language as dl
from ...shmem import layout
from . import protocol
from .protocol import TL_LAYOUT

BIG = tl.constexpr(2**30)  # "no row" in min-reductions
SITE_EXPERT_IDS = tl.constexpr(layout.SITE_EXPERT_IDS)


@triton.jit
def column(block, j, cols):
    """Column ``j`` of a [rows, n] block, as [rows] (``cols = tl.arange(0, n)``; j may differ per call)."""
    return tl.sum(tl.where(cols[None, :] == j, block, 0), axis=1)


@triton.jit
def route(topk_idx, t0, t_end, E, K: tl.constexpr, EL: tl.constexpr, BT: tl.constexpr, K_PAD: tl.constexpr,
          EL_PAD: tl.constexpr):
    """Tokens [t0, t0 + BT) clipped to t_end: padded expert index d * EL_PAD + local (-1: no expert), owner rank
    (-1: none), both [BT, K_PAD]."""
    t = t0 + tl.arange(0, BT)
    return route_at(topk_idx, t, t < t_end, E, K, EL, K_PAD, EL_PAD)


@triton.jit
def route_at(topk_idx, t, valid, E, K: tl.constexpr, EL: tl.constexpr, K_PAD: tl.constexpr, EL_PAD: tl.constexpr):
    """``route`` of any tokens ``t`` [N] (those with ``valid`` false have none): [N, K_PAD] each."""
    kk = tl.arange(0, K_PAD)
    m = valid[:, None] & (kk[None, :] < K)
    e = tl.load(topk_idx + t[:, None] * K + kk[None, :], mask=m, other=-1).to(tl.int32)  # int32 or int64
    ok = (e >= 0) & (e < E) & m
    owner = tl.where(ok, e // EL, -1)
    return tl.where(ok, owner * EL_PAD + e % EL, -1), owner


@triton.jit
def check_ids(topk_idx, t, valid, E, ctx, K: tl.constexpr, K_PAD: tl.constexpr):
    """Record an expert id of tokens ``t`` outside [-1, E) (``DeviceIndexError`` on the host); the routing drops
    such a slot like -1, so it never addresses memory."""
    kk = tl.arange(0, K_PAD)
    m = valid[:, None] & (kk[None, :] < K)
    pos = t[:, None].to(tl.int64) * K + kk[None, :]
    e = tl.load(topk_idx + pos, mask=m, other=-1)
    dl.check_index(e, pos, E, ctx, SITE_EXPERT_IDS, mask=m & (e != -1))


@triton.jit
def publish_counts(per_expert, all_counts, counts_ready, parity, epoch, ctx, W_PAD: tl.constexpr,
                   EL_PAD: tl.constexpr):
    """Push this rank's slots-per-expert row to counts[parity, me, :] on every rank, then raise counts_ready[me]
    there (every row goes out before the first flag, whose release drains them all)."""
    me = dl.rank(ctx)
    world = dl.num_ranks(ctx)
    ev = tl.arange(0, W_PAD * EL_PAD)
    row = all_counts + (parity * world + me) * (W_PAD * EL_PAD) + ev
    for i in range(world):
        dl.put(row, per_expert, (me + 1 + i) % world, ctx)  # peers first, this rank last
    for i in range(world):
        dl.signal(counts_ready + me, epoch, (me + 1 + i) % world, ctx)


@triton.jit
def count_group(g, topk_idx, T, E, n_chunks, ctx, K: tl.constexpr, EL: tl.constexpr, TB: tl.constexpr,
                K_PAD: tl.constexpr, EL_PAD: tl.constexpr, W_PAD: tl.constexpr, CG: tl.constexpr):
    """Count the CG token chunks [g * CG, g * CG + CG) in one pass (histograms keyed by chunk and padded expert /
    destination rank: every token of the group loaded at once, TB tokens of each chunk at a time), checking their
    expert ids. Returns (slots per padded expert [CG, EP], tokens per destination rank [CG, W_PAD])."""
    EP: tl.constexpr = W_PAD * EL_PAD
    chunk = tl.cdiv(T, n_chunks)
    dv = tl.arange(0, W_PAD)
    i = tl.arange(0, CG * TB) // TB  # (chunk i of the group, token j of its block): [CG * TB] at once
    j = tl.arange(0, CG * TB) % TB
    per_expert = tl.zeros([CG, EP], dtype=tl.int32)
    per_rank = tl.zeros([CG, W_PAD], dtype=tl.int32)
    for j0 in range(0, chunk, TB):  # one step unless a chunk has more than TB tokens
        t = (g * CG + i) * chunk + j0 + j
        valid = (j0 + j < chunk) & (g * CG + i < n_chunks) & (t < T)
        check_ids(topk_idx, t, valid, E, ctx, K, K_PAD)
        ep, owner = route_at(topk_idx, t, valid, E, K, EL, K_PAD, EL_PAD)
        ok = ep >= 0
        key_e = tl.where(ok, i[:, None] * EP + ep, 0)  # (chunk, padded expert)
        per_expert += tl.reshape(tl.histogram(tl.reshape(key_e, (CG * TB * K_PAD,)), CG * EP,
                                              mask=tl.reshape(ok, (CG * TB * K_PAD,))), (CG, EP))
        goes = tl.max((owner[:, :, None] == dv[None, None, :]).to(tl.int32), axis=1) > 0  # [CG * TB, W_PAD]
        key_r = i[:, None] * W_PAD + dv[None, :]  # (chunk, destination rank)
        per_rank += tl.reshape(tl.histogram(tl.reshape(key_r, (CG * TB * W_PAD,)), CG * W_PAD,
                                            mask=tl.reshape(goes, (CG * TB * W_PAD,))), (CG, W_PAD))
    return per_expert, per_rank


@triton.jit
def store_prefix(g, per_expert, per_rank, before_e, before_r, chunk_prefix, n_chunks, EP: tl.constexpr,
                 W_PAD: tl.constexpr, CG: tl.constexpr):
    """chunk_prefix of group g's chunks: where each starts, per padded expert and destination rank, given the
    totals ``before_e`` / ``before_r`` of every chunk before the group."""
    ROW: tl.constexpr = EP + W_PAD
    ev = tl.arange(0, EP)
    dv = tl.arange(0, W_PAD)
    c = g * CG + tl.arange(0, CG)
    mc = (c < n_chunks)[:, None]
    tl.store(chunk_prefix + c[:, None] * ROW + ev[None, :],
             before_e[None, :] + tl.cumsum(per_expert, axis=0) - per_expert, mask=mc)
    tl.store(chunk_prefix + c[:, None] * ROW + EP + dv[None, :],
             before_r[None, :] + tl.cumsum(per_rank, axis=0) - per_rank, mask=mc)


@triton.jit
def layout_in_order(topk_idx, chunk_prefix, all_counts, counts_ready, T, E, n_chunks, epoch, ctx,
                    K: tl.constexpr, EL: tl.constexpr, TB: tl.constexpr, K_PAD: tl.constexpr, EL_PAD: tl.constexpr,
                    W_PAD: tl.constexpr, CG: tl.constexpr):
    """The whole layout in one program (the dispatch launch's program 0 with ``FUSED_LAYOUT``): the groups of CG
    chunks one after another, each counted at once, their prefixes carried; then the call's totals pushed to
    every rank (after every chunk_prefix store, so a wait for this rank's counts sees them too)."""
    EP: tl.constexpr = W_PAD * EL_PAD
    before_e = tl.zeros([EP], dtype=tl.int32)
    before_r = tl.zeros([W_PAD], dtype=tl.int32)
    for g in range(0, tl.cdiv(n_chunks, CG)):
        per_expert, per_rank = count_group(g, topk_idx, T, E, n_chunks, ctx, K, EL, TB, K_PAD, EL_PAD, W_PAD, CG)
        store_prefix(g, per_expert, per_rank, before_e, before_r, chunk_prefix, n_chunks, EP, W_PAD, CG)
        before_e += tl.sum(per_expert, axis=0)
        before_r += tl.sum(per_rank, axis=0)
    publish_counts(before_e, all_counts, counts_ready, epoch % 2, epoch, ctx, W_PAD, EL_PAD)


@triton.jit
def ep_layout_kernel(topk_idx, chunk_counts, chunk_prefix, counted, all_counts, counts_ready, state, T, E, n_chunks,
                     ctx, timeline, K: tl.constexpr, EL: tl.constexpr, TB: tl.constexpr, K_PAD: tl.constexpr,
                     EL_PAD: tl.constexpr, W_PAD: tl.constexpr, CG: tl.constexpr, QB: tl.constexpr,
                     TIMELINE: tl.constexpr, PDL: tl.constexpr):
    """Program g counts the CG token chunks [g * CG, g * CG + CG) (``count_group``), stores the group's totals
    into chunk_counts[g] and raises counted[g]; then it waits for the groups before it and adds the sum of their
    totals: chunk_prefix[c] = where chunk c's rows start. Every program does its own look-back in parallel
    (earlier programs only: they run first); the last one, whose prefix plus its own totals are the call's
    totals, pushes them to every rank."""
    g = tl.program_id(0)
    n_groups = tl.num_programs(0)
    protocol.stamp(timeline, TL_LAYOUT + 4 * g, TIMELINE)
    EP: tl.constexpr = W_PAD * EL_PAD
    ROW: tl.constexpr = EP + W_PAD
    epoch = dl.call_epoch(state)
    dl.launch_dependents(PDL)  # the dispatch launch may start now (its programs wait for the counts anyway)
    per_expert, per_rank = count_group(g, topk_idx, T, E, n_chunks, ctx, K, EL, TB, K_PAD, EL_PAD, W_PAD, CG)
    protocol.stamp(timeline, TL_LAYOUT + 4 * g + 1, TIMELINE)
    ev = tl.arange(0, EP)
    dv = tl.arange(0, W_PAD)
    tl.store(chunk_counts + g * ROW + ev, tl.sum(per_expert, axis=0))
    tl.store(chunk_counts + g * ROW + EP + dv, tl.sum(per_rank, axis=0))
    tl.debug_barrier()
    tl.atomic_xchg(counted + g, epoch, sem="release", scope="gpu")
    before_e = tl.zeros([EP], dtype=tl.int32)
    before_r = tl.zeros([W_PAD], dtype=tl.int32)
    for q0 in range(0, g, QB):
        q = q0 + tl.arange(0, QB)
        dl.wait(counted + q, epoch, ctx, mask=q < g)
        mq = q[:, None] < g
        before_e += tl.sum(tl.load(chunk_counts + q[:, None] * ROW + ev[None, :], mask=mq, other=0), axis=0)
        before_r += tl.sum(tl.load(chunk_counts + q[:, None] * ROW + EP + dv[None, :], mask=mq, other=0), axis=0)
    protocol.stamp(timeline, TL_LAYOUT + 4 * g + 2, TIMELINE)
    store_prefix(g, per_expert, per_rank, before_e, before_r, chunk_prefix, n_chunks, EP, W_PAD, CG)
    if g == n_groups - 1:
        publish_counts(before_e + tl.sum(per_expert, axis=0), all_counts, counts_ready, epoch % 2, epoch, ctx,
                       W_PAD, EL_PAD)
    protocol.stamp(timeline, TL_LAYOUT + 4 * g + 3, TIMELINE)
