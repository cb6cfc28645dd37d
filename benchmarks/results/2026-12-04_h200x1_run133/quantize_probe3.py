"""run133's probe (one H200): run132 found the rowwise kernel at HBM speed for the bytes it moves — each row is read
twice, and with every SM full of programs (57 KB of rows each) the second sweep misses L2 — and the blockwise
kernel (one pass) latency-bound. Here persistent variants: a grid of a few programs per SM looping over the rows
(so the rows between a row's two sweeps fit in L2) and over the 128x128 blocks (``tl.range`` with num_stages:
the next tile's load in flight while this one is quantised). Same stack as run131 ([64 x 4096, 7168] bf16),
bitwise against today's kernels, device time, median of 10.
    python quantize_probe3.py OUT_DIR"""
import json
import os
import sys

import torch
import triton
import triton.language as tl

from triton_dist.kernels.fp8 import _quantized, _scale_of, quantize_blocks_kernel, quantize_rows_kernel

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "2026-12-04_h200x1_run131"))
from quantize_probe import timed  # noqa: E402


@triton.jit
def rows_persistent(x, q, scales, T, H, BT: tl.constexpr, BH: tl.constexpr):
    for blk in tl.range(tl.program_id(0), tl.cdiv(T, BT), tl.num_programs(0)):
        t = blk * BT + tl.arange(0, BT)
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
def blocks_persistent(x, q, scales, T, H, STAGES: tl.constexpr):
    g = tl.cdiv(H, 128)
    for tile in tl.range(tl.program_id(0), tl.cdiv(T, 128) * g, tl.num_programs(0), num_stages=STAGES):
        i, j = tile // g, tile % g
        t = i * 128 + tl.arange(0, 128)
        h = j * 128 + tl.arange(0, 128)
        m = (t < T)[:, None] & (h < H)[None, :]
        offs = t.to(tl.int64)[:, None] * H + h[None, :]
        block = tl.load(x + offs, mask=m, other=0.0).to(tl.float32)
        scale = _scale_of(tl.max(tl.max(tl.abs(block), axis=1), axis=0))
        tl.store(q + offs, _quantized(block, scale), mask=m)
        tl.store(scales + tile, scale)


def main(out_dir):
    T, H = 64 * 4096, 7168
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16) * torch.rand(T, 1, device="cuda", dtype=torch.bfloat16)
    gb = x.numel() * 3 / 1e9
    q0, s0 = torch.empty(T, H, device="cuda", dtype=torch.float8_e4m3fn), torch.empty(T, device="cuda")
    quantize_rows_kernel[(triton.cdiv(T, 4),)](x, q0, s0, T, H, BT=4, BH=1024, num_warps=4)
    res = {}

    def add(name, fn, q, s, ref_q, ref_s):
        fn(q, s)
        same = bool(torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(s, ref_s))
        us = timed(lambda: fn(q, s))
        res[name] = dict(us=us, tbps=gb / us * 1e6 / 1e3, bitwise=same)

    add("rows today 4x1024 w4", lambda q, s: quantize_rows_kernel[(triton.cdiv(T, 4),)](
        x, q, s, T, H, BT=4, BH=1024, num_warps=4), torch.empty_like(q0), torch.empty_like(s0), q0, s0)
    for per_sm, bt, bh, nw in ((2, 4, 1024, 4), (4, 4, 1024, 4), (8, 4, 1024, 4), (4, 2, 1024, 4), (8, 2, 512, 4),
                               (4, 4, 512, 4), (2, 8, 1024, 8), (16, 1, 1024, 4)):
        add(f"rows persistent {per_sm}/SM {bt}x{bh} w{nw}", (lambda p, bt, bh, nw: lambda q, s: rows_persistent[
            (p * sms,)](x, q, s, T, H, BT=bt, BH=bh, num_warps=nw))(per_sm, bt, bh, nw), torch.empty_like(q0),
            torch.empty_like(s0), q0, s0)
    g = triton.cdiv(H, 128)
    b0 = torch.empty(T // 128, g, device="cuda")
    quantize_blocks_kernel[(T // 128, g)](x, q0, b0, T, H, BLOCK=128, num_warps=8)
    add("blocks today w16", lambda q, s: quantize_blocks_kernel[(T // 128, g)](x, q, s, T, H, BLOCK=128,
                                                                               num_warps=16),
        torch.empty_like(q0), torch.empty_like(b0), q0, b0)
    for per_sm, stages, nw in ((1, 2, 16), (2, 2, 8), (2, 2, 16), (2, 3, 8), (4, 2, 8), (4, 1, 8), (2, 1, 16)):
        add(f"blocks persistent {per_sm}/SM s{stages} w{nw}", (lambda p, st, nw: lambda q, s: blocks_persistent[
            (p * sms,)](x, q, s, T, H, STAGES=st, num_warps=nw))(per_sm, stages, nw), torch.empty_like(q0),
            torch.empty_like(b0), q0, b0)
    lines = [f"{name:40s} {r['us']:9.1f} us  {r['tbps']:5.2f} TB/s  bitwise {r['bitwise']}" for name, r in res.items()]
    print("\n".join(lines))
    with open(os.path.join(out_dir, "quantize_probe3.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
