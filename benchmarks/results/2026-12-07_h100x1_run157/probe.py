"""run157 probe (one GPU, device time by ``do_bench``: no communication). Two questions of issue 34:

block  Does the 256-wide block-scale tile in 128-column pieces beat the 128 tile? The 64-column pieces (no spills)
       lost everywhere in run155 (a 64-wide wgmma reads as many A bytes as B bytes: shared-memory bound); the
       128-column pieces move a quarter fewer bytes from L2 per FLOP than the 128 tile, as our per-tensor 256 tile
       does, and no longer spill (the second piece's wgmmas after the first piece's adds, ``_zeros_after``; before:
       264 B). The tuner offers them since; these rows time them named.
split  Where do bf16 1024x1024x16384's split-K items lose ~13 us (run156: 59.4 us, cuBLAS 51.5)? The same 128 work
       items without the split: 1024x2048x8192 and 2048x1024x8192 (the same tile, K share, FLOPs and SMs; no
       partials). If those run at ~46 us the partials' traffic costs the difference; if at ~57 the SMs' shared
       L2 bandwidth does (then only fewer bytes per FLOP help: wider tiles, multicast).

    PYTHONPATH=$PWD:$PWD/benchmarks torchrun --nproc-per-node=1 benchmarks/results/2026-12-07_h100x1_run157/probe.py [block] [split]
"""

import json
import os
import sys

import torch
import triton

import triton_dist as td
from bench_gemm import cublas_fp8, fp8_operands
from triton_dist.kernels import fp8
from triton_dist.kernels.gemm import gemm, scaled_gemm


BLOCK_SHAPES = [(8192, 8192, 8192), (8192, 28672, 8192), (4096, 6144, 4096), (2048, 8192, 8192)]


def start():
    """One rank on this process's GPU, as the ops expect (a group of one)."""
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    td.init(backend="cuda")


def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=100) * 1e3


def block_case(m, n, k):
    """Per-tensor and blockwise e4m3 operands of one shape (each ``(a, scale_a, w, scale_w)``), the blockwise
    product in fp64 and a bf16 result buffer."""
    tensor, block = fp8_operands(m, n, k, "tensor", "cuda"), fp8_operands(m, n, k, "block", "cuda")
    ab, sab, wb, swb = block
    want = (ab.double() * fp8.expand(sab, "group", m, k).double()) @ \
        (wb.double() * fp8.expand(swb, "block", n, k).double()).T
    return tensor, block, want, torch.empty((m, n), device="cuda", dtype=torch.bfloat16)


def time_block_contenders(shape, calls, want, out, **fields):
    """Rows of ``calls`` ({name: fn}, the bar first) at ``shape``: device time, ratio to the bar, and for the
    block contenders (named "... block ...") the relative error of a result poisoned with NaN against ``want``."""
    rows = []
    for name, fn in calls.items():
        out.fill_(float("nan"))
        fn()
        err = ((out.double() - want).norm() / want.norm()).item() if "block" in name else None
        rows.append(dict(fields, shape=list(shape), name=name, device_us=bench(fn), rel_err=err))
    for r in rows:
        r["vs_cublas"] = rows[0]["device_us"] / r["device_us"]
        print(f"{'x'.join(map(str, shape))} {r['name']:22s} {r['device_us']:8.1f} us {r['vs_cublas']:5.2f}x"
              + (f" rel err {r['rel_err']:.1e}" if r["rel_err"] is not None else ""), flush=True)
    return rows


def write(rows, name):
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], name), "w") as f:
            json.dump(rows, f, indent=1)


def block_rows(m, n, k):
    tensor, block, want, out = block_case(m, n, k)

    def ours(mode, block_n, stages):
        a, sa, w, sw = block if mode == "block" else tensor
        cfg = {"MAINLOOP": "gluon", "BLOCK_N": block_n, "num_stages": stages, "SPLIT_N": False}
        return lambda: scaled_gemm(a, w, sa, sw, scaling=mode, out=out, config=cfg)

    at, sat, wt, swt = tensor
    calls = {"cuBLAS tensor": cublas_fp8(at, wt, sat, swt, "tensor", False),
             "ours tensor 256 s3": ours("tensor", 256, 3), "ours tensor 128 s5": ours("tensor", 128, 5),
             "ours block 128 s4": ours("block", 128, 4),
             "ours block 256/128 s3": ours("block", 256, 3), "ours block 256/128 s4": ours("block", 256, 4)}
    return time_block_contenders((m, n, k), calls, want, out, part="block")


def split_rows():
    rows = []
    square = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_stages=4, num_warps=8, GROUP_M=8)
    wide = dict(square, BLOCK_N=256, num_stages=3)  # a quarter fewer bytes per FLOP
    for m, n, k, split, tile in [(1024, 1024, 16384, 2, square), (1024, 2048, 8192, 1, square),
                                 (2048, 1024, 8192, 1, square), (1024, 1024, 8192, 1, square),
                                 (1024, 1024, 16384, 1, square), (1024, 1024, 16384, 4, wide),
                                 (1024, 4096, 4096, 1, wide)]:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 64
        out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        cfg = dict(tile, SPLIT_K=split)
        gemm(a, w, out=out, config=cfg)
        want = a.float() @ w.float().T
        err = ((out.float() - want).norm() / want.norm()).item()
        ours, ref = bench(lambda: gemm(a, w, out=out, config=cfg)), bench(lambda: torch.matmul(a, w.T))
        rows.append(dict(part="split", shape=[m, n, k], tile=cfg, split_k=split, device_us=ours, cublas_us=ref,
                         vs_cublas=ref / ours, rel_err=err))
        print(f"{m}x{n}x{k} 128x{tile['BLOCK_N']}x64 w8 split-k {split}: {ours:7.1f} us, cuBLAS {ref:7.1f} us "
              f"{ref / ours:5.2f}x rel err {err:.1e}", flush=True)
    return rows


if __name__ == "__main__":
    start()
    parts = sys.argv[1:] or ["block", "split"]
    rows = [r for shape in BLOCK_SHAPES for r in block_rows(*shape)] if "block" in parts else []
    write(rows + (split_rows() if "split" in parts else []), "probe.json")
