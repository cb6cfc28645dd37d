"""run158 probe (one GPU, device time by ``do_bench``): where bf16 split-K loses its time (run157: the partials
cost ~6.5 us at split 2, ~12.5 us at split 4 of 1024x1024x16384's ~64.6 us; cuBLAS 57.3). The shipped reduction
(``gemm._sum_splits``): every split stores its fp32 partial tile, and the last to arrive loads all of them, its
own included, and adds them in split order. Variants, each in its own process (``gemm_kernel`` compiles the
``_sum_splits`` it finds when first launched):

  shipped  as above
  own      the last arriver takes its own partial from its registers (the same bits as the stored ones: the result
           bitwise the shipped one's) and loads the others, all issued before the adds
  nosum    no reduction (each split stores its partial; the last stores its own share only: wrong results, the
           partials' cost bound)

    PYTHONPATH=$PWD:$PWD/benchmarks torchrun --nproc-per-node=1 .../split_probe.py shipped|own|nosum
Prints per shape ours vs torch.matmul and a checksum of the result's bits (shipped and own must agree).
"""

import hashlib
import importlib
import json
import os
import sys

import torch
import triton
import triton.language as tl

import triton_dist as td
import triton_dist.language as dl
from triton_dist.kernels.gemm import gemm

gemm_module = importlib.import_module("triton_dist.kernels.gemm")  # (the package's ``gemm`` is the op)


@triton.jit
def _store_and_arrive(acc, partials, tile_counts, tile, split, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr):
    """What every variant does as shipped: store this split's partial and arrive; the last resets the counter.
    (offsets in a partial, the tile's partials, whether this split arrived last)."""
    offs = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    tile_partials = partials + tile.to(tl.int64) * (SPLIT_K * BLOCK_M * BLOCK_N)
    tl.store(tile_partials + split * (BLOCK_M * BLOCK_N) + offs, acc)
    last = dl.arrive_last(tile_counts + tile, SPLIT_K)
    if last:
        tl.atomic_xchg(tile_counts + tile, 0, sem="relaxed", scope="gpu")
    return offs, tile_partials, last


@triton.jit
def _sum_splits_own(acc, partials, tile_counts, tile, split, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr):
    offs, tile_partials, last = _store_and_arrive(acc, partials, tile_counts, tile, split, SPLIT_K, BLOCK_M,
                                                  BLOCK_N)
    if last:
        splits = offs * 0 + split  # (a block: masks of the loads that are not this split's own)
        total = tl.where(splits == 0, acc, tl.load(tile_partials + offs, mask=splits != 0, other=0.0,
                                                   cache_modifier=".cg"))
        for s in tl.static_range(1, SPLIT_K):
            part = tl.load(tile_partials + s * (BLOCK_M * BLOCK_N) + offs, mask=splits != s, other=0.0,
                           cache_modifier=".cg")
            total += tl.where(splits == s, acc, part)
        acc = total
    return acc, last


@triton.jit
def _sum_splits_none(acc, partials, tile_counts, tile, split, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr):
    _, _, last = _store_and_arrive(acc, partials, tile_counts, tile, split, SPLIT_K, BLOCK_M, BLOCK_N)
    return acc, last


SQUARE = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_stages=4, num_warps=8, GROUP_M=8)
WIDE = dict(SQUARE, BLOCK_N=256, num_stages=3)
CASES = [(1024, 1024, 16384, 2, SQUARE), (1024, 1024, 16384, 4, WIDE), (1024, 1024, 8192, 2, SQUARE),
         (1024, 2048, 16384, 2, WIDE), (512, 4096, 8192, 2, SQUARE), (128, 4096, 8192, 4, SQUARE)]

if __name__ == "__main__":
    variant = sys.argv[1] if len(sys.argv) > 1 else "shipped"
    if variant != "shipped":
        gemm_module._sum_splits = {"own": _sum_splits_own, "nosum": _sum_splits_none}[variant]
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    td.init(backend="cuda")
    rows = []
    for m, n, k, split, tile in CASES:
        g = torch.Generator(device="cuda").manual_seed(m + n + k)
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) / 64
        out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        cfg = dict(tile, SPLIT_K=split)
        gemm(a, w, out=out, config=cfg)
        want = a.float() @ w.float().T
        err = ((out.float() - want).norm() / want.norm()).item()
        bits = hashlib.sha1(out.view(torch.int16).cpu().numpy().tobytes()).hexdigest()[:12]
        ours = triton.testing.do_bench(lambda: gemm(a, w, out=out, config=cfg), warmup=25, rep=100) * 1e3
        ref = triton.testing.do_bench(lambda: torch.matmul(a, w.T), warmup=25, rep=100) * 1e3
        rows.append(dict(variant=variant, shape=[m, n, k], split_k=split, block_n=tile["BLOCK_N"], device_us=ours,
                         cublas_us=ref, vs_cublas=ref / ours, rel_err=err, bits=bits))
        print(f"{variant:8s} {m}x{n}x{k} 128x{tile['BLOCK_N']} split-k {split}: {ours:7.1f} us, cuBLAS {ref:7.1f} us "
              f"{ref / ours:5.2f}x rel err {err:.1e} bits {bits}", flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], f"split_probe_{variant}.json"), "w") as f:
            json.dump(rows, f, indent=1)
