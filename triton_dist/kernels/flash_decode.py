"""Sequence-parallel flash-decode: one new query token per sequence, the KV cache of every sequence split over ranks.

Each rank holds a slice of every sequence's KV cache (``k_cache``/``v_cache`` [B, S_local_max, Hkv, D], the first
``kv_lens[b]`` tokens valid; a rank may hold none of a sequence) and the same query ``q`` [B, Hq, D]. Attention has
no causal mask at decode time, so softmax(q K^T) V over the concatenated shards is a weighted mix of per-shard
results: a shard summarised by its normalised output ``o_i`` and log-sum-exp ``lse_i`` combines as

    o = sum_i exp(lse_i - M) o_i / sum_i exp(lse_i - M),    M = max_i lse_i

(the same rule merges the splits of one shard). No host sync, CUDA-graph safe:

    flash_decode_split_kernel, grid (n_splits, B * Hkv)                                  [reads the KV at HBM speed]
         program (split, b, kv head): the Hq/Hkv query heads of that KV head together (GQA: each KV tile is read
         once, for all of them), online softmax over its slice of the tokens -> partial (o, lse) in a local scratch;
         counts itself in with an atomic. The LAST split of (b, kv head) to arrive merges the n_splits partials
         (it waits for nobody: everyone else is already done) and pushes the rank's partial for its G heads,
         G * (D + 1) floats, into slot [me] of every peer's receive buffer (dl.put), then dl.signal-s that peer's
         flag[me, b, kv head] with this call's epoch. Then, by ``combine`` mode:
      "fused"   the same program waits for the peers' partials of (b, kv head), merges them with its own (still in
                registers) and writes o [B, Hq, D]. ONE launch per call. Only used while B * Hkv < number of SMs:
                at most B * Hkv programs ever wait, so at least one SM always has room for the splits everyone
                waits on, whatever order the hardware schedules them in (no hang by construction).
      "kernel"  it also pushes its partial into its own receive buffer, and a second launch does the waiting:
    flash_decode_merge_kernel, grid (B * Hkv,)                                           [a few µs]
         waits until flag[r, b, kv head] >= epoch for every rank r (one vector poll), merges the world partials
         with the rule above and writes o in q's dtype. The second launch never holds an SM the splits need, so it
         is safe for any B * Hkv. ``pdl=True`` launches it with programmatic dependent launch (Hopper+; ignored on
         older GPUs): the split kernel lets it start once all split programs are running
         (griddepcontrol.launch_dependents), so its launch latency hides under the splits' tail; it synchronises
         through the flags and only waits for the split grid's completion at its very end (griddepcontrol.wait),
         so stream order is kept for what follows.
    ``combine="auto"`` (default): "fused" when B * Hkv < SMs, else "kernel".

Data movement per call and rank: the KV shard once from HBM; B * Hq * (D + 1) * 4 bytes to each peer over NVLink.

Repeated calls and graphs: flags carry the call's epoch (1, 2, 3, ... kept on the device; the last program to
finish a call advances it), so nothing is ever reset from the host. The receive buffer is double-buffered by epoch
parity, which makes a ``ready`` handshake unnecessary: rank A can push call n+2 into the half that rank B reads in
call n only after A's call n+1 merge saw B's call n+1 pushes, and B makes those only after its call n merge finished
(stream order). (The Triton interpreter runs the programs of a launch one after another, in the same order on every
rank, so the same source runs on CPU ranks: each waiting program waits for the peer's program at the same place.)

Knobs (``config=``, identical on every rank; see ``default_config``): block_n (tokens per tile), num_stages
(pipelined tile loads), num_warps, n_splits or programs_per_sm (splits chosen to fill whole waves of SMs), combine,
pdl, merge_num_warps. ``resolved_config(...)`` shows what a call would use.

Host cost per call: everything that depends only on the inputs' shapes/strides/dtypes and the config (validation,
config, split count, scratch, launch constants) is computed once and cached in a plan; a call is a dictionary
look-up and one (or two) Triton launches.

Paged KV: pass ``block_table`` [B, max_pages] (int32/int64) and a paged cache [num_pages, page_size, Hkv, D];
token t of sequence b lives in page ``block_table[b, t // page_size]``, row ``t % page_size``.

``local_flash_decode`` is the split kernel alone with a local epilogue (this rank's (o, lse)): single-GPU decode, and
the "local part" the benchmark measures.
"""

import math

import torch
import triton
import triton.language as tl

from .. import autotune, shmem
from .. import language as dl
from . import library
from .gemm import num_sms, pdl_capable

LOG2E = 1.4426950408889634  # kernels work in log2 units (exp2 is one instruction); lse leaves in natural log

# What the split kernel does with its result (constexpr MODE).
MODE_LOCAL, MODE_PUSH, MODE_FUSED = 0, 1, 2
LOCAL = tl.constexpr(MODE_LOCAL)  # store this rank's (o, lse)
PUSH = tl.constexpr(MODE_PUSH)  # push to every rank (itself included); flash_decode_merge_kernel merges
FUSED = tl.constexpr(MODE_FUSED)  # push to the peers, wait for theirs, merge, store o


# ----------------------------------------------------------------------------------------------- kernels
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
        B, HQ, HKV, s_max, scale_log2,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
        GROUP_P2: tl.constexpr, N_SPLITS: tl.constexpr, SPLIT_CHUNK: tl.constexpr, PAGE_SIZE: tl.constexpr,
        MODE: tl.constexpr, WORLD: tl.constexpr, WORLD_PAD: tl.constexpr, RANK_CHUNK: tl.constexpr,
        FP32_DOT: tl.constexpr, PDL: tl.constexpr):
    dl.launch_dependents(PDL)  # the merge launch may start once every split program is running (none starved)
    split = tl.program_id(0)
    bk = tl.program_id(1)  # (b, kv head)
    b = bk // HKV
    kv_head = bk % HKV
    b64 = b.to(tl.int64)

    # This sequence's local tokens, cut into N_SPLITS slices of whole BLOCK_N tiles (sized per sequence, on the
    # device: ragged batches split evenly without a host sync; a slice past the end is empty).
    kv_len = tl.minimum(tl.maximum(tl.load(kv_lens + b).to(tl.int32), 0), s_max)
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
            page = tl.load(block_table + b64 * stride_table_b + tok // PAGE_SIZE, mask=t_ok, other=0).to(tl.int64)
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


# ----------------------------------------------------------------------------------------------- launcher
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
HEAD_DIMS = (16, 32, 64, 128, 256)
COMBINES = ("auto", "fused", "kernel")
H200_SMS = 132
SMEM_PER_SM = 228 << 10  # Hopper: 228 KB per SM, 227 KB per block (opt-in)
SMEM_PER_BLOCK = 227 << 10
SMEM_RESERVE = 16 << 10  # what a split program needs besides its K/V buffers: q, layout conversions (6-8 KB seen)
PLAN_CACHE_SIZE = 256
MAX_SPLITS = 512


def choose_splits(batch_kv_heads, s_local_max, num_sms, programs_per_sm=2, block_n=64, min_tiles_per_split=2):
    """How many slices to cut each (sequence, KV head) into: the fewest that fill whole waves of
    ``num_sms * programs_per_sm`` programs at >= 95% (else the best filling), and never slices shorter than
    ``min_tiles_per_split`` tiles."""
    slots = max(1, num_sms * programs_per_sm)
    most = max(1, min(256, s_local_max // (block_n * min_tiles_per_split)))
    best, best_fill = 1, 0.0
    for n in range(1, most + 1):
        programs = batch_kv_heads * n
        fill = programs / (triton.cdiv(programs, slots) * slots)
        if fill >= 0.95:
            return n
        if fill > best_fill + 1e-9:
            best, best_fill = n, fill
    return best


def merge_chunk(group, head_dim, n, num_warps=4):
    """Partials merged per load round: the largest power of two that keeps a [chunk, group, head_dim] fp32 tile
    within 32 registers a thread (1024 elements a warp), and no more than ``n`` needs."""
    max_elems = 1024 * num_warps
    chunk = 1
    while chunk < n and 2 * chunk * triton.next_power_of_2(group) * head_dim <= max_elems:
        chunk *= 2
    return chunk


def split_smem_bytes(block_n, num_stages, head_dim, elem_bytes):
    """Shared memory of one split program, upper estimate: Triton's pipeliner keeps num_stages - 1 K and V tiles in
    flight (sm_90 compile, bf16 D=128: bn64 s3 -> 70 KB, bn128 s3 -> 136 KB), plus SMEM_RESERVE."""
    return max(1, num_stages - 1) * 2 * block_n * head_dim * elem_bytes + SMEM_RESERVE


def default_config(batch, kv_heads, s_local_max, head_dim, device_type, num_sms=None, elem_bytes=2):
    """Launch knobs; any of them can be overridden through ``config=``. GPU: the largest tile and deepest pipeline
    (128 tokens x 3 stages, then smaller) that fits in a block's shared memory (227 KB on Hopper; see
    ``split_smem_bytes``), 8 warps for 128-token tiles (the best local config on H200 at (B, S) = (32, 32K) and
    within 4% at (1, 1M), first sweep); ``programs_per_sm`` None = as many as fit in an SM's shared memory, at
    most 2; ``n_splits`` None = ``choose_splits``; ``combine`` "auto" and ``pdl`` off (see the module docstring)."""
    if device_type == "cpu":
        return {"block_n": 16, "n_splits": None, "programs_per_sm": 1, "num_sms": 2, "num_warps": 4,
                "num_stages": 1, "merge_num_warps": 4, "combine": "auto", "pdl": False}
    for block_n, stages in ((128, 3), (64, 3), (64, 2), (32, 3), (32, 2), (16, 2)):
        if split_smem_bytes(block_n, stages, head_dim, elem_bytes) <= SMEM_PER_BLOCK:
            break
    return {"block_n": block_n, "n_splits": None, "programs_per_sm": None, "num_sms": num_sms or H200_SMS,
            "num_warps": 8 if block_n >= 128 else 4, "num_stages": stages, "merge_num_warps": 4, "combine": "auto",
            "pdl": False}


def _num_sms(device):
    """SM count of a CUDA device; None on CPU."""
    return num_sms(device.index) if device.type == "cuda" else None


def _check_inputs(q, k_cache, v_cache, kv_lens, block_table, softmax_scale):
    """Validate and describe the inputs; returns (B, Hq, Hkv, D, S_local_max, page_size)."""
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("kv_lens", kv_lens)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if block_table is not None and not isinstance(block_table, torch.Tensor):
        raise TypeError(f"block_table must be a torch.Tensor or None, got {type(block_table).__name__}")
    if q.dtype not in DTYPES:
        raise TypeError(f"q must be float16, bfloat16 or float32, got {q.dtype}")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise TypeError(f"q, k_cache and v_cache must share a dtype, got {q.dtype}, {k_cache.dtype}, "
                        f"{v_cache.dtype}")
    if kv_lens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"kv_lens must be int32 or int64, got {kv_lens.dtype}")
    if block_table is not None and block_table.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"block_table must be int32 or int64, got {block_table.dtype}")
    if q.dim() != 3:
        raise ValueError(f"q must be [B, Hq, D], got shape {list(q.shape)}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache and v_cache must both be [B, S_local_max, Hkv, D] (paged: [num_pages, "
                         f"page_size, Hkv, D]), got {list(k_cache.shape)} and {list(v_cache.shape)}")
    batch, q_heads, head_dim = q.shape
    _, rows, kv_heads, kv_dim = k_cache.shape
    if kv_dim != head_dim:
        raise ValueError(f"head dim of q ({head_dim}) and of the KV cache ({kv_dim}) differ")
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head dim must be one of {HEAD_DIMS}, got {head_dim}")
    if kv_heads < 1 or q_heads % kv_heads != 0:
        raise ValueError(f"Hq ({q_heads}) must be a multiple of Hkv ({kv_heads})")
    if batch * kv_heads > 65535:
        raise ValueError(f"B * Hkv = {batch * kv_heads} exceeds the 65535 programs of a grid dimension")
    if tuple(kv_lens.shape) != (batch,):
        raise ValueError(f"kv_lens must have shape [{batch}], got {list(kv_lens.shape)}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("kv_lens", kv_lens), ("block_table", block_table)):
        if t is not None and t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache need a contiguous last (head) dimension")
    if block_table is None:
        if k_cache.shape[0] != batch:
            raise ValueError(f"k_cache holds {k_cache.shape[0]} sequences, q {batch} (paged caches need block_table)")
        page_size, s_max = 0, rows
    else:
        if block_table.dim() != 2 or block_table.shape[0] != batch:
            raise ValueError(f"block_table must be [{batch}, max_pages], got {list(block_table.shape)}")
        if block_table.stride(-1) != 1:
            raise ValueError("block_table needs a contiguous last dimension")
        page_size, s_max = rows, rows * block_table.shape[1]
    if softmax_scale is not None:
        if not isinstance(softmax_scale, (int, float)) or isinstance(softmax_scale, bool):
            raise TypeError(f"softmax_scale must be a float, got {type(softmax_scale).__name__}")
        if not math.isfinite(softmax_scale) or softmax_scale <= 0:
            raise ValueError(f"softmax_scale must be finite and > 0, got {softmax_scale}")
    return batch, q_heads, kv_heads, head_dim, s_max, page_size


def _check_out(out, shape, dtype, name):
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(out).__name__}")
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(f"{name} must be a contiguous {dtype} tensor of shape {list(shape)}, got {out.dtype} "
                         f"{list(out.shape)} with strides {list(out.stride())}")


def _resolve(dims, dtype, device, config, distributed):
    """The full config of a call: defaults, overrides (checked), split count and combine mode resolved."""
    batch, _, kv_heads, head_dim, s_max, _ = dims
    real_sms = _num_sms(device)
    cfg = autotune.with_overrides(
        default_config(batch, kv_heads, s_max, head_dim, device.type, real_sms, dtype.itemsize), config)
    for key in ("block_n", "num_warps", "merge_num_warps"):
        value = cfg[key]
        if not isinstance(value, int) or value < 1 or value & (value - 1):
            raise ValueError(f"config {key} must be a power of two, got {value!r}")
    if cfg["block_n"] < 16:
        raise ValueError(f"config block_n must be >= 16 (tl.dot), got {cfg['block_n']}")
    for key in ("num_stages", "num_sms"):
        if not isinstance(cfg[key], int) or cfg[key] < 1:
            raise ValueError(f"config {key} must be a positive int, got {cfg[key]!r}")
    for key in ("n_splits", "programs_per_sm"):
        if cfg[key] is not None and (not isinstance(cfg[key], int) or cfg[key] < 1):
            raise ValueError(f"config {key} must be None or a positive int, got {cfg[key]!r}")
    if cfg["n_splits"] is not None and cfg["n_splits"] > MAX_SPLITS:
        raise ValueError(f"config n_splits must be <= {MAX_SPLITS} (the merge of the splits is unrolled), got "
                         f"{cfg['n_splits']}")
    if cfg["combine"] not in COMBINES:
        raise ValueError(f"config combine must be one of {COMBINES}, got {cfg['combine']!r}")
    if not isinstance(cfg["pdl"], bool):
        raise ValueError(f"config pdl must be a bool, got {cfg['pdl']!r}")
    if cfg["programs_per_sm"] is None:  # as many split programs as fit in an SM's shared memory, 1 or 2
        smem = split_smem_bytes(cfg["block_n"], cfg["num_stages"], head_dim, dtype.itemsize)
        cfg["programs_per_sm"] = max(1, min(2, SMEM_PER_SM // smem))
    if batch * kv_heads == 0:
        cfg["n_splits"] = 1
    elif cfg["n_splits"] is None:
        cfg["n_splits"] = choose_splits(batch * kv_heads, s_max, cfg["num_sms"], cfg["programs_per_sm"],
                                        cfg["block_n"])
    if distributed:
        # "fused" makes the last split of every (b, kv head) wait inside the split launch. Safe while fewer
        # programs can wait than there are SMs (one SM always has room for the splits everyone waits for). The
        # interpreter runs programs in the same order on every rank: safe for any size.
        fused_ok = real_sms is None or batch * kv_heads < real_sms
        if cfg["combine"] == "auto":
            cfg["combine"] = "fused" if fused_ok else "kernel"
        elif cfg["combine"] == "fused" and not fused_ok:
            raise ValueError(f"combine='fused' needs B * Hkv ({batch * kv_heads}) < the number of SMs ({real_sms}): "
                             f"waiting split programs could otherwise fill the GPU; use 'kernel' or 'auto'")
    cfg["pdl"] = bool(cfg["pdl"]) and pdl_capable(device)  # before Hopper: launched without
    return cfg


class _Exchange:
    """Symmetric receive buffers and flags for one (B, Hq, Hkv, D), created once (collectively) and reused.
    recv_o [2 (epoch parity), world, B, Hq, D] fp32, recv_lse [2, world, B, Hq] fp32 (log2 units),
    flags [world, B * Hkv] int32 (epochs), state int32[2] (the epoch counter)."""

    _cache = {}

    def __init__(self, batch, q_heads, kv_heads, head_dim):
        world = shmem.world_size()
        self.recv_o = shmem.zeros((2, world, batch, q_heads, head_dim), torch.float32, name="flash_decode.recv_o")
        self.recv_lse = shmem.zeros((2, world, batch, q_heads), torch.float32, name="flash_decode.recv_lse")
        # signals()/counters(): zeroed again by shmem.reset() (recovery after a WaitTimeoutError)
        self.state = shmem.counters(2, name="flash_decode.state")
        self.flags = shmem.signals((world, batch * kv_heads), name="flash_decode.flags")
        shmem.barrier()  # peers push into these only after every rank zeroed them

    @classmethod
    def get(cls, batch, q_heads, kv_heads, head_dim):
        key = (id(shmem.context()), batch, q_heads, kv_heads, head_dim)  # a re-initialised runtime: new buffers
        if key not in cls._cache:
            cls._cache[key] = cls(batch, q_heads, kv_heads, head_dim)
        return cls._cache[key]


class _Plan:
    """Everything a call needs that depends only on the inputs' metadata and the config: built (and the inputs
    validated) on the first call with that metadata, then reused, so a call costs a look-up and the launches."""

    _cache = {}

    def __init__(self, q, k_cache, v_cache, kv_lens, block_table, softmax_scale, config, distributed):
        dims = _check_inputs(q, k_cache, v_cache, kv_lens, block_table, softmax_scale)
        batch, q_heads, kv_heads, head_dim, s_max, page_size = dims
        self.dims = dims
        cfg = self.cfg = _resolve(dims, q.dtype, q.device, config, distributed)
        group, n_splits = q_heads // kv_heads, cfg["n_splits"]
        self.empty = batch == 0
        self.q_copy = q.stride(-1) != 1
        self.grid = (n_splits, batch * kv_heads)
        world = shmem.world_size() if distributed else 1
        mode = {"fused": MODE_FUSED, "kernel": MODE_PUSH}[cfg["combine"]] if distributed else MODE_LOCAL
        self.mode = mode
        pad = max(16, triton.next_power_of_2(group))  # tl.dot needs >= 16 rows
        group_p2 = triton.next_power_of_2(group)
        rank_pad = pad if n_splits == 1 else group_p2  # rows of the tile a rank publishes
        self.part = (torch.empty((batch * kv_heads, n_splits, group, head_dim), dtype=torch.float32, device=q.device),
                     torch.empty((batch * kv_heads, n_splits, group), dtype=torch.float32, device=q.device),
                     torch.zeros((batch * kv_heads,), dtype=torch.int32, device=q.device))
        scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
        self.table_stride = block_table.stride(0) if block_table is not None else 1
        self.strides = (q.stride(0) if not self.q_copy else q_heads * head_dim,
                        q.stride(1) if not self.q_copy else head_dim,
                        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), self.table_stride)
        self.scalars = (batch, q_heads, kv_heads, s_max, scale * LOG2E)
        self.split_meta = dict(
            GROUP=group, GROUP_PAD=pad, HEAD_DIM=head_dim, BLOCK_N=cfg["block_n"], GROUP_P2=group_p2,
            N_SPLITS=n_splits, SPLIT_CHUNK=merge_chunk(group, head_dim, n_splits, cfg["num_warps"]),
            PAGE_SIZE=page_size, MODE=mode, WORLD=world, WORLD_PAD=max(2, triton.next_power_of_2(world)),
            RANK_CHUNK=merge_chunk(rank_pad, head_dim, world, cfg["num_warps"]), FP32_DOT=q.dtype == torch.float32,
            PDL=mode == MODE_PUSH and cfg["pdl"], num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
        self.merge_meta = dict(
            GROUP=group, GROUP_P2=group_p2, HEAD_DIM=head_dim, WORLD=world,
            WORLD_PAD=max(2, triton.next_power_of_2(world)),
            RANK_CHUNK=merge_chunk(group, head_dim, world, cfg["merge_num_warps"]), PDL=cfg["pdl"],
            num_warps=cfg["merge_num_warps"])
        if cfg["pdl"]:
            self.merge_meta["launch_pdl"] = True
        self.exchange = _Exchange.get(batch, q_heads, kv_heads, head_dim) if distributed and batch else None

    @classmethod
    def get(cls, q, k_cache, v_cache, kv_lens, block_table, softmax_scale, config, distributed):
        for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("kv_lens", kv_lens)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if block_table is not None and not isinstance(block_table, torch.Tensor):
            raise TypeError(f"block_table must be a torch.Tensor or None, got {type(block_table).__name__}")
        if config is not None and not isinstance(config, dict):
            raise TypeError(f"config must be a dict or None, got {type(config).__name__}")
        key = (distributed, q.dtype, q.device, q.shape, q.stride(), k_cache.dtype, k_cache.shape, k_cache.stride(),
               v_cache.dtype, v_cache.shape, v_cache.stride(), kv_lens.dtype, kv_lens.device, kv_lens.shape,
               None if block_table is None else (block_table.dtype, block_table.device, block_table.shape,
                                                 block_table.stride()),
               softmax_scale, tuple(sorted(config.items())) if config else None,
               id(shmem.context()) if distributed else None)
        plan = cls._cache.get(key)
        if plan is None:
            plan = cls(q, k_cache, v_cache, kv_lens, block_table, softmax_scale, config, distributed)
            if len(cls._cache) >= PLAN_CACHE_SIZE:
                cls._cache.clear()
            cls._cache[key] = plan
        return plan

    def launch_split(self, q, k_cache, v_cache, kv_lens, block_table, dst_o, dst_lse, out, flags, state, ctx):
        if self.q_copy:
            q = q.contiguous()
        table = block_table if block_table is not None else kv_lens  # a dummy pointer when not paged
        flash_decode_split_kernel[self.grid](
            q, k_cache, v_cache, kv_lens, table, *self.part, dst_o, dst_lse, out, flags, state, ctx,
            *self.strides, out.stride(0), out.stride(1), *self.scalars, **self.split_meta)


def resolved_config(q, k_cache, v_cache, kv_lens, block_table=None, softmax_scale=None, config=None,
                    distributed=True):
    """The knobs a call with these inputs would use: ``config`` over ``default_config``, with ``n_splits``,
    ``programs_per_sm`` and (``distributed``: sp_flash_decode) ``combine`` resolved."""
    dims = _check_inputs(q, k_cache, v_cache, kv_lens, block_table, softmax_scale)
    return _resolve(dims, q.dtype, q.device, config, distributed)


def local_flash_decode(q, k_cache, v_cache, kv_lens, block_table=None, softmax_scale=None, config=None, out=None,
                       lse=None):
    """Attention of ``q`` [B, Hq, D] over this rank's cache only: returns (o [B, Hq, D] in q's dtype,
    lse [B, Hq] float32, natural log; -inf where the rank holds no token of a sequence, with o = 0 there).
    ``out``/``lse`` may be given (contiguous; graph capture wants them fixed). Needs no ``triton_dist.init``;
    no communication."""
    plan = _Plan.get(q, k_cache, v_cache, kv_lens, block_table, softmax_scale, config, False)
    batch, q_heads, _, head_dim, _, _ = plan.dims
    if out is None:
        out = torch.empty((batch, q_heads, head_dim), dtype=q.dtype, device=q.device)
    else:
        _check_out(out, (batch, q_heads, head_dim), q.dtype, "out")
    if lse is None:
        lse = torch.empty((batch, q_heads), dtype=torch.float32, device=q.device)
    else:
        _check_out(lse, (batch, q_heads), torch.float32, "lse")
    if not plan.empty:
        plan.launch_split(q, k_cache, v_cache, kv_lens, block_table, out, lse, out, kv_lens, kv_lens, kv_lens)
    return out, lse


def sp_flash_decode(q, k_cache, v_cache, kv_lens, block_table=None, softmax_scale=None, out=None, config=None):
    """Decode attention over a KV cache split across ranks; every rank gets the full result.

    ``q`` [B, Hq, D] (the same on every rank); ``k_cache``/``v_cache`` this rank's shard [B, S_local_max, Hkv, D]
    (or, with ``block_table`` [B, max_pages], a paged cache [num_pages, page_size, Hkv, D]); ``kv_lens`` [B]
    int32/int64: how many tokens of each sequence this rank holds (0 allowed; values are clamped to
    S_local_max on the device). GQA: Hq a multiple of Hkv, query head h uses KV head h // (Hq / Hkv).
    ``softmax_scale`` defaults to 1/sqrt(D). Returns o [B, Hq, D] in q's dtype (zeros for a sequence with no
    tokens on any rank); ``out`` may be given (any strides with a contiguous last dimension). fp16, bf16 or fp32.

    Collective: every rank calls it with the same B, Hq, Hkv, D and config, in the same order. The first call for a
    shape allocates symmetric buffers (collective, not graph capturable); later calls are graph capturable.
    ``config``: launch knobs (see ``default_config``), identical on every rank.
    """
    if isinstance(q, torch.Tensor):
        shmem.check_device(q, "q")
    ctx = shmem.context()
    plan = _Plan.get(q, k_cache, v_cache, kv_lens, block_table, softmax_scale, config, True)
    batch, q_heads, _, head_dim, _, _ = plan.dims
    if out is None:
        out = torch.empty((batch, q_heads, head_dim), dtype=q.dtype, device=q.device)
    elif not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be a {q.dtype} tensor of shape {[batch, q_heads, head_dim]} with a contiguous "
                         f"last dimension, got {out.dtype} {list(out.shape)}")
    if plan.empty:
        return out
    ex = plan.exchange
    shmem.raise_pending_errors()
    plan.launch_split(q, k_cache, v_cache, kv_lens, block_table, ex.recv_o, ex.recv_lse, out, ex.flags, ex.state,
                      ctx)
    if plan.mode == MODE_PUSH:
        flash_decode_merge_kernel[(plan.grid[1],)](
            ex.recv_o, ex.recv_lse, ex.flags, out, ex.state, ctx, out.stride(0), out.stride(1), *plan.scalars[:3],
            **plan.merge_meta)
    return out


# ----------------------------------------------------------------------------------------------- torch op
def _sp_flash_decode_op(q, k_cache, v_cache, kv_lens, block_table=None, softmax_scale=None):
    return sp_flash_decode(q, k_cache, v_cache, kv_lens, block_table=block_table, softmax_scale=softmax_scale)


def _sp_flash_decode_fake(q, k_cache, v_cache, kv_lens, block_table=None, softmax_scale=None):
    return q.new_empty(q.shape)


library.define("sp_flash_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor kv_lens, Tensor? block_table=None, "
               "float? softmax_scale=None) -> Tensor", _sp_flash_decode_op, _sp_flash_decode_fake)
