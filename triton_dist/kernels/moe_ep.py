"""MoE expert parallelism: dispatch tokens to the ranks that own their experts, combine the expert outputs back.

Experts are spread over ranks: rank d owns the ``EL = E / W`` experts ``[d * EL, (d + 1) * EL)``. Every rank has
tokens ``x[T, H]``, router choices ``topk_idx[T, K]`` (``-1`` = unused slot) and ``topk_weights[T, K]``.

    recv = ep_dispatch(x, topk_idx, topk_weights, num_experts=E, max_tokens=M)
    out = my_experts(recv.x, recv.expert_offsets)          # rows grouped by local expert
    y = ep_combine(out, recv.handle)                       # y[t] = sum_j w[t, j] * expert_{idx[t, j]}(x[t])

The receive layout (rank d)
---------------------------
``recv.x[rows, H]`` holds one row per (token, slot) whose expert lives on d, grouped by local expert: expert ``e``
owns rows ``[expert_offsets[e], expert_offsets[e] + expert_counts[e])`` and its group starts on a multiple of
``align`` (padding rows for grouped GEMMs: ``expert_ids == -1``, ``weights == 0``). Inside a group rows are ordered
by source rank, then token, then slot, so positions are deterministic. Every per-row tensor and the counts are
device tensors; buffers are sized for the worst case (``max_tokens`` per rank), so nothing syncs with the host and
the whole path can be captured in a CUDA graph. ``ep_dispatch(..., exact=True)`` syncs once and trims to size.

Data movement
-------------
Each rank cuts its tokens into NC chunks (the unit of flags); a launch's programs split into SENDERS (the first
n_push; they take chunks in order from a per-call counter, so faster programs take more) and RECEIVERS (the
rest), so receivers work on early chunks while senders still push later ones.
    layout    (one launch, NC / G programs)  program g counts the experts and destination ranks of its G chunks
              at once (histograms keyed by chunk), then sums the counts of the programs before it (a look-back
              at earlier programs, all in parallel: no serial pass) = where each of its chunks starts; the last
              program pushes the totals row counts[me, :] to every rank.
    dispatch  (one launch; on sm_90+ it starts while the layout runs: programmatic dependent launch, its senders
              ``dl.wait_prior_kernel`` before reading the chunk prefixes) everyone waits for every rank's counts
              -> group offsets on every rank.
              sender, chunk c: prefix + cumsum inside the chunk = position of every (token, slot) in its expert
                  group and of every token in each destination's receive list. For each token and REMOTE rank d
                  it has experts on: ONE row crosses the link, to the token's first slot row on d, plus a small
                  record (its slot rows on d and their weights) at recv_slots[me, pos] on d; then the chunk's
                  span of positions and a flag arrived[me, c] = epoch, raised once the sender has routed its
                  next chunk (deferred: the release then finds the chunk's stores drained). Rows for this rank go
                  straight into all their slot rows, tile by tile with the pushes (measured faster than flagging
                  the peers first and writing them after, and than leaving them to the receivers).
              receiver: expert ids of all rows (-1 on padding); then (chunk c, column part) units in order from
                  a per-call counter (``_unit``; optionally finer parts for the last chunks; on a GPU the senders
                  join once their chunks are out): wait arrived[s, c] for every peer s and copy each arrived row
                  into the token's other slot rows here (duplicates never cross the link).
    combine   (one launch)  sender, chunk c of every PEER s: partial = sum over the token's slots on this rank,
              in slot order, of w * out[slot row] (fp32, rounded to the dtype) -> one row pushed back to s into
              partials[call parity, (me - s - 1) mod W, pos] (s keeps one block per peer, two sets for odd and
              even calls); flag combined[me, c] (deferred like dispatch's: after the next chunk's first tile).
              receiver, chunk c of my tokens: this rank's own partial computed the same way in registers (never
              stored), then wait combined[d, c] for every peer d (also for a chunk without tokens) and
              y[t] = sum over d = 0..W-1 of partial_d(t) (fp32, rank order). Receivers take (chunk, column
              part) units in order from a per-call counter, and on a GPU the senders join them once their own
              chunks are out (the receivers' side is longer).
The copies that touch a row once (dispatch's local writes, its receivers' copies; combine's expert-row reads and y)
may carry the L2 policy evict_first (``stream_hints``, on at T=4096), so that what arrives over the link may stay
in L2 until it is read.
Every sum runs in a FIXED order (slots in top-k order within a rank, then ranks in order), whoever's message lands
first, so y is bitwise identical run to run. Dispatch moves each token at most once per destination rank, and
combine returns one row per (token, destination rank).

Flags carry per-call epochs (``dl.call_epoch``): no resets between calls. The exchange of counts is also the
"ready" handshake of dispatch: a rank pushes rows into d only after d published this call's counts, i.e. after d
finished everything it queued before (its experts and combine of the previous call). Combine needs no handshake:
its partials alternate between two sets by call parity, and rank r writes the set of call n into s only after its
own call n-1 waited for every flag of s's call n-1, so s is done with call n-2, the last reader of that set
(combines may repeat on one handle, with no dispatch in between). Outputs are views of a cached workspace, valid
until the next ep_dispatch with the same shapes.

Low-latency mode, decode sizes (max_tokens <= 256): small chunks over every SM, and an eager ep_dispatch replays
its launches from a cached CUDA graph (inputs copied in; ``replay.py``): there the Python launch cost, not the
GPU, is what an eager caller waits for. ``fused_layout`` drops the layout launch (every program counts the tokens
before its chunk itself and program 0 pushes the totals: one launch, one cross-rank round trip); it is the CPU
default at these sizes and was slower on H200 (122 us at T=128). Interpreter rule kept throughout: a program never
waits on a later program of its own rank (senders precede receivers; senders wait only for counts, which program
0 or the previous launch publishes; the layout looks back at earlier programs only; senders help receiving only
on a GPU, where every program of the launch is resident at once). The receivers' work counters are the one piece
of per-call state reset on the device: by the call's last claim.
"""

import functools
import types
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .. import autotune, shmem
from .. import language as dl
from . import library
from .gemm import num_sms, pdl_capable
from .replay import GraphCache

MAX_CHUNKS = 1024  # flags and chunk tables are sized for this many token chunks per call
# Optional phase timeline (``timeline=`` of ep_dispatch / ep_combine: int64 [TIMELINE_SLOTS], GPU only): GPU-clock
# ns at each phase boundary, for tuning. Per program p: [TL_PROGRAM + 4p + i], i = 0 start, 1 counts known (dispatch)
# / sending starts (combine senders), 2 all chunks sent (senders) / expert ids marked (dispatch receivers), 3 end.
# Per chunk c: [TL_CHUNK + 4c + i], i = 0 sent and flagged, 1 its flags seen by a receiver, 2 received and done.
# Layout program g (dispatch's timeline): [TL_LAYOUT + 4g + i], i = 0 start, 1 its chunks counted, 2 prefix known
# (look-back done), 3 end.
MAX_TIMELINE_PROGRAMS = 512
TL_PROGRAM = tl.constexpr(0)
TL_CHUNK = tl.constexpr(4 * MAX_TIMELINE_PROGRAMS)
TL_LAYOUT = tl.constexpr(4 * MAX_TIMELINE_PROGRAMS + 4 * MAX_CHUNKS)
TIMELINE_SLOTS = 4 * MAX_TIMELINE_PROGRAMS + 8 * MAX_CHUNKS
_BIG = tl.constexpr(2**30)  # "no row" in min-reductions


# ----------------------------------------------------------------------------------------------------- helpers
@triton.jit
def _stamp(timeline, slot, ON: tl.constexpr):
    """timeline[slot] = now (GPU clock, ns) when the phase timeline is on."""
    if ON:
        tl.store(timeline + slot, dl.timestamp())


@triton.jit
def _column(block, j, cols):
    """Column ``j`` of a [rows, n] block, as [rows] (``cols = tl.arange(0, n)``; j may differ per call)."""
    return tl.sum(tl.where(cols[None, :] == j, block, 0), axis=1)


@triton.jit
def _route(topk_idx, t0, t_end, E, K: tl.constexpr, EL: tl.constexpr, BT: tl.constexpr, K_PAD: tl.constexpr,
           EL_PAD: tl.constexpr):
    """Tokens [t0, t0 + BT) clipped to t_end: padded expert index d * EL_PAD + local (-1: no expert), owner rank
    (-1: none), both [BT, K_PAD]."""
    t = t0 + tl.arange(0, BT)
    return _route_at(topk_idx, t, t < t_end, E, K, EL, K_PAD, EL_PAD)


@triton.jit
def _route_at(topk_idx, t, valid, E, K: tl.constexpr, EL: tl.constexpr, K_PAD: tl.constexpr, EL_PAD: tl.constexpr):
    """``_route`` of any tokens ``t`` [N] (those with ``valid`` false have none): [N, K_PAD] each."""
    kk = tl.arange(0, K_PAD)
    m = valid[:, None] & (kk[None, :] < K)
    e = tl.load(topk_idx + t[:, None] * K + kk[None, :], mask=m, other=-1).to(tl.int32)  # int32 or int64
    ok = (e >= 0) & (e < E) & m
    owner = tl.where(ok, e // EL, -1)
    return tl.where(ok, owner * EL_PAD + e % EL, -1), owner


@triton.jit
def _count(topk_idx, t_start, t_end, E, K: tl.constexpr, EL: tl.constexpr, BT: tl.constexpr, K_PAD: tl.constexpr,
           EL_PAD: tl.constexpr, W_PAD: tl.constexpr):
    """(slots per padded expert [W_PAD * EL_PAD], tokens per destination rank [W_PAD]) over tokens [start, end)."""
    ev = tl.arange(0, W_PAD * EL_PAD)
    dv = tl.arange(0, W_PAD)
    per_expert = tl.zeros([W_PAD * EL_PAD], dtype=tl.int32)
    per_rank = tl.zeros([W_PAD], dtype=tl.int32)
    for t0 in range(t_start, t_end, BT):
        ep, owner = _route(topk_idx, t0, t_end, E, K, EL, BT, K_PAD, EL_PAD)
        hit = (ep[:, :, None] == ev[None, None, :]).to(tl.int32)
        per_expert += tl.sum(tl.sum(hit, axis=1), axis=0)
        goes = tl.max((owner[:, :, None] == dv[None, None, :]).to(tl.int32), axis=1)
        per_rank += tl.sum(goes, axis=0)
    return per_expert, per_rank


@triton.jit
def _publish_counts(per_expert, all_counts, counts_ready, parity, epoch, ctx, W_PAD: tl.constexpr,
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
def _store_rows(recv_x, tile, slots, skip, hh, H, K: tl.constexpr, K_PAD: tl.constexpr, EVICT: tl.constexpr):
    """Store a [BT, BH] tile of token rows into each token's slot rows ``slots`` [BT, K_PAD] (-1: none), except
    row ``skip`` [BT] (the one the tile came from; -1: none). EVICT: the stores' L2 eviction policy."""
    kk = tl.arange(0, K_PAD)
    for j in tl.static_range(K):
        row = _column(slots, j, kk)
        tl.store(recv_x + row[:, None].to(tl.int64) * H + hh[None, :], tile,
                 mask=((row >= 0) & (row != skip))[:, None] & (hh[None, :] < H), eviction_policy=EVICT)


@triton.jit
def _slot_sum(expert_out, slots, w, hh, H, K: tl.constexpr, K_PAD: tl.constexpr, BT: tl.constexpr,
              BH: tl.constexpr, EVICT: tl.constexpr):
    """fp32 [BT, BH] sum over j = 0..K-1, in that FIXED order, of w[:, j] * expert_out[slots[:, j], hh]
    (slots < 0 contribute nothing): a token's partial over the slots one rank holds. EVICT: the loads' L2
    eviction policy."""
    kk = tl.arange(0, K_PAD)
    hm = hh[None, :] < H
    acc = tl.zeros([BT, BH], dtype=tl.float32)
    for j in tl.static_range(K):
        row = _column(slots, j, kk)
        wj = _column(w, j, kk)
        v = tl.load(expert_out + row[:, None].to(tl.int64) * H + hh[None, :], mask=(row >= 0)[:, None] & hm,
                    other=0.0, eviction_policy=EVICT)
        acc += wj[:, None] * v.to(tl.float32)
    return acc


@triton.jit
def _flag_chunk(flags, c, epoch, ctx, timeline, MAXC: tl.constexpr, TIMELINE: tl.constexpr):
    """Raise flags[me, c] = epoch on every peer (after every earlier store of this program: dl.signal's release)
    and stamp the chunk as sent."""
    me = dl.rank(ctx)
    world = dl.num_ranks(ctx)
    for i in range(world - 1):
        dl.signal(flags + me * MAXC + c, epoch, (me + 1 + i) % world, ctx)
    _stamp(timeline, TL_CHUNK + 4 * c, TIMELINE)


@triton.jit
def _flag_pending(flags, pending, epoch, ctx, timeline, MAXC: tl.constexpr, TIMELINE: tl.constexpr):
    """Raise the flags of chunk ``pending`` if there is one (>= 0); the new pending chunk: none (-1)."""
    if pending >= 0:
        _flag_chunk(flags, pending, epoch, ctx, timeline, MAXC, TIMELINE)
    return tl.full((), -1, tl.int32)


@triton.jit
def _chunk_sent(flags, c, pending, epoch, ctx, timeline, MAXC: tl.constexpr, TIMELINE: tl.constexpr,
                DEFER_SIGNAL: tl.constexpr):
    """A sender has sent chunk ``c``: raise the flags of a chunk still pending (a chunk without tokens came
    between, so nothing flagged it), then those of ``c`` now, or with DEFER_SIGNAL once the next chunk is under
    way. Returns the pending chunk (-1: none)."""
    pending = _flag_pending(flags, pending, epoch, ctx, timeline, MAXC, TIMELINE)
    if DEFER_SIGNAL:
        pending = c
    else:
        _flag_chunk(flags, c, epoch, ctx, timeline, MAXC, TIMELINE)
    return pending


@triton.jit
def _first_claim(claims, pid, n_prog, n_push, n_units, SENDERS_HELP: tl.constexpr):
    """Receivers (and with SENDERS_HELP the senders, programs [0, n_push)) take units of work in order from a
    per-call counter: (this program's first unit, number of programs taking part). A program that takes no part
    gets ``n_units + claimers`` (none)."""
    claimers = n_prog if SENDERS_HELP else n_prog - n_push
    u = n_units + claimers
    if SENDERS_HELP or pid >= n_push:
        u = tl.atomic_add(claims, 1, sem="relaxed", scope="gpu")
    return u, claimers


@triton.jit
def _n_units(n_chunks, h_parts, tail, tail_parts):
    """Units of the receivers' work (see ``_unit``)."""
    return (n_chunks - tail) * h_parts + tail * tail_parts


@triton.jit
def _unit(u, n_chunks, h_parts, tail, tail_parts, H, BH: tl.constexpr):
    """Unit ``u`` of the receivers' work: (chunk, first column, end column). A chunk's columns come in h_parts
    parts of whole BH tiles (the last part may be short or empty), those of the last ``tail`` chunks in
    tail_parts: finer units there shorten the work left once the last chunk lands."""
    n_head = (n_chunks - tail) * h_parts
    head = u < n_head
    v = tl.maximum(u - n_head, 0)
    parts = tl.where(head, h_parts, tail_parts)
    part = tl.where(head, u % h_parts, v % tail_parts)
    part_h = tl.cdiv(tl.cdiv(H, BH), parts) * BH
    h_first = part * part_h
    return tl.where(head, u // h_parts, n_chunks - tail + v // tail_parts), h_first, tl.minimum(h_first + part_h, H)


@triton.jit
def _next_claim(claims):
    return tl.atomic_add(claims, 1, sem="relaxed", scope="gpu")


@triton.jit
def _end_claims(claims, u, n_units, claimers):
    """``u``: this program's failed claim. The call's last claim (every claimer's last one fails) resets the
    counter for the next call."""
    if u == n_units + claimers - 1:
        tl.atomic_xchg(claims, 0, sem="relaxed", scope="gpu")


# ----------------------------------------------------------------------------------------------------- kernels
@triton.jit
def ep_layout_kernel(topk_idx, chunk_counts, chunk_prefix, counted, all_counts, counts_ready, state, T, E, n_chunks,
                     ctx, timeline, K: tl.constexpr, EL: tl.constexpr, TB: tl.constexpr, K_PAD: tl.constexpr,
                     EL_PAD: tl.constexpr, W_PAD: tl.constexpr, CG: tl.constexpr, QB: tl.constexpr,
                     TIMELINE: tl.constexpr, PDL: tl.constexpr):
    """Program g counts the CG token chunks [g * CG, g * CG + CG) in one pass (histograms keyed by chunk and
    padded expert / destination rank: every token of the group loaded at once), writes each chunk's offset
    inside the group, stores the group's totals into chunk_counts[g] and raises counted[g]; then it waits for
    the groups before it and adds the sum of their totals: chunk_prefix[c] = where chunk c's rows start. Every
    program does its own look-back in parallel (earlier programs only: they run first); the last one, whose
    prefix plus its own totals are the call's totals, pushes them to every rank."""
    g = tl.program_id(0)
    n_groups = tl.num_programs(0)
    _stamp(timeline, TL_LAYOUT + 4 * g, TIMELINE)
    EP: tl.constexpr = W_PAD * EL_PAD
    ROW: tl.constexpr = EP + W_PAD
    epoch = dl.call_epoch(state)
    dl.launch_dependents(PDL)  # the dispatch launch may start now (its programs wait for the counts anyway)
    chunk = tl.cdiv(T, n_chunks)
    dv = tl.arange(0, W_PAD)
    i = tl.arange(0, CG * TB) // TB  # (chunk i of the group, token j of its block): [CG * TB] at once
    j = tl.arange(0, CG * TB) % TB
    per_expert = tl.zeros([CG, EP], dtype=tl.int32)
    per_rank = tl.zeros([CG, W_PAD], dtype=tl.int32)
    for j0 in range(0, chunk, TB):  # one step unless a chunk has more than TB tokens
        t = (g * CG + i) * chunk + j0 + j
        ep, owner = _route_at(topk_idx, t, (j0 + j < chunk) & (g * CG + i < n_chunks) & (t < T), E, K, EL, K_PAD,
                              EL_PAD)
        ok = ep >= 0
        key_e = tl.where(ok, i[:, None] * EP + ep, 0)  # (chunk, padded expert)
        per_expert += tl.reshape(tl.histogram(tl.reshape(key_e, (CG * TB * K_PAD,)), CG * EP,
                                              mask=tl.reshape(ok, (CG * TB * K_PAD,))), (CG, EP))
        goes = tl.max((owner[:, :, None] == dv[None, None, :]).to(tl.int32), axis=1) > 0  # [CG * TB, W_PAD]
        key_r = i[:, None] * W_PAD + dv[None, :]  # (chunk, destination rank)
        per_rank += tl.reshape(tl.histogram(tl.reshape(key_r, (CG * TB * W_PAD,)), CG * W_PAD,
                                            mask=tl.reshape(goes, (CG * TB * W_PAD,))), (CG, W_PAD))
    _stamp(timeline, TL_LAYOUT + 4 * g + 1, TIMELINE)
    ev = tl.arange(0, EP)
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
    _stamp(timeline, TL_LAYOUT + 4 * g + 2, TIMELINE)
    c = g * CG + tl.arange(0, CG)
    mc = (c < n_chunks)[:, None]
    tl.store(chunk_prefix + c[:, None] * ROW + ev[None, :],
             before_e[None, :] + tl.cumsum(per_expert, axis=0) - per_expert, mask=mc)
    tl.store(chunk_prefix + c[:, None] * ROW + EP + dv[None, :],
             before_r[None, :] + tl.cumsum(per_rank, axis=0) - per_rank, mask=mc)
    if g == n_groups - 1:
        _publish_counts(before_e + tl.sum(per_expert, axis=0), all_counts, counts_ready, epoch % 2, epoch, ctx,
                        W_PAD, EL_PAD)
    _stamp(timeline, TL_LAYOUT + 4 * g + 3, TIMELINE)


@triton.jit
def ep_dispatch_kernel(x, topk_idx, topk_weights, T, H, E, align, max_tokens, max_rows, n_chunks, h_parts, tail,
                       tail_parts, n_push, recv_x, recv_slots, recv_w, recv_span, all_counts, counts_ready,
                       arrived, recv_expert_ids, recv_weights, expert_counts, expert_offsets, token_pos,
                       chunk_prefix, claims, state, ctx, timeline,
                       K: tl.constexpr, EL: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr,
                       K_PAD: tl.constexpr, EL_PAD: tl.constexpr, W_PAD: tl.constexpr, RB: tl.constexpr,
                       MAXC: tl.constexpr, FUSED_LAYOUT: tl.constexpr, BT_COUNT: tl.constexpr,
                       SENDERS_HELP: tl.constexpr, TIMELINE: tl.constexpr, PDL: tl.constexpr,
                       DEFER_SIGNAL: tl.constexpr, EVICT: tl.constexpr):
    """Programs [0, n_push) send chunks in order (taken from a per-call counter: claims[1]); the others receive:
    they mark the rows' expert ids and copy every arrived row into its other slot rows, chunk by chunk as chunks
    land. DEFER_SIGNAL: a sender raises a chunk's flags once it has routed its next chunk (the release then finds
    the chunk's last stores drained instead of waiting for them). EVICT ("evict_first" or ""): the L2 policy of
    the copies' loads of ``x`` and of arrived rows and of every slot-row store here, so that the rows arriving
    from the peers (plain stores over the link) may keep their L2 lines until the receivers read them."""
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    _stamp(timeline, TL_PROGRAM + 4 * pid, TIMELINE)
    me = dl.rank(ctx)
    world = dl.num_ranks(ctx)
    EP: tl.constexpr = W_PAD * EL_PAD  # padded expert space: rank d's local expert e sits at d * EL_PAD + e
    ROW: tl.constexpr = EP + W_PAD
    epoch = dl.call_epoch(state)
    parity = epoch % 2
    ev = tl.arange(0, EP)
    dv = tl.arange(0, W_PAD)
    kk = tl.arange(0, K_PAD)
    chunk = tl.cdiv(T, n_chunks)
    if FUSED_LAYOUT:
        if pid == 0:
            total, _ = _count(topk_idx, 0, T, E, K, EL, BT_COUNT, K_PAD, EL_PAD, W_PAD)
            _publish_counts(total, all_counts, counts_ready, parity, epoch, ctx, W_PAD, EL_PAD)

    # every rank's counts -> group offsets on every rank, and where my rows start inside each group
    dl.wait(counts_ready + dv, epoch, ctx, mask=dv < world)
    _stamp(timeline, TL_PROGRAM + 4 * pid + 1, TIMELINE)
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

    if pid < n_push:
        # SEND: one row per (token, remote rank) to the token's first slot row there, plus its slot record;
        # rows for this rank go straight into all their slot rows
        dl.wait_prior_kernel(PDL)  # the layout launch's chunk_prefix (started early: launched with launch_pdl)
        c = _next_claim(claims + 1)  # senders take chunks in order: faster programs take more
        pending = tl.full((), -1, tl.int32)  # DEFER_SIGNAL: the sent chunk whose flags are not raised yet
        while c < n_chunks:
            c0 = tl.minimum(c * chunk, T)
            c1 = tl.minimum(c0 + chunk, T)
            if FUSED_LAYOUT:
                # counting takes wide blocks of tokens (BT_COUNT): it is a serial loop over every earlier token
                carry_e, carry_r = _count(topk_idx, 0, c0, E, K, EL, BT_COUNT, K_PAD, EL_PAD, W_PAD)
            else:  # (summing the layout's rows here instead cost the senders ~15 % throughput: run18)
                carry_e = tl.load(chunk_prefix + c * ROW + ev)
                carry_r = tl.load(chunk_prefix + c * ROW + EP + dv)
            r_first = carry_r
            for t0 in range(c0, c1, BT):
                t = t0 + tl.arange(0, BT)
                tm = t < c1
                ep, owner = _route(topk_idx, t0, c1, E, K, EL, BT, K_PAD, EL_PAD)
                hit = tl.reshape((ep[:, :, None] == ev[None, None, :]).to(tl.int32), (BT * K_PAD, EP))
                before = tl.cumsum(hit, axis=0) - hit + (carry_e + base)[None, :]
                slot = tl.reshape(tl.sum(before * hit, axis=1), (BT, K_PAD))
                slot = tl.where(ep >= 0, slot, -1)  # row of (token, slot) on its owner rank
                carry_e += tl.sum(hit, axis=0)
                at = owner[:, :, None] == dv[None, None, :]
                goes = tl.max(at.to(tl.int32), axis=1)  # [BT, W_PAD]: token goes to rank d
                rpos = tl.cumsum(goes, axis=0) - goes + carry_r[None, :]
                carry_r += tl.sum(goes, axis=0)
                first = tl.min(tl.where(at, slot[:, :, None], _BIG), axis=1)  # [BT, W_PAD]
                # (DEFER_SIGNAL) the previous chunk's stores drained while this one was routed: flag it
                pending = _flag_pending(arrived, pending, epoch, ctx, timeline, MAXC, TIMELINE)
                tl.store(token_pos + t[:, None] * world + dv[None, :], tl.where(goes > 0, rpos, -1),
                         mask=tm[:, None] & (dv[None, :] < world))
                kmask = tm[:, None] & (kk[None, :] < K)
                w = tl.load(topk_weights + t[:, None] * K + kk[None, :], mask=kmask, other=0.0).to(tl.float32)
                here = tl.where(owner == me, slot, -1)
                tl.store(recv_weights + here, w, mask=here >= 0)
                for i in range(world):
                    d = (me + 1 + i) % world  # peers first, this rank last
                    go_d = _column(goes, d, dv) > 0
                    rec = (me * max_tokens + _column(rpos, d, dv)) * K
                    m = go_d[:, None] & (kk[None, :] < K)
                    dl.put(recv_slots + rec[:, None] + kk[None, :], tl.where(owner == d, slot, -1), d, ctx, mask=m)
                    dl.put(recv_w + rec[:, None] + kk[None, :], w, d, ctx, mask=m)
                src = x + t[:, None].to(tl.int64) * H
                for h0 in range(0, H, BH):
                    hh = h0 + tl.arange(0, BH)
                    hm = hh[None, :] < H
                    tile = tl.load(src + hh[None, :], mask=tm[:, None] & hm, eviction_policy=EVICT)
                    for i in range(world - 1):
                        d = (me + 1 + i) % world
                        row = _column(first, d, dv)
                        dst = recv_x + row[:, None].to(tl.int64) * H + hh[None, :]
                        dl.put(dst, tile, d, ctx, mask=(row < _BIG)[:, None] & hm)
                    _store_rows(recv_x, tile, here, -1, hh, H, K, K_PAD, EVICT)
            span = tl.arange(0, 2)
            for i in range(world):
                d = (me + 1 + i) % world
                ends = tl.where(span == 0, tl.sum(tl.where(dv == d, r_first, 0)),
                                tl.sum(tl.where(dv == d, carry_r, 0)))
                dl.put(recv_span + (me * MAXC + c) * 2 + span, ends, d, ctx)
            pending = _chunk_sent(arrived, c, pending, epoch, ctx, timeline, MAXC, TIMELINE, DEFER_SIGNAL)
            c = _next_claim(claims + 1)
        _flag_pending(arrived, pending, epoch, ctx, timeline, MAXC, TIMELINE)
        _end_claims(claims + 1, c, n_chunks, n_push)
        _stamp(timeline, TL_PROGRAM + 4 * pid + 2, TIMELINE)
    else:
        # RECEIVE: expert id of every row (-1 = padding), zero weights on padding ...
        q = pid - n_push
        n_recv = n_prog - n_push
        stripe = tl.cdiv(max_rows, n_recv)
        r_end = tl.minimum(q * stripe + stripe, max_rows)
        for r0 in range(q * stripe, r_end, RB):
            r = r0 + tl.arange(0, RB)
            inside = (r[:, None] >= my_start[None, :]) & (r[:, None] < my_start[None, :] + my_count[None, :]) & \
                (lv[None, :] < EL)
            eid = tl.max(tl.where(inside, lv[None, :], -1), axis=1)
            tl.store(recv_expert_ids + r, eid, mask=r < r_end)
            tl.store(recv_weights + r, tl.zeros([RB], dtype=tl.float32), mask=(r < r_end) & (eid < 0))
        _stamp(timeline, TL_PROGRAM + 4 * pid + 2, TIMELINE)
    # ... then, (chunk, column part) units in order as they land, taken from a per-call counter (on a GPU the
    # senders join once their own chunks are out): copy each row from a peer into the token's other slot rows
    n_units = _n_units(n_chunks, h_parts, tail, tail_parts)
    u, claimers = _first_claim(claims, pid, n_prog, n_push, n_units, SENDERS_HELP)
    while u < n_units:
        c, h_first, h_end = _unit(u, n_chunks, h_parts, tail, tail_parts, H, BH)
        dl.wait(arrived + dv * MAXC + c, epoch, ctx, mask=(dv < world) & (dv != me))
        _stamp(timeline, TL_CHUNK + 4 * c + 1, TIMELINE)
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
                first = tl.min(tl.where(slots >= 0, slots, _BIG), axis=1)
                has = first < _BIG
                for h0 in range(h_first, h_end, BH):
                    hh = h0 + tl.arange(0, BH)
                    hm = hh[None, :] < H
                    tile = tl.load(recv_x + first[:, None].to(tl.int64) * H + hh[None, :], mask=has[:, None] & hm,
                                   eviction_policy=EVICT)
                    _store_rows(recv_x, tile, slots, first, hh, H, K, K_PAD, EVICT)
        _stamp(timeline, TL_CHUNK + 4 * c + 2, TIMELINE)
        u = _next_claim(claims)
    _end_claims(claims, u, n_units, claimers)
    _stamp(timeline, TL_PROGRAM + 4 * pid + 3, TIMELINE)
    dl.finish_call(state, epoch, n_prog)


@triton.jit
def ep_combine_kernel(expert_out, y, T, H, max_tokens, n_chunks, h_parts, tail, tail_parts, n_push, recv_slots,
                      recv_w, recv_span, token_pos, partials, combined, claims, state, ctx, timeline,
                      K: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr, K_PAD: tl.constexpr,
                      W_PAD: tl.constexpr, MAXC: tl.constexpr, SENDERS_HELP: tl.constexpr,
                      TIMELINE: tl.constexpr, DEFER_SIGNAL: tl.constexpr, EVICT: tl.constexpr):
    """Programs [0, n_push) reduce the tokens received from peers over their slots and push one partial row
    back per token; then the others (and with SENDERS_HELP the senders too, once done) take chunks of this rank's
    tokens from the ``claims`` counter, reduce the slots held here, wait for the peers' partials and sum all of
    them in rank order. SENDERS_HELP needs every program resident at once (a sender that waits must not keep a
    peer's sender off the GPU), so never under the interpreter, whose programs run one after another.
    DEFER_SIGNAL: a sender raises a chunk's flags once it has reduced the first tile of its next chunk.
    EVICT ("evict_first" or ""): the L2 policy of the expert rows' loads and of y's stores (each touched once),
    so that the partials arriving from the peers may keep their L2 lines until the receivers sum them."""
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    _stamp(timeline, TL_PROGRAM + 4 * pid, TIMELINE)
    me = dl.rank(ctx)
    world = dl.num_ranks(ctx)
    epoch = dl.call_epoch(state)
    dv = tl.arange(0, W_PAD)
    kk = tl.arange(0, K_PAD)
    # this call's set of partials (see the module docstring: two sets, so no handshake before pushing)
    partials += (epoch % 2).to(tl.int64) * tl.maximum(world - 1, 1) * max_tokens * H
    if pid < n_push:
        _stamp(timeline, TL_PROGRAM + 4 * pid + 1, TIMELINE)
        c = _next_claim(claims + 1)  # senders take chunks in order: faster programs take more
        pending = tl.full((), -1, tl.int32)  # DEFER_SIGNAL: the sent chunk whose flags are not raised yet
        while c < n_chunks:
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
                        pending = _flag_pending(combined, pending, epoch, ctx, timeline, MAXC, TIMELINE)
                        dl.put(dst + hh[None, :], acc.to(partials.dtype.element_ty), s, ctx, mask=pm[:, None] & hm)
            pending = _chunk_sent(combined, c, pending, epoch, ctx, timeline, MAXC, TIMELINE, DEFER_SIGNAL)
            c = _next_claim(claims + 1)
        _flag_pending(combined, pending, epoch, ctx, timeline, MAXC, TIMELINE)
        _end_claims(claims + 1, c, n_chunks, n_push)
        _stamp(timeline, TL_PROGRAM + 4 * pid + 2, TIMELINE)
    # RECEIVE, every program (senders once their chunks are out): take units (chunk c, column part) of this rank's
    # tokens in order, one at a time, from a per-call counter, so that senders that finish early share the
    # receivers' remaining work; column parts keep the last units short (the tail after the last chunk lands)
    chunk = tl.cdiv(T, n_chunks)
    n_units = _n_units(n_chunks, h_parts, tail, tail_parts)
    u, claimers = _first_claim(claims, pid, n_prog, n_push, n_units, SENDERS_HELP)
    while u < n_units:
        c, h_first, h_end = _unit(u, n_chunks, h_parts, tail, tail_parts, H, BH)
        c0 = tl.minimum(c * chunk, T)
        c1 = tl.minimum(c0 + chunk, T)
        for t0 in range(c0, c1, BT):
            t = t0 + tl.arange(0, BT)
            tm = t < c1
            pos = tl.load(token_pos + t[:, None] * world + dv[None, :], mask=tm[:, None] & (dv[None, :] < world),
                          other=-1)
            p_me = _column(pos, me, dv)
            m = (p_me >= 0)[:, None] & (kk[None, :] < K)
            rec = (me * max_tokens + p_me[:, None]) * K + kk[None, :]
            slots = tl.load(recv_slots + rec, mask=m, other=-1)
            w = tl.load(recv_w + rec, mask=m, other=0.0)
            for h0 in range(h_first, h_end, BH):
                hh = h0 + tl.arange(0, BH)
                hm = hh[None, :] < H
                # this rank's partial, rounded like the partials that crossed the link
                own = _slot_sum(expert_out, slots, w, hh, H, K, K_PAD, BT, BH, EVICT).to(partials.dtype.element_ty)
                if (t0 == c0) & (h0 == h_first):  # the peers' partials are awaited with the first own tile in hand
                    dl.wait(combined + dv * MAXC + c, epoch, ctx, mask=(dv < world) & (dv != me))
                    _stamp(timeline, TL_CHUNK + 4 * c + 1, TIMELINE)
                acc = tl.zeros([BT, BH], dtype=tl.float32)
                for d in range(world):  # FIXED order: rank order
                    if d == me:
                        acc += own.to(tl.float32)
                    else:
                        pd = _column(pos, d, dv)
                        block = (d - me - 1 + world) % world
                        v = tl.load(partials + (block * max_tokens + pd[:, None]).to(tl.int64) * H + hh[None, :],
                                    mask=(pd >= 0)[:, None] & hm, other=0.0)
                        acc += v.to(tl.float32)
                tl.store(y + t[:, None].to(tl.int64) * H + hh[None, :], acc.to(y.dtype.element_ty),
                         mask=tm[:, None] & hm, eviction_policy=EVICT)
        if (c0 == c1) & (h_first == 0):  # no tokens here: the flags are still awaited (partials' double buffer)
            dl.wait(combined + dv * MAXC + c, epoch, ctx, mask=(dv < world) & (dv != me))
        _stamp(timeline, TL_CHUNK + 4 * c + 2, TIMELINE)
        u = _next_claim(claims)
    _end_claims(claims, u, n_units, claimers)
    _stamp(timeline, TL_PROGRAM + 4 * pid + 3, TIMELINE)
    dl.finish_call(state, epoch, n_prog)


# ----------------------------------------------------------------------------------------------------- launchers
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def max_recv_rows(world, num_experts, topk, max_tokens, align=1):
    """Worst-case rows of a rank's receive buffer: every slot of every token of every rank lands here (K, not
    min(K, EL): a router may repeat an expert id within a token), plus alignment padding."""
    local = num_experts // world
    return world * max_tokens * topk + local * (align - 1)


class _Workspace:
    """Symmetric buffers and flags of one (E, K, max_tokens, H, dtype, align), created once (collectively)."""

    _cache = {}

    def __init__(self, num_experts, topk, max_tokens, hidden, dtype, align):
        w = shmem.world_size()
        dev = shmem.device()
        self.key = (num_experts, topk, max_tokens, hidden, dtype, align)
        self.num_experts, self.topk, self.max_tokens, self.hidden, self.dtype, self.align = self.key
        self.local = num_experts // w
        self.el_pad = triton.next_power_of_2(self.local)
        self.w_pad = triton.next_power_of_2(w)
        self.max_rows = max_recv_rows(w, num_experts, topk, max_tokens, align)
        ep = self.w_pad * self.el_pad
        name = "ep."
        # symmetric: peers write here
        self.recv_x = shmem.empty((self.max_rows, hidden), dtype, name=name + "recv_x")
        self.recv_slots = shmem.empty((w, max_tokens, topk), torch.int32, name=name + "recv_slots")
        self.recv_w = shmem.empty((w, max_tokens, topk), torch.float32, name=name + "recv_w")
        self.recv_span = shmem.zeros((w, MAX_CHUNKS, 2), torch.int32, name=name + "recv_span")
        self.all_counts = shmem.zeros((2, w, ep), torch.int32, name=name + "counts")
        # one block per peer (this rank's own partial never leaves the registers of combine's receivers)
        self.partials = shmem.empty((2, max(w - 1, 1), max_tokens, hidden), dtype, name=name + "partials")
        self.counts_ready = shmem.signals((w,), name=name + "counts_ready")
        self.arrived = shmem.signals((w * MAX_CHUNKS,), name=name + "arrived")
        self.combined = shmem.signals((w * MAX_CHUNKS,), name=name + "combined")
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
        shmem.barrier()  # peers write into these only after every rank zeroed them

    @classmethod
    def get(cls, *key):
        if key not in cls._cache:
            cls._cache[key] = cls(*key)
        return cls._cache[key]


_GRAPHS = GraphCache()  # eager dispatches at decode sizes, replayed from CUDA graphs


def clear_workspaces():
    """Free every cached EP workspace. Collective: call it on every rank at the same point."""
    _GRAPHS.clear()
    _Workspace._cache.clear()


def default_config(max_tokens, hidden, device_type):
    """Knobs, identical on every rank (they depend only on max_tokens and hidden):
    num_chunks (token chunks per rank: the unit of flags, pipelining and combine), num_programs (grid),
    push_programs (of them, the senders; the rest receive), block_tokens / block_h (rows / columns per copy
    step), num_warps, fused_layout (low latency: no separate layout launch; for small max_tokens),
    maxnreg (a register cap per thread, None = the compiler's choice; lets two programs share an SM),
    eager_graph (an eager dispatch replays its launches from a cached CUDA graph: host-bound decode sizes),
    h_parts (the receivers' unit of work: a chunk's columns in this many parts), layout_chunks (chunks counted
    by one program of the layout launch), pdl (on GPUs of compute capability 9.0+: the dispatch launch starts
    while the layout launch runs, programmatic dependent launch), defer_signal / combine_defer_signal (a sender
    raises a chunk's flags after starting its next chunk, when the chunk's stores have drained; run50: 2 us less
    per T=4096 call, and 3.5 us less for a T=128 combine), tail_chunks / tail_parts (the receivers' units of the
    last tail_chunks chunks: their columns in tail_parts parts instead of h_parts), stream_hints (dispatch's
    copies load and store with the L2 policy evict_first, so that rows arriving over the link may stay in L2
    until the receivers copy them; combine_stream_hints: the same for combine's expert-row loads and y's stores;
    runs 71-76: dispatch 7-19 us and combine 2-3.5 us less per T=4096 call, timed in turn).
    ``combine_*``: the same knobs for ep_combine's own launch (its chunks are the dispatch's)."""
    if device_type == "cpu":
        cfg = {"num_chunks": 2, "num_programs": 2, "push_programs": 1, "block_h": 32, "block_tokens": 8,
               "num_warps": 4, "fused_layout": max_tokens <= 256, "eager_graph": False, "layout_chunks": 2}
    elif max_tokens <= 256:  # decode-sized batches: small chunks, wide copies, every SM (2xH200, T=128, per call
        # in a graph of 20: dispatch 24 us, combine 19 us, runs 21-24; the fused layout was slower: 122 us)
        cfg = {"num_chunks": 64, "num_programs": 132, "push_programs": 66, "block_h": 1024, "block_tokens": 2,
               "num_warps": 8, "fused_layout": False, "eager_graph": True}
    else:  # 2xH200, T=4096: dispatch 211-220 us with these (runs 25-39; receivers' units are (chunk, column
        # quarter), the senders help once done; 4 parts 211-220 us against 216-218 with 2, runs 34-39).
        # Combine: senders reduce and push the peers' tokens, then help the receivers (this rank's own slots + the sum)
        # in (chunk, column-half) units; 52 of 128 programs sent to start with (48 now, below), 16x512 tiles, 16 warps
        # (more loads in flight per SM): 210-215 us (runs 27-31; 64 senders 216-222, 8 warps 237-242, 264 programs
        # 250-336, 7 column parts 237). With the deferred chunk flags and the early dispatch launch (run50): dispatch
        # 214 / combine 209 us per graph, 209 / 204 per call in a graph of 20. The receivers' units of the last 16
        # chunks in finer column parts (8 for dispatch, 4 for combine; run51): 210.9 / 204.2 us per graph against 212.2
        # / 207.8. With the tails, 48 combine senders (runs 60-61; timed in turn, per call in graphs of 20: 198.2 us
        # against 200.5 with 52, 44: 200.1, 40: 208.1; dispatch senders 64 / 60 / 68: 206.0 / 210.9 / 207.5; run62
        # again: 197.9 against 203.1 with 52).
        # L2 hints (run71, in turn, per call in graphs of 20): dispatch 200.1 us against 207.8 without, combine
        # 197.1 against 199.1 (meant to keep the arrivals from the link in L2 until they are read). With them the
        # receivers' copies cost less and more senders pay (in turn: 76 senders 197.5 / 197.9 us in runs 73-74,
        # 80: 196.4 / 196.4 in runs 74-75, against 199.0 / 199.1 / 199.6 with 64 in runs 73-75; 88: 200.3).
        cfg = {"num_chunks": 256, "num_programs": 128, "push_programs": 80, "block_h": 512, "block_tokens": 16,
               "num_warps": 8, "fused_layout": False, "h_parts": 4, "tail_chunks": 16, "tail_parts": 8,
               "combine_programs": 128, "combine_push": 48, "combine_warps": 16, "combine_h_parts": 2,
               "combine_tail_chunks": 16, "combine_tail_parts": 4, "stream_hints": True,
               "combine_stream_hints": True}
    return {"maxnreg": None, "combine_maxnreg": None, "eager_graph": False, "layout_chunks": 4, "h_parts": 1,
            "pdl": True, "defer_signal": True, "combine_defer_signal": True, "tail_chunks": 0, "tail_parts": 1,
            "stream_hints": False, "combine_stream_hints": False,  # (on at T=4096, above)
            "combine_tail_chunks": 0, "combine_tail_parts": 1,
            "combine_h_parts": 1,
            "combine_programs": cfg["num_programs"], "combine_push": cfg["push_programs"],
            "combine_block_h": cfg["block_h"], "combine_block_tokens": cfg["block_tokens"],
            "combine_warps": cfg["num_warps"], **cfg}


@dataclass
class EpHandle:
    """What ep_combine needs from a dispatch: the workspace, which call it was, and the token chunking."""

    workspace: _Workspace
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


def _check_inputs(x, topk_idx, topk_weights, num_experts, max_tokens, align):
    for name, t in (("x", x), ("topk_idx", topk_idx), ("topk_weights", topk_weights)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        shmem.check_device(t, name)
    if x.dtype not in _DTYPES:
        raise TypeError(f"x must be bfloat16, float16 or float32, got {x.dtype}")
    if topk_idx.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"topk_idx must be int32 or int64, got {topk_idx.dtype}")
    if not topk_weights.dtype.is_floating_point:
        raise TypeError(f"topk_weights must be a floating tensor, got {topk_weights.dtype}")
    if x.dim() != 2 or topk_idx.dim() != 2 or tuple(topk_weights.shape) != tuple(topk_idx.shape) \
            or topk_idx.shape[0] != x.shape[0]:
        raise ValueError(f"expected x [T, H], topk_idx [T, K], topk_weights [T, K]; got {list(x.shape)}, "
                         f"{list(topk_idx.shape)}, {list(topk_weights.shape)}")
    world = shmem.world_size()
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


def resolve_config(max_tokens, hidden, device_type, config=None):
    """``default_config`` overridden by ``config`` (a dict of knobs), checked: unknown knob names and values the
    kernels cannot run with raise ValueError. ep_dispatch and ep_combine call it with their ``config``; without
    one the result is cached (read-only): every call pays a few µs of Python otherwise."""
    if not config:
        return _checked_defaults(max_tokens, hidden, device_type)
    return _checked(max_tokens, hidden, device_type, config)


@functools.lru_cache(maxsize=64)
def _checked_defaults(max_tokens, hidden, device_type):
    return types.MappingProxyType(_checked(max_tokens, hidden, device_type, {}))


def _checked(max_tokens, hidden, device_type, config):
    cfg = autotune.with_overrides(default_config(max_tokens, hidden, device_type), config)
    if not 1 <= int(cfg["num_chunks"]) <= MAX_CHUNKS:
        raise ValueError(f"num_chunks must be in [1, {MAX_CHUNKS}], got {cfg['num_chunks']}")
    for prog, push in (("num_programs", "push_programs"), ("combine_programs", "combine_push")):
        if not 1 <= int(cfg[push]) < int(cfg[prog]):
            raise ValueError(f"need 1 <= {push} < {prog}, got {cfg[push]}, {cfg[prog]}")
    for name in ("h_parts", "combine_h_parts", "tail_parts", "combine_tail_parts"):
        if not isinstance(cfg[name], int) or not 1 <= cfg[name] <= 2**20:
            raise ValueError(f"{name} must be an int in [1, 2**20], got {cfg[name]!r}")
    for name in ("layout_chunks", "block_tokens", "block_h", "combine_block_tokens", "combine_block_h"):
        if int(cfg[name]) < 1:
            raise ValueError(f"{name} must be >= 1, got {cfg[name]}")
    for name in ("tail_chunks", "combine_tail_chunks"):
        if not isinstance(cfg[name], int) or cfg[name] < 0:
            raise ValueError(f"{name} must be an int >= 0, got {cfg[name]!r}")
    return cfg


def _senders_help(n_prog, t):
    """Whether a launch's senders may join its receivers: on a GPU, with every program resident at once (a
    waiting sender must not keep a peer's sender off the GPU); never under the interpreter."""
    return t.is_cuda and n_prog <= num_sms(t.device.index)


def _tail(tail_chunks, tail_parts, n_chunks):
    """The receivers' (tail, tail_parts) launch arguments: the last tail_chunks chunks (at most all) in
    tail_parts column parts."""
    return min(int(tail_chunks), n_chunks), int(tail_parts)


def _register_cap(maxnreg, t):
    """Launch options for a register cap per thread (GPU only; the interpreter has no registers)."""
    return {"maxnreg": int(maxnreg)} if maxnreg and t.device.type == "cuda" else {}


def _check_timeline(timeline, device, n_prog):
    """The optional phase-timeline buffer: None, or an int64 GPU tensor of TIMELINE_SLOTS on the op's GPU."""
    if timeline is None:
        return
    if not isinstance(timeline, torch.Tensor) or timeline.dtype != torch.int64 or timeline.numel() < TIMELINE_SLOTS \
            or not timeline.is_contiguous():
        raise TypeError(f"timeline must be a contiguous int64 tensor of at least {TIMELINE_SLOTS} elements")
    if device.type != "cuda":
        raise ValueError("timeline needs a GPU (it reads the GPU clock)")
    shmem.check_device(timeline, "timeline")
    if n_prog > MAX_TIMELINE_PROGRAMS:
        raise ValueError(f"a timeline has room for {MAX_TIMELINE_PROGRAMS} programs, the launch has {n_prog}")


def ep_dispatch(x, topk_idx, topk_weights, *, num_experts, max_tokens, align=1, exact=False, check_ids=None,
                config=None, timeline=None):
    """Send every token to the ranks owning its top-k experts (once per rank), grouped by local expert there.

    ``x`` [T, H] (bf16/fp16/fp32), ``topk_idx`` [T, K] int (global expert ids, -1 = unused slot),
    ``topk_weights`` [T, K]. ``num_experts``, ``max_tokens`` (>= T on every rank), ``align``, K, H and the dtype
    must be the same on every rank. ``exact``: sync once and trim the outputs to the rows in use.
    ``check_ids``: verify ids on the host (ValueError; on GPU that is a device sync). Default: on CPU only, so
    that a GPU call never syncs; the kernels treat an id outside [0, E) like -1 (the slot is dropped).
    ``timeline``: optional int64 GPU tensor [TIMELINE_SLOTS] that receives the phase timeline (see TL_PROGRAM).
    Returns an ``EpDispatchResult``; its tensors are views valid until the next dispatch of the same shapes."""
    _check_inputs(x, topk_idx, topk_weights, num_experts, max_tokens, align)
    if check_ids is None:
        check_ids = x.device.type == "cpu"
    if check_ids and topk_idx.numel() and bool(((topk_idx < -1) | (topk_idx >= num_experts)).any()):
        bad = topk_idx[(topk_idx < -1) | (topk_idx >= num_experts)][0].item()
        raise ValueError(f"topk_idx holds expert id {bad}, outside [0, {num_experts}) (-1 marks an unused slot)")
    T, H = x.shape
    K = topk_idx.shape[1]
    ws = _Workspace.get(num_experts, K, max_tokens, H, x.dtype, align)
    cfg = resolve_config(max_tokens, H, x.device.type, config)
    n_chunks, n_prog, n_push = int(cfg["num_chunks"]), int(cfg["num_programs"]), int(cfg["push_programs"])
    _check_timeline(timeline, x.device, n_prog)
    h_parts = cfg["h_parts"]
    k_pad = triton.next_power_of_2(K)
    ep = ws.w_pad * ws.el_pad
    bt = min(int(cfg["block_tokens"]), 8192 // (k_pad * ep), triton.cdiv(max_tokens, n_chunks))
    bt = triton.next_power_of_2(max(1, bt))
    bt_count = triton.next_power_of_2(max(1, min(8192 // (k_pad * ep), max_tokens)))  # tokens per counting step
    # layout programs: cg chunks each, counted tb tokens of every chunk at a time (at most 4096 tokens per step)
    tb_layout = min(triton.next_power_of_2(triton.cdiv(max_tokens, n_chunks)), 256)
    cg = min(triton.next_power_of_2(min(int(cfg["layout_chunks"]), n_chunks)), 4096 // tb_layout)
    n_groups = triton.cdiv(n_chunks, cg)
    bh = min(triton.next_power_of_2(int(cfg["block_h"])), triton.next_power_of_2(H))
    if T == 0:  # keep real pointers for the kernels; nothing is read
        x = torch.zeros((1, H), dtype=x.dtype, device=x.device)
        topk_idx = torch.full((1, K), -1, dtype=torch.int32, device=x.device)
        topk_weights = torch.zeros((1, K), dtype=torch.float32, device=x.device)
    x = x.contiguous()
    idx = topk_idx.contiguous()  # int32/int64 and any float weights are read as they are: no conversion kernels
    wts = topk_weights.contiguous()
    ctx = shmem.context()
    common = dict(K=K, EL=ws.local, BT=bt, K_PAD=k_pad, EL_PAD=ws.el_pad, W_PAD=ws.w_pad)
    shmem.raise_pending_errors()
    fused = bool(cfg["fused_layout"])
    pdl = not fused and pdl_capable(x.device) and bool(cfg["pdl"])

    def launch(x, idx, wts):
        if not fused:
            ep_layout_kernel[(n_groups,)](
                idx, ws.chunk_counts, ws.chunk_prefix, ws.counted, ws.all_counts, ws.counts_ready, ws.state, T,
                num_experts, n_chunks, ctx, ws.state if timeline is None else timeline, TB=tb_layout, CG=cg,
                QB=min(triton.next_power_of_2(n_groups), 128 if x.device.type == "cuda" else 4),
                TIMELINE=timeline is not None, PDL=pdl, num_warps=4, K=K, EL=ws.local, K_PAD=k_pad,
                EL_PAD=ws.el_pad, W_PAD=ws.w_pad)
        ep_dispatch_kernel[(n_prog,)](
            x, idx, wts, T, H, num_experts, align, max_tokens, ws.max_rows, n_chunks, h_parts,
            *_tail(cfg["tail_chunks"], cfg["tail_parts"], n_chunks), n_push,
            ws.recv_x, ws.recv_slots, ws.recv_w, ws.recv_span, ws.all_counts, ws.counts_ready, ws.arrived,
            ws.expert_ids, ws.weights, ws.expert_counts, ws.expert_offsets, ws.token_pos, ws.chunk_prefix,
            ws.dispatch_claims, ws.state, ctx, ws.state if timeline is None else timeline, BH=bh,
            RB=128 if x.device.type == "cuda" else 16, MAXC=MAX_CHUNKS, FUSED_LAYOUT=fused, BT_COUNT=bt_count,
            SENDERS_HELP=_senders_help(n_prog, x), TIMELINE=timeline is not None, PDL=pdl,
            DEFER_SIGNAL=bool(cfg["defer_signal"]), EVICT="evict_first" if cfg["stream_hints"] else "",
            num_warps=int(cfg["num_warps"]), **({"launch_pdl": True} if pdl else {}),
            **_register_cap(cfg["maxnreg"], x), **common)
        return ws.recv_x  # the results are views of the workspace, whichever way the kernels ran

    # decode sizes: an eager call replays the two launches from a cached CUDA graph (inputs copied in), which
    # costs a fraction of their Python launch cost; inside a capture, under torch.compile or on CPU: direct
    replayed = False
    if cfg["eager_graph"] and timeline is None:  # (the defaults of a workspace's shapes never change)
        graph_key = (ws.key, T, idx.dtype, wts.dtype, repr(sorted(cfg.items())) if config else "defaults")
        replayed = _GRAPHS.run(graph_key, launch, (x, idx, wts), clone=False) is not None
    if not replayed:
        launch(x, idx, wts)
    ws.calls += 1
    handle = EpHandle(ws, ws.calls, T, n_chunks, ws.token_pos[:T])
    ws.last = handle
    rows = ws.max_rows
    if exact:
        rows = int(ws.expert_offsets[ws.local].item())
    return EpDispatchResult(ws.recv_x[:rows], ws.expert_ids[:rows], ws.weights[:rows], ws.expert_counts,
                            ws.expert_offsets, handle)


def ep_combine(expert_out, handle, out=None, config=None, timeline=None):
    """``y[t] = sum_j topk_weights[t, j] * expert_out[row of (t, j)]`` back on every token's own rank, summed in
    a fixed order (slot order within a rank, then rank order): bitwise reproducible.

    ``expert_out`` [>= rows in use, H] in the receive layout of ``ep_dispatch`` (padding rows are never read),
    same dtype as the dispatched x. ``handle``: ``EpDispatchResult.handle`` of the latest dispatch.
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
    T, H = handle.num_tokens, ws.hidden
    y = out if out is not None else torch.empty((T, H), dtype=ws.dtype, device=expert_out.device)
    if tuple(y.shape) != (T, H) or y.dtype != ws.dtype or not y.is_contiguous():
        raise ValueError(f"out must be a contiguous {ws.dtype} tensor [{T}, {H}]")
    cfg = resolve_config(ws.max_tokens, H, expert_out.device.type, config)
    bh = min(triton.next_power_of_2(int(cfg["combine_block_h"])), triton.next_power_of_2(H))
    bt = triton.next_power_of_2(max(1, min(int(cfg["combine_block_tokens"]),
                                           triton.cdiv(ws.max_tokens, handle.num_chunks))))
    expert_out = expert_out.contiguous()
    if expert_out.shape[0] == 0:
        expert_out = torch.zeros((1, H), dtype=ws.dtype, device=expert_out.device)
    y_arg = y if T else torch.empty((1, H), dtype=ws.dtype, device=expert_out.device)
    tp = handle.token_pos if T else ws.token_pos
    shmem.raise_pending_errors()
    n_prog, n_push = int(cfg["combine_programs"]), int(cfg["combine_push"])
    _check_timeline(timeline, expert_out.device, n_prog)
    h_parts = cfg["combine_h_parts"]
    ep_combine_kernel[(n_prog,)](
        expert_out, y_arg, T, H, ws.max_tokens, handle.num_chunks, h_parts,
        *_tail(cfg["combine_tail_chunks"], cfg["combine_tail_parts"], handle.num_chunks), n_push, ws.recv_slots,
        ws.recv_w, ws.recv_span, tp, ws.partials, ws.combined, ws.combine_claims, ws.combine_state,
        shmem.context(), ws.combine_state if timeline is None else timeline, K=ws.topk, BT=bt, BH=bh,
        K_PAD=triton.next_power_of_2(ws.topk), W_PAD=ws.w_pad, MAXC=MAX_CHUNKS,
        SENDERS_HELP=_senders_help(n_prog, expert_out), TIMELINE=timeline is not None,
        DEFER_SIGNAL=bool(cfg["combine_defer_signal"]), EVICT="evict_first" if cfg["combine_stream_hints"] else "",
        num_warps=int(cfg["combine_warps"]), **_register_cap(cfg["combine_maxnreg"], expert_out))
    return y


# ----------------------------------------------------------------------------------------------------- torch ops
def _fake_rows(num_experts, topk, max_tokens, align):
    return max_recv_rows(shmem.world_size(), num_experts, topk, max_tokens, align)


def _ep_dispatch_op(x, topk_idx, topk_weights, num_experts, max_tokens, align):
    r = ep_dispatch(x, topk_idx, topk_weights, num_experts=num_experts, max_tokens=max_tokens, align=align,
                    check_ids=False)
    # zero-copy: views of the workspace (distinct buffers, so no two outputs alias), valid until the next dispatch
    return r.x, r.expert_ids, r.weights, r.expert_counts, r.expert_offsets, r.handle.token_pos


def _ep_dispatch_fake(x, topk_idx, topk_weights, num_experts, max_tokens, align):
    rows = _fake_rows(num_experts, topk_idx.shape[1], max_tokens, align)
    local = num_experts // shmem.world_size()
    i32 = dict(dtype=torch.int32, device=x.device)
    return (x.new_empty((rows, x.shape[1])), torch.empty((rows,), **i32),
            torch.empty((rows,), dtype=torch.float32, device=x.device), torch.empty((local,), **i32),
            torch.empty((local + 1,), **i32), torch.empty((x.shape[0], shmem.world_size()), **i32))


def _ep_combine_op(expert_out, token_pos, num_experts, topk, max_tokens, align):
    key = (num_experts, topk, max_tokens, expert_out.shape[1], expert_out.dtype, align)
    ws = _Workspace._cache.get(key)
    if ws is None or ws.last is None:
        raise ValueError("torch.ops.triton_dist.ep_combine needs an earlier ep_dispatch with the same shapes")
    if token_pos.shape[0] != ws.last.num_tokens:
        raise ValueError(f"token_pos has {token_pos.shape[0]} tokens, the latest dispatch had "
                         f"{ws.last.num_tokens}")
    return ep_combine(expert_out, ws.last)


def _ep_combine_fake(expert_out, token_pos, num_experts, topk, max_tokens, align):
    return expert_out.new_empty((token_pos.shape[0], expert_out.shape[1]))


library.define("ep_dispatch(Tensor x, Tensor topk_idx, Tensor topk_weights, int num_experts, int max_tokens, "
               "int align) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)", _ep_dispatch_op, _ep_dispatch_fake)
library.define("ep_combine(Tensor expert_out, Tensor token_pos, int num_experts, int topk, int max_tokens, "
               "int align) -> Tensor", _ep_combine_op, _ep_combine_fake)
