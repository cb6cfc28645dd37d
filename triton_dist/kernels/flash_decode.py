"""Sequence-parallel flash-decode: one new query token per sequence, the KV cache of every sequence split over ranks.

Each rank holds a slice of every sequence's KV cache (``k_cache``/``v_cache`` [B, S_local_max, Hkv, D], the first
``kv_lens[b]`` tokens valid; a rank may hold none of a sequence) and the same query ``q`` [B, Hq, D]. Attention has
no causal mask at decode time, so softmax(q K^T) V over the concatenated shards is a weighted mix of per-shard
results: a shard summarised by its normalised output ``o_i`` and log-sum-exp ``lse_i`` combines as

    o = sum_i exp(lse_i - M) o_i / sum_i exp(lse_i - M),    M = max_i lse_i

(the same rule merges the splits of one shard). Two launches per call, no host sync, CUDA-graph safe:

    1. flash_decode_split_kernel, grid (n_splits, B * Hkv)                               [reads the KV at HBM speed]
         program (split, b, kv head): the Hq/Hkv query heads of that KV head together (GQA: each KV tile is read
         once, for all of them), online softmax over its slice of the tokens -> partial (o, lse) in a local scratch;
         counts itself in with an atomic. The LAST split of (b, kv head) to arrive merges the n_splits partials
         (it waits for nobody: everyone else is already done) and pushes the rank's partial for its G heads,
         G * (D + 1) floats, into slot [me] of EVERY rank's receive buffer (dl.put), then dl.signal-s that rank's
         flag[me, b, kv head] with this call's epoch.
    2. flash_decode_merge_kernel, grid (B * Hkv,)                                         [a few µs]
         waits until flag[r, b, kv head] >= epoch for every rank r (one vector poll), merges the world partials
         with the rule above and writes o [B, Hq, D] in q's dtype. The last program advances the epoch.

Data movement per call and rank: the KV shard once from HBM; B * Hq * (D + 1) * 4 bytes to each peer over NVLink.

Repeated calls and graphs: flags carry the call's epoch (1, 2, 3, ... kept on the device), so nothing is ever
reset from the host. The receive buffer is double-buffered by epoch parity, which makes a ``ready`` handshake
unnecessary: rank A can push call n+2 into the half that rank B reads in call n only after A's call n+1 merge saw
B's call n+1 pushes, and B makes those only after its call n merge finished (stream order).

Why two launches and not one: launch 1 never waits, so it cannot hang whatever its grid size. A fused merge
would spin inside a launch whose programs need not all be resident, while the peer's matching programs may be
queued behind spinners of their own. The second launch costs a few µs and no risk. (The Triton interpreter runs
the programs of a launch one after another; the same argument makes the same source run on CPU ranks.)

Knobs (``config=``, identical on every rank; see ``default_config``): block_n (tokens per tile), num_stages
(pipelined tile loads), num_warps, n_splits or programs_per_sm (splits chosen to fill whole waves of SMs).

Paged KV: pass ``block_table`` [B, max_pages] (int32/int64) and a paged cache [num_pages, page_size, Hkv, D];
token t of sequence b lives in page ``block_table[b, t // page_size]``, row ``t % page_size``.

``local_flash_decode`` is launch 1 alone with a local epilogue (this rank's (o, lse)): single-GPU decode, and the
"local part" the benchmark measures.
"""

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from .. import language as dl
from .. import shmem

LOG2E = 1.4426950408889634  # kernels work in log2 units (exp2 is one instruction); lse leaves in natural log


# ----------------------------------------------------------------------------------------------- kernels
@triton.jit
def _merge_partials(o_ptr, lse_ptr, o_stride, lse_stride, n, GROUP: tl.constexpr, GROUP_P2: tl.constexpr,
                    HEAD_DIM: tl.constexpr, CHUNK: tl.constexpr):
    """Merge ``n`` partials (o [GROUP, HEAD_DIM] fp32 normalised, lse [GROUP] log2 units) of one head group:
    partial i's o row g at ``o_ptr + i * o_stride + g * HEAD_DIM``, its lse at ``lse_ptr + i * lse_stride + g``.
    CHUNK partials per load round (one L2 round trip each), online rescaling across rounds. Partials with
    lse = -inf weigh nothing; if all do, o = 0 and lse = -inf. Loads bypass L1 (``.cg``): the partials were
    written by other programs (or other GPUs) and published by a release/acquire pair."""
    i = tl.arange(0, CHUNK)
    g = tl.arange(0, GROUP_P2)
    d = tl.arange(0, HEAD_DIM)
    top = tl.full([GROUP_P2], float("-inf"), tl.float32)
    total = tl.zeros([GROUP_P2], tl.float32)
    acc = tl.zeros([GROUP_P2, HEAD_DIM], tl.float32)
    for first in range(0, n, CHUNK):
        row = first + i
        ok = (row[:, None] < n) & (g[None, :] < GROUP)  # [CHUNK, GROUP_P2]
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
def _publish(o, lse, b, kv_head, dst_o, dst_lse, flags, state, ctx, B, HQ, HKV, GROUP: tl.constexpr,
             HEAD_DIM: tl.constexpr, PUSH: tl.constexpr):
    """This rank's result for (b, kv head): o [G', HEAD_DIM] fp32 and lse [G'] (log2 units), G' >= GROUP.
    PUSH: into slot [epoch parity, me, b] of every rank's receive buffer, then flag[me, b, kv head] = epoch there.
    Else: o in dst_o's dtype and lse in natural-log units into this rank's [B, HQ, ...] outputs."""
    g = tl.arange(0, o.shape[0])
    d = tl.arange(0, HEAD_DIM)
    head = kv_head * GROUP + g
    g_ok = g < GROUP
    if PUSH:
        me = dl.rank(ctx)
        world = dl.num_ranks(ctx)
        epoch = dl.call_epoch(state)
        slot = ((epoch % 2) * world + me).to(tl.int64) * B + b
        o_at = dst_o + (slot * HQ + head[:, None]) * HEAD_DIM + d[None, :]
        lse_at = dst_lse + slot * HQ + head
        for i in range(world):
            peer = (me + 1 + i) % world  # peers first, our own copy last
            dl.put(o_at, o, peer, ctx, mask=g_ok[:, None])
            dl.put(lse_at, lse, peer, ctx, mask=g_ok)
            dl.signal(flags + me * (B * HKV) + b * HKV + kv_head, epoch, peer, ctx)
    else:
        row = b.to(tl.int64) * HQ + head
        tl.store(dst_o + row[:, None] * HEAD_DIM + d[None, :], o.to(dst_o.dtype.element_ty), mask=g_ok[:, None])
        tl.store(dst_lse + row, lse * 0.6931471805599453, mask=g_ok)  # log2 -> natural log


@triton.jit
def flash_decode_split_kernel(
        q, k_cache, v_cache, kv_lens, block_table,
        part_o, part_lse, split_arrivals,              # local scratch: per-split partials, arrival counters
        dst_o, dst_lse,                                # PUSH: symmetric receive buffers; else this rank's o, lse
        flags, state, ctx,
        stride_qb, stride_qh,
        stride_kb, stride_kn, stride_kh,
        stride_vb, stride_vn, stride_vh,
        stride_table_b,
        B, HQ, HKV, s_max, scale_log2,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
        GROUP_P2: tl.constexpr, SPLIT_CHUNK: tl.constexpr, PAGE_SIZE: tl.constexpr, PUSH: tl.constexpr,
        FP32_DOT: tl.constexpr):
    split = tl.program_id(0)
    n_splits = tl.num_programs(0)
    bk = tl.program_id(1)  # (b, kv head)
    b = bk // HKV
    kv_head = bk % HKV
    b64 = b.to(tl.int64)

    # This sequence's local tokens, cut into n_splits slices of whole BLOCK_N tiles (sized per sequence, on the
    # device: ragged batches split evenly without a host sync; a slice past the end is empty).
    kv_len = tl.minimum(tl.maximum(tl.load(kv_lens + b).to(tl.int32), 0), s_max)
    per_split = tl.cdiv(tl.cdiv(kv_len, n_splits), BLOCK_N) * BLOCK_N
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

    if n_splits == 1:
        _publish(o, lse, b, kv_head, dst_o, dst_lse, flags, state, ctx, B, HQ, HKV, GROUP, HEAD_DIM, PUSH)
    else:  # every split files its partial and counts in; the last to arrive merges them all and publishes
        row = bk * n_splits + split
        tl.store(part_o + (row * GROUP + g[:, None]) * HEAD_DIM + d[None, :], o, mask=g_ok[:, None])
        tl.store(part_lse + row * GROUP + g, lse, mask=g_ok)
        tl.debug_barrier()  # all threads' partials are written before the count below releases them
        arrived = tl.atomic_add(split_arrivals + bk, 1, sem="acq_rel", scope="gpu")
        if arrived == n_splits - 1:
            tl.atomic_xchg(split_arrivals + bk, 0, sem="relaxed", scope="gpu")  # ready for the next call
            first = bk * n_splits
            o_all, lse_all = _merge_partials(part_o + first * GROUP * HEAD_DIM, part_lse + first * GROUP,
                                             GROUP * HEAD_DIM, GROUP, n_splits, GROUP, GROUP_P2, HEAD_DIM,
                                             SPLIT_CHUNK)
            _publish(o_all, lse_all, b, kv_head, dst_o, dst_lse, flags, state, ctx, B, HQ, HKV, GROUP, HEAD_DIM,
                     PUSH)


@triton.jit
def flash_decode_merge_kernel(recv_o, recv_lse, flags, out, state, ctx, stride_ob, stride_oh, B, HQ, HKV,
                              GROUP: tl.constexpr, GROUP_P2: tl.constexpr, HEAD_DIM: tl.constexpr,
                              WORLD_PAD: tl.constexpr, RANK_CHUNK: tl.constexpr):
    bk = tl.program_id(0)
    b = bk // HKV
    kv_head = bk % HKV
    world = dl.num_ranks(ctx)
    epoch = dl.call_epoch(state)
    r = tl.arange(0, WORLD_PAD)
    dl.wait(flags + r * (B * HKV) + bk, epoch, ctx, mask=r < world)  # every rank's partial has landed here
    first = ((epoch % 2) * world).to(tl.int64) * B + b  # slot of rank 0's partial of sequence b
    o, lse = _merge_partials(recv_o + (first * HQ + kv_head * GROUP) * HEAD_DIM, recv_lse + first * HQ
                             + kv_head * GROUP, B * HQ * HEAD_DIM, B * HQ, world, GROUP, GROUP_P2, HEAD_DIM,
                             RANK_CHUNK)
    g = tl.arange(0, GROUP_P2)
    d = tl.arange(0, HEAD_DIM)
    head = kv_head * GROUP + g
    tl.store(out + b.to(tl.int64) * stride_ob + head[:, None] * stride_oh + d[None, :], o.to(out.dtype.element_ty),
             mask=(g < GROUP)[:, None])  # a sequence with no tokens anywhere gives 0
    dl.finish_call(state, epoch, tl.num_programs(0))


# ----------------------------------------------------------------------------------------------- launcher
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
HEAD_DIMS = (16, 32, 64, 128, 256)
H200_SMS = 132


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


def merge_chunk(group, head_dim, n, max_elems=4096):
    """Partials merged per load round: the largest power of two that keeps a [chunk, group, head_dim] fp32 tile
    within ``max_elems`` (32 registers a thread at 4 warps), and no more than ``n`` needs."""
    chunk = 1
    while chunk < n and 2 * chunk * triton.next_power_of_2(group) * head_dim <= max_elems:
        chunk *= 2
    return chunk


def default_config(batch, kv_heads, s_local_max, head_dim, device_type, num_sms=None, elem_bytes=2):
    """Launch knobs; any of them can be overridden through ``config=``. ``n_splits`` None: ``choose_splits``
    with ``programs_per_sm`` programs per SM. GPU: 64-token tiles, 3 pipeline stages while the K and V tiles of
    all stages fit in ~160 KB of shared memory (fewer stages, then smaller tiles, for wide heads / fp32)."""
    if device_type == "cpu":
        return {"block_n": 16, "n_splits": None, "programs_per_sm": 1, "num_sms": 2, "num_warps": 4,
                "num_stages": 1, "merge_num_warps": 4}
    block_n, stages = 64, 3
    while stages * 2 * block_n * head_dim * elem_bytes > (160 << 10):
        if stages > 2:
            stages -= 1
        else:
            block_n //= 2
    return {"block_n": block_n, "n_splits": None, "programs_per_sm": 2, "num_sms": num_sms or H200_SMS,
            "num_warps": 4, "num_stages": stages, "merge_num_warps": 4}


def _num_sms(device):
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return None


class _Scratch:
    """Per-split partials and arrival counters (this rank only), per (B * Hkv, n_splits, G, D)."""

    _cache = {}

    def __init__(self, bkv, n_splits, group, head_dim, device):
        self.part_o = torch.empty((bkv, n_splits, group, head_dim), dtype=torch.float32, device=device)
        self.part_lse = torch.empty((bkv, n_splits, group), dtype=torch.float32, device=device)
        self.split_arrivals = torch.zeros((bkv,), dtype=torch.int32, device=device)

    @classmethod
    def get(cls, bkv, n_splits, group, head_dim, device):
        key = (bkv, n_splits, group, head_dim, str(device))
        if key not in cls._cache:
            cls._cache[key] = cls(bkv, n_splits, group, head_dim, device)
        return cls._cache[key]


class _Exchange:
    """Symmetric receive buffers and flags for one (B, Hq, Hkv, D), created once (collectively) and reused.
    recv_o [2 (epoch parity), world, B, Hq, D] fp32, recv_lse [2, world, B, Hq] fp32 (log2 units),
    flags [world, B * Hkv] int32 (epochs), state int32[2] (the epoch counter)."""

    _cache = {}

    def __init__(self, batch, q_heads, kv_heads, head_dim):
        world = shmem.world_size()
        self.recv_o = shmem.zeros((2, world, batch, q_heads, head_dim), torch.float32, name="flash_decode.recv_o")
        self.recv_lse = shmem.zeros((2, world, batch, q_heads), torch.float32, name="flash_decode.recv_lse")
        self.flags = shmem.zeros((world, batch * kv_heads), torch.int32, name="flash_decode.flags")
        self.state = torch.zeros(2, dtype=torch.int32, device=shmem.device())
        shmem.barrier()  # peers push into these only after everyone zeroed them

    @classmethod
    def get(cls, batch, q_heads, kv_heads, head_dim):
        key = (batch, q_heads, kv_heads, head_dim)
        if key not in cls._cache:
            cls._cache[key] = cls(*key)
        return cls._cache[key]


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


def _launch_split_kernel(q, k_cache, v_cache, kv_lens, block_table, dims, softmax_scale, cfg, dst_o, dst_lse,
                         push, flags, state, ctx):
    batch, q_heads, kv_heads, head_dim, s_max, page_size = dims
    group = q_heads // kv_heads
    n_splits = cfg["n_splits"] or choose_splits(batch * kv_heads, s_max, cfg["num_sms"], cfg["programs_per_sm"],
                                                cfg["block_n"])
    n_splits = max(1, int(n_splits))
    scratch = _Scratch.get(batch * kv_heads, n_splits, group, head_dim, q.device)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    table = block_table if block_table is not None else kv_lens  # a dummy pointer when not paged
    flash_decode_split_kernel[(n_splits, batch * kv_heads)](
        q, k_cache, v_cache, kv_lens, table,
        scratch.part_o, scratch.part_lse, scratch.split_arrivals,
        dst_o, dst_lse, flags, state, ctx,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        table.stride(0),
        batch, q_heads, kv_heads, s_max, scale * LOG2E,
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, BLOCK_N=cfg["block_n"],
        GROUP_P2=triton.next_power_of_2(group), SPLIT_CHUNK=merge_chunk(group, head_dim, n_splits),
        PAGE_SIZE=page_size, PUSH=push,
        FP32_DOT=q.dtype == torch.float32, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


def _config(dims, dtype, device, config):
    batch, _, kv_heads, head_dim, s_max, _ = dims
    cfg = default_config(batch, kv_heads, s_max, head_dim, device.type, _num_sms(device), dtype.itemsize)
    if config:
        unknown = set(config) - set(cfg)
        if unknown:
            raise ValueError(f"unknown config keys {sorted(unknown)}; known: {sorted(cfg)}")
        cfg.update(config)
    return cfg


def local_flash_decode(q, k_cache, v_cache, kv_lens, block_table=None, softmax_scale=None, config=None):
    """Attention of ``q`` [B, Hq, D] over this rank's cache only: returns (o [B, Hq, D] in q's dtype,
    lse [B, Hq] float32, natural log; -inf where the rank holds no token of a sequence, with o = 0 there).
    Needs no ``triton_dist.init``; no communication."""
    dims = _check_inputs(q, k_cache, v_cache, kv_lens, block_table, softmax_scale)
    cfg = _config(dims, q.dtype, q.device, config)
    batch, q_heads, _, head_dim, _, _ = dims
    q = q.contiguous()
    o = torch.empty((batch, q_heads, head_dim), dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, q_heads), dtype=torch.float32, device=q.device)
    if batch == 0:
        return o, lse
    _launch_split_kernel(q, k_cache, v_cache, kv_lens, block_table, dims, softmax_scale, cfg, o, lse, False,
                         kv_lens, kv_lens, kv_lens)
    return o, lse


def sp_flash_decode(q, k_cache, v_cache, kv_lens, block_table=None, softmax_scale=None, out=None, config=None):
    """Decode attention over a KV cache split across ranks; every rank gets the full result.

    ``q`` [B, Hq, D] (the same on every rank); ``k_cache``/``v_cache`` this rank's shard [B, S_local_max, Hkv, D]
    (or, with ``block_table`` [B, max_pages], a paged cache [num_pages, page_size, Hkv, D]); ``kv_lens`` [B]
    int32/int64: how many tokens of each sequence this rank holds (0 allowed; values are clamped to
    S_local_max on the device). GQA: Hq a multiple of Hkv, query head h uses KV head h // (Hq / Hkv).
    ``softmax_scale`` defaults to 1/sqrt(D). Returns o [B, Hq, D] in q's dtype (zeros for a sequence with no
    tokens on any rank); ``out`` may be given. fp16, bf16 or fp32.

    Collective: every rank calls it with the same B, Hq, Hkv, D, in the same order. The first call for a shape
    allocates symmetric buffers (collective, not graph capturable); later calls are graph capturable.
    ``config``: launch knobs (see ``default_config``), identical on every rank.
    """
    dims = _check_inputs(q, k_cache, v_cache, kv_lens, block_table, softmax_scale)
    batch, q_heads, kv_heads, head_dim, _, _ = dims
    if q.device.type != shmem.device().type:
        raise ValueError(f"q is on {q.device}, triton_dist runs on {shmem.device()}")
    if out is None:
        out = torch.empty((batch, q_heads, head_dim), dtype=q.dtype, device=q.device)
    elif not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
    elif tuple(out.shape) != (batch, q_heads, head_dim) or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be a {q.dtype} tensor of shape {[batch, q_heads, head_dim]} with a contiguous "
                         f"last dimension, got {out.dtype} {list(out.shape)}")
    if batch == 0:
        return out
    cfg = _config(dims, q.dtype, q.device, config)
    q = q.contiguous()
    ex = _Exchange.get(batch, q_heads, kv_heads, head_dim)
    ctx = shmem.context()
    shmem.raise_pending_errors()
    _launch_split_kernel(q, k_cache, v_cache, kv_lens, block_table, dims, softmax_scale, cfg, ex.recv_o,
                         ex.recv_lse, True, ex.flags, ex.state, ctx)
    group, world = q_heads // kv_heads, shmem.world_size()
    flash_decode_merge_kernel[(batch * kv_heads,)](
        ex.recv_o, ex.recv_lse, ex.flags, out, ex.state, ctx, out.stride(0), out.stride(1), batch, q_heads,
        kv_heads, GROUP=group, GROUP_P2=triton.next_power_of_2(group), HEAD_DIM=head_dim,
        WORLD_PAD=max(2, triton.next_power_of_2(world)), RANK_CHUNK=merge_chunk(group, head_dim, world),
        num_warps=cfg["merge_num_warps"])
    return out


# ----------------------------------------------------------------------------------------------- torch op
@torch.library.custom_op("triton_dist::sp_flash_decode", mutates_args=())
def _sp_flash_decode_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_lens: torch.Tensor,
                        block_table: Optional[torch.Tensor] = None,
                        softmax_scale: Optional[float] = None) -> torch.Tensor:
    return sp_flash_decode(q, k_cache, v_cache, kv_lens, block_table=block_table, softmax_scale=softmax_scale)


@_sp_flash_decode_op.register_fake
def _sp_flash_decode_fake(q, k_cache, v_cache, kv_lens, block_table=None, softmax_scale=None):
    return q.new_empty(q.shape)
