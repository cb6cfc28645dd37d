"""FP8 in triton_dist: the formats, the three scaling modes and their scale layouts, and the quantisation rule.

Operands are ``float8_e4m3fn`` (or ``float8_e5m2``: one format for both operands), scales float32, results
bfloat16 / float16 / float32. ``out = (A * scale_a) @ (W * scale_w).T`` accumulated in fp32 (``torch._scaled_mm``
for the first two modes), for A [M, K] and W [N, K]:

    scaling   scale_a                      scale_w                          applied to the fp32 accumulator
    "tensor"  [1]                          [1]                              after the K loop (epilogue)
    "row"     [M, 1]: one per row (token)  [N, 1]: one per output channel   after the K loop (epilogue)
    "block"   [M, ceil(K/128)]: one per    [ceil(N/128), ceil(K/128)]: one  to each 128-wide K block's product,
              1x128 group of A             per 128x128 block of W           then summed (DeepSeek-V3)

A ragged K (or N) has a short last group (block); its scale covers what is there. ``Scales`` carries a call's
checked scales to the kernels (``gemm.tile_accumulate`` applies them).

FP8 is a mode of the GEMM ops, not a set of its own: ``gemm``, ``ag_gemm`` and ``gemm_rs`` take FP8 operands with
the keywords ``scale_a``, ``scale_w``, ``scaling``, ``out_dtype``, ``fast_accum`` (``scaled_operands`` reads them),
and ``scaled_gemm`` / ``scaled_ag_gemm`` / ``scaled_gemm_rs`` are the same ops with the scales required.

Quantisation (``quantize_fp8``, ``quantize``, ``ep_dispatch(quant="fp8")``): per group of values, scale =
amax(|x|) / 448 (the largest e4m3 value) and q = x / scale rounded to the nearest e4m3 value (ties to even); a group
of zeros gets scale 1.

FP8 training (the ops' ``quantize=`` mode, the ``nn`` layers' ``fp8=``): ag_gemm, gemm_rs and grouped_gemm take
bf16 / fp16 / fp32 operands and quantise them in the call (``quantize_operands``, ``quantize_stack`` for a stack of
expert weights: dynamic scales of this rank's operands, by ``quantize_fp8``'s kernels on the device), run the FP8
op, and differentiate straight-through: their backward is the high-precision one (``kernels/autograd.py``) on the
unquantised operands. With ``fp8_grads=True`` (the layers' ``fp8_grads``) the
backward's GEMMs are FP8 too (DeepSeek-V3's recipe, e4m3 throughout): each quantises its own operands (the output
gradient and the saved a or w, laid out for that GEMM) along its reduction dimension, in the forward's mode.
"""

import dataclasses
import weakref

import torch
import triton
import triton.language as tl

from .. import hardware
from ..hardware import cdiv

GROUP = 128  # values per scale along K (1 x 128 groups of A, 128 x 128 blocks of W)
E4M3_MAX = 448.0
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
MODES = ("tensor", "row", "block")
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# ----------------------------------------------------------------------------------------------- device side
@triton.jit
def round_to_e4m3(x):
    """fp32 ``x`` (|x| <= 448) rounded to the nearest e4m3 value (ties to even), still in fp32, so that a conversion
    after it is exact on every backend (the interpreter's drops a carry into the exponent: 124.3 -> 64): normal
    values keep 3 mantissa bits (integer rounding of the fp32 bits), subnormal ones (|x| < 2**-6) are whole
    multiples of 2**-9 (an fp32 add of 2**23 rounds them there)."""
    bits = x.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)  # 3 mantissa bits
    mag = tl.abs(x)
    tiny = ((mag * 512.0 + 8388608.0) - 8388608.0) / 512.0  # subnormals: whole multiples of 2**-9
    # x's sign bit on the rounded magnitude (``-tiny`` is ``0 - tiny``: +0 for a negative x that rounds to zero)
    signed_tiny = (tiny.to(tl.int32, bitcast=True) | ((bits >> 31) << 31)).to(tl.float32, bitcast=True)
    return tl.where(mag < 0.015625, signed_tiny, normal)


@triton.jit
def to_e4m3(x):
    """fp32 ``x`` (|x| <= 448) -> float8e4nv, rounded to the nearest e4m3 value (ties to even): ``round_to_e4m3``,
    then an exact conversion."""
    return round_to_e4m3(x).to(tl.float8e4nv)


@triton.jit
def _scale_of(amax):
    """The quantisation scale of a group whose largest magnitude is ``amax``: amax / 448, or 1 for zeros."""
    return tl.where(amax > 0, tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32)), 1.0)


@triton.jit
def _quantized(x, scale):
    """fp32 ``x`` / ``scale`` as float8e4nv (clamped to +-448, rounded to the nearest e4m3 value)."""
    return to_e4m3(tl.clamp(tl.math.div_rn(x, scale), -448.0, 448.0))


@triton.jit
def quantize_groups(x, BT: tl.constexpr, BH: tl.constexpr):
    """A [BT, BH] tile (BH a multiple of 128; values outside the tensor loaded as 0) in 1x128 groups ->
    (q [BT, BH] float8e4nv, scales [BT, BH // 128] fp32), by the rule of the module docstring (IEEE divisions)."""
    g = tl.reshape(x.to(tl.float32), (BT, BH // 128, 128))
    scale = _scale_of(tl.max(tl.abs(g), axis=2))
    return tl.reshape(_quantized(g, scale[:, :, None]), (BT, BH)), scale


@triton.jit
def quantize_fp8_kernel(x, q, scales, T, H, BT: tl.constexpr, BH: tl.constexpr, K_MAJOR: tl.constexpr = False):
    """Program (i, j): rows [i * BT, +BT) and columns [j * BH, +BH) of x [T, H] -> q [T, H], scales [T, G]
    (K_MAJOR: laid out [G, T], a group's scales of consecutive rows side by side)."""
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    h = tl.program_id(1) * BH + tl.arange(0, BH)
    m = (t < T)[:, None] & (h < H)[None, :]
    offs = t.to(tl.int64)[:, None] * H + h[None, :]
    qt, st = quantize_groups(tl.load(x + offs, mask=m, other=0.0), BT, BH)
    tl.store(q + offs, qt, mask=m)
    groups = tl.cdiv(H, 128)
    g = tl.program_id(1) * (BH // 128) + tl.arange(0, BH // 128)
    if K_MAJOR:
        tl.store(scales + g.to(tl.int64)[None, :] * T + t[:, None], st,
                 mask=(t < T)[:, None] & (g < groups)[None, :])
    else:
        tl.store(scales + t.to(tl.int64)[:, None] * groups + g[None, :], st,
                 mask=(t < T)[:, None] & (g < groups)[None, :])


@triton.jit
def quantize_blocks_kernel(x, q, scales, T, H, BLOCK: tl.constexpr):
    """Program (i, j): block [i * BLOCK, +BLOCK) x [j * BLOCK, +BLOCK) of x [T, H] -> q, scales[i, j] (W's "block"
    scales: one per 128x128 block)."""
    t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    h = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = (t < T)[:, None] & (h < H)[None, :]
    offs = t.to(tl.int64)[:, None] * H + h[None, :]
    tile = tl.load(x + offs, mask=m, other=0.0).to(tl.float32)
    scale = _scale_of(tl.max(tl.max(tl.abs(tile), axis=1), axis=0))
    tl.store(q + offs, _quantized(tile, scale), mask=m)
    tl.store(scales + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1), scale)


@triton.jit
def quantize_rows_kernel(x, q, scales, T, H, BT: tl.constexpr, BH: tl.constexpr):
    """Program i: rows [i * BT, +BT) of x [T, H] -> q, scales [T, 1] ("row"): each row's amax in a first sweep
    over H, the quantisation in a second (the rows read twice, the second time mostly from L2)."""
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    rows = t.to(tl.int64)[:, None] * H
    amax = tl.zeros((BT,), dtype=tl.float32)
    for h0 in range(0, H, BH):
        h = h0 + tl.arange(0, BH)
        m = (t < T)[:, None] & (h < H)[None, :]
        amax = tl.maximum(amax, tl.max(tl.abs(tl.load(x + rows + h[None, :], mask=m, other=0.0).to(tl.float32)),
                                       axis=1))
    scale = _scale_of(amax)
    for h0 in range(0, H, BH):
        h = h0 + tl.arange(0, BH)
        m = (t < T)[:, None] & (h < H)[None, :]
        tile = tl.load(x + rows + h[None, :], mask=m, other=0.0).to(tl.float32)
        tl.store(q + rows + h[None, :], _quantized(tile, scale[:, None]), mask=m)
    tl.store(scales + t, scale, mask=t < T)


@triton.jit
def amax_kernel(x, amax, numel, BLOCK: tl.constexpr):
    """``amax[i]`` = max(amax[i], |x| over this program's BLOCK values of tensor ``i = program_id(1)``, the i-th
    ``numel`` values of x (a stack of tensors: one scale each). amax starts at 0: magnitudes compare as their
    bits, so an integer atomic max is exact and order-free."""
    i = tl.program_id(1)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    values = tl.load(x + i.to(tl.int64) * numel + offs, mask=offs < numel, other=0.0)
    part = tl.max(tl.abs(values.to(tl.float32)), axis=0)
    tl.atomic_max(amax + i, part.to(tl.int32, bitcast=True))


@triton.jit
def quantize_tensor_kernel(x, q, amax, scale, numel, BLOCK: tl.constexpr):
    """Tensor ``i = program_id(1)`` of the stack -> q by the scale of ``amax[i]`` (``amax_kernel``'s bits)
    ("tensor"); its program 0 writes the scale."""
    i = tl.program_id(1)
    s = _scale_of(tl.load(amax + i).to(tl.float32, bitcast=True))
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    first = i.to(tl.int64) * numel
    tl.store(q + first + offs, _quantized(tl.load(x + first + offs, mask=offs < numel, other=0.0).to(tl.float32), s),
             mask=offs < numel)
    if tl.program_id(0) == 0:
        tl.store(scale + i, s)


@triton.jit
def column_amax_kernel(x, amax, T, H, BT: tl.constexpr, BH: tl.constexpr, STACK: tl.constexpr = False):
    """``amax[h]`` = max(amax[h], |x[t, h]| over this program's BT rows) for x [T, H]: each column's amax (the
    "row" scales of x.T), from 0, as ``amax_kernel`` (magnitudes compared as their bits). STACK: x [E, T, H],
    program axis 2 the expert, amax [E, H]."""
    if STACK:
        e = tl.program_id(2).to(tl.int64)
        x += e * T * H
        amax += e * H
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    h = tl.program_id(1) * BH + tl.arange(0, BH)
    tile = tl.load(x + t.to(tl.int64)[:, None] * H + h[None, :], mask=(t < T)[:, None] & (h < H)[None, :], other=0.0)
    tl.atomic_max(amax + h, tl.max(tl.abs(tile.to(tl.float32)), axis=0).to(tl.int32, bitcast=True), mask=h < H)


@triton.jit
def quantize_transposed_kernel(x, q, scales, amax, T, H, SCALING: tl.constexpr, BT: tl.constexpr,
                               BH: tl.constexpr, STACK: tl.constexpr = False, K_MAJOR: tl.constexpr = False):
    """Program (i, j): rows [i * BT, +BT) and columns [j * BH, +BH) of x [T, H] -> that block of x.T in q [H, T],
    quantised as ``quantize_fp8(x.T, SCALING)`` would (x.T never written in high precision): "group" in 1x128
    groups along T (BT = 128; scales [H, ceil(T/128)]), "block" per 128x128 block (BT = BH = 128; scales
    [ceil(H/128), ceil(T/128)]), "row" / "tensor" by the amax of column h / of x (``column_amax_kernel`` /
    ``amax_kernel``'s bits; scales [H, 1] / [1]). STACK: x [E, T, H], program axis 2 the expert, everything
    per expert as ``quantize_stack`` of the transposes lays it out (amax [E, H] / [E]). K_MAJOR ("group"): the
    scales laid out [ceil(T/128), H], a group's scales of consecutive rows of x.T side by side."""
    if STACK:
        e = tl.program_id(2).to(tl.int64)
        x += e * T * H
        q += e * T * H
        if SCALING == "group":
            scales += e * H * tl.num_programs(0)
        elif SCALING == "block":
            scales += e * tl.num_programs(1) * tl.num_programs(0)
        elif SCALING == "row":
            scales += e * H
            amax += e * H
        else:
            scales += e
            amax += e
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    h = tl.program_id(1) * BH + tl.arange(0, BH)
    inside = (h < H)[:, None] & (t < T)[None, :]
    tile = tl.load(x + t.to(tl.int64)[None, :] * H + h[:, None], mask=inside, other=0.0).to(tl.float32)  # [BH, BT]
    if SCALING == "group":  # BT = 128: a group per row of the tile
        scale = _scale_of(tl.max(tl.abs(tile), axis=1))
        qt = _quantized(tile, scale[:, None])
        if K_MAJOR:
            tl.store(scales + tl.program_id(0).to(tl.int64) * H + h, scale, mask=h < H)
        else:
            tl.store(scales + h.to(tl.int64) * tl.num_programs(0) + tl.program_id(0), scale, mask=h < H)
    elif SCALING == "block":
        scale = _scale_of(tl.max(tl.max(tl.abs(tile), axis=1), axis=0))
        qt = _quantized(tile, scale)
        tl.store(scales + tl.program_id(1) * tl.num_programs(0) + tl.program_id(0), scale)
    elif SCALING == "row":
        scale = _scale_of(tl.load(amax + h, mask=h < H, other=0).to(tl.float32, bitcast=True))
        qt = _quantized(tile, scale[:, None])
        if tl.program_id(0) == 0:
            tl.store(scales + h, scale, mask=h < H)
    else:
        scale = _scale_of(tl.load(amax).to(tl.float32, bitcast=True))
        qt = _quantized(tile, scale)
        if tl.program_id(0) + tl.program_id(1) == 0:
            tl.store(scales, scale)
    tl.store(q + h.to(tl.int64)[:, None] * T + t[None, :], qt, mask=inside)


# ----------------------------------------------------------------------------------------------- host side
def is_fp8(t):
    return getattr(t, "dtype", None) in FP8_DTYPES


def groups(k):
    """Scales along a dimension of ``k`` values (the last group may be short)."""
    return cdiv(k, GROUP)


def quantize_fp8(x, scaling="group", transposed=False, k_major=False):
    """``x`` [T, H] (bf16/fp16/fp32) -> (q [T, H] float8_e4m3fn, scale) by the rule above, ``scaling`` as in
    ``quantize``: "group" (per 1x128 group: [T, ceil(H/128)]; the kernel dispatch's senders run), "row" ([T, 1]),
    "block" (per 128x128 block: [ceil(T/128), ceil(H/128)]) or "tensor" ([1]). Triton kernels, one sweep over x
    ("row": two over each row; "tensor": an amax sweep first); under the interpreter on CPU (CPU tensors without
    it: ``quantize``). ``transposed``: the quantisation of ``x.T`` [H, T] (bitwise that of ``x.T.contiguous()``)
    read from x as it lies, one sweep ("row" / "tensor": an amax sweep first): an FP8 backward's operand
    quantised along the tokens. ``k_major`` ("group" only): the same scales [rows, G] laid out K-major (strides
    (1, rows), as ``torch._scaled_mm`` takes A's 1x128 scales), which ``gemm`` reads faster (docs/design/fp8.md)."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype not in OUT_DTYPES:
        raise TypeError("x must be a 2-D bfloat16 / float16 / float32 tensor")
    if scaling not in ("group", "row", "block", "tensor"):
        raise ValueError(f"scaling must be group, row, block or tensor, got {scaling!r}")
    if k_major and scaling != "group":
        raise ValueError(f"k_major lays out 1x128 group scales (scaling 'group'), got scaling {scaling!r}")
    check_device(x)
    if not x.is_cuda and not hardware.interpreting():
        q, scales = quantize(x.T if transposed else x, scaling)
        return q, (as_k_major(scales) if k_major else scales)
    x = x.contiguous()
    t, h = x.shape
    r, c = (h, t) if transposed else (t, h)  # the quantised tensor's shape
    q = torch.empty((r, c), dtype=torch.float8_e4m3fn, device=x.device)
    shape = {"group": (r, groups(c)), "row": (r, 1), "block": (cdiv(r, GROUP), groups(c)), "tensor": (1,)}
    if k_major:
        scales = torch.empty(shape[scaling][::-1], dtype=torch.float32, device=x.device).t()
    else:
        scales = torch.empty(shape[scaling], dtype=torch.float32, device=x.device)
    if not (t and h):
        return q, scales.fill_(1.0)
    if transposed:
        _quantize_transposed(x, q, scales, scaling, k_major)
    elif scaling == "group":
        bt, bh = (16, 512) if x.is_cuda else (4, 128)
        quantize_fp8_kernel[(cdiv(t, bt), cdiv(h, bh))](x, q, scales, t, h, BT=bt, BH=bh, num_warps=4,
                                                        **({"K_MAJOR": True} if k_major else {}))
    elif scaling == "block":
        quantize_blocks_kernel[(cdiv(t, GROUP), groups(h))](x, q, scales, t, h, BLOCK=GROUP, num_warps=16)
    elif scaling == "row":
        bt, bh = (4, 1024) if x.is_cuda else (4, 128)
        quantize_rows_kernel[(cdiv(t, bt),)](x, q, scales, t, h, BT=bt, BH=bh, num_warps=4)
    else:
        _quantize_tensors(x, q, scales)
    return q, scales


def _quantize_transposed(x, q, scales, scaling, k_major=False):
    """``quantize_transposed_kernel`` over contiguous ``x`` [T, H] into q [H, T] and ``scales`` (``quantize_fp8``'s
    of x.T), after the amax sweep that "row" (per column of x) and "tensor" take; a stack x [E, T, H]: each
    expert's into q [E, H, T] and the stacked scales (``quantize_stack``'s of the transposes)."""
    *stack, t, h = x.shape
    experts = stack[0] if stack else 1
    bh = GROUP if scaling == "block" else (64 if x.is_cuda else 16)
    grid = (cdiv(t, GROUP), cdiv(h, bh)) + ((experts,) if stack else ())
    extra = {"STACK": True} if stack else {}  # (a 2-D call compiles exactly as before the stack axis)
    amax = scales  # (unread by "group" and "block")
    if scaling == "row":
        amax = torch.zeros(experts * h, dtype=torch.int32, device=x.device)
        column_amax_kernel[grid](x, amax, t, h, BT=GROUP, BH=bh, num_warps=4, **extra)
    elif scaling == "tensor":
        amax = _amax_bits(x, experts)[0]
    if k_major:
        extra["K_MAJOR"] = True
    quantize_transposed_kernel[grid](x, q, scales, amax, t, h, SCALING=scaling, BT=GROUP, BH=bh,
                                     num_warps=8 if scaling == "block" else 4, **extra)


def _quantize_tensors(x, q, scales):
    """Contiguous ``x`` as a stack of ``len(scales)`` tensors of equal size, each quantised to ``q`` by its own
    per-tensor scale (``amax_kernel``, then ``quantize_tensor_kernel``): one launch each for the whole stack."""
    amax, numel, block, grid = _amax_bits(x, scales.numel())
    quantize_tensor_kernel[grid](x, q, amax, scales, numel, BLOCK=block, num_warps=8)


def _amax_bits(x, stack):
    """(amax, numel, block, grid): ``amax_kernel``'s sweep of contiguous ``x`` as a stack of ``stack`` tensors,
    their amax as int32 bits, and the sweep's launch (a quantising sweep over the same grid follows)."""
    numel = x.numel() // stack
    block = 4096 if x.is_cuda else 1024
    amax = torch.zeros(stack, dtype=torch.int32, device=x.device)
    grid = (cdiv(numel, block), stack)
    amax_kernel[grid](x, amax, numel, BLOCK=block, num_warps=8)
    return amax, numel, block, grid


def quantize_stack(w, scaling, transposed=False):
    """A stack of weights ``w`` [E, R, C] (an MoE layer's experts; bf16 / fp16 / fp32) -> (q [E, R, C]
    float8_e4m3fn, scales): each ``w[e]`` quantised as ``quantize_fp8`` quantises a weight, its scales stacked:
    "tensor" [E], "row" [E, R, 1], "block" [E, ceil(R/128), ceil(C/128)] (a block never straddles two
    experts). The same kernels, one launch for the whole stack (R not a multiple of 128, "block": a padded copy).
    ``transposed``: the stack of transposes [E, C, R] quantised (bitwise ``quantize_stack(w.transpose(1, 2)
    .contiguous())``), read from w as it lies: one launch of the transposed quantiser (after an amax sweep for
    "row" / "tensor")."""
    if not isinstance(w, torch.Tensor) or w.dim() != 3 or w.dtype not in OUT_DTYPES:
        raise TypeError("w must be a 3-D bfloat16 / float16 / float32 tensor [E, R, C]")
    if scaling not in MODES:
        raise ValueError(f"scaling must be one of {MODES}, got {scaling!r}")
    if transposed:
        return _quantize_stack_transposed(w, scaling)
    e, r, c = w.shape
    if scaling == "tensor":
        if not w.is_cuda and not hardware.interpreting():
            parts = [quantize(w[i], "tensor") for i in range(e)]
            return (torch.stack([p[0] for p in parts]) if e else w.to(torch.float8_e4m3fn),
                    torch.cat([p[1] for p in parts]) if e else w.new_ones(0, dtype=torch.float32))
        check_device(w)
        w = w.contiguous()
        q = torch.empty(w.shape, dtype=torch.float8_e4m3fn, device=w.device)
        scales = torch.ones(e, dtype=torch.float32, device=w.device)
        if w.numel():
            _quantize_tensors(w, q, scales)
        return q, scales
    if scaling == "block" and r % GROUP:  # whole 128-row blocks per expert: rows of zeros added, then cut
        padded = w.new_zeros((e, cdiv(r, GROUP) * GROUP, c))
        padded[:, :r] = w
        q, s = quantize_stack(padded, "block")
        return q[:, :r].contiguous(), s
    q, s = quantize_fp8(w.reshape(e * r, c), scaling)
    return q.view(e, r, c), s.view(e, r, 1) if scaling == "row" else s.view(e, r // GROUP, groups(c))


def _quantize_stack_transposed(w, scaling):
    """``quantize_stack(w, scaling, transposed=True)``: ``quantize_transposed_kernel`` with its stack axis."""
    if not w.is_cuda and not hardware.interpreting():
        return quantize_stack(w.transpose(1, 2).contiguous(), scaling)
    check_device(w)
    w = w.contiguous()
    e, r, c = w.shape
    q = torch.empty((e, c, r), dtype=torch.float8_e4m3fn, device=w.device)
    shape = {"tensor": (e,), "row": (e, c, 1), "block": (e, cdiv(c, GROUP), groups(r))}[scaling]
    scales = torch.empty(shape, dtype=torch.float32, device=w.device)
    if not w.numel():
        return q, scales.fill_(1.0)
    _quantize_transposed(w, q, scales, scaling)
    return q, scales


class weight_cache:
    """``with fp8.weight_cache(): ...``: while the weights do not change, quantise each once.

    FP8 training quantises a layer's weights in every forward (the ops' ``quantize=``). Inside this context the
    FP8 copy of a weight (its values and scales, one per mode) is kept and reused, so that the micro-batches of
    one optimizer step, and an activation-checkpointed forward recomputed in the backward, quantise each weight
    once::

        for batch in loader:
            with triton_dist.nn.fp8_weight_cache():
                for micro in batch.split(micro_rows):
                    model(micro).loss.backward()
            optimizer.step()

    or one cache for the whole run, entered around each forward and backward (``with cache: ...``): a weight is
    quantised again when it has changed, once per optimizer step.

    What is kept: the weights of the FP8 ops (``ag_gemm`` / ``gemm_rs`` / ``grouped_gemm`` with ``quantize=``, hence
    the ``nn`` layers' ``fp8=``) that are ``nn.Parameter``s, and with ``fp8_grads`` the copies of their transposes
    that ``ag_gemm``'s, ``gemm_rs``'s and ``grouped_gemm``'s FP8 backward multiplies by
    (``quantize_weight(transposed=True)``), never activations or gradients. A kept copy is used while the parameter
    is the same tensor with the same storage and version counter, so an in-place update (``optimizer.step()``,
    ``load_state_dict``, ``p.add_`` under no_grad) is quantised again; a write through ``p.data`` is not seen
    (``.data`` has a version counter of its own): do not edit weights that way while a cache holds them, or
    ``clear()`` it after. The copies (half a bf16 weight's bytes each) live as long as the cache object and their
    weights. Without ``fp8_grads`` the backward stays the straight-through one, on the high-precision weights. The
    innermost open cache keeps; the ops called by a torch.compile'd graph, forward and backward, get the parameters
    themselves and use it as eager calls do (nothing is kept while the graph is traced), and nothing is kept or
    reused during CUDA-graph capture."""

    _active = []  # the open caches, innermost last

    def __init__(self):
        self.kept = {}  # (id(w), what) -> (weakref to w, w's stamp, (q, scales))

    def __enter__(self):
        weight_cache._active.append(self)
        return self

    def __exit__(self, *exc):
        weight_cache._active.remove(self)
        return False

    def __len__(self):
        return len(self.kept)

    def clear(self):
        """Drop every kept copy."""
        self.kept.clear()

    @staticmethod
    def quantized(w, what, quantise):
        """``quantise()`` (w's FP8 copy for ``what``, e.g. its mode), or the copy the innermost open context
        keeps for this unchanged parameter."""
        if (not weight_cache._active or not isinstance(w, torch.nn.Parameter) or hardware.compiling()
                or (w.is_cuda and torch.cuda.is_current_stream_capturing())):
            return quantise()
        kept, key = weight_cache._active[-1].kept, (id(w), what)
        stamp = (w._version, w.data_ptr(), tuple(w.shape), w.stride(), w.dtype, w.device)
        entry = kept.get(key)
        if entry is not None and entry[0]() is w and entry[1] == stamp:
            return entry[2]
        copy = quantise()

        def forget(ref):  # w is gone: its copy with it (unless the key was reused by a later tensor)
            if kept.get(key, (None,))[0] is ref:
                del kept[key]
        kept[key] = (weakref.ref(w, forget), stamp, copy)
        return copy


def quantize_weight(w, mode, transposed=False):
    """A weight's FP8 copy in ``mode`` for the ops' ``quantize=``: (q, scales) of ``quantize_fp8`` for a weight
    [N, K], of ``quantize_stack`` for a stack of experts' weights [E, N, K]; ``transposed``: that of ``w.T`` [K, N]
    (a weight [N, K]: the operand of the FP8 backward's ``grad @ w``, ``fp8_grads``), or of the stack of each
    expert's transpose [E, K, N] (``grouped_gemm``'s other layout). From an open ``weight_cache`` where it keeps
    this parameter unchanged (the transpose's copy under a key of its own)."""
    if not transposed:
        return weight_cache.quantized(w, mode,
                                      lambda: quantize_stack(w, mode) if w.dim() == 3 else quantize_fp8(w, mode))
    if w.dim() not in (2, 3):
        raise ValueError(f"transposed: a weight [N, K] or a stack [E, N, K], got shape {list(w.shape)}")
    return weight_cache.quantized(w, (mode, "T"), lambda: _transposed_copy(w, mode))


def _transposed_copy(w, mode):
    """``quantize_fp8(w.T.contiguous(), mode)`` (a stack: ``quantize_stack`` of each expert's transpose), bitwise:
    a weight's by ``quantize_fp8(transposed=True)`` (one sweep of w, the transpose written in FP8; torch's
    transposing copy of an FP8 tensor is an unvectorised strided kernel, 1.25 ms of a 6.9 ms MLP step in run154).
    A stack's likewise (``quantize_stack(transposed=True)``)."""
    if w.dim() == 2:
        return quantize_fp8(w, mode, transposed=True)
    return quantize_stack(w, mode, transposed=True)


def quantize(x, scaling, dtype=torch.float8_e4m3fn):
    """``x`` [R, C] in torch (a reference and a convenience; ``quantize_fp8`` is the kernels) -> (q, scale):
    "tensor" (scale [1]), "row" (one per row: [R, 1]), "group" (per 1x128 group: [R, ceil(C/128)], A's "block"
    scales), "block" (per 128x128 block: [ceil(R/128), ceil(C/128)], W's "block" scales)."""
    top = torch.finfo(dtype).max
    x = x.float()
    r, c = x.shape
    if scaling == "tensor":
        amax = x.abs().amax().reshape(1) if x.numel() else x.new_zeros(1)
    elif scaling == "row":
        amax = x.abs().amax(dim=1, keepdim=True)
    elif scaling in ("group", "block"):
        rb = GROUP if scaling == "block" else 1
        pad = torch.zeros((cdiv(r, rb) * rb, groups(c) * GROUP), device=x.device)
        pad[:r, :c] = x.abs()
        amax = pad.view(pad.shape[0] // rb, rb, groups(c), GROUP).amax(dim=(1, 3))
    else:
        raise ValueError(f"scaling must be tensor, row, group or block, got {scaling!r}")
    # a tensor divisor: CUDA divides by a Python number as a product with its reciprocal (a scale off by an ulp
    # moves the many bf16 values that lie on a rounding tie of e4m3 by a step), the kernels divide exactly
    scale = torch.where(amax > 0, amax / torch.full_like(amax, top), torch.ones_like(amax))
    full = expand(scale, scaling, r, c)
    return (x / full).clamp(-top, top).to(dtype), scale


def check_mode(mode, name="quantize"):
    """``mode`` when it is None or one of ``MODES``, else ValueError naming the keyword ``name``."""
    if mode is not None and mode not in MODES:
        raise ValueError(f"{name} must be None or one of {MODES}, got {mode!r}")
    return mode


def check_fp8_grads(fp8_grads, mode, name="fp8_grads", mode_name="quantize"):
    """``fp8_grads`` (a bool: the backward GEMMs in FP8 too) when valid with the FP8 ``mode`` (None: none), else
    TypeError (not a bool) or ValueError (True without a mode), naming the keywords ``name`` and ``mode_name``."""
    if not isinstance(fp8_grads, bool):
        raise TypeError(f"{name} must be a bool, got {type(fp8_grads).__name__}")
    if fp8_grads and mode is None:
        raise ValueError(f"{name}=True quantises the backward's GEMMs as {mode_name}= quantises the forward's: it "
                         f"needs {mode_name}= (one of {MODES})")
    return fp8_grads


def a_scaling(mode):
    """The scaling of a GEMM's first operand in ``mode``: its 1x128 groups for "block" (W's are 128x128 blocks),
    else ``mode`` itself."""
    return "group" if mode == "block" else mode


def quantize_operands(a, w, mode, transposed=False):
    """High-precision operands ``a`` [M, K] and ``w`` [N, K] -> (a8, w8, ``Scales``) in ``mode`` (one of
    ``MODES``; "block": a in 1x128 groups, w in 128x128 blocks), e4m3, by ``quantize_fp8``: dynamic scales, taken
    from the operands' amax on their device (no host sync; w's copy from an open ``weight_cache`` where it keeps
    it: ``quantize_weight``). What the ops' ``quantize=`` mode runs (FP8 training: the forward of the usual
    recipe; with ``fp8_grads``, the operands of every backward GEMM too, each quantised along that GEMM's
    reduction dimension). ``transposed``: ``w`` [K, N] is a weight whose transpose is the operand (w8 = w.T's
    copy, kept as the weight's are; the backward's ``grad @ w``)."""
    if check_mode(mode) is None:
        raise ValueError(f"quantize_operands needs a mode of {MODES}, got None")
    a8, scale_a = quantize_fp8(a, a_scaling(mode))
    w8, scale_w = quantize_weight(w, mode, transposed)
    return a8, w8, check_scales(a8, w8, scale_a, scale_w, mode)


def expand(scale, scaling, r, c):
    """The [r, c] scale of every element, from a ``quantize`` scale."""
    if scaling == "tensor":
        return scale.reshape(1, 1).expand(r, c)
    if scaling == "row":
        return scale.reshape(r, 1).expand(r, c)
    rb = GROUP if scaling == "block" else 1
    return scale.repeat_interleave(rb, 0)[:r].repeat_interleave(GROUP, 1)[:, :c]


def check_device(t):
    """ValueError when ``t`` sits on a GPU without FP8 tensor cores (compute capability below 8.9)."""
    if t.is_cuda and not hardware.fp8_capable(t.device):
        major, minor = torch.cuda.get_device_capability(t.device)
        raise ValueError(f"FP8 needs a GPU of compute capability 8.9 or newer (Ada, Hopper); {t.device} has "
                         f"{major}.{minor}")


def out_dtype_of(out_dtype):
    """The result dtype of an FP8 product: bfloat16 unless given (float16 / float32 also)."""
    if out_dtype is None:
        return torch.bfloat16
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"out_dtype must be bfloat16, float16 or float32 (an FP8 result is not supported), "
                         f"got {out_dtype}")
    return out_dtype


@dataclasses.dataclass(frozen=True)
class Scales:
    """A call's checked scales: ``a`` (of A's rows) and ``w`` (of W's rows), contiguous fp32 (A's block scales
    in ``gemm`` also K-major: ``check_scales``), and the mode."""

    mode: str
    a: torch.Tensor
    w: torch.Tensor
    fast_accum: bool = False

    @property
    def a_k_major(self):
        """Whether A's block scales lie K-major (``check_scales``' ``a_strided``): another tuning of the op."""
        return self.mode == "block" and not self.a.is_contiguous()

    def k_major_a(self):
        """These scales with A's block scales K-major (a copy where they are not; others: these)."""
        if self.mode != "block" or self.a_k_major:
            return self
        return dataclasses.replace(self, a=as_k_major(self.a))

    def kernel_args(self, cfg, a=None):
        """The scale arguments of ``gemm.tile_accumulate``: ``tensor_args`` and ``constexprs``."""
        return {**self.tensor_args(a), **self.constexprs(cfg)}

    def tensor_args(self, a=None, k_stride=False):
        """The runtime scale arguments of ``gemm.tile_accumulate``; ``a``: A's scales as rows [rows, S] instead
        (``rows_of_a``, or gathered ones); ``k_stride``: with block scales also ``stride_sak``, the stride of A's
        scales along K (a kernel that reads them K-major too: ``gemm_kernel``)."""
        tensor = self.mode == "tensor"
        sa = self.a if a is None else a
        args = dict(scale_a=sa, scale_w=self.w, stride_sa=0 if tensor and a is None else sa.stride(0),
                    stride_sw=0 if tensor else self.w.stride(0))
        if k_stride and self.mode == "block":
            args["stride_sak"] = sa.stride(1)
        return args

    def constexprs(self, cfg):
        """The scale constexprs of ``gemm.tile_accumulate``. fast_accum False: the tensor cores' partial sums are
        promoted to fp32 every K step (``max_num_imprecise_acc``), like cuBLAS without fast accumulation."""
        return dict(SCALES="blocks" if self.mode == "block" else "rows",
                    MAX_IMPRECISE_ACC=None if self.fast_accum else cfg["BLOCK_K"])

    def rows_of_a(self, m):
        """A's scales as rows [m, S] (S: 1, or the groups of "block"): a per-tensor scale repeated, so that rows
        gathered from several ranks keep their own scale."""
        return self.a.reshape(1, 1).expand(m, 1).contiguous() if self.mode == "tensor" else self.a.contiguous()

    def as_rows(self, m):
        """These scales with A's as rows [m, S] (``rows_of_a``): what the gather moves with the rows."""
        return dataclasses.replace(self, a=self.rows_of_a(m))

    def of_gathered(self, rows, n):
        """The scales of rows gathered from several ranks, ``rows`` their gathered ``rows_of_a`` [W * m, S], for W
        [n, K]: per-tensor scales of several ranks are rowwise ones (W's repeated per output channel)."""
        if self.mode == "block":
            return Scales("block", rows, self.w, self.fast_accum)
        w = self.w.reshape(1, 1).expand(n, 1) if self.mode == "tensor" else self.w
        return Scales("row", rows, w.contiguous(), self.fast_accum)

    def probe(self):
        """Scales of the same mode, shapes and strides, all ones: what the autotuner's timed calls take."""
        a = torch.empty_strided(self.a.shape, self.a.stride(), dtype=self.a.dtype, device=self.a.device).fill_(1.0)
        return Scales(self.mode, a, torch.ones_like(self.w), self.fast_accum)


def _shapes(mode, m, n, k):
    if mode == "tensor":
        return "[1]", "[1]"
    if mode == "row":
        return (m, 1), (n, 1)
    return (m, groups(k)), (groups(n), groups(k))


def infer_mode(m, n, k, scale_a, scale_w):
    """The scaling mode the scales' shapes name (see the module docstring), or None."""
    if scale_a.numel() == 1 and scale_w.numel() == 1 and scale_a.dim() <= 2 and scale_w.dim() <= 2:
        return "tensor"
    for mode in ("row", "block"):
        if (tuple(scale_a.shape), tuple(scale_w.shape)) == _shapes(mode, m, n, k):
            return mode
    return None


def check_scales(a, w, scale_a, scale_w, scaling=None, fast_accum=False, what=("a", "w"), a_strided=False):
    """``Scales`` for FP8 operands ``a`` [M, K], ``w`` [N, K] (K: the operands' own, a shard's on TP ranks), or
    TypeError (not FP8, mixed formats, scales not fp32 tensors) / ValueError (shapes that do not match the
    mode, devices). The scales are held contiguous, but with ``a_strided`` (an op whose kernels read A's block
    scales by both strides: ``gemm``) A's stay as given where ``strided_a_scales`` keeps them."""
    na, nw = what
    for t, name in ((a, na), (w, nw)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in FP8_DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}: scales go with FP8 operands (float8_e4m3fn or "
                            f"float8_e5m2)")
        if t.dim() != 2 or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous 2-D tensor, got shape {list(t.shape)}")
    if a.dtype != w.dtype:
        raise TypeError(f"{na} is {a.dtype} but {nw} is {w.dtype}: mixed FP8 formats are not supported")
    if a.shape[1] != w.shape[1]:
        raise ValueError(f"inner dimensions differ: {na} {list(a.shape)} vs {nw} {list(w.shape)}")
    if a.device != w.device:
        raise ValueError(f"{na} is on {a.device} but {nw} is on {w.device}")
    check_device(a)
    for t, name in ((scale_a, "scale_a"), (scale_w, "scale_w")):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"FP8 operands need {name}, a float32 tensor; got {type(t).__name__}")
        if t.dtype != torch.float32:
            raise TypeError(f"{name} must be float32, got {t.dtype}")
        if t.device != a.device:
            raise ValueError(f"{name} is on {t.device} but {na} is on {a.device}")
    (m, k), n = a.shape, w.shape[0]
    if scaling is not None and scaling not in MODES:
        raise ValueError(f"scaling must be one of {MODES}, got {scaling!r}")
    mode = infer_mode(m, n, k, scale_a, scale_w)
    if scaling is not None and scaling != mode:
        sa, sw = _shapes(scaling, m, n, k)
        if scaling == "tensor" or (tuple(scale_a.shape), tuple(scale_w.shape)) != (sa, sw):
            raise ValueError(f"scaling {scaling!r} takes scale_a {sa} and scale_w {sw} for {na} {list(a.shape)}, "
                             f"{nw} {list(w.shape)}; got {list(scale_a.shape)} and {list(scale_w.shape)}")
        mode = scaling  # e.g. "row" with M = N = 1: the same numbers as "tensor"
    if mode is None:
        shapes = "; ".join(f"{md}: scale_a {sa}, scale_w {sw}" for md in MODES for sa, sw in [_shapes(md, m, n, k)])
        raise ValueError(f"scale shapes {list(scale_a.shape)} and {list(scale_w.shape)} match no scaling mode for "
                         f"{na} {list(a.shape)}, {nw} {list(w.shape)} (expected {shapes})")
    keep_a = a_strided and mode == "block" and strided_a_scales(scale_a)
    return Scales(mode, scale_a if keep_a else scale_a.contiguous(), scale_w.contiguous(), bool(fast_accum))


def as_k_major(scales):
    """A copy of [rows, G] ``scales`` laid out K-major (strides (1, rows)): the same values."""
    return scales.t().contiguous().t()


def strided_a_scales(scale_a):
    """Whether A's scales are read as they lie by an op that takes them so (``check_scales``' ``a_strided``):
    contiguous, or 2-D of unit row stride, e.g. K-major [M, K/128] block scales (strides (1, M): the layout
    ``torch._scaled_mm`` takes, each K block's scales of consecutive rows side by side)."""
    return scale_a.is_contiguous() or (scale_a.dim() == 2 and scale_a.stride(0) == 1)


def takes(scales, cfg):
    """Whether a configuration can run a call's scales (None: not FP8): block scales change every 128 values of
    K, so a K step must not straddle two groups."""
    return scales is None or scales.mode != "block" or GROUP % int(cfg["BLOCK_K"]) == 0


def check_block_k(scales, cfg):
    """ValueError unless ``takes(scales, cfg)``."""
    if not takes(scales, cfg):
        raise ValueError(f"scaling 'block' needs BLOCK_K dividing {GROUP}, got {cfg['BLOCK_K']}")


def scaled_operands(a, w, scale_a=None, scale_w=None, scaling=None, out_dtype=None, fast_accum=False,
                    required=False, quantize=None, a_strided=False):
    """A GEMM op's FP8 mode, from its keywords: ``(Scales, result dtype)`` for FP8 operands with their scales
    (``check_scales``, ``out_dtype_of``), ``(None, a's dtype)`` for other operands without scales (the op as it
    is) and for ``quantize=`` (the op quantises them itself: ``quantize_operands``). The keywords' rules:
    ``keywords_given``; ``a_strided``: ``check_scales``'."""
    if keywords_given(a, w, scale_a, scale_w, scaling, out_dtype, fast_accum, required, quantize):
        return (check_scales(a, w, scale_a, scale_w, scaling, fast_accum, a_strided=a_strided),
                out_dtype_of(out_dtype))
    return None, getattr(a, "dtype", None)


def keywords_given(a, w, scale_a=None, scale_w=None, scaling=None, out_dtype=None, fast_accum=False,
                   required=False, quantize=None, names=("a", "w", "scale_a", "scale_w")):
    """Whether an FP8-capable op's call gives FP8 scales to check (True), or runs without them (False: other
    operands, or ``quantize=``, a mode of ``MODES``, with high-precision operands the op quantises itself).
    ``required`` (the ``scaled_*`` entry points): scales are expected whatever the operands. TypeError for FP8
    operands without scales, or for FP8 operands with ``quantize``; ValueError for ``scaling``, ``out_dtype`` or
    ``fast_accum`` without scales, for another mode, or for ``quantize`` with any other FP8 keyword. ``names``:
    the op's names of the operands and scales, for the messages."""
    a_name, w_name, sa_name, sw_name = names
    if check_mode(quantize) is not None:
        if required or scale_a is not None or scale_w is not None or scaling is not None or out_dtype is not None \
                or fast_accum:
            raise ValueError(f"quantize= computes the scales itself and returns {a_name}'s dtype: it takes no "
                             f"{sa_name}, {sw_name}, scaling, out_dtype or fast_accum")
        for t, name in ((a, a_name), (w, w_name)):
            if is_fp8(t):
                raise TypeError(f"{name} is {t.dtype} already: quantize= takes bfloat16 / float16 / float32 "
                                f"operands (FP8 ones come with {sa_name}= and {sw_name}=)")
        return False
    if required or scale_a is not None or scale_w is not None:
        return True
    for t, name in ((a, a_name), (w, w_name)):
        if is_fp8(t):
            raise TypeError(f"{name} is {t.dtype}: FP8 operands take their float32 scales, {sa_name}= and "
                            f"{sw_name}= (per-tensor, rowwise or 128-blockwise: kernels/fp8.py)")
    if scaling is not None or out_dtype is not None or fast_accum:
        raise ValueError(f"scaling, out_dtype and fast_accum go with FP8 operands and their scales ({sa_name}=, "
                         f"{sw_name}=); got {getattr(a, 'dtype', type(a).__name__)} operands without scales")
    return False


def describe(scales, out_dtype):
    """What an FP8 call adds to its op's tuning key and call signature (nothing for other operands)."""
    if scales is None:
        return {}
    key = dict(scaling=scales.mode, fast_accum=scales.fast_accum, out_dtype=str(out_dtype).replace("torch.", ""))
    return {**key, "a_scales": "k-major"} if scales.a_k_major else key


def plan_key(scales, out_dtype):
    """What an FP8 call adds to its op's plan (and CUDA-graph) key: the mode, the accumulation, the result (and
    A's K-major block scales)."""
    return () if scales is None else (scales.mode, scales.fast_accum, out_dtype) + \
        (("a_scales", "k-major"),) * scales.a_k_major
