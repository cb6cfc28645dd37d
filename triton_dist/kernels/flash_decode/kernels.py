"""The kernels of sequence-parallel flash-decode (see the package docstring for the data movement).

    flash_decode_split_kernel  grid (n_splits, B * Hkv): one slice of one sequence's local tokens for the Hq/Hkv
                               query heads of one KV head (GQA: each KV tile is read once for all of them), online
                               softmax in log2 units -> partial (o, lse). The last split of (b, kv head) to arrive
                               merges the splits and publishes by ``MODE``: LOCAL (this rank's (o, lse) out), PUSH
                               (to every rank's receive buffer + flag), FUSED (to the peers, then wait for theirs,
                               merge, store o).
    flash_decode_merge_kernel  grid (B * Hkv,): wait for every rank's partial, merge, store o (after PUSH).

Partials merge by ``o = sum_i 2^(lse_i - M) o_i / sum_i 2^(lse_i - M)`` with M = max_i lse_i; a partial with
lse = -inf (no tokens) weighs nothing.
"""

import triton
import triton.language as tl

from ... import language as dl
from ...shmem import layout

SITE_BLOCK_TABLE = tl.constexpr(layout.SITE_BLOCK_TABLE)
SITE_KV_LENS = tl.constexpr(layout.SITE_KV_LENS)

LOG2E = 1.4426950408889634  # kernels work in log2 units (exp2 is one instruction); lse leaves in natural log

# What the split kernel does with its result (constexpr MODE).
MODE_LOCAL, MODE_PUSH, MODE_FUSED = 0, 1, 2
LOCAL = tl.constexpr(MODE_LOCAL)  # store this rank's (o, lse)
PUSH = tl.constexpr(MODE_PUSH)  # push to every rank (itself included); flash_decode_merge_kernel merges
FUSED = tl.constexpr(MODE_FUSED)  # push to the peers, wait for theirs, merge, store o


@triton.jit
def _merge_partials(o_ptr, lse_ptr, o_stride, lse_stride, skip, N: tl.constexpr, GROUP: tl.constexpr,
                    GROUP_P2: tl.constexpr, HEAD_DIM: tl.constexpr, CHUNK: tl.constexpr):
    """Merge the ``N`` partials (o [GROUP, HEAD_DIM] fp32 normalised, lse [GROUP] log2 units) of one head group,
    all but number ``skip`` (-1: none): partial i's o row g at ``o_ptr + i * o_stride + g * HEAD_DIM``, its lse at
    ``lse_ptr + i * lse_stride + g``. CHUNK partials per load round; N is a compile-time constant, so the rounds are
    unrolled and their loads can all be in flight together. Partials with lse = -inf weigh nothing; if all do,
    o = 0 and lse = -inf. Loads bypass L1 (``.cg``): the partials were written by other programs (or other GPUs)
    and published by a release/acquire pair. Returns o [GROUP_P2, HEAD_DIM], lse [GROUP_P2]."""
    i = tl.arange(0, CHUNK)
    g = tl.arange(0, GROUP_P2)
    d = tl.arange(0, HEAD_DIM)
    top = tl.full([GROUP_P2], float("-inf"), tl.float32)
    total = tl.zeros([GROUP_P2], tl.float32)
    acc = tl.zeros([GROUP_P2, HEAD_DIM], tl.float32)
    for first in tl.static_range(0, N, CHUNK):
        row = first + i
        ok = ((row < N) & (row != skip))[:, None] & (g[None, :] < GROUP)  # [CHUNK, GROUP_P2]
        lse = tl.load(lse_ptr + row[:, None].to(tl.int64) * lse_stride + g[None, :], mask=ok,
                      other=float("-inf"), cache_modifier=".cg")
        o = tl.load(o_ptr + row[:, None, None].to(tl.int64) * o_stride + g[None, :, None] * HEAD_DIM
                    + d[None, None, :], mask=ok[:, :, None], other=0.0, cache_modifier=".cg")
        new_top = tl.maximum(top, tl.max(lse, 0))
        safe_top = tl.where(new_top == float("-inf"), 0.0, new_top)
        rescale = tl.exp2(top - safe_top)  # 0 while nothing was seen yet
        weight = tl.exp2(lse - safe_top[None, :])  # [CHUNK, GROUP_P2]
        total = total * rescale + tl.sum(weight, 0)
        acc = acc * rescale[:, None] + tl.sum(weight[:, :, None] * o, 0)
        top = new_top
    has = total > 0
    o = acc / tl.where(has, total, 1.0)[:, None]
    lse = tl.where(has, top + tl.log2(tl.where(has, total, 1.0)), float("-inf"))
    return o, lse


@triton.jit
def _merge_two(o1, lse1, o2, lse2):
    """The rule above for two partials (o [G, D] finite, 0 where lse = -inf); a head with neither gives 0."""
    top = tl.maximum(lse1, lse2)
    safe_top = tl.where(top == float("-inf"), 0.0, top)
    w1 = tl.exp2(lse1 - safe_top)
    w2 = tl.exp2(lse2 - safe_top)
    total = w1 + w2
    return (o1 * w1[:, None] + o2 * w2[:, None]) / tl.where(total > 0, total, 1.0)[:, None]


@triton.jit
def _recv_o_at(recv_o, first, HQ, kv_head, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Address of partial row 0 of the head group ``kv_head`` in receive slot ``first`` (rank 0's)."""
    return recv_o + (first * HQ + kv_head * GROUP) * HEAD_DIM


@triton.jit
def _publish(o, lse, b, kv_head, dst_o, dst_lse, out, flags, state, ctx, stride_ob, stride_oh, B, HQ, HKV,
             GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, MODE: tl.constexpr, WORLD: tl.constexpr,
             WORLD_PAD: tl.constexpr, RANK_CHUNK: tl.constexpr):
    """This rank's result for (b, kv head): o [G', HEAD_DIM] fp32 and lse [G'] (log2 units), G' >= GROUP.
    LOCAL: o in dst_o's dtype and lse in natural-log units into this rank's [B, HQ, ...] outputs.
    PUSH: into slot [epoch parity, me, b] of every rank's receive buffer (dst_o, dst_lse), then
    flag[me, b, kv head] = epoch there. FUSED: the same to the peers only, then wait for the peers' partials,
    merge them with ours and store o into ``out``; the last (b, kv head) to finish advances the epoch."""
    GP: tl.constexpr = o.shape[0]
    g = tl.arange(0, GP)
    d = tl.arange(0, HEAD_DIM)
    head = kv_head * GROUP + g
    g_ok = g < GROUP
    if MODE == LOCAL:
        row = b.to(tl.int64) * HQ + head
        tl.store(dst_o + row[:, None] * HEAD_DIM + d[None, :], o.to(dst_o.dtype.element_ty), mask=g_ok[:, None])
        tl.store(dst_lse + row, lse * 0.6931471805599453, mask=g_ok)  # log2 -> natural log
    else:
        me = dl.rank(ctx)
        epoch = dl.call_epoch(state)
        bk = b * HKV + kv_head
        first = ((epoch % 2) * WORLD).to(tl.int64) * B + b  # slot of rank 0's partial of sequence b
        slot = first + me.to(tl.int64) * B
        o_at = dst_o + (slot * HQ + head[:, None]) * HEAD_DIM + d[None, :]
        lse_at = dst_lse + slot * HQ + head
        N_PUSH: tl.constexpr = WORLD - 1 if MODE == FUSED else WORLD
        for i in tl.static_range(N_PUSH):
            peer = (me + 1 + i) % WORLD  # peers first, our own copy (PUSH) last
            dl.put(o_at, o, peer, ctx, mask=g_ok[:, None])
            dl.put(lse_at, lse, peer, ctx, mask=g_ok)
            dl.signal(flags + me * (B * HKV) + bk, epoch, peer, ctx)
        if MODE == FUSED:
            r = tl.arange(0, WORLD_PAD)
            dl.wait(flags + r * (B * HKV) + bk, epoch, ctx, mask=(r < WORLD) & (r != me))
            o_peers, lse_peers = _merge_partials(_recv_o_at(dst_o, first, HQ, kv_head, GROUP, HEAD_DIM),
                                                 dst_lse + first * HQ + kv_head * GROUP, B * HQ * HEAD_DIM,
                                                 B * HQ, me, WORLD, GROUP, GP, HEAD_DIM, RANK_CHUNK)
            o_all = _merge_two(o, lse, o_peers, lse_peers)
            tl.store(out + b.to(tl.int64) * stride_ob + head[:, None] * stride_oh + d[None, :],
                     o_all.to(out.dtype.element_ty), mask=g_ok[:, None])  # no tokens anywhere: 0
            dl.finish_call(state, epoch, B * HKV)


@triton.jit
def flash_decode_split_kernel(
        q, k_cache, v_cache, kv_lens, block_table,
        part_o, part_lse, split_arrivals,              # local scratch: per-split partials, arrival counters
        dst_o, dst_lse,                                # PUSH/FUSED: symmetric receive buffers; LOCAL: o, lse
        out, flags, state, ctx,                        # FUSED: the final output
        stride_qb, stride_qh,
        stride_kb, stride_kn, stride_kh,
        stride_vb, stride_vn, stride_vh,
        stride_table_b, stride_ob, stride_oh,
        B, HQ, HKV, s_max, num_pages, scale_log2,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
        GROUP_P2: tl.constexpr, N_SPLITS: tl.constexpr, SPLIT_CHUNK: tl.constexpr, PAGE_SIZE: tl.constexpr,
        MODE: tl.constexpr, WORLD: tl.constexpr, WORLD_PAD: tl.constexpr, RANK_CHUNK: tl.constexpr,
        FP32_DOT: tl.constexpr, PDL: tl.constexpr, CHECK_INDICES: tl.constexpr):
    dl.launch_dependents(PDL)  # the merge launch may start once every split program is running (none starved)
    split = tl.program_id(0)
    bk = tl.program_id(1)  # (b, kv head)
    b = bk // HKV
    kv_head = bk % HKV
    b64 = b.to(tl.int64)

    # This sequence's local tokens, cut into N_SPLITS slices of whole BLOCK_N tiles (sized per sequence, on the
    # device: ragged batches split evenly without a host sync; a slice past the end is empty). A length outside
    # [0, s_max] is clamped, and recorded with CHECK_INDICES == 2 (ctx is a context then).
    kv_raw = tl.load(kv_lens + b)
    if CHECK_INDICES == 2:
        dl.check_index(kv_raw, b, s_max + 1, ctx, SITE_KV_LENS)
    kv_len = tl.minimum(tl.maximum(kv_raw, 0), s_max).to(tl.int32)
    per_split = tl.cdiv(tl.cdiv(kv_len, N_SPLITS), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, kv_len)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM)
    head = kv_head * GROUP + g
    g_ok = g < GROUP
    q_tile = tl.load(q + b64 * stride_qb + head[:, None] * stride_qh + d[None, :], mask=g_ok[:, None], other=0.0)

    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)  # running max of the scores (log2 units)
    l = tl.zeros([GROUP_PAD], tl.float32)  # running sum of exp2(score - m)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    for t0 in tl.range(start, end, BLOCK_N):
        tok = t0 + tl.arange(0, BLOCK_N)
        t_ok = tok < end
        if PAGE_SIZE > 0:
            at = b64 * stride_table_b + tok // PAGE_SIZE
            page = tl.load(block_table + at, mask=t_ok, other=0).to(tl.int64)
            if CHECK_INDICES > 0:  # a page id outside the cache is never read (page 0 instead), 2: and recorded
                if CHECK_INDICES == 2:
                    page_ok = dl.check_index(page, at, num_pages, ctx, SITE_BLOCK_TABLE, mask=t_ok)
                else:
                    page_ok = (page >= 0) & (page < num_pages)
                page = tl.where(page_ok, page, 0)
            k_rows = page * stride_kb + (tok % PAGE_SIZE) * stride_kn
            v_rows = page * stride_vb + (tok % PAGE_SIZE) * stride_vn
        else:
            k_rows = b64 * stride_kb + tok.to(tl.int64) * stride_kn
            v_rows = b64 * stride_vb + tok.to(tl.int64) * stride_vn
        k = tl.load(k_cache + k_rows[:, None] + kv_head * stride_kh + d[None, :], mask=t_ok[:, None], other=0.0)
        if FP32_DOT:
            s = tl.dot(q_tile, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q_tile, tl.trans(k))
        s = tl.where(t_ok[None, :], s * scale_log2, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))  # finite: the tile has at least one valid token
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        v = tl.load(v_cache + v_rows[:, None] + kv_head * stride_vh + d[None, :], mask=t_ok[:, None], other=0.0)
        if FP32_DOT:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    o = acc / tl.where(l > 0, l, 1.0)[:, None]  # an empty slice gives o = 0, lse = -inf (weight 0 below)
    lse = tl.where(l > 0, m + tl.log2(tl.where(l > 0, l, 1.0)), float("-inf"))

    if N_SPLITS == 1:
        _publish(o, lse, b, kv_head, dst_o, dst_lse, out, flags, state, ctx, stride_ob, stride_oh, B, HQ, HKV,
                 GROUP, HEAD_DIM, MODE, WORLD, WORLD_PAD, RANK_CHUNK)
    else:  # every split files its partial and counts in; the last to arrive merges them all and publishes
        row = bk * N_SPLITS + split
        tl.store(part_o + (row * GROUP + g[:, None]) * HEAD_DIM + d[None, :], o, mask=g_ok[:, None])
        tl.store(part_lse + row * GROUP + g, lse, mask=g_ok)
        tl.debug_barrier()  # all threads' partials are written before the count below releases them
        arrived = tl.atomic_add(split_arrivals + bk, 1, sem="acq_rel", scope="gpu")
        if arrived == N_SPLITS - 1:
            tl.atomic_xchg(split_arrivals + bk, 0, sem="relaxed", scope="gpu")  # ready for the next call
            first = bk * N_SPLITS
            o_all, lse_all = _merge_partials(part_o + first * GROUP * HEAD_DIM, part_lse + first * GROUP,
                                             GROUP * HEAD_DIM, GROUP, -1, N_SPLITS, GROUP, GROUP_P2, HEAD_DIM,
                                             SPLIT_CHUNK)
            _publish(o_all, lse_all, b, kv_head, dst_o, dst_lse, out, flags, state, ctx, stride_ob, stride_oh, B,
                     HQ, HKV, GROUP, HEAD_DIM, MODE, WORLD, WORLD_PAD, RANK_CHUNK)


@triton.jit
def flash_decode_merge_kernel(recv_o, recv_lse, flags, out, state, ctx, stride_ob, stride_oh, B, HQ, HKV,
                              GROUP: tl.constexpr, GROUP_P2: tl.constexpr, HEAD_DIM: tl.constexpr,
                              WORLD: tl.constexpr, WORLD_PAD: tl.constexpr, RANK_CHUNK: tl.constexpr,
                              PDL: tl.constexpr):
    bk = tl.program_id(0)
    b = bk // HKV
    kv_head = bk % HKV
    epoch = dl.call_epoch(state)
    r = tl.arange(0, WORLD_PAD)
    dl.wait(flags + r * (B * HKV) + bk, epoch, ctx, mask=r < WORLD)  # every rank's partial has landed here
    first = ((epoch % 2) * WORLD).to(tl.int64) * B + b  # slot of rank 0's partial of sequence b
    o, lse = _merge_partials(_recv_o_at(recv_o, first, HQ, kv_head, GROUP, HEAD_DIM),
                             recv_lse + first * HQ + kv_head * GROUP, B * HQ * HEAD_DIM, B * HQ, -1, WORLD, GROUP,
                             GROUP_P2, HEAD_DIM, RANK_CHUNK)
    g = tl.arange(0, GROUP_P2)
    d = tl.arange(0, HEAD_DIM)
    head = kv_head * GROUP + g
    tl.store(out + b.to(tl.int64) * stride_ob + head[:, None] * stride_oh + d[None, :], o.to(out.dtype.element_ty),
             mask=(g < GROUP)[:, None])  # a sequence with no tokens anywhere gives 0
    dl.finish_call(state, epoch, tl.num_programs(0))
    dl.wait_prior_kernel(PDL)  # complete only after the split grid has: what follows sees both finished

