"""The tile GEMM core: ``C[seg] = A[seg] @ B.T`` one output tile at a time, in a tile order the caller chooses.

Every overlapped kernel of triton_dist is "a persistent GEMM that does something between tiles": wait for the rows
it is about to read, or push the tile it just wrote. So the GEMM is three ``@triton.jit`` pieces that such kernels
call from their own persistent tile loop, plus ``gemm_kernel`` built from them:

    for tile in tl.range(pid, num_tiles, num_programs):                 # persistent: one program per SM
        seg, pid_m, pid_n = tile_coords(tile, ...)                      # caller-chosen segment order, grouped-M
        ... wait for the rows of A this tile reads ...
        acc = tile_accumulate(a, b, row, pid_n * BLOCK_N, ...)          # fp32 [BLOCK_M, BLOCK_N] of A @ B.T
        tile_store(c, acc, seg, pid_m * BLOCK_M, pid_n * BLOCK_N, ...)  # clipped to the segment's rows
        ... signal / push the finished tile ...

Shapes (torch ``linear`` convention, row-major): A [S * seg_rows, K] is S row *segments* stacked (AG+GEMM: one per
source rank), B [N, K], C [S, seg_rows, N], so that a tile never writes past its segment (ragged segments need no
padding). Operands are TMA tensor descriptors (``USE_TMA``: 16-byte aligned bases and row strides; the fast path
on Hopper) or plain pointers with masked loads (any shape). ``describe_operands`` builds either; ``gemm_config``,
``launch_gemm`` and ``gemm`` show the launch. docs/design/gemm.md describes the knobs.

FP8 is a mode of the same pieces: FP8 operands come with fp32 scales (``kernels/fp8.py``: per-tensor, rowwise,
128-blockwise), ``tile_accumulate`` applies them to the fp32 accumulator and ``tile_store`` converts to the
result's dtype; the op is ``gemm(a8, w8, scale_a=..., scale_w=...)`` (``scaled_gemm``: the same, the scales
required). docs/design/fp8.md.
"""

import torch
import triton
import triton.language as tl

from .. import autotune
from .. import hardware
from .. import language as dl
from ..hardware import interpreting, num_sms
from ..shmem.workspaces import Plans
from . import fp8, gemm_sm90, library
from .launcher import Launcher, Launchers

try:  # triton >= 3.4 (host-side TMA descriptors)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older triton: masks only
    TensorDescriptor = None


# ----------------------------------------------------------------------------------------------- device side
@triton.jit
def tile_coords(tile, tiles_m, tiles_n, num_segments, first_segment, segment_step, GROUP_M: tl.constexpr):
    """Tile index -> (segment, pid_m, pid_n).

    Tiles are numbered segment after segment; the k-th segment visited is ``(first_segment + k * segment_step)
    mod num_segments`` (``segment_step`` may be negative, e.g. -1 to follow a ring backwards). Inside a segment,
    tiles go in groups of ``GROUP_M`` tile-rows, column by column inside a group (L2 reuse of B): all tile-rows
    of a group are visited before the next group, so a consumer that waits for row chunks made of whole groups
    sees them in increasing order."""
    tiles_per_segment = tiles_m * tiles_n
    k = tile // tiles_per_segment
    seg = ((first_segment + k * segment_step) % num_segments + num_segments) % num_segments
    t = tile % tiles_per_segment
    tiles_per_group = GROUP_M * tiles_n
    group = t // tiles_per_group
    first_m = group * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (t % tiles_per_group) % group_rows
    pid_n = (t % tiles_per_group) // group_rows
    return seg, pid_m, pid_n


@triton.jit
def _scale_rows(scale, rows, stride, mask):
    """[len(rows)] fp32: scale[rows * stride] (0 where ``mask`` is false)."""
    return tl.load(scale + rows.to(tl.int64) * stride, mask=mask, other=0.0)


@triton.jit
def _block_scales(scale_a, scale_w, rows, col0, kb, a_rows, N, stride_sa, stride_sw, WIDTH: tl.constexpr,
                  SCALES: tl.constexpr, SILU_GATE: tl.constexpr, stride_sak=1):
    """SCALES "blocks": the scales of K block ``kb`` for the gate (and up) columns ``col0 .. col0 + WIDTH``: A's
    1x128 group scales of ``rows`` times B's 128x128 block scales. A tile of WIDTH <= 128 columns starting at a
    multiple of WIDTH lies in one block of B: its gate scale is A's column times one scalar ([BLOCK_M, 1]), where a
    [BLOCK_M, WIDTH] scale tile would take a thread as many registers as an accumulator. Up columns (SILU_GATE)
    start at N + col0 and may straddle two blocks: a scale per column. Otherwise nothing to scale (1, 1).
    A's scales: ``scale_a[row * stride_sa + kb * stride_sak]`` (row-major: stride_sak 1; K-major: stride_sa 1)."""
    if SCALES == "blocks":
        s_a = _scale_rows(scale_a + kb * stride_sak, rows, stride_sa, rows < a_rows)[:, None]
        cols = col0 + tl.arange(0, WIDTH)
        if WIDTH <= 128:  # (a tile's right half may start past N: masked)
            s_gate = s_a * tl.load(scale_w + kb + (col0 // 128).to(tl.int64) * stride_sw, mask=col0 < N, other=0.0)
        else:
            s_gate = s_a * _scale_rows(scale_w + kb, cols // 128, stride_sw, cols < N)[None, :]
        s_up = s_gate
        if SILU_GATE:
            s_up = s_a * _scale_rows(scale_w + kb, (N + cols) // 128, stride_sw, cols < N)[None, :]
        return s_gate, s_up
    else:  # (both branches spelt out: a constexpr if compiles only one)
        return 1.0, 1.0


@triton.jit
def _mma(acc, a_tile, b_tile, s, DOT_PRECISION: tl.constexpr, SCALES: tl.constexpr,
         MAX_IMPRECISE_ACC: tl.constexpr):
    """One K step: ``acc + a_tile @ b_tile.T``; SCALES "blocks": the step's product accumulated on its own (in
    fp32, the tensor cores' partial sum promoted every step) and multiplied by its block scales ``s``."""
    if SCALES == "blocks":
        return acc + tl.dot(a_tile, b_tile.T) * s
    return tl.dot(a_tile, b_tile.T, acc, input_precision=DOT_PRECISION, max_num_imprecise_acc=MAX_IMPRECISE_ACC)


@triton.jit
def tile_accumulate(a, b, a_row, off_n, a_rows, N, K, stride_am, stride_bn,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    USE_TMA: tl.constexpr, DOT_PRECISION: tl.constexpr = None, SILU_GATE: tl.constexpr = False,
                    scale_a=None, scale_w=None, stride_sa=None, stride_sw=None, SCALES: tl.constexpr = None,
                    MAX_IMPRECISE_ACC: tl.constexpr = None, b_row0=None, k_tile_lo=None, k_tile_hi=None,
                    B_KN: tl.constexpr = False, b_index=None, stride_sak=1):
    """fp32 ``A[a_row : a_row + BLOCK_M, :] @ B[off_n : off_n + BLOCK_N, :].T`` (rows past ``a_rows`` and
    columns past ``N`` / ``K`` count as zeros; ``off_n`` a multiple of BLOCK_N). ``a``/``b``: tensor descriptors
    (USE_TMA) or pointers.

    SILU_GATE: B is [2N, K], a gate half over an up half (rows [0, N) and [N, 2N)); the tile is
    ``silu(A @ B_gate.T) * (A @ B_up.T)`` for output columns off_n.., both products accumulated in the same K
    loop (one A tile feeds two dots) and combined in fp32, so the [M, 2N] product never reaches memory.

    FP8 operands with scales (fp32, ``kernels/fp8.py``), applied in fp32 before the gate: SCALES "rows": the
    product times ``scale_a[row * stride_sa] * scale_w[b_row * stride_sw]`` after the K loop (per-tensor scales:
    strides 0; rowwise: a scale per row of A and per row of B); "blocks":
    ``scale_a[row * stride_sa + kb * stride_sak]`` (A's scales row-major or K-major) per 1x128 group of A times
    ``scale_w[(b_row // 128) * stride_sw + kb]`` per 128x128 block of B, applied to each K step (kb = its
    128-wide K block: BLOCK_K divides 128). MAX_IMPRECISE_ACC, DOT_PRECISION (None: the default): see ``tl.dot``.
    ``b_row0`` (TMA): the row of B's descriptor where B starts (a weight in a stack of them, e.g. an expert's;
    None: 0), so that ``off_n`` and the scales stay B's own. ``k_tile_lo`` / ``k_tile_hi``: only
    the K steps lo .. hi - 1 (of BLOCK_K each; split-K's share; None: all). B_KN: B is given as B.T, [K, N]
    row-major (a weight multiplied as it lies, ``x @ w``: no transposed copy; ``stride_bn`` its K rows' stride, TMA
    blocks [BLOCK_K, BLOCK_N]; 16-bit and fp32 operands, no gate); with ``b_index`` (TMA) B.T is entry
    ``b_index`` of a 3-D descriptor [E, K, N] (an expert's weight in a stack: its bounds clip each entry's K rows,
    so a K step never reads the next one's). (Defaults are None, never strings:
    triton 3.6 passes a left-out default of a nested call as a plain Python value, and a str then fails to
    compile.)"""
    if B_KN:
        tl.static_assert(not SILU_GATE and SCALES != "rows" and SCALES != "blocks", "B_KN: no gate, no FP8 scales")
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # unused (and compiled away) without SILU_GATE
    ki_lo = 0
    ki_hi = tl.cdiv(K, BLOCK_K)
    if k_tile_lo is not None:
        ki_lo = k_tile_lo
        ki_hi = tl.minimum(k_tile_hi, ki_hi)
    rows = a_row + tl.arange(0, BLOCK_M)
    cols = off_n + tl.arange(0, BLOCK_N)
    if USE_TMA:
        # B's descriptor holds BLOCK_N rows, or half of them (SPLIT_N, ``b_block``): then the tile's columns are two
        # accumulators, one dot each per K step, so that a promoted FP8 step's partial sum is half a tile
        COLS: tl.constexpr = b.block_shape[-1] if B_KN else b.block_shape[0]
        b_row = off_n
        if b_row0 is not None:
            b_row = b_row0 + off_n
        acc_l = tl.zeros((BLOCK_M, COLS), dtype=tl.float32)
        acc_r = tl.zeros((BLOCK_M, COLS), dtype=tl.float32)  # the right half (split columns only)
        up_l = tl.zeros((BLOCK_M, COLS), dtype=tl.float32)
        up_r = tl.zeros((BLOCK_M, COLS), dtype=tl.float32)
        for ki in range(ki_lo, ki_hi):
            a_tile = a.load([a_row, ki * BLOCK_K])
            s_gate, s_up = _block_scales(scale_a, scale_w, rows, off_n, ki * BLOCK_K // 128, a_rows, N, stride_sa,
                                         stride_sw, COLS, SCALES, SILU_GATE, stride_sak)
            if B_KN:  # a [BLOCK_K, COLS] tile of B.T straight into the dot (no scales here)
                if b_index is not None:
                    b_tile = b.load([b_index, ki * BLOCK_K, b_row]).reshape(BLOCK_K, COLS)
                else:
                    b_tile = b.load([ki * BLOCK_K, b_row])
                acc_l = tl.dot(a_tile, b_tile, acc_l, input_precision=DOT_PRECISION)
            else:
                acc_l = _mma(acc_l, a_tile, b.load([b_row, ki * BLOCK_K]), s_gate, DOT_PRECISION, SCALES,
                             MAX_IMPRECISE_ACC)
            if COLS < BLOCK_N:
                s_gate_r, s_up_r = _block_scales(scale_a, scale_w, rows, off_n + COLS, ki * BLOCK_K // 128, a_rows,
                                                 N, stride_sa, stride_sw, COLS, SCALES, SILU_GATE, stride_sak)
                acc_r = _mma(acc_r, a_tile, b.load([b_row + COLS, ki * BLOCK_K]), s_gate_r, DOT_PRECISION, SCALES,
                             MAX_IMPRECISE_ACC)
            if SILU_GATE:  # gate rows past N (a ragged last tile) read up rows: their columns are never stored
                up_l = _mma(up_l, a_tile, b.load([N + b_row, ki * BLOCK_K]), s_up, DOT_PRECISION, SCALES,
                            MAX_IMPRECISE_ACC)
                if COLS < BLOCK_N:
                    up_r = _mma(up_r, a_tile, b.load([N + b_row + COLS, ki * BLOCK_K]), s_up_r, DOT_PRECISION,
                                SCALES, MAX_IMPRECISE_ACC)
        if COLS < BLOCK_N:
            acc = _join_columns(acc_l, acc_r, BLOCK_M, BLOCK_N)
            up = _join_columns(up_l, up_r, BLOCK_M, BLOCK_N)
        else:
            acc, up = acc_l, up_l
    else:
        ks = tl.arange(0, BLOCK_K)
        a_ptrs = a + rows.to(tl.int64)[:, None] * stride_am + ks[None, :]
        if B_KN:  # [BLOCK_K, BLOCK_N] tiles of B.T [K, N]
            b_ptrs = b + ks.to(tl.int64)[:, None] * stride_bn + cols[None, :]
        else:
            b_ptrs = b + cols.to(tl.int64)[:, None] * stride_bn + ks[None, :]
        up_ptrs = b + (N + cols).to(tl.int64)[:, None] * stride_bn + ks[None, :]  # SILU_GATE only
        if k_tile_lo is not None:
            a_ptrs += ki_lo * BLOCK_K
            if B_KN:
                b_ptrs += ki_lo * BLOCK_K * stride_bn.to(tl.int64)
            else:
                b_ptrs += ki_lo * BLOCK_K
            up_ptrs += ki_lo * BLOCK_K
        for ki in range(ki_lo, ki_hi):
            k_left = K - ki * BLOCK_K
            b_mask = (cols[:, None] < N) & (ks[None, :] < k_left)
            a_tile = tl.load(a_ptrs, mask=(rows[:, None] < a_rows) & (ks[None, :] < k_left), other=0.0)
            s_gate, s_up = _block_scales(scale_a, scale_w, rows, off_n, ki * BLOCK_K // 128, a_rows, N, stride_sa,
                                         stride_sw, BLOCK_N, SCALES, SILU_GATE, stride_sak)
            if B_KN:
                b_kn = tl.load(b_ptrs, mask=(ks[:, None] < k_left) & (cols[None, :] < N), other=0.0)
                acc = tl.dot(a_tile, b_kn, acc, input_precision=DOT_PRECISION)
            else:
                acc = _mma(acc, a_tile, tl.load(b_ptrs, mask=b_mask, other=0.0), s_gate, DOT_PRECISION, SCALES,
                           MAX_IMPRECISE_ACC)
            if SILU_GATE:
                up = _mma(up, a_tile, tl.load(up_ptrs, mask=b_mask, other=0.0), s_up, DOT_PRECISION, SCALES,
                          MAX_IMPRECISE_ACC)
                up_ptrs += BLOCK_K
            a_ptrs += BLOCK_K
            if B_KN:
                b_ptrs += BLOCK_K * stride_bn.to(tl.int64)
            else:
                b_ptrs += BLOCK_K
    if SCALES == "rows":
        s_a = _scale_rows(scale_a, rows, stride_sa, rows < a_rows)[:, None]
        acc = acc * s_a * _scale_rows(scale_w, cols, stride_sw, cols < N)[None, :]
        if SILU_GATE:
            up = up * s_a * _scale_rows(scale_w, N + cols, stride_sw, cols < N)[None, :]
    if SILU_GATE:
        acc = acc * tl.sigmoid(acc) * up
    return acc


@triton.jit
def tile_store(c, acc, seg, off_m, off_n, seg_rows, N, stride_cs, stride_cm,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, USE_TMA: tl.constexpr,
               EPILOGUE_SUBTILE: tl.constexpr = False):
    """Store the fp32 tile ``acc`` (converted to C's dtype) at rows ``off_m..`` of segment ``seg``, columns
    ``off_n..``, clipped to ``seg_rows`` x ``N``. ``c``: 3-D tensor descriptor (USE_TMA) or pointer (masked
    stores; tiles wider than 128 in two halves, so their addresses do not spill: docs/design/gemm.md)."""
    if USE_TMA:
        if EPILOGUE_SUBTILE:  # two half-width stores: half the smem staging buffer
            left, right = _column_halves(acc, BLOCK_M, BLOCK_N)
            c.store([seg, off_m, off_n], left.to(c.dtype).reshape(1, BLOCK_M, BLOCK_N // 2))
            c.store([seg, off_m, off_n + BLOCK_N // 2], right.to(c.dtype).reshape(1, BLOCK_M, BLOCK_N // 2))
        else:
            c.store([seg, off_m, off_n], acc.to(c.dtype).reshape(1, BLOCK_M, BLOCK_N))
    elif BLOCK_N > 128:
        left, right = _column_halves(acc, BLOCK_M, BLOCK_N)
        _store_masked(c, left, seg, off_m, off_n, seg_rows, N, stride_cs, stride_cm, BLOCK_M, BLOCK_N // 2)
        _store_masked(c, right, seg, off_m, off_n + BLOCK_N // 2, seg_rows, N, stride_cs, stride_cm, BLOCK_M,
                      BLOCK_N // 2)
    else:
        _store_masked(c, acc, seg, off_m, off_n, seg_rows, N, stride_cs, stride_cm, BLOCK_M, BLOCK_N)


@triton.jit
def _column_halves(acc, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """[BLOCK_M, BLOCK_N] -> its left and right [BLOCK_M, BLOCK_N // 2] halves."""
    return tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))


@triton.jit
def _join_columns(left, right, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Two [BLOCK_M, BLOCK_N // 2] halves -> [BLOCK_M, BLOCK_N], left beside right (``_column_halves`` undone)."""
    return tl.reshape(tl.permute(tl.join(left, right), (0, 2, 1)), (BLOCK_M, BLOCK_N))


@triton.jit
def _store_masked(c, acc, seg, off_m, off_n, seg_rows, N, stride_cs, stride_cm, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr):
    """``tile_store``'s masked store of ``acc`` [BLOCK_M, BLOCK_N]."""
    rows = off_m + tl.arange(0, BLOCK_M)
    cols = off_n + tl.arange(0, BLOCK_N)
    ptrs = c + seg.to(tl.int64) * stride_cs + rows.to(tl.int64)[:, None] * stride_cm + cols[None, :]
    tl.store(ptrs, acc.to(c.dtype.element_ty), mask=(rows[:, None] < seg_rows) & (cols[None, :] < N))


@triton.jit
def gemm_kernel(a, b, c, num_segments, seg_rows, N, K, stride_am, stride_bn, stride_cs, stride_cm,
                first_segment, segment_step,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                USE_TMA: tl.constexpr, EPILOGUE_SUBTILE: tl.constexpr, FLATTEN: tl.constexpr,
                WARP_SPECIALIZE: tl.constexpr, DOT_PRECISION: tl.constexpr, SILU_GATE: tl.constexpr,
                scale_a=None, scale_w=None, stride_sa=None, stride_sw=None, SCALES: tl.constexpr = "",
                MAX_IMPRECISE_ACC: tl.constexpr = None, SPLIT_K: tl.constexpr = 1, partials=None, tile_counts=None,
                B_KN: tl.constexpr = False, stride_sak=1):
    """Persistent ``C[seg] = A[seg] @ B.T`` over all segments: the reference use of the three pieces above
    (SILU_GATE: ``silu(A @ B_gate.T) * (A @ B_up.T)``; FP8 scales: SCALES and ``stride_sak``, see
    ``tile_accumulate``; B_KN: ``b`` is B.T [K, N] as it lies, ``stride_bn`` its rows' stride).

    SPLIT_K > 1 (few tiles, long K: M small): each tile's K steps in SPLIT_K shares, a work item each, so that
    every SM streams its part of B; an item stores its fp32 partial tile in ``partials`` and the last of a tile's
    items to arrive (``tile_counts``: an int32 counter per tile, 0 between launches) sums the partials in split
    order (deterministic) and stores the tile."""
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    tiles_m = tl.cdiv(seg_rows, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_segments * tiles_m * tiles_n
    a_rows = num_segments * seg_rows
    if SPLIT_K == 1:
        for tile in tl.range(pid, num_tiles, num_programs, flatten=FLATTEN, warp_specialize=WARP_SPECIALIZE):
            seg, pid_m, pid_n = tile_coords(tile, tiles_m, tiles_n, num_segments, first_segment, segment_step,
                                            GROUP_M)
            acc = tile_accumulate(a, b, seg * seg_rows + pid_m * BLOCK_M, pid_n * BLOCK_N, a_rows, N, K,
                                  stride_am, stride_bn, BLOCK_M, BLOCK_N, BLOCK_K, USE_TMA, DOT_PRECISION, SILU_GATE,
                                  scale_a, scale_w, stride_sa, stride_sw, SCALES, MAX_IMPRECISE_ACC, B_KN=B_KN,
                                  stride_sak=stride_sak)
            tile_store(c, acc, seg, pid_m * BLOCK_M, pid_n * BLOCK_N, seg_rows, N, stride_cs, stride_cm,
                       BLOCK_M, BLOCK_N, USE_TMA, EPILOGUE_SUBTILE)
    else:
        tl.static_assert(not SILU_GATE, "split-K sums partial products: no SiLU gate")
        k_share = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K)  # K steps per split
        for item in tl.range(pid, num_tiles * SPLIT_K, num_programs, flatten=FLATTEN):
            tile = item // SPLIT_K  # a tile's splits are neighbours: they run at once and meet in L2
            split = item % SPLIT_K
            seg, pid_m, pid_n = tile_coords(tile, tiles_m, tiles_n, num_segments, first_segment, segment_step,
                                            GROUP_M)
            acc = tile_accumulate(a, b, seg * seg_rows + pid_m * BLOCK_M, pid_n * BLOCK_N, a_rows, N, K,
                                  stride_am, stride_bn, BLOCK_M, BLOCK_N, BLOCK_K, USE_TMA, DOT_PRECISION, False,
                                  scale_a, scale_w, stride_sa, stride_sw, SCALES, MAX_IMPRECISE_ACC, None,
                                  split * k_share, (split + 1) * k_share, B_KN=B_KN, stride_sak=stride_sak)
            acc, last = _sum_splits(acc, partials, tile_counts, tile, split, SPLIT_K, BLOCK_M, BLOCK_N)
            if last:
                tile_store(c, acc, seg, pid_m * BLOCK_M, pid_n * BLOCK_N, seg_rows, N, stride_cs, stride_cm,
                           BLOCK_M, BLOCK_N, USE_TMA, EPILOGUE_SUBTILE)


@triton.jit
def _sum_splits(acc, partials, tile_counts, tile, split, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr):
    """Split-K: store this split's fp32 partial tile; in the last of the tile's splits to arrive, return the sum
    of all of them in split order (the same bits whichever arrives last; its own partial from its registers, the
    others' read) and True; elsewhere ``acc`` and False."""
    offs = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    tile_partials = partials + tile.to(tl.int64) * (SPLIT_K * BLOCK_M * BLOCK_N)
    tl.store(tile_partials + split * (BLOCK_M * BLOCK_N) + offs, acc)
    last = dl.arrive_last(tile_counts + tile, SPLIT_K)
    if last:  # (".cg": from L2, where the other SMs' partials are; never a stale L1 line)
        tl.atomic_xchg(tile_counts + tile, 0, sem="relaxed", scope="gpu")
        own = acc
        splits = tl.zeros((BLOCK_M, BLOCK_N), tl.int32) + split  # (a mask of the tile's shape: the interpreter's)
        acc = tl.where(splits == 0, own, tl.load(tile_partials + offs, mask=splits != 0, cache_modifier=".cg"))
        for s in tl.static_range(1, SPLIT_K):
            acc += tl.where(splits == s, own, tl.load(tile_partials + s * (BLOCK_M * BLOCK_N) + offs,
                                                      mask=splits != s, cache_modifier=".cg"))
    return acc, last


# ----------------------------------------------------------------------------------------------- host side
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FP8_BLOCK_K = 128  # FP8 tiles keep the bf16 tiles' bytes per pipeline stage: twice their K step
FP8_ACC_PER_THREAD = 64  # fp32 values of one accumulator per thread where a tile holds two (FP8 block scales)


def default_num_programs(device, cfg=None):
    """One persistent program per SM on GPU (``cfg``'s ``programs_per_sm`` for tiles of one warpgroup that share
    an SM); a couple under the interpreter (programs run one after another)."""
    if device.type != "cuda":
        return 2
    return num_sms(device.index) * ((cfg or {}).get("programs_per_sm") or 1)


def _has_block_scales(scales):
    """Whether a call's ``fp8.Scales`` (None: not FP8) are 128-blockwise."""
    return scales is not None and scales.mode == "block"


def fp8_tiles(cfg, dtype, device, scales=None):
    """``cfg`` as tiles of ``dtype``: for FP8 operands on a GPU BLOCK_K 128 (fp8 wgmma takes K in steps of 32),
    the same bytes per pipeline stage as bf16's 64; unchanged otherwise. Block scales (``scales``, the call's
    ``fp8.Scales``) keep each K step's product apart from the sum, two fp32 accumulators: BLOCK_N halves until
    both fit a thread's registers (a 128x256 tile spills: docs/design/fp8.md), with the pipeline's bytes kept by
    more stages. Promoted per-tensor / rowwise scales at BLOCK_N >= 256: ``SPLIT_N``, the
    tile's columns as two accumulators (``tile_accumulate``), so that a K step's partial sum is half a tile."""
    if dtype not in fp8.FP8_DTYPES or device.type != "cuda":
        return cfg
    cfg = {**cfg, "BLOCK_K": FP8_BLOCK_K}
    cfg["SPLIT_N"] = (scales is not None and scales.mode != "block" and not scales.fast_accum
                      and cfg["BLOCK_N"] >= 256)
    if _has_block_scales(scales):
        stage_bytes = (cfg["BLOCK_M"] + cfg["BLOCK_N"]) * FP8_BLOCK_K
        while cfg["BLOCK_M"] * cfg["BLOCK_N"] > FP8_ACC_PER_THREAD * 32 * cfg["num_warps"] and cfg["BLOCK_N"] > 16:
            cfg["BLOCK_N"] //= 2
        cfg["num_stages"] = max(cfg["num_stages"],
                                cfg["num_stages"] * stage_bytes // ((cfg["BLOCK_M"] + cfg["BLOCK_N"]) * FP8_BLOCK_K))
    return cfg


def gemm_config(m, n, k, dtype, device, scales=None, **overrides):
    """A good fixed configuration for ``[m, k] @ [n, k].T`` (the autotuner refines it on GPU).

    Keys: BLOCK_M/N/K, GROUP_M, num_stages, num_warps, EPILOGUE_SUBTILE, FLATTEN, WARP_SPECIALIZE, SPLIT_N (the
    tile's columns as two accumulators, TMA only: ``tile_accumulate``), use_tma (None: whenever the operands
    allow), num_programs (None: one per SM, or ``programs_per_sm`` per SM); the ``gemm`` op's also SPLIT_K (each
    tile's K in that many shares, summed by the last: ``gemm_kernel``; the fused ops' kernels have none),
    A_SCALES_K_MAJOR (block scales of A given row-major: copied K-major first, the layout both mainloops read
    faster), TAIL_SPLIT (the Gluon mainloop's tiles of its last, partial round in at most that many K shares:
    ``gemm_sm90.tail_split``; ``OP_KNOBS``) and MAINLOOP ("triton": the core; "gluon": ``gemm_sm90``'s
    warp-specialized kernel, FP8 or 16-bit). FP8 operands (``scales``: their ``fp8.Scales``): ``fp8_tiles``."""
    if device.type != "cuda":  # interpreter: small tiles keep it quick
        cfg = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=2, num_stages=1, num_warps=4)
    elif m <= 1024 or n <= 1024:  # few tiles of 128x256 would leave SMs idle
        cfg = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_stages=4, num_warps=8)
    else:  # the Hopper workhorse: 128x256 tiles, 2 consumer warpgroups, 3-stage TMA pipeline
        cfg = dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_stages=3, num_warps=8)
    if dtype == torch.float32 and device.type == "cuda":
        cfg.update(BLOCK_N=min(cfg["BLOCK_N"], 128), BLOCK_K=32)
    cfg.update(EPILOGUE_SUBTILE=False, FLATTEN=False, WARP_SPECIALIZE=False, SPLIT_N=False, use_tma=None,
               num_programs=None, programs_per_sm=None, MAINLOOP="triton")
    cfg = fp8_tiles(cfg, dtype, device, scales)
    cfg.update(overrides)
    return cfg


def check_tiles(config, **choices):
    """ValueError for a caller's ``config`` override that no GEMM-core kernel can take (checked before any launch,
    so a bad value is refused by every rank alike instead of failing inside the kernel, ZeroDivisionError or a
    compile error): tile sides BLOCK_M / N / K powers of two >= 16 (``tl.dot``'s smallest), GROUP_M,
    num_stages positive ints, num_warps a power of two; ``choices``: an op's knobs of a few values (e.g.
    ``path=("overlap", "graph", "fallback")``) and those values."""
    for name, value in config.items():
        is_int = isinstance(value, int) and not isinstance(value, bool)
        if name in ("BLOCK_M", "BLOCK_N", "BLOCK_K"):
            ok = is_int and value >= 16 and value & (value - 1) == 0
            want = "a power of two >= 16"
        elif name in ("GROUP_M", "num_stages", "TAIL_SPLIT"):
            ok, want = is_int and value >= 1, "a positive int"
        elif name == "num_warps":
            ok, want = is_int and value >= 1 and value & (value - 1) == 0, "a power of two"
        elif name == "MAINLOOP":
            ok, want = value in ("triton", "gluon"), "'triton' or 'gluon'"
        elif name == "A_SCALES_K_MAJOR":
            ok, want = isinstance(value, bool), "a bool"
        elif name in choices:
            ok, want = value in choices[name], f"one of {choices[name]}"
        else:
            continue
        if not ok:
            raise ValueError(f"config {name} must be {want}, got {value!r}")
    return config


def tma_compatible(*tensors):
    """TMA needs 16-byte aligned base addresses and row strides (and a unit last stride)."""
    if TensorDescriptor is None:
        return False
    for t in tensors:
        strides, size = t.stride(), t.element_size()
        if strides[-1] != 1 or t.data_ptr() % 16:
            return False
        for stride in strides[:-1]:
            if (stride * size) % 16:
                return False
    return True


def tma_descriptor(t, block, shape=None, strides=None):
    """A host TMA descriptor of ``t`` (``shape`` / ``strides``: t's own unless given) with ``block``, for a tensor
    that ``tma_compatible`` accepted: built without Triton's checks of it again (which cost more than the launch)."""
    desc = _NEW(TensorDescriptor)
    desc.base, desc.block_shape = t, block
    desc.shape = list(t.shape) if shape is None else shape
    desc.strides = list(t.stride()) if strides is None else strides
    return desc


_NEW = object.__new__


def c_block(cfg):
    """The block of C's tensor descriptor [1, BLOCK_M, BLOCK_N] (half the columns with ``EPILOGUE_SUBTILE``)."""
    return [1, cfg["BLOCK_M"], cfg["BLOCK_N"] // 2 if cfg.get("EPILOGUE_SUBTILE") else cfg["BLOCK_N"]]


def describe_operands(a, b, c3, cfg, kn=False):
    """Kernel arguments for A [rows, K], B [N, K], C [S, seg_rows, N]: descriptors when TMA applies (``use_tma``
    None or True: whenever the operands allow), else the tensors themselves. ``kn``: B is the transposed view of a
    contiguous [K, N] (``is_kn``), described as it lies (``B_KN``). Returns (a_arg, b_arg, c_arg, use_tma)."""
    b = b.T if kn else b  # contiguous either way
    if cfg.get("use_tma") is False or not tma_compatible(a, b, c3):
        return a, b, c3, False
    return (tma_descriptor(a, [cfg["BLOCK_M"], cfg["BLOCK_K"]]), tma_descriptor(b, b_block(cfg, kn)),
            tma_descriptor(c3, c_block(cfg)), True)


def is_kn(w):
    """Whether ``w`` [N, K] is the transposed view of a contiguous [K, N] (a weight multiplied as it lies, the
    backward's ``grad @ w``): the kernels read it so (``B_KN``), without a contiguous copy."""
    return w.dim() == 2 and not w.is_contiguous() and w.T.is_contiguous()


def b_row_stride(b, kn=False):
    """The stride of B's rows as the kernels read them (``stride_bn``): of B [N, K], or with ``kn`` of B.T [K, N]
    (``is_kn``)."""
    return b.stride(1) if kn else b.stride(0)


def b_block(cfg, kn=False):
    """The block of B's tensor descriptor: [BLOCK_N, BLOCK_K], or [BLOCK_N // 2, BLOCK_K] where ``SPLIT_N`` (the
    tile's columns as two accumulators: ``tile_accumulate``); ``kn``: of B.T [K, N] (``B_KN``), transposed."""
    cols = cfg["BLOCK_N"] // 2 if cfg.get("SPLIT_N") else cfg["BLOCK_N"]
    return [cfg["BLOCK_K"], cols] if kn else [cols, cfg["BLOCK_K"]]


def dot_precision(dtype):
    return "ieee" if dtype == torch.float32 else "tf32"  # fp32 inputs: exact fp32 products; 16-bit: ignored


_LAUNCH_GEMM = Launchers(gemm_kernel, "gemm_launch")  # gemm_kernel's bound launches


def launch_gemm(a, b, c3, cfg, first_segment=0, segment_step=1, silu_gate=False, scales=None, scale_rows=None,
                kn=False):
    """``c3[s] = a[s*seg_rows:(s+1)*seg_rows] @ b.T`` for every segment s of ``c3`` [S, seg_rows, N]
    (``silu_gate``: b is [2N, K], gate over up, and c3 gets ``silu(a @ b_gate.T) * (a @ b_up.T)``; ``scales``:
    FP8 operands' ``fp8.Scales``, ``scale_rows``: A's scales as rows [rows, S] instead of ``scales.a``; ``kn``:
    b is the transposed view of a contiguous [K, N], read as it lies: no gate, no scales; ``cfg``'s
    A_SCALES_K_MAJOR: A's block scales copied K-major first)."""
    segments, seg_rows, n = c3.shape
    if cfg.get("A_SCALES_K_MAJOR") and scales is not None and scale_rows is None:
        scales = scales.k_major_a()
    if cfg.get("MAINLOOP") == "gluon":  # ``gemm``'s own configurations only: one segment, no gate
        if segments != 1 or silu_gate or scale_rows is not None:
            raise ValueError("the Gluon mainloop runs gemm's calls: one segment, no SiLU gate")
        grid, split, space = gluon_tail(cfg, seg_rows, n, a.shape[1], a.device)
        tail = None if split == 1 else gemm_sm90.tail_arguments(c3[0], split, split_k_workspace(*space))
        return gemm_sm90.launch(a, b, c3[0], cfg, *_mode_and_scales(scales),
                                grid or gemm_grid(cfg, 1, seg_rows, n, a.device), tail)
    a_arg, b_arg, c_arg, use_tma = describe_operands(a, b, c3, cfg, kn)
    args = (a_arg, b_arg, c_arg, segments, seg_rows, n, a.shape[1], a.stride(0), b_row_stride(b, kn),
            c3.stride(0), c3.stride(1), first_segment, segment_step)
    named = {} if scales is None else scales.tensor_args(scale_rows, k_stride=True)
    split_k = split_k_of(cfg, silu_gate)
    if split_k > 1:
        named.update(split_k_workspace(a.device, gemm_tiles(cfg, segments, seg_rows, n), split_k, cfg))
    # bound once per grid and constants (``Launcher``): a call costs the driver launch
    _LAUNCH_GEMM(gemm_grid(cfg, segments, seg_rows, n, a.device), *args, named=named,
                 **gemm_meta(cfg, use_tma, a.dtype, silu_gate, scales), **({"B_KN": True} if kn else {}))
    return c3


def gluon_tail(cfg, m, n, k, device):
    """The Gluon mainloop's split tail (``gemm_sm90.tail_split``) of ``cfg`` at [m, n, k]: (its grid, every SM's;
    the split; ``split_k_workspace``'s arguments for its partials and two counters per tail tile), the grid None
    where the split is 1 (whole tiles: ``gemm_grid``)."""
    programs = default_num_programs(device, cfg)
    split = gemm_sm90.tail_split(cfg, m, n, k, programs)
    space = (device, gemm_sm90.tail_tiles(cfg, m, n, programs), split, cfg, 2)
    return ((programs,) if split > 1 else None), split, space


def split_k_of(cfg, silu_gate=False):
    """``cfg``'s SPLIT_K, checked: a positive int, 1 with the SiLU gate (ValueError otherwise)."""
    split_k = cfg.get("SPLIT_K")
    if split_k is None:
        return 1
    if not isinstance(split_k, int) or isinstance(split_k, bool) or split_k < 1:
        raise ValueError(f"SPLIT_K must be a positive int, got {split_k!r}")
    if split_k > 1 and silu_gate:
        raise ValueError("SPLIT_K > 1 sums partial products: it cannot take the SiLU-gate epilogue")
    return split_k


_SPLIT_K_SPACE = {}  # (device, stream) -> split-K's partial tiles and tile counters there


def split_k_workspace(device, tiles, split_k, cfg, counters=1):
    """``gemm_kernel``'s split-K arguments for ``tiles`` tiles of ``cfg`` launched on the current stream: fp32
    room for every split's partial tile and ``counters`` int32 counters per tile, zero between launches (the
    kernel resets them). One pair per stream (launches on one stream never overlap), grown as needed; under
    CUDA-graph capture a new pair the graph keeps to itself (its zeroing is captured too). Also the Gluon
    mainloop's split tail (``gemm_sm90.tail_split``: two counters per tile, one per consumer)."""
    tile_elems = cfg["BLOCK_M"] * cfg["BLOCK_N"]
    need = (tiles * split_k * tile_elems, tiles * counters)
    key = (device, torch._C._cuda_getCurrentRawStream(device.index) if device.type == "cuda" else None)
    capturing = hardware.capturing()  # (a kept pair may be replaced when it grows: a graph must not hold it)
    space = None if capturing else _SPLIT_K_SPACE.get(key)
    if space is None or space["partials"].numel() < need[0] or space["tile_counts"].numel() < need[1]:
        if space is not None:  # grown to hold both the old and the new needs
            need = (max(need[0], space["partials"].numel()), max(need[1], space["tile_counts"].numel()))
        space = dict(partials=torch.empty(need[0], dtype=torch.float32, device=device),
                     tile_counts=torch.zeros(need[1], dtype=torch.int32, device=device))
        if not capturing:
            _SPLIT_K_SPACE[key] = space
    return space


def gemm_tiles(cfg, segments, seg_rows, n):
    """The output tiles of ``cfg`` over C [segments, seg_rows, n]."""
    return segments * -(-seg_rows // cfg["BLOCK_M"]) * -(-n // cfg["BLOCK_N"])  # (triton.cdiv costs µs on host)


def gemm_grid(cfg, segments, seg_rows, n, device):
    """``gemm_kernel``'s persistent grid: one program per SM (``num_programs``), at most one per work item (a
    tile, or a tile's K share: ``SPLIT_K``)."""
    items = gemm_tiles(cfg, segments, seg_rows, n) * (cfg.get("SPLIT_K") or 1)
    return (max(1, min(cfg.get("num_programs") or default_num_programs(device, cfg), items)),)


def gemm_meta(cfg, use_tma, dtype, silu_gate=False, scales=None):
    """``gemm_kernel``'s constexprs and launch options for ``cfg`` (FP8: the scales' constexprs; their tensors are
    runtime arguments after the constexprs, by name)."""
    meta = dict(BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], GROUP_M=cfg["GROUP_M"],
                USE_TMA=use_tma, EPILOGUE_SUBTILE=bool(cfg["EPILOGUE_SUBTILE"] and use_tma), FLATTEN=cfg["FLATTEN"],
                WARP_SPECIALIZE=cfg["WARP_SPECIALIZE"], DOT_PRECISION=dot_precision(dtype), SILU_GATE=silu_gate,
                num_stages=cfg["num_stages"], num_warps=cfg["num_warps"])
    if (cfg.get("SPLIT_K") or 1) > 1:
        meta["SPLIT_K"] = cfg["SPLIT_K"]
    if scales is not None:
        meta.update(scales.constexprs(cfg))
    return meta


def check_matmul_operands(a, b, what_a="a", what_b="w", w_as_it_lies=False):
    """TypeError/ValueError for operands ``gemm`` and the fused ops cannot take (``w_as_it_lies``: ``b`` may also
    be the transposed view of a contiguous [K, N], ``is_kn``, for an op that reads it so)."""
    for t, name in ((a, what_a), (b, what_b)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in SUPPORTED_DTYPES:
            hint = " (FP8 operands take their scales: gemm / ag_gemm / gemm_rs with scale_a=, scale_w=)" \
                if fp8.is_fp8(t) else ""
            raise TypeError(f"{name} has dtype {t.dtype}; supported: float16, bfloat16 (and float32){hint}")
        if t.dim() != 2:
            raise ValueError(f"{name} must be 2-D, got shape {list(t.shape)}")
        if not t.is_contiguous() and not (w_as_it_lies and t is b and is_kn(t)):
            raise ValueError(f"{name} must be contiguous (call .contiguous() first)")
    if a.dtype != b.dtype:
        raise TypeError(f"{what_a} and {what_b} must have the same dtype, got {a.dtype} and {b.dtype}")
    if a.device != b.device:
        raise ValueError(f"{what_a} is on {a.device} but {what_b} is on {b.device}")
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"inner dimensions differ: {what_a} {list(a.shape)} vs {what_b} {list(b.shape)} "
                         f"(expected {what_b} of shape [N, {a.shape[1]}])")


def check_launchable(t, what="a and w"):
    """ValueError unless a compiled (or interpreted) Triton kernel can read ``t``: CUDA tensors on the current
    device, or CPU tensors under the Triton interpreter (``TRITON_INTERPRET=1``). Without this check a compiled
    kernel handed host pointers writes garbage and then faults, poisoning the CUDA context of the process."""
    if t.device.type == "cpu":
        if not interpreting():
            raise ValueError(f"{what} are CPU tensors, but Triton is not in interpreter mode: move them to the GPU "
                             f"(or set TRITON_INTERPRET=1 before importing triton to run on CPU)")
    elif t.device.type == "cuda":
        current = torch.cuda.current_device()
        if t.device.index is not None and t.device.index != current:
            raise ValueError(f"{what} are on {t.device} but the current CUDA device is cuda:{current}: call "
                             f"torch.cuda.set_device({t.device.index}) first")
    else:
        raise ValueError(f"{what} are on {t.device}; triton_dist kernels take CUDA tensors (CPU under the "
                         f"Triton interpreter)")


OP_KNOBS = dict(SPLIT_K=1, A_SCALES_K_MAJOR=False, TAIL_SPLIT=1)  # the gemm op's knobs beside the core's
_CONFIGS = Plans("gemm")  # (m, n, k, dtype, device[, FP8 mode]) -> the tuned configuration


def output_like(out, shape, a, dtype=None):
    """``out`` checked to be a contiguous tensor of ``shape`` with ``dtype`` (default: a's) on a's device, or a new
    one if None."""
    dtype = a.dtype if dtype is None else dtype
    if out is None:
        return torch.empty(shape, dtype=dtype, device=a.device)
    if (not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(shape) or out.dtype != dtype
            or out.device != a.device or not out.is_contiguous()):
        got = f"{out.dtype} {list(out.shape)} on {out.device}" if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"out must be a contiguous {dtype} tensor of shape {list(shape)} on {a.device}, got {got}")
    return out


def matmul_torch(a, w, scales=None, out_dtype=None):
    """``a @ w.T`` by torch (cuBLAS on a GPU): the baseline and the fused ops' fallback GEMM. FP8 operands
    (``scales``: ``fp8.Scales``, result in ``out_dtype``): ``torch._scaled_mm`` for per-tensor and rowwise scales,
    our core where cuBLAS takes none of it (block scales in this form, e5m2 x e5m2, rowwise into fp16 / fp32, N or
    K not a multiple of 16)."""
    if scales is None:
        return torch.matmul(a, w.t())
    cublas_takes = not (w.shape[0] % 16 or a.shape[1] % 16)  # N and K in multiples of 16 (cuBLAS' alignment)
    if scales.mode == "block" or a.dtype == torch.float8_e5m2 or not cublas_takes or \
            (scales.mode == "row" and out_dtype != torch.bfloat16):
        return _gemm(a, w, None, None, scales, out_dtype)
    sw = scales.w.reshape(1, -1) if scales.mode == "row" else scales.w.reshape(())
    # (rowwise: [M, 1] with unit strides, as cuBLAS checks them; a transposed [1, M] is contiguous but not that)
    sa = scales.a.reshape(-1).unsqueeze(1) if scales.mode == "row" else scales.a.reshape(())
    return torch._scaled_mm(a, w.t(), sa, sw, out_dtype=out_dtype, use_fast_accum=scales.fast_accum)


def gemm(a, w, out=None, config=None, *, scale_a=None, scale_w=None, scaling=None, out_dtype=None,
         fast_accum=False):
    """``a @ w.T`` with the persistent core (``a`` [M, K], ``w`` [N, K]); fp16/bf16 (fp32 for tests).
    CUDA tensors on the current device, or CPU tensors under the Triton interpreter (else ValueError). ``out``:
    an [M, N] result to fill; ``config``: overrides of ``gemm_config`` (else the tuned configuration).

    FP8 operands (float8_e4m3fn, or float8_e5m2 for both) come with their float32 scales and the product is
    ``(a * scale_a) @ (w * scale_w).T`` accumulated in fp32: ``scale_a`` / ``scale_w`` [1] / [1] (per tensor),
    [M, 1] / [N, 1] (rowwise) or [M, ceil(K/128)] / [ceil(N/128), ceil(K/128)] (1x128 groups of a, 128x128 blocks
    of w; every K step scaled), ``scaling`` ("tensor", "row", "block"; None: named by the scales' shapes). The
    result is ``out_dtype`` (bfloat16 unless given; float16, float32). ``fast_accum``: the tensor cores
    accumulate through the whole K loop (``torch._scaled_mm(use_fast_accum=True)``); without it their partial
    sums are promoted to fp32 every K step. FP8 tiles take 128-wide K steps on a GPU (``fp8_tiles``). FP8
    operands without scales, scales with other operands, scale shapes of no mode, a GPU below compute
    capability 8.9: TypeError / ValueError (``kernels/fp8.py``). ``scaled_gemm``: the same with the scales
    required.

    Differentiable: a call with grad (``a`` or ``w`` requiring it, grad mode on), and every call that
    torch.compile traces, goes through ``torch.ops.triton_dist.gemm`` (its backward: ``kernels/autograd.py``;
    ``config=`` applies to its forward, eagerly); ``out=`` is for calls without grad, and FP8 operands carry none
    (ValueError)."""
    if _with_grad(a, w, out, scale_a, scale_w):
        return library.with_caller_config("gemm", config, lambda: torch.ops.triton_dist.gemm(
            a, w, scale_a, scale_w, scaling, out_dtype, fast_accum))
    return _checked_or_planned(a, w, out, config, scale_a, scale_w, scaling, out_dtype, fast_accum, False)


def scaled_gemm(a, w, scale_a, scale_w, *, scaling=None, out=None, out_dtype=None, fast_accum=False, config=None):
    """``gemm`` on FP8 operands, the scales required (as in ``torch._scaled_mm``): ``(a * scale_a) @ (w *
    scale_w).T`` in ``out_dtype`` (bfloat16 by default) or into ``out``."""
    if _with_grad(a, w, out, scale_a, scale_w):
        fp8.scaled_operands(a, w, scale_a, scale_w, scaling, out_dtype, fast_accum, required=True)
        return torch.ops.triton_dist.gemm(a, w, scale_a, scale_w, scaling, out_dtype, fast_accum)
    return _checked_or_planned(a, w, out, config, scale_a, scale_w, scaling, out_dtype, fast_accum, True)


def _with_grad(a, w, out, scale_a, scale_w):
    """Whether a call must go through the torch op for autograd (``library.needs_grad``); ValueError where it
    cannot have a gradient."""
    if not (isinstance(a, torch.Tensor) and isinstance(w, torch.Tensor) and library.needs_grad(a, w)):
        return False  # (not tensors: the checks of the direct path name the argument)
    if scale_a is not None or scale_w is not None or a.dtype in fp8.FP8_DTYPES or w.dtype in fp8.FP8_DTYPES:
        raise ValueError("gemm: FP8 operands carry no gradient (call it under torch.no_grad(); layers train in FP8 "
                         "with their fp8= mode)")
    if out is not None:
        raise ValueError("gemm: out= is for calls without grad (under torch.no_grad())")
    return True


def _checked_or_planned(a, w, out, config, scale_a, scale_w, scaling, out_dtype, fast_accum, required, op=False):
    """A call of ``gemm`` / ``scaled_gemm``: through the eager plan of its layout (``EagerGemm``) where one was
    made, else checked, configured and launched (which makes the plan). Traced by torch.compile (without ``out=``
    / ``config=``): the torch op, checked as the call would be (``op``: the call is that op's own)."""
    key = None
    if config is None and isinstance(a, torch.Tensor) and isinstance(w, torch.Tensor):
        if not op and hardware.compiling():
            if out is None:
                fp8.scaled_operands(a, w, scale_a, scale_w, scaling, out_dtype, fast_accum, required)
                return torch.ops.triton_dist.gemm(a, w, scale_a, scale_w, scaling, out_dtype, fast_accum)
        elif out is None and scale_a is None and scale_w is None:  # the common call: a flat key, two layouts
            key = (a.shape, a.stride(), a.dtype, a.device, w.shape, w.stride(), w.dtype, w.device, scaling,
                   out_dtype, fast_accum, required)
        elif _tensors_or_none(out, scale_a, scale_w) and _scales_as_held(scale_a, scale_w):
            key = (_layout(a), _layout(w), _layout(out), _layout(scale_a), _layout(scale_w), scaling, out_dtype,
                   fast_accum, required)
    if key is not None:
        try:
            plan = _EAGER.find(key)
        except TypeError:  # an unhashable keyword: the checks below name it
            plan = key = None
        if plan is not None:
            result = plan(a, w, out, scale_a, scale_w)
            if result is not None:
                return result
    scales, out_dtype = fp8.scaled_operands(a, w, scale_a, scale_w, scaling, out_dtype, fast_accum, required,
                                            a_strided=True)
    return _gemm(a, w, out, config, scales, out_dtype, plan_key=key)


def _gemm(a, w, out, config, scales, out_dtype, plan_key=None):
    """The op on its operands' mode (``fp8.scaled_operands``: FP8 ``scales`` or None, the result's dtype);
    ``plan_key``: the call's key in ``_EAGER``, to launch through a new plan."""
    if scales is None:
        check_matmul_operands(a, w)
    check_launchable(a)
    m, k = a.shape
    n = w.shape[0]
    out = output_like(out, (m, n), a, out_dtype)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    if config is None:
        key = (m, n, k, a.dtype, a.device) + fp8.plan_key(scales, out_dtype)
        cfg = _CONFIGS.get(key, lambda: {**gemm_config(m, n, k, a.dtype, a.device, scales, **OP_KNOBS),
                                         **_tuned_gemm_config(m, n, k, a.dtype, a.device, scales, out_dtype)})
    else:
        base = gemm_config(m, n, k, a.dtype, a.device, scales, **OP_KNOBS)
        if isinstance(config, dict) and config.get("MAINLOOP") == "gluon" and a.dtype in gemm_sm90.DTYPES:
            # the knobs a caller leaves out: the Gluon mainloop's own (a 128-wide tile, its deepest ring)
            base = gemm_sm90.default_config(base, out.dtype, _has_block_scales(scales), dtype=a.dtype)
        cfg = check_tiles(autotune.with_overrides(base, config))
    fp8.check_block_k(scales, cfg)
    unmet = _gluon_unmet(a, w, out, cfg, scales) if cfg.get("MAINLOOP") == "gluon" else ()
    if unmet:
        if config is not None and config.get("MAINLOOP") == "gluon":
            raise ValueError(f"config MAINLOOP='gluon' needs {'; '.join(unmet)}; got {config} for a {tuple(a.shape)} "
                             f"{a.dtype} and w {tuple(w.shape)}")
        cfg = gemm_config(m, n, k, a.dtype, a.device, scales, **OP_KNOBS)  # a tuned one, for operands at an offset
    if plan_key is not None and a.is_cuda and cfg.get("use_tma") is not False and tma_compatible(a, w, out):
        plan = _EAGER.get(plan_key, lambda: EagerGemm(a, w, cfg, scales, out_dtype))
        if plan(a, w, out, *_scale_tensors(scales)) is not None:
            return out
    launch_gemm(a, w, out.view(1, m, n), cfg, scales=scales)
    return out


def _gluon_unmet(a, w, out, cfg, scales):
    """What keeps the Gluon mainloop (``gemm_sm90``) from running this call with ``cfg``: the conditions not met."""
    bk = gemm_sm90.block_k(a.dtype) if a.dtype in gemm_sm90.DTYPES else 128
    return [what for what, met in (
        ("FP8 operands with promoted scales (fast_accum=False), or bf16 / fp16 ones, on an sm_90 GPU",
         gemm_sm90.available(a.device, a.dtype, scales, out.dtype)),
        ("TMA-compatible operands (16-byte aligned data and rows)", tma_compatible(a, w, out)),
        (f"BLOCK_M 128, BLOCK_K {bk}, BLOCK_N in {gemm_sm90.BLOCK_NS} (no SPLIT_N), num_warps 4, num_stages >= 2 "
         "within the shared memory (EPILOGUE_SUBTILE: beside half a C piece)",
         a.dtype in gemm_sm90.DTYPES and gemm_sm90.takes(cfg, out.dtype, _has_block_scales(scales), a.dtype)))
        if not met]


def _mode_and_scales(scales):
    """(mode, scale_a, scale_w) of the Gluon mainloop's launch: None for 16-bit operands."""
    return (None, None, None) if scales is None else (scales.mode, scales.a, scales.w)


# ----------------------------------------------------------------------------------------------- torch op
def _gemm_torch_op(a, w, scale_a=None, scale_w=None, scaling=None, out_dtype=None, fast_accum=False):
    return _checked_or_planned(a, w, None, library.caller_config("gemm"), scale_a, scale_w, scaling, out_dtype,
                               fast_accum, False, op=True)


def _gemm_fake(a, w, scale_a=None, scale_w=None, scaling=None, out_dtype=None, fast_accum=False):
    _, dtype = fp8.scaled_operands(a, w, scale_a, scale_w, scaling, out_dtype, fast_accum)
    return a.new_empty((a.shape[0], w.shape[0]), dtype=dtype)


library.define("gemm(Tensor a, Tensor w, Tensor? scale_a=None, Tensor? scale_w=None, str? scaling=None, "
               "ScalarType? out_dtype=None, bool fast_accum=False) -> Tensor", _gemm_torch_op, _gemm_fake)


# ----------------------------------------------------------------------------------------------- eager calls
class EagerGemm:
    """A repeated eager ``gemm`` on operands of one layout (shapes, strides, dtypes, devices, of the result and
    the scales too) whose first call was checked and configured: TMA descriptors' shapes and blocks, the runtime
    arguments that follow from the layout, and a ``Launcher`` bound to the compiled kernel, given the operands
    themselves for their descriptors (``described``). A call checks what the layout does not fix (the current
    device, 16-byte aligned data) and costs the result's allocation and the launch; it answers None where it does
    not apply (the checked path then runs)."""

    def __init__(self, a, w, cfg, scales, out_dtype):
        (m, k), n = a.shape, w.shape[0]
        self.device, self.out_shape, self.out_dtype = a.device, (m, n), out_dtype
        given = scales
        if cfg.get("A_SCALES_K_MAJOR") and scales is not None:
            scales = scales.k_major_a()
        self.a_to_k_major = scales is not given  # each call's row-major A scales copied K-major (``__call__``)
        named = None if scales is None else scales.tensor_args(k_stride=True)
        self.scale_strides = None if named is None else {k: v for k, v in named.items() if k.startswith("stride")}
        split_k = split_k_of(cfg)
        self.split_args = (gemm_tiles(cfg, 1, m, n), split_k, cfg) if split_k > 1 else None  # split_k_workspace's
        grid = gemm_grid(cfg, 1, m, n, a.device)
        self.gluon = cfg.get("MAINLOOP") == "gluon"  # the Gluon mainloop (``gemm_sm90``) runs the call
        if self.gluon:
            mode_and_scales = _mode_and_scales(scales)
            arguments = gemm_sm90.Arguments(a, w, torch.empty((m, n), dtype=out_dtype, device="meta"), cfg,
                                            *mode_and_scales)
            self.ints = arguments.ints
            tail_grid, self.tail_split, self.tail_space = gluon_tail(cfg, m, n, k, a.device)
            grid = tail_grid or grid
            self.launcher = Launcher(gemm_sm90.gemm_fp8_sm90_kernel, grid, described=arguments.described(),
                                     **gemm_sm90.meta(cfg, mode_and_scales[0], self.tail_split > 1))
        else:  # the descriptors' blocks, shapes and strides (the [m, n] result as one segment) follow from the layout
            described = {0: _described([cfg["BLOCK_M"], cfg["BLOCK_K"]], [m, k], [k, 1]),
                         1: _described(b_block(cfg), [n, k], [k, 1]),
                         2: _described(c_block(cfg), [1, m, n], [m * n, n, 1])}
            self.ints = (1, m, n, k, k, k, m * n, n, 0, 1)
            self.launcher = Launcher(gemm_kernel, grid, described=described,
                                     **gemm_meta(cfg, True, a.dtype, scales=scales))

    def __call__(self, a, w, out, scale_a=None, scale_w=None):
        if torch._C._cuda_getDevice() != self.device.index or (a.data_ptr() | w.data_ptr()) % 16:
            return None
        if out is None:
            out = torch.empty(self.out_shape, dtype=self.out_dtype, device=self.device)
        elif out.data_ptr() % 16:
            return None
        if self.a_to_k_major:
            scale_a = fp8.as_k_major(scale_a)
        if self.gluon:
            if scale_a is not None and (scale_a.data_ptr() | scale_w.data_ptr()) % 16:
                return None
            if self.tail_split > 1:
                self.launcher.run(a, w, out, scale_a, scale_w, *self.ints, **gemm_sm90.tail_arguments(
                    out, self.tail_split, split_k_workspace(*self.tail_space)))
            else:
                self.launcher.run(a, w, out, scale_a, scale_w, *self.ints)
            return out
        named = {}
        if self.scale_strides is not None:
            if (scale_a.data_ptr() | scale_w.data_ptr()) % 16:
                return None
            named = dict(scale_a=scale_a, scale_w=scale_w, **self.scale_strides)
        if self.split_args is not None:
            named.update(split_k_workspace(self.device, *self.split_args))
        self.launcher.run(a, w, out, *self.ints, **named)
        return out


def _described(block, shape, strides):
    """A tensor's descriptor with these fields (fixed by a plan's layout), built when the launch needs one."""
    return lambda t: tma_descriptor(t, block, shape, strides)


_EAGER = Plans("gemm_eager")  # a call's layout and FP8 keywords -> its EagerGemm


def _tensors_or_none(*args):
    for t in args:
        if t is not None and not isinstance(t, torch.Tensor):
            return False
    return True


def _scales_as_held(scale_a, scale_w):  # a plan launches the scales as given: as ``Scales`` holds them
    return (scale_a is None or fp8.strided_a_scales(scale_a)) and (scale_w is None or scale_w.is_contiguous())


def _layout(t):
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device)


def _scale_tensors(scales):
    return () if scales is None else (scales.a, scales.w)


def skinny_configs(dtype):
    """Tiles for small M (<= 512 rows), where the GEMM streams the weight from HBM once and 128x128+ tiles would
    leave most SMs idle: narrow N tiles put every SM on the stream."""
    if dtype == torch.float32:
        return []
    return [dict(BLOCK_M=128, BLOCK_N=32, BLOCK_K=128, GROUP_M=8, num_stages=5, num_warps=4),
            dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=64, GROUP_M=8, num_stages=6, num_warps=4)]


def decode_tiles(m, dtype, scales=None):
    """Tiles of 16 rows for M <= 16 (decode): the shared memory a 64-row tile would spend on rows of zeros holds
    more of the weight in flight instead (mma.sync, not wgmma, at these rows), or two programs share an SM, one's
    first loads beside the other's last; not for FP8 operands."""
    if m > 16 or scales is not None or dtype not in (torch.float16, torch.bfloat16):
        return []
    return [dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, num_stages=5, num_warps=4),
            dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, num_stages=4, num_warps=4),
            dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=128, num_stages=5, num_warps=4),
            dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_stages=5, num_warps=4, programs_per_sm=2)]


def split_k_configs(m, n, k, dtype, device, base, scales=None):
    """Split-K tiles where a shape has too few output tiles to put every SM on it (small M, long K): each with the
    largest SPLIT_K that keeps the work items within one wave (``programs_per_sm`` programs an SM) and every split
    at least four K steps."""
    if device.type != "cuda" or dtype == torch.float32:
        return []
    sms, out = num_sms(device.index), []
    tiles = [dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_stages=4, num_warps=4),
             dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_stages=3, num_warps=8),
             dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_stages=5, num_warps=4)]
    if m <= 64:  # one warpgroup's rows: more of the weight in flight per SM (the GEMM streams it from HBM)
        tiles += [dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, num_stages=4, num_warps=4),
                  dict(BLOCK_M=64, BLOCK_N=256, BLOCK_K=64, num_stages=4, num_warps=4)]
    elif m <= 128:  # one tile of rows: narrower columns, so that the weight is read once by twice the items
        tiles.append(dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=128, num_stages=4, num_warps=4))
    elif m > 256:  # compute-bound shares: two warpgroups a tile
        tiles.append(dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_stages=4, num_warps=8))
    tiles += decode_tiles(m, dtype, scales)
    for tile in tiles:
        cfg = fp8_tiles({**base, **tile}, dtype, device, scales)
        wave = sms * (cfg.get("programs_per_sm") or 1)
        split_k = min(wave // gemm_tiles(cfg, 1, m, n), -(-k // cfg["BLOCK_K"]) // 4, 16)
        if split_k >= 2:
            out.append({**cfg, "SPLIT_K": split_k})
    return out


def gemm_candidates(m, n, k, dtype, device, scales=None, split_k=False, out_dtype=None):
    """The small sweep the autotuner runs on GPU (a few of the known-good Hopper shapes; FP8: ``fp8_tiles``);
    ``split_k``: ``gemm``'s own sweep (the fused ops' kernels call the core tile by tile), with
    ``split_k_configs`` and, for promoted FP8 on sm_90 (and bf16 / fp16 where ``gemm_sm90.TUNER_OFFERS_16BIT``),
    the Gluon mainloop's (``gemm_sm90``; ``out_dtype``: the result's, bf16 for FP8 by default), with row-major
    block scales of A also copying them K-major first (timed with the copy: A_SCALES_K_MAJOR), and where a shape
    leaves the last round of tiles mostly idle, with that round's tiles split along K (TAIL_SPLIT)."""
    base = gemm_config(m, n, k, dtype, device, scales)
    cands = [base,
             {**base, "BLOCK_N": 256, "num_stages": 3, "num_warps": 8, "BLOCK_M": 128},
             {**base, "BLOCK_N": 256, "num_stages": 4, "EPILOGUE_SUBTILE": True},
             {**base, "BLOCK_N": 256, "num_stages": 3, "FLATTEN": True},
             {**base, "BLOCK_N": 256, "num_stages": 3, "WARP_SPECIALIZE": True},
             {**base, "BLOCK_N": 128, "num_stages": 4, "num_warps": 8}]
    if dtype in fp8.FP8_DTYPES:  # FP8: 128x128 tiles with deeper pipelines, 256x128 (docs/design/fp8.md)
        cands += [{**base, "BLOCK_N": 128, "num_stages": 5}, {**base, "BLOCK_N": 128, "num_stages": 5, "GROUP_M": 16},
                  {**base, "BLOCK_M": 256, "BLOCK_N": 128, "num_stages": 3}]
    if _has_block_scales(scales) and device.type == "cuda":
        # one warpgroup a program, two programs an SM: one's block scaling beside the other's wgmmas (fp8.md)
        cands += [{**base, "BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 4, "num_stages": stages,
                   "programs_per_sm": 2} for stages in (3, 4)]
    if m <= 512:
        cands += [{**base, **c} for c in skinny_configs(dtype) + decode_tiles(m, dtype, scales)]
    cands = [fp8_tiles(c, dtype, device, scales) for c in cands]
    # split columns also as one accumulator: which is faster depends on the shape (docs/design/fp8.md)
    cands += [{**c, "SPLIT_N": False} for c in cands if c.get("SPLIT_N")]
    if split_k:
        cands += split_k_configs(m, n, k, dtype, device, base, scales)
        out_dtype = out_dtype or (torch.bfloat16 if scales is not None else dtype)
        # (the tuner's contiguous operands)
        tma_rows = k * dtype.itemsize % 16 == 0 and n * out_dtype.itemsize % 16 == 0
        offered = gemm_sm90.TUNER_OFFERS if scales is not None else gemm_sm90.TUNER_OFFERS_16BIT
        if offered and tma_rows and gemm_sm90.available(device, dtype, scales, out_dtype):
            gluon = gemm_sm90.candidates(base, out_dtype, _has_block_scales(scales), dtype=dtype)
            if _has_block_scales(scales) and not getattr(scales, "a_k_major", False):  # row-major A scales copied
                # K-major first; the split tail only with K-major scales (row-major as they lie: docs/design/fp8.md)
                cands += gluon
                gluon = [{**c, "A_SCALES_K_MAJOR": True} for c in gluon]
            cands += gluon + [c for c in ({**c, "TAIL_SPLIT": gemm_sm90.TUNER_TAIL_SPLIT} for c in gluon)
                              if gemm_sm90.tail_split(c, m, n, k, default_num_programs(device, c)) > 1]
    return autotune.dedupe(cands)


def _tuned_gemm_config(m, n, k, dtype, device, scales=None, out_dtype=None):
    def make_runner():  # only called when tuning actually happens
        a = torch.randn((m, k), device=device).to(dtype)
        w = torch.randn((n, k), device=device).to(dtype)
        probe = None if scales is None else scales.probe()
        out = torch.empty((m, n), dtype=out_dtype or dtype, device=device)
        # device time (CUDA-graph replays), so that small shapes are not timed by their identical host cost
        work = hardware.work_us(2 * m * n * k, (m * k + n * k) * dtype.itemsize + m * n * out.element_size(), dtype)
        return autotune.graph_runner(lambda cfg: launch_gemm(a, w, out.view(1, m, n), cfg, scales=probe),
                                     autotune.graph_calls(work))

    key = dict(m=m, n=n, k=k, dtype=str(dtype).replace("torch.", ""), **fp8.describe(scales, out_dtype))
    cands = [c for c in gemm_candidates(m, n, k, dtype, device, scales, split_k=True, out_dtype=out_dtype)
             if fp8.takes(scales, c)]
    return autotune.choose("gemm", key, cands, make_runner, default=gemm_config(m, n, k, dtype, device, scales),
                           collective=False)
