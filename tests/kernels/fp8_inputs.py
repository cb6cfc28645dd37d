"""FP8 test inputs and their fp64 references, written independently of ``triton_dist.kernels.fp8``: quantise
with torch, dequantise to fp64 by repeating each scale over its group, multiply in fp64."""

import torch

E4M3 = torch.float8_e4m3fn
A_KIND = {"tensor": "tensor", "row": "row", "block": "group"}  # A's scales per mode; W's are named as the mode


def repeat_scale(scale, kind, rows, cols):
    """[rows, cols] fp64: each element's scale (kind: tensor, row, group = 1x128, block = 128x128)."""
    s = scale.double()
    if kind == "tensor":
        return s.reshape(1, 1).expand(rows, cols)
    if kind == "row":
        return s.reshape(rows, 1).expand(rows, cols)
    r = 128 if kind == "block" else 1
    return s.repeat_interleave(r, dim=0)[:rows].repeat_interleave(128, dim=1)[:, :cols]


def quantize(x, kind, dtype=E4M3):
    """(q, scale) of ``x`` [rows, cols]: scale = amax / fp8 max per group (1 for a group of zeros)."""
    rows, cols = x.shape
    top = torch.finfo(dtype).max
    if kind == "tensor":
        amax = x.abs().amax().reshape(1)
    elif kind == "row":
        amax = x.abs().amax(dim=1, keepdim=True)
    else:
        r = 128 if kind == "block" else 1
        g = (cols + 127) // 128
        padded = torch.zeros(((rows + r - 1) // r * r, g * 128), dtype=x.dtype)
        padded[:rows, :cols] = x.abs()
        amax = padded.view(-1, r, g, 128).amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / top, torch.ones_like(amax)).float()
    q = (x.double() / repeat_scale(scale, kind, rows, cols)).clamp(-top, top).to(dtype)
    return q, scale


def dequantize(q, scale, kind):
    return q.double() * repeat_scale(scale, kind, *q.shape)


def operands(m, n, k, mode, gen, dtype=E4M3, w_rows=None):
    """Random FP8 operands of a scaling mode: (a, scale_a, w, scale_w) and the fp64 dequantised a and w. Mode
    "block-kmajor": block scales with A's laid out K-major ([M, K/128] of strides (1, M), torch._scaled_mm's)."""
    kmajor = mode == "block-kmajor"
    mode = "block" if kmajor else mode
    x = torch.randn(m, k, generator=gen) * torch.rand(m, 1, generator=gen) * 4  # rows of different magnitudes
    y = torch.randn(w_rows or n, k, generator=gen) / k ** 0.5
    a, sa = quantize(x, A_KIND[mode], dtype)
    w, sw = quantize(y, mode, dtype)
    da, dw = dequantize(a, sa, A_KIND[mode]), dequantize(w, sw, mode)
    return a, (sa.t().contiguous().t() if kmajor else sa), w, sw, da, dw


def rel_err(out, ref):
    """Max |out - ref| over max |ref|; inf when out holds a NaN (a poisoned value that was never overwritten)."""
    err = ((out.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
    return err if err == err else float("inf")


def fp8_steps(q, ref):
    """Max distance between e4m3 values ``q`` and ``ref`` in FP8 steps (adjacent codes of the same sign)."""
    a = q.view(torch.uint8).int()
    b = ref.view(torch.uint8).int()
    same_sign = (a & 0x80) == (b & 0x80)
    far = torch.where(same_sign, (a - b).abs(), (a & 0x7F) + (b & 0x7F))
    return int(far.max()) if far.numel() else 0
