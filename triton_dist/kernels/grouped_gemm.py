"""Grouped GEMM: every expert's rows times that expert's weight, in one persistent launch.

``ep_dispatch`` delivers rows grouped by local expert: expert ``e`` owns rows ``[offsets[e], offsets[e] + n_e)``
of ``x`` [rows, K] (``n_e = counts[e]``, or ``offsets[e+1] - offsets[e]`` without counts). The op computes

    out[rows of e] = x[rows of e] @ w[e].T                      w [E, N, K]   (torch linear convention)
    out[rows of e] = silu(x @ w[e, :I].T) * (x @ w[e, I:].T)    w [E, 2I, K]  (activation="silu_gate")

The group boundaries stay on the device: no host sync, no per-expert padding, CUDA-graph capturable. The host
sizes the launch for the worst case the buffer allows (``cdiv(rows, BLOCK_M) + E`` tile-rows) and each program:

    tiles_e = cdiv(n_e, BLOCK_M); first_e = cumsum(tiles_e) - tiles_e        (vectors of E, once per program)
    for tile in range(pid, sum(tiles_e) * tiles_n, num_programs):         (persistent; tiles past the real
        pid_m, pid_n = grouped-M order over the tile-rows of all experts        work are never visited)
        e = #experts whose tiles end at or before pid_m;  row = offsets[e] + (pid_m - first_e[e]) * BLOCK_M
        acc = gemm.tile_accumulate(x rows from `row`, w[e] rows)            (the GEMM core's K loop, SILU_GATE)
        store: a whole tile inside the group by TMA, the group's last partial tile by a store masked to n_e

A tile may *read* rows past its group (the next group's, or zeros past the buffer): they only feed output rows
that are masked out. Rows outside every group (alignment padding, rows past the end) are left untouched: pass a
zeroed ``out`` if you need zeros there. Offsets and counts are clamped to the buffer, so bad ones cannot write
out of bounds. The K loop, tile order and stores are the GEMM core's (``gemm.py``), and so is FP8: FP8 x and w
with their scales (x's by row, as ``ep_dispatch(quant="fp8")`` delivers them; each expert's weight scales after the
previous expert's) are the core's SCALES modes, the expert's scales found as its weight is.
"""

import torch
import triton
import triton.language as tl

from .. import autotune, hardware, shmem
from ..hardware import cdiv, next_power_of_2
from . import fp8, library
from .gemm import (SUPPORTED_DTYPES, b_block, c_block, check_launchable, check_tiles, default_num_programs,
                   dot_precision, gemm_candidates, gemm_config, tile_accumulate, tile_coords, tile_store,
                   tma_compatible, tma_descriptor)
from .silu_gate import silu_gate

ACTIVATIONS = ("none", "silu_gate")
W_LAYOUTS = ("nk", "kn")  # w [E, N, K] (torch linear: out = x @ w[e].T) or [E, K, N] (out = x @ w[e])


# ----------------------------------------------------------------------------------------------- kernel
@triton.jit
def _group_table(offsets, counts, E, rows, BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, HAS_COUNTS: tl.constexpr):
    """Per expert (vectors of E_PAD): first row, row count (clamped to the buffer), first tile-row, tile-rows."""
    e = tl.arange(0, E_PAD)
    valid = e < E
    start = tl.load(offsets + e, mask=valid, other=0)
    if HAS_COUNTS:
        n = tl.load(counts + e, mask=valid, other=0)
    else:
        n = tl.load(offsets + e + 1, mask=valid, other=0) - start
    start = tl.minimum(tl.maximum(start, 0), rows)
    n = tl.minimum(tl.maximum(n, 0), rows - start)
    tiles = tl.where(valid, (n + BLOCK_M - 1) // BLOCK_M, 0)
    first_tile = tl.cumsum(tiles, 0) - tiles
    return start, n, first_tile, tiles


@triton.jit
def _group_tile(x, w, out_desc, out, e, row0, n_rows, local_m, pid_n, rows, N, K, w_rows, stride_xm, stride_we,
                stride_wn, stride_om, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                USE_TMA: tl.constexpr, EPILOGUE_SUBTILE: tl.constexpr, DOT_PRECISION: tl.constexpr,
                SILU_GATE: tl.constexpr, W_KN: tl.constexpr, scale_a, scale_w, stride_sa, stride_sw, stride_swe,
                SCALES: tl.constexpr, MAX_IMPRECISE_ACC: tl.constexpr):
    """One output tile: rows ``local_m..`` of expert ``e``'s group (``n_rows`` rows from ``row0``), columns
    ``pid_n * BLOCK_N..``. TMA: ``w`` is a descriptor of all experts' rows [E * w_rows, K], so expert e's rows
    start at e * w_rows (W_KN: a 3-D descriptor of w [E, K, N]); masks: ``w`` points at expert 0 and expert e
    starts ``e * stride_we`` further. FP8 (SCALES): x's scales ``scale_a`` by row, expert e's weight scales
    ``e * stride_swe`` after expert 0's."""
    off_n = pid_n * BLOCK_N
    if SCALES != "":
        scale_w = scale_w + e.to(tl.int64) * stride_swe
    if W_KN and USE_TMA:  # expert e's [K, N] weight as it lies: entry e of the 3-D descriptor of w [E, K, N]
        acc = tile_accumulate(x, w, row0 + local_m, off_n, rows, N, K, stride_xm, stride_wn, BLOCK_M, BLOCK_N,
                              BLOCK_K, True, DOT_PRECISION, B_KN=True, b_index=e)
    elif W_KN:
        acc = tile_accumulate(x, w + e.to(tl.int64) * stride_we, row0 + local_m, off_n, rows, N, K, stride_xm,
                              stride_wn, BLOCK_M, BLOCK_N, BLOCK_K, False, DOT_PRECISION, B_KN=True)
    elif USE_TMA:
        acc = tile_accumulate(x, w, row0 + local_m, off_n, rows, N, K, stride_xm, stride_wn, BLOCK_M, BLOCK_N,
                              BLOCK_K, True, DOT_PRECISION, SILU_GATE, scale_a, scale_w, stride_sa, stride_sw, SCALES,
                              MAX_IMPRECISE_ACC, e * w_rows)
    else:
        acc = tile_accumulate(x, w + e.to(tl.int64) * stride_we, row0 + local_m, off_n, rows, N, K, stride_xm,
                              stride_wn, BLOCK_M, BLOCK_N, BLOCK_K, False, DOT_PRECISION, SILU_GATE, scale_a, scale_w,
                              stride_sa, stride_sw, SCALES, MAX_IMPRECISE_ACC)
    full = local_m + BLOCK_M <= n_rows
    if USE_TMA:
        if full:  # inside the group: one TMA store (the descriptor clips columns past N)
            tile_store(out_desc, acc, 0, row0 + local_m, off_n, rows, N, 0, stride_om, BLOCK_M, BLOCK_N, True,
                       EPILOGUE_SUBTILE)
        else:
            _store_masked(out, acc, row0, local_m, off_n, n_rows, N, stride_om, BLOCK_M, BLOCK_N)
    else:
        _store_masked(out, acc, row0, local_m, off_n, n_rows, N, stride_om, BLOCK_M, BLOCK_N)


@triton.jit
def _store_masked(out, acc, row0, local_m, off_n, n_rows, N, stride_om, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr):
    """The group's rows of a tile, masked to its ``n_rows`` (the core's "segment" starting at row0)."""
    tile_store(out, acc, row0, local_m, off_n, n_rows, N, stride_om, stride_om, BLOCK_M, BLOCK_N, False)


@triton.jit
def grouped_gemm_kernel(x, w, out_desc, out, offsets, counts, E, rows, N, K, w_rows, stride_xm, stride_we,
                        stride_wn, stride_om, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        GROUP_M: tl.constexpr, E_PAD: tl.constexpr, HAS_COUNTS: tl.constexpr,
                        USE_TMA: tl.constexpr, EPILOGUE_SUBTILE: tl.constexpr, FLATTEN: tl.constexpr,
                        WARP_SPECIALIZE: tl.constexpr, DOT_PRECISION: tl.constexpr, SILU_GATE: tl.constexpr,
                        W_KN: tl.constexpr = False, scale_a=None, scale_w=None, stride_sa=None, stride_sw=None,
                        stride_swe=None, SCALES: tl.constexpr = "", MAX_IMPRECISE_ACC: tl.constexpr = None):
    """Persistent grouped GEMM over the experts' row groups (module docstring). ``N``: output columns
    (SILU_GATE: I, half of ``w_rows``); ``x``/``w``/``out_desc``: descriptors (USE_TMA) or pointers. W_KN: w is
    [E, K, N] (``w_layout="kn"``), ``stride_wn`` its K rows' stride. FP8: the core's SCALES (``tile_accumulate``),
    expert e's weight scales ``e * stride_swe`` after expert 0's."""
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    start, n, first_tile, tiles = _group_table(offsets, counts, E, rows, BLOCK_M, E_PAD, HAS_COUNTS)
    experts = tl.arange(0, E_PAD)
    tiles_m = tl.sum(tiles, 0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    for tile in tl.range(pid, tiles_m * tiles_n, num_programs, flatten=FLATTEN, warp_specialize=WARP_SPECIALIZE):
        _, pid_m, pid_n = tile_coords(tile, tiles_m, tiles_n, 1, 0, 1, GROUP_M)
        e = tl.sum((first_tile + tiles <= pid_m).to(tl.int32), 0)  # experts entirely before tile-row pid_m
        mine = experts == e
        row0 = tl.sum(tl.where(mine, start, 0), 0)
        n_rows = tl.sum(tl.where(mine, n, 0), 0)
        local_m = (pid_m - tl.sum(tl.where(mine, first_tile, 0), 0)) * BLOCK_M
        _group_tile(x, w, out_desc, out, e, row0, n_rows, local_m, pid_n, rows, N, K, w_rows, stride_xm, stride_we,
                    stride_wn, stride_om, BLOCK_M, BLOCK_N, BLOCK_K, USE_TMA, EPILOGUE_SUBTILE, DOT_PRECISION,
                    SILU_GATE, W_KN, scale_a, scale_w, stride_sa, stride_sw, stride_swe, SCALES, MAX_IMPRECISE_ACC)


@triton.jit
def _weight_grad_step(dy, x, acc, row, off_n, off_k, rows, N, K, stride_dym, stride_xm, inside,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_TMA: tl.constexpr,
                      MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr, FP8: tl.constexpr = "",
                      MAX_IMPRECISE_ACC: tl.constexpr = None):
    """``acc + dy[row : row + BLOCK_M, off_n..].T @ x[row : row + BLOCK_M, off_k..]``; MASKED: only the rows
    ``inside`` count (both operands zeroed elsewhere: a row past the group may hold anything, NaN included).
    FP8 "rows": dy and x are token-major FP8 copies (dy.T [N, rows], x.T [K, rows]: the layout FP8 wgmma takes),
    their scales applied after the loop. FP8 "blocks": dy and x high precision, each column of this step's rows
    quantised here (one scale per column per 128-token step, the step inside one expert), the step's FP8 product
    scaled and added to ``acc``."""
    if FP8 == "rows":  # (pointers only: a group starts at any row, a TMA box's inner coordinate at 16 bytes)
        m = tl.arange(0, BLOCK_M)
        ns = tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        # the tile's corner in int64, 32-bit offsets within it (int64 offsets of two tiles spill on sm_90)
        a = tl.load(dy + off_n.to(tl.int64) * stride_dym + row + (ns[:, None] * stride_dym + m[None, :]),
                    mask=(off_n + ns < N)[:, None] & (row + m < rows)[None, :], other=0.0)
        b = tl.load(x + off_k.to(tl.int64) * stride_xm + row + (ks[:, None] * stride_xm + m[None, :]),
                    mask=(off_k + ks < K)[:, None] & (row + m < rows)[None, :], other=0.0)
        if MASKED:
            a = tl.where(inside[None, :], a, tl.zeros_like(a))
            b = tl.where(inside[None, :], b, tl.zeros_like(b))
        acc = tl.dot(a, tl.trans(b), acc, max_num_imprecise_acc=MAX_IMPRECISE_ACC)
    else:  # (no early returns: the frontend compiles what follows a constexpr branch's return too)
        if USE_TMA:
            a = dy.load([row, off_n])
            b = x.load([row, off_k])
        else:
            m = (row + tl.arange(0, BLOCK_M)).to(tl.int64)
            ns = off_n + tl.arange(0, BLOCK_N)
            ks = off_k + tl.arange(0, BLOCK_K)
            a = tl.load(dy + m[:, None] * stride_dym + ns[None, :], mask=(m < rows)[:, None] & (ns < N)[None, :],
                        other=0.0)
            b = tl.load(x + m[:, None] * stride_xm + ks[None, :], mask=(m < rows)[:, None] & (ks < K)[None, :],
                        other=0.0)
        if MASKED:
            a = tl.where(inside[:, None], a, 0.0)
            b = tl.where(inside[:, None], b, 0.0)
        if FP8 == "blocks":  # the rule of kernels/fp8.py (masked rows count as 0): amax / 448 per column
            a = a.to(tl.float32)
            b = b.to(tl.float32)
            scale_a = fp8._scale_of(tl.max(tl.abs(a), axis=0))
            scale_b = fp8._scale_of(tl.max(tl.abs(b), axis=0))
            part = tl.dot(tl.trans(fp8._quantized(a, scale_a[None, :])), fp8._quantized(b, scale_b[None, :]))
            acc += part * scale_a[:, None] * scale_b[None, :]
        else:
            acc = tl.dot(tl.trans(a), b, acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def grouped_weight_grad_kernel(dy, x, dw, dw_ptr, offsets, counts, E, rows, N, K, stride_dym, stride_xm, stride_we,
                               stride_wn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                               HAS_COUNTS: tl.constexpr, USE_TMA: tl.constexpr, DOT_PRECISION: tl.constexpr,
                               scale_dy=None, scale_x=None, stride_sdy=None, stride_sx=None, FP8: tl.constexpr = "",
                               MAX_IMPRECISE_ACC: tl.constexpr = None):
    """The weights' gradient of the grouped GEMM, persistent over the tiles (e, n tile, k tile) of dw [E, N, K]:
    ``dw[e, n tile, k tile] = dy[rows of e, n tile].T @ x[rows of e, k tile]``, fp32 accumulation over the group's
    rows BLOCK_M at a time, in order (deterministic); the group's last partial step masked. An expert's tiles are
    neighbours in the order, so its rows of dy and x are read from L2 by all but the first. An empty group gives
    zeros. ``dy``/``x``/``dw``: descriptors (USE_TMA; dw's 3-D, its bounds clip each expert) or pointers.
    FP8 (``fp8_grads``): "rows", token-major FP8 dy.T [N, rows] and x.T [K, rows] (pointers; ``stride_dym`` /
    ``stride_xm`` their row strides; dw a descriptor or a pointer) with a scale per column of dy and of x
    (``scale_dy[n * stride_sdy]``, stride 0: one per tensor), applied after the loop; "blocks", high-precision dy
    and x quantised in the loop per 128-row step (BLOCK_M = 128), ``_weight_grad_step``."""
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    tiles_k = tl.cdiv(K, BLOCK_K)
    per_expert = tiles_n * tiles_k
    for tile in tl.range(pid, E * per_expert, tl.num_programs(0)):
        e = tile // per_expert
        pid_n = (tile % per_expert) // tiles_k
        off_n = pid_n * BLOCK_N
        off_k = (tile % tiles_k) * BLOCK_K
        start = tl.load(offsets + e)
        if HAS_COUNTS:
            n_rows = tl.load(counts + e)
        else:
            n_rows = tl.load(offsets + e + 1) - start
        start = tl.minimum(tl.maximum(start, 0), rows)  # clamped to the buffer, as the forward does
        n_rows = tl.minimum(tl.maximum(n_rows, 0), rows - start)
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        whole = n_rows // BLOCK_M
        for i in range(whole):
            acc = _weight_grad_step(dy, x, acc, start + i * BLOCK_M, off_n, off_k, rows, N, K, stride_dym,
                                    stride_xm, None, BLOCK_M, BLOCK_N, BLOCK_K, USE_TMA, False, DOT_PRECISION, FP8,
                                    MAX_IMPRECISE_ACC)
        if whole * BLOCK_M < n_rows:
            inside = whole * BLOCK_M + tl.arange(0, BLOCK_M) < n_rows
            acc = _weight_grad_step(dy, x, acc, start + whole * BLOCK_M, off_n, off_k, rows, N, K, stride_dym,
                                    stride_xm, inside, BLOCK_M, BLOCK_N, BLOCK_K, USE_TMA, True, DOT_PRECISION, FP8,
                                    MAX_IMPRECISE_ACC)
        ns = off_n + tl.arange(0, BLOCK_N)
        ks = off_k + tl.arange(0, BLOCK_K)
        if FP8 == "rows":  # s_dy[n] * s_x[k] of the FP8 operands' columns
            acc = acc * tl.load(scale_dy + ns * stride_sdy, mask=ns < N, other=1.0)[:, None]
            acc = acc * tl.load(scale_x + ks * stride_sx, mask=ks < K, other=1.0)[None, :]
        if USE_TMA:
            dw.store([e, off_n, off_k], acc.to(dw.dtype).reshape(1, BLOCK_N, BLOCK_K))
        else:
            dst = dw_ptr + e.to(tl.int64) * stride_we + ns.to(tl.int64)[:, None] * stride_wn + ks[None, :]
            tl.store(dst, acc.to(dw_ptr.dtype.element_ty), mask=(ns < N)[:, None] & (ks < K)[None, :])


# ----------------------------------------------------------------------------------------------- launcher
def default_config(rows, n, k, dtype, device, silu_gate=False, scales=None):
    """The GEMM core's configuration for the shape (``gemm.gemm_config``; FP8: its ``scales``). SILU_GATE: a tile
    holds a gate and an up accumulator, each half the width (FP8: the pair sized as the core sizes one tile, so
    the split of a promoted tile's columns is the pair itself)."""
    cfg = gemm_config(rows, n, k, dtype, device, scales)
    if silu_gate:
        cfg.update(BLOCK_N=max(16, cfg["BLOCK_N"] // 2), SPLIT_N=False)
    return cfg


def worst_case_tiles(rows, experts, n_out, cfg):
    """Tiles the launch may meet: every group's last tile-row can be partial, so at most cdiv(rows, BM) + E."""
    return (cdiv(rows, cfg["BLOCK_M"]) + experts) * cdiv(n_out, cfg["BLOCK_N"])


def launch_grouped_gemm(x, w, offsets, counts, out, cfg, silu_gate, w_kn=False, scales=None):
    """The kernel on checked inputs: x [rows, K], w [E, w_rows, K], out [rows, N] (N = w_rows, or w_rows / 2
    with ``silu_gate``); ``w_kn``: w [E, K, N]; ``scales``: FP8 operands' (``expert_scales``)."""
    rows, k = x.shape
    experts, w_rows = w.shape[:2]
    n_out = out.shape[1]
    w_view = w if w_kn else w.view(experts * w_rows, k)
    use_tma = cfg.get("use_tma") is not False and k > 0 and tma_compatible(x, w_view, out)  # None/True: if allowed
    out3 = out.view(1, rows, n_out)
    if use_tma:
        bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
        x_arg, w_arg = tma_descriptor(x, [bm, bk]), tma_descriptor(w_view, [1, bk, bn] if w_kn else b_block(cfg))
        out_arg = tma_descriptor(out3, c_block(cfg))
    else:
        x_arg, w_arg, out_arg = x, w, out
    programs = max(1, min(cfg.get("num_programs") or default_num_programs(x.device, cfg),
                          worst_case_tiles(rows, experts, n_out, cfg)))
    fp8_args = {} if scales is None else dict(scales.kernel_args(cfg), stride_swe=scales.w.numel() // experts)
    grouped_gemm_kernel[(programs,)](
        x_arg, w_arg, out_arg, out, offsets, offsets if counts is None else counts, experts, rows, n_out, k, w_rows,
        x.stride(0), w.stride(0), w.stride(1), out.stride(0),
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], GROUP_M=cfg["GROUP_M"],
        E_PAD=max(2, next_power_of_2(experts)), HAS_COUNTS=counts is not None, USE_TMA=use_tma,
        EPILOGUE_SUBTILE=bool(cfg["EPILOGUE_SUBTILE"]) and use_tma, FLATTEN=cfg["FLATTEN"],
        WARP_SPECIALIZE=cfg["WARP_SPECIALIZE"], DOT_PRECISION=dot_precision(x.dtype), SILU_GATE=silu_gate,
        W_KN=w_kn, num_stages=cfg["num_stages"], num_warps=cfg["num_warps"], **fp8_args)
    return out


_CONFIGS = shmem.Plans("grouped_gemm")  # (rows, E, N, K, dtype, device, silu_gate, w_kn, FP8 key) -> tuned config


def _tuned_config(rows, experts, n_out, k, dtype, device, silu_gate, w_kn, scales=None, out_dtype=None):
    """On GPU the GEMM core's candidates timed with evenly filled groups (the op itself cannot see the real
    sizes without a sync); elsewhere the default."""
    w_rows = 2 * n_out if silu_gate else n_out
    base = default_config(rows, n_out, k, dtype, device, silu_gate, scales)
    if device.type != "cuda":
        return base
    cands = []
    for c in gemm_candidates(rows, n_out, k, dtype, device, scales):
        if c.get("WARP_SPECIALIZE") or c.get("FLATTEN"):  # the store branch and the group look-up in the loop
            continue  # are outside what triton's warp specialisation and loop flattening take (3.6 fails)
        if silu_gate:  # a tile holds a gate and an up accumulator: half the width
            c = {**c, "BLOCK_N": max(16, c["BLOCK_N"] // 2), "SPLIT_N": False}
        if fp8.takes(scales, c):
            cands.append(c)

    def make_runner():  # device time, from CUDA graphs (as gemm's)
        x = torch.randn((rows, k), device=device).to(dtype)
        w = (torch.randn((experts, k, n_out) if w_kn else (experts, w_rows, k), device=device) / k ** 0.5).to(dtype)
        offsets = torch.linspace(0, rows, experts + 1, device=device).to(torch.int32)
        out = torch.empty((rows, n_out), dtype=out_dtype or dtype, device=device)
        probe = None if scales is None else scales.probe()
        work = hardware.work_us(2 * rows * w_rows * k, (x.numel() + w.numel()) * dtype.itemsize
                                + out.numel() * out.element_size(), dtype)
        return autotune.graph_runner(lambda cfg: launch_grouped_gemm(x, w, offsets, None, out, cfg, silu_gate, w_kn,
                                                                     probe), autotune.graph_calls(work))

    key = dict(rows=rows, experts=experts, n=w_rows, k=k, dtype=str(dtype).replace("torch.", ""),
               silu_gate=silu_gate, **({"w_layout": "kn"} if w_kn else {}), **fp8.describe(scales, out_dtype))
    return autotune.choose("grouped_gemm", key, autotune.dedupe(cands), make_runner, default=base, collective=False)


# ----------------------------------------------------------------------------------------------- the op
def _check_inputs(x, w, expert_offsets, expert_counts, activation, w_layout="nk", scale_x=None, scale_w=None,
                  scaling=None, out_dtype=None, fast_accum=False, quantize=None, fp8_grads=False):
    """A call's FP8 mode: ``(expert_scales, the result's dtype)`` for FP8 operands, ``(None, x's dtype)``
    otherwise (``quantize``: the op quantises them; ``fp8_grads``: its backward too); TypeError / ValueError for
    what the op cannot take."""
    for name, t in (("x", x), ("w", w)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    given = fp8.keywords_given(x, w, scale_x, scale_w, scaling, out_dtype, fast_accum, quantize=quantize,
                               names=("x", "w", "scale_x", "scale_w"))
    fp8.check_fp8_grads(fp8_grads, quantize)
    if given and w_layout != "nk":  # (quantize= takes "kn" too: it quantises w's transposed copy)
        raise ValueError("FP8 grouped_gemm takes w_layout='nk' (w [E, N, K], scaled along K)")
    if not given and (x.dtype not in SUPPORTED_DTYPES or w.dtype != x.dtype):
        raise TypeError(f"x and w must share one dtype of float16/bfloat16 (float32 for tests; FP8 with scale_x= and "
                        f"scale_w=), got {x.dtype} and {w.dtype}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if w_layout not in W_LAYOUTS:
        raise ValueError(f"w_layout must be one of {W_LAYOUTS}, got {w_layout!r}")
    k_dim = 2 if w_layout == "nk" else 1
    if x.dim() != 2 or w.dim() != 3 or w.shape[k_dim] != x.shape[1]:
        expected = "[E, N, K]" if w_layout == "nk" else "[E, K, N] (w_layout='kn')"
        raise ValueError(f"expected x [rows, K] and w {expected}; got {list(x.shape)} and {list(w.shape)}")
    if activation == "silu_gate" and w_layout != "nk":
        raise ValueError("activation='silu_gate' takes w [E, 2I, K] (w_layout='nk')")
    if activation == "silu_gate" and w.shape[1] % 2:
        raise ValueError(f"activation='silu_gate' takes w [E, 2I, K] (gate over up), got {list(w.shape)}")
    if not x.is_contiguous() or not w.is_contiguous():
        raise ValueError("x and w must be contiguous (call .contiguous() first)")
    _check_groups(x, w.shape[0], expert_offsets, expert_counts, ("w", w))
    if not given:
        return None, x.dtype
    return expert_scales(x, w, scale_x, scale_w, scaling, fast_accum), fp8.out_dtype_of(out_dtype)


def expert_scales(x, w, scale_x, scale_w, scaling=None, fast_accum=False):
    """``fp8.Scales`` of FP8 ``x`` [rows, K] and a stack of FP8 weights ``w`` [E, N, K]: ``scale_x`` as the GEMM
    core's A scales ([1], [rows, 1], [rows, ceil(K/128)]), ``scale_w`` one weight's scales per expert ([E],
    [E, N, 1], [E, ceil(N/128), ceil(K/128)]: ``fp8.quantize_stack``), held as the rows of all experts' scales."""
    if not isinstance(scale_w, torch.Tensor):
        raise TypeError(f"FP8 operands need scale_w, a float32 tensor; got {type(scale_w).__name__}")
    experts = w.shape[0]
    if scale_w.dim() == 0 or scale_w.shape[0] != experts:
        raise ValueError(f"scale_w holds one weight's scales per expert ([E], [E, N, 1] or [E, ceil(N/128), "
                         f"ceil(K/128)] for w {list(w.shape)}), got {list(scale_w.shape)}")
    first = w[0] if experts else w.new_empty((w.shape[1], w.shape[2]))
    one = scale_w[0] if experts else scale_w.new_empty(scale_w.shape[1:])
    per = fp8.check_scales(x, first, scale_x, one, scaling, fast_accum, what=("x", "w[e]"))
    stacked = scale_w.contiguous()
    stacked = stacked.reshape(experts) if per.mode == "tensor" else stacked.reshape(-1, per.w.shape[-1])
    return fp8.Scales(per.mode, per.a, stacked, per.fast_accum)


def _check_groups(x, experts, expert_offsets, expert_counts, operand):
    """The group tensors for ``experts`` experts, and they and ``operand`` (name, tensor) on x's device."""
    if not isinstance(expert_offsets, torch.Tensor):
        raise TypeError(f"expert_offsets must be a torch.Tensor, got {type(expert_offsets).__name__}")
    if expert_counts is not None and not isinstance(expert_counts, torch.Tensor):
        raise TypeError(f"expert_counts must be a torch.Tensor or None, got {type(expert_counts).__name__}")
    for name, t, size in (("expert_offsets", expert_offsets, experts + 1), ("expert_counts", expert_counts, experts)):
        if t is None:
            continue
        if t.dtype != torch.int32:
            raise TypeError(f"{name} must be int32 (as ep_dispatch returns it), got {t.dtype}")
        if t.dim() != 1 or t.shape[0] != size or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous [{size}] tensor for {experts} experts, got "
                             f"{list(t.shape)}")
    for name, t in (operand, ("expert_offsets", expert_offsets), ("expert_counts", expert_counts)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device}")


def _output_shape(x, w, activation, w_layout="nk"):
    if w_layout == "kn":
        return x.shape[0], w.shape[2]
    return x.shape[0], w.shape[1] // 2 if activation == "silu_gate" else w.shape[1]


def grouped_gemm(x, w, expert_offsets, expert_counts=None, activation="none", out=None, config=None, *,
                 w_layout="nk", scale_x=None, scale_w=None, scaling=None, out_dtype=None, fast_accum=False,
                 quantize=None, fp8_grads=False):
    """``out[rows of e] = x[rows of e] @ w[e].T`` for every expert e, group boundaries read on the device.

    ``x`` [rows, K] and ``w`` [E, N, K] (float16/bfloat16; float32 for tests), contiguous, on one device (CUDA, or
    CPU under the Triton interpreter). ``w_layout="kn"``: ``w`` is [E, K, N] (``torch._grouped_mm``'s layout)
    and ``out[rows of e] = x[rows of e] @ w[e]``, read as it lies (no transposed copy; activation "none").
    ``expert_offsets`` int32 [E+1]: group e starts at row ``expert_offsets[e]``
    (``expert_offsets[E]``: the end), e.g. ``EpDispatchResult.expert_offsets``. ``expert_counts`` int32 [E]
    (optional): group e is ``[offsets[e], offsets[e] + counts[e])``, so alignment padding after a group's rows
    is skipped; without it a group runs to the next offset. ``activation="silu_gate"``: ``w`` [E, 2I, K] holds
    each expert's gate rows over its up rows and ``out`` [rows, I] gets ``silu(x @ gate.T) * (x @ up.T)``.
    Rows outside every group are left untouched (``out=None``: uninitialised there). ``config``: overrides of
    ``default_config``. No host sync: CUDA-graph capturable after a first call of the shape (tuning).

    FP8 (the GEMM core's modes, ``kernels/fp8.py``): ``x`` and ``w`` float8_e4m3fn (or float8_e5m2 for both) with
    float32 ``scale_x`` (x's, as ``gemm``'s scale_a: [1], [rows, 1] or 1x128 groups [rows, ceil(K/128)], which
    ``ep_dispatch(quant="fp8")`` delivers as ``recv.scales``) and ``scale_w`` (each expert's: [E], [E, N, 1] or
    128x128 blocks [E, ceil(N/128), ceil(K/128)], as ``fp8.quantize_stack`` gives them); ``scaling`` names the
    mode (None: the shapes do), the result in ``out_dtype`` (bfloat16 unless given), ``fast_accum`` as in ``gemm``;
    w_layout "nk". ``quantize`` ("tensor", "row", "block"; FP8 training's forward): high-precision x and w
    quantised in the call (x by ``fp8.quantize_fp8``: 1x128 groups for "block", the rows inside the groups only
    for "tensor"; w by ``fp8.quantize_stack``, each expert along K: "kn", the copy of its transpose, as
    ``fp8.quantize_weight(w, mode, transposed=True)`` keeps it), then the FP8 op, the result in x's dtype.

    Also ``torch.ops.triton_dist.grouped_gemm(x, w, expert_offsets, expert_counts, activation, w_layout,
    quantize, scale_x, scale_w, scaling, out_dtype, fast_accum, fp8_grads)``. Autograd: an ``x`` or ``w`` that
    requires grad goes through the torch op; the backward is the grouped GEMM of the other layout on the same weight
    (``grad_x``) and ``grouped_weight_grad`` (``grad_w``), ``kernels/autograd.py``; rows outside every group get
    zero gradients; with ``quantize`` the same backward on the unquantised x and w (straight-through, gradients
    in x's dtype). ``fp8_grads=True`` (with ``quantize`` only: ValueError otherwise; a bool: TypeError otherwise):
    both backward GEMMs in FP8 too, each operand quantised in ``quantize``'s mode along that GEMM's reduction
    (DeepSeek-V3's recipe, ``kernels/autograd.py``): grad_x the op itself with ``quantize`` on the other layout
    (the gradient along N, each expert's weight transposed), grad_w ``grouped_weight_grad(..., quantize)`` (along
    each expert's tokens). With grad, ``silu_gate`` keeps the pre-activation [rows, 2I] (as Megatron keeps SwiGLU's
    input) and gates it with the ``silu_gate`` op, so the backward computes no GEMM again (the torch op called
    with "silu_gate" keeps only x and recomputes it).
    """
    fp8_kw = dict(scale_x=scale_x, scale_w=scale_w, scaling=scaling, out_dtype=out_dtype, fast_accum=fast_accum,
                  quantize=quantize)
    scales, result_dtype = _check_inputs(x, w, expert_offsets, expert_counts, activation, w_layout, **fp8_kw,
                                         fp8_grads=fp8_grads)
    if library.needs_grad(x, w):
        if out is not None:
            raise ValueError("grouped_gemm: out= is for calls without grad (under torch.no_grad())")
        # (config=: the op's forward, eagerly) training keeps the SiLU gate's pre-activation: the backward runs no
        # GEMM again
        gated = activation == "silu_gate"
        y = library.with_caller_config("grouped_gemm", config, lambda: torch.ops.triton_dist.grouped_gemm(
            x, w, expert_offsets, expert_counts, "none" if gated else activation, w_layout, quantize=quantize,
            fp8_grads=fp8_grads))
        return silu_gate(y) if gated else y
    if config is None and out is None and hardware.compiling():
        return torch.ops.triton_dist.grouped_gemm(x, w, expert_offsets, expert_counts, activation, w_layout,
                                                  **fp8_kw)
    return _grouped_gemm(x, w, expert_offsets, expert_counts, activation, out, config, w_layout, scales, result_dtype,
                         quantize)


def _quantized(x, w, expert_offsets, expert_counts, mode, w_layout="nk"):
    """(x8, w8, scales) of high-precision x and w in ``mode`` (``grouped_gemm``'s ``quantize``): dynamic scales,
    on the device. "tensor": x's amax over the rows inside the groups only (the others may hold anything). w8 an
    "nk" stack either way ("kn": the FP8 copy of each expert's transpose, so that its scales run along K)."""
    if mode == "tensor":
        x = torch.where(group_rows(x.shape[0], expert_offsets, expert_counts, x.device)[:, None], x, 0)
    x8, scale_x = fp8.quantize_fp8(x, fp8.a_scaling(mode))
    w8, scale_w = fp8.quantize_weight(w, mode, transposed=w_layout == "kn")
    return x8, w8, expert_scales(x8, w8, scale_x, scale_w, mode)


def _grouped_gemm(x, w, expert_offsets, expert_counts, activation, out, config, w_layout="nk", scales=None,
                  result_dtype=None, quantize=None):
    """The op on checked inputs (FP8: their ``scales``, the result in ``result_dtype``; ``quantize``: x and w
    quantised here first)."""
    shape = _output_shape(x, w, activation, w_layout)
    if quantize is not None:
        x, w, scales = _quantized(x, w, expert_offsets, expert_counts, quantize, w_layout)
        w_layout = "nk"
    check_launchable(x, "x and w")
    dtype = result_dtype or x.dtype
    if out is None:
        out = torch.empty(shape, dtype=dtype, device=x.device)
    elif (not isinstance(out, torch.Tensor) or tuple(out.shape) != shape or out.dtype != dtype
          or out.device != x.device or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous {dtype} tensor of shape {list(shape)} on {x.device}")
    rows, k = x.shape
    experts = w.shape[0]
    if rows == 0 or shape[1] == 0 or experts == 0:
        return out
    silu_gate, w_kn = activation == "silu_gate", w_layout == "kn"
    fp8_key = fp8.plan_key(scales, dtype)
    if config is None:
        key = (rows, experts, shape[1], k, x.dtype, x.device, silu_gate, w_kn, *fp8_key)
        cfg = _CONFIGS.get(key, lambda: _tuned_config(rows, experts, shape[1], k, x.dtype, x.device, silu_gate,
                                                      w_kn, scales, dtype if scales is not None else None))
    else:
        cfg = check_tiles(autotune.with_overrides(default_config(rows, shape[1], k, x.dtype, x.device, silu_gate,
                                                                 scales), config))
        fp8.check_block_k(scales, cfg)
    return launch_grouped_gemm(x, w, expert_offsets, expert_counts, out, cfg, silu_gate, w_kn, scales)


# ----------------------------------------------------------------------------------------------- weight gradient
def weight_grad_candidates(dtype, device, quantize=None):
    """The weight-gradient kernel's tiles (BLOCK_N x BLOCK_K output tiles, BLOCK_M rows a step); the first: the
    default. Under the interpreter: small tiles. FP8 (``quantize``): one candidate, not timed yet, 128 rows a step
    ("block": its quantisation groups), output tiles that do not spill (docs/design/fp8.md)."""
    if quantize is not None:
        if device.type != "cuda":
            return [dict(BLOCK_M=128 if quantize == "block" else 16, BLOCK_N=16, BLOCK_K=16, num_warps=4,
                         num_stages=1)]
        return [dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3)]
    if device.type != "cuda":
        return [dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, num_warps=4, num_stages=1)]
    if dtype == torch.float32:
        return [dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3)]
    return [dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=4),
            dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=256, num_warps=8, num_stages=3),
            dict(BLOCK_M=64, BLOCK_N=256, BLOCK_K=128, num_warps=8, num_stages=3),
            dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=3),
            dict(BLOCK_M=32, BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=5)]


def launch_weight_grad(dy, x, offsets, counts, dw, cfg, fp8_rows=None):
    """``grouped_weight_grad_kernel`` on contiguous dy [rows, N], x [rows, K], dw [E, N, K]. ``fp8_rows``
    (FP8 "rows"): ``(scale_dy, scale_x)`` of token-major FP8 dy.T [N, rows] and x.T [K, rows] given as ``dy``
    and ``x``; ``cfg["FP8"] == "blocks"``: high-precision dy and x quantised in the kernel."""
    experts, n, k = dw.shape
    rows = dy.shape[1] if fp8_rows else dy.shape[0]
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    use_tma = cfg.get("use_tma") is not False and tma_compatible(dy, x, dw)  # None / True: when allowed
    if use_tma:
        args = (dy if fp8_rows else tma_descriptor(dy, [bm, bn]), x if fp8_rows else tma_descriptor(x, [bm, bk]),
                tma_descriptor(dw, [1, bn, bk]))  # (FP8 "rows": dy and x by pointers, the kernel's docstring)
    else:
        args = dy, x, dw
    fp8_args = {}
    if fp8_rows:
        scale_dy, scale_x = fp8_rows
        fp8_args = dict(scale_dy=scale_dy, scale_x=scale_x, stride_sdy=int(scale_dy.numel() > 1),
                        stride_sx=int(scale_x.numel() > 1), FP8="rows", MAX_IMPRECISE_ACC=bm)
    elif cfg.get("FP8"):
        fp8_args = dict(FP8=cfg["FP8"])
    tiles = experts * cdiv(n, bn) * cdiv(k, bk)
    grouped_weight_grad_kernel[(max(1, min(default_num_programs(dy.device), tiles)),)](
        *args, dw, offsets, offsets if counts is None else counts, experts, rows, n, k, dy.stride(0), x.stride(0),
        dw.stride(0), dw.stride(1), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, HAS_COUNTS=counts is not None,
        USE_TMA=use_tma, DOT_PRECISION=dot_precision(x.dtype), num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"], **fp8_args)
    return dw


_WEIGHT_GRAD_CONFIGS = shmem.Plans("grouped_weight_grad")  # (rows, E, N, K, dtype, device) -> tuned config


def _tuned_weight_grad_config(rows, experts, n, k, dtype, device):
    """The candidates timed with evenly filled groups (as ``_tuned_config``)."""
    cands = weight_grad_candidates(dtype, device)

    def make_runner():
        dy = torch.randn((rows, n), device=device).to(dtype)
        x = torch.randn((rows, k), device=device).to(dtype)
        offsets = torch.linspace(0, rows, experts + 1, device=device).to(torch.int32)
        dw = torch.empty((experts, n, k), dtype=dtype, device=device)
        work = hardware.work_us(2 * rows * n * k, (dy.numel() + x.numel() + dw.numel()) * dtype.itemsize, dtype)
        return autotune.graph_runner(lambda cfg: launch_weight_grad(dy, x, offsets, None, dw, cfg),
                                     autotune.graph_calls(work))

    key = dict(rows=rows, experts=experts, n=n, k=k, dtype=str(dtype).replace("torch.", ""))
    return autotune.choose("grouped_weight_grad", key, cands, make_runner, default=cands[0], collective=False)


def grouped_weight_grad(dy, x, expert_offsets, expert_counts, experts, quantize=None):
    """``dw[e] = dy[rows of e].T @ x[rows of e]`` for every expert e: [E, N, K] for dy [rows, N], x [rows, K] (the
    grouped GEMM's weight gradient; groups as ``grouped_gemm`` reads them, on the device; rows outside every group
    are never read). Also ``torch.ops.triton_dist.grouped_weight_grad``.

    ``quantize`` ("tensor", "row", "block"; FP8 training's ``fp8_grads``): an FP8 product, dy and x quantised
    along the tokens (this GEMM's reduction) with a scale per column: "row", each column of dy and of x over the
    rows inside the groups; "tensor", one for dy and one for x over those rows; "block", each column over each
    128-row step of an expert's rows (the steps start at the group's first row, so none straddles two experts),
    quantised in the kernel. The result in x's dtype."""
    if hardware.compiling():
        return torch.ops.triton_dist.grouped_weight_grad(dy, x, expert_offsets, expert_counts, experts, quantize)
    for name, t in (("dy", dy), ("x", x)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            raise ValueError(f"grouped_weight_grad: {name} must be a 2-D tensor")
    if dy.shape[0] != x.shape[0] or dy.dtype != x.dtype or x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"grouped_weight_grad: dy {list(dy.shape)} {dy.dtype} and x {list(x.shape)} {x.dtype} "
                         "must share rows and a dtype of float16/bfloat16 (float32 for tests)")
    fp8.check_mode(quantize)
    _check_groups(x, experts, expert_offsets, expert_counts, ("dy", dy))
    rows, n = dy.shape
    k = x.shape[1]
    dw = torch.empty((experts, n, k), dtype=x.dtype, device=x.device)
    if experts == 0 or n == 0 or k == 0:
        return dw
    if rows == 0:
        return dw.zero_()
    check_launchable(x, "dy and x")
    dy, x = dy.contiguous(), x.contiguous()
    if quantize is not None:
        fp8.check_device(x)
        cfg = weight_grad_candidates(x.dtype, x.device, quantize)[0]
        if quantize == "block":
            return launch_weight_grad(dy, x, expert_offsets, expert_counts, dw, dict(cfg, FP8="blocks"))
        # token-major FP8 copies, a scale per column over the rows inside the groups (the others may hold anything),
        # quantised from the row-major tensors as they lie (no high-precision transposed copies)
        inside = group_rows(rows, expert_offsets, expert_counts, x.device)[:, None]
        dy8, scale_dy = fp8.quantize_fp8(torch.where(inside, dy, 0), quantize, transposed=True)
        x8, scale_x = fp8.quantize_fp8(torch.where(inside, x, 0), quantize, transposed=True)
        return launch_weight_grad(dy8, x8, expert_offsets, expert_counts, dw, cfg, (scale_dy, scale_x))
    key = (rows, experts, n, k, x.dtype, x.device)
    cfg = _WEIGHT_GRAD_CONFIGS.get(key, lambda: _tuned_weight_grad_config(rows, experts, n, k, x.dtype, x.device))
    return launch_weight_grad(dy, x, expert_offsets, expert_counts, dw, cfg)


def grouped_gemm_torch(x, w, expert_offsets, expert_counts=None, activation="none", out=None, w_layout="nk"):
    """The same product in torch, one ``matmul`` per expert (syncs: reads the offsets on the host): the
    reference of the tests and a baseline of the benchmark. Rows outside every group: zeros unless ``out``."""
    offsets = expert_offsets.tolist()
    counts = expert_counts.tolist() if expert_counts is not None else [b - a for a, b in zip(offsets, offsets[1:])]
    shape = _output_shape(x, w, activation, w_layout)
    out = torch.zeros(shape, dtype=x.dtype, device=x.device) if out is None else out
    for e, (start, n) in enumerate(zip(offsets, counts)):
        h = x[start:start + n] @ (w[e] if w_layout == "kn" else w[e].T)
        if activation == "silu_gate":
            h = torch.nn.functional.silu(h[:, :shape[1]]) * h[:, shape[1]:]
        out[start:start + n] = h
    return out


def _grouped_gemm_op(x, w, expert_offsets, expert_counts=None, activation="none", w_layout="nk", quantize=None,
                     scale_x=None, scale_w=None, scaling=None, out_dtype=None, fast_accum=False, fp8_grads=False):
    fp8_kw = dict(scale_x=scale_x, scale_w=scale_w, scaling=scaling, out_dtype=out_dtype, fast_accum=fast_accum,
                  quantize=quantize, fp8_grads=fp8_grads)  # (fp8_grads: the backward's business, autograd.py)
    scales, result_dtype = _check_inputs(x, w, expert_offsets, expert_counts, activation, w_layout, **fp8_kw)
    return _grouped_gemm(x, w, expert_offsets, expert_counts, activation, None, library.caller_config("grouped_gemm"),
                         w_layout, scales, result_dtype, quantize)


def _grouped_gemm_fake(x, w, expert_offsets, expert_counts=None, activation="none", w_layout="nk", quantize=None,
                       scale_x=None, scale_w=None, scaling=None, out_dtype=None, fast_accum=False, fp8_grads=False):
    _, result_dtype = _check_inputs(x, w, expert_offsets, expert_counts, activation, w_layout, scale_x, scale_w,
                                    scaling, out_dtype, fast_accum, quantize, fp8_grads)
    return x.new_empty(_output_shape(x, w, activation, w_layout), dtype=result_dtype)


library.define('grouped_gemm(Tensor x, Tensor w, Tensor expert_offsets, Tensor? expert_counts=None, '
               'str activation="none", str w_layout="nk", str? quantize=None, Tensor? scale_x=None, '
               'Tensor? scale_w=None, str? scaling=None, ScalarType? out_dtype=None, bool fast_accum=False, '
               'bool fp8_grads=False) -> Tensor',
               _grouped_gemm_op, _grouped_gemm_fake)
library.define("grouped_weight_grad(Tensor dy, Tensor x, Tensor expert_offsets, Tensor? expert_counts, int experts, "
               "str? quantize=None) -> Tensor", grouped_weight_grad,
               lambda dy, x, offsets, counts, experts, quantize=None: x.new_empty((experts, dy.shape[1], x.shape[1])))


def group_rows(rows, expert_offsets, expert_counts, device):
    """[rows] bool: the rows inside some expert's group (on the device, no sync)."""
    r = torch.arange(rows, device=device)[:, None]
    start = expert_offsets[:-1].long()[None, :]
    n = (expert_counts if expert_counts is not None else expert_offsets[1:] - expert_offsets[:-1]).long()[None, :]
    return ((r >= start) & (r < start + n)).any(dim=1)

__all__ = ["grouped_gemm", "grouped_gemm_kernel", "grouped_gemm_torch", "grouped_weight_grad",
           "grouped_weight_grad_kernel", "default_config", "ACTIVATIONS"]
