"""run158 probe (one GPU, device time by ``do_bench``): where bf16 split-K loses its time (run157: the partials
cost ~6.5 us at split 2, ~12.5 us at split 4 of 1024x1024x16384's ~64.6 us; cuBLAS 57.3). Since 2026-12-07
``gemm._sum_splits`` spreads a tile's sum over its splits (split q sums row slice q once all have arrived).
Variants, each in its own process (``gemm_kernel`` compiles what it finds when first launched):

  shipped  as above (``sum_slices``: as many slices as splits, powers of two, at most 8)
  one      one slice: one split sums the whole tile (the reduction before 2026-12-07, plus a wait)
  nowait   as many slices, no split waits: the last to arrive sums every slice
  old      the kernel before (gemm_981c910.py, a copy of kernels/gemm.py at 981c910): the last arriver sums

    PYTHONPATH=$PWD:$PWD/benchmarks torchrun --nproc-per-node=1 .../split_probe.py shipped|one
Times each call by ``do_bench`` (a launch a rep, host time included where it exceeds the GPU's) and by
``do_bench_cudagraph`` (device time). Prints per shape ours vs torch.matmul and a checksum of the result's bits (both variants must agree).
"""

import hashlib
import importlib
import json
import os
import sys

import torch
import triton

import triton_dist as td
from triton_dist.kernels.gemm import gemm

gemm_module = importlib.import_module("triton_dist.kernels.gemm")  # (the package's ``gemm`` is the op)


def old_gemm():
    """The ``gemm`` op of gemm_981c910.py, loaded as a module of the package (its torch op not defined twice)."""
    import importlib.util

    from triton_dist.kernels import library
    spec = importlib.util.spec_from_file_location("triton_dist.kernels.gemm_981c910",
                                                  os.path.join(os.path.dirname(__file__), "gemm_981c910.py"))
    module = importlib.util.module_from_spec(spec)
    define, library.define = library.define, lambda *args, **kwargs: None
    try:
        spec.loader.exec_module(module)
    finally:
        library.define = define
    return module.gemm

SQUARE = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_stages=4, num_warps=8, GROUP_M=8)
WIDE = dict(SQUARE, BLOCK_N=256, num_stages=3)
CASES = [(1024, 1024, 16384, 2, SQUARE), (1024, 1024, 16384, 4, WIDE), (1024, 1024, 8192, 2, SQUARE),
         (1024, 2048, 16384, 2, WIDE), (512, 4096, 8192, 2, SQUARE), (128, 4096, 8192, 4, SQUARE)]

if __name__ == "__main__":
    variant = sys.argv[1] if len(sys.argv) > 1 else "shipped"
    op = gemm
    if variant == "one":
        gemm_module.sum_slices = lambda cfg: 1
    elif variant == "nowait":
        gemm_module.SPLIT_WAIT_POLLS = triton.language.constexpr(0)
    elif variant == "old":
        op = old_gemm()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    td.init(backend="cuda")
    rows = []
    for m, n, k, split, tile in CASES:
        g = torch.Generator(device="cuda").manual_seed(m + n + k)
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) / 64
        out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        cfg = dict(tile, SPLIT_K=split)
        op(a, w, out=out, config=cfg)
        want = a.float() @ w.float().T
        err = ((out.float() - want).norm() / want.norm()).item()
        bits = hashlib.sha1(out.view(torch.int16).cpu().numpy().tobytes()).hexdigest()[:12]
        ours = triton.testing.do_bench(lambda: op(a, w, out=out, config=cfg), warmup=25, rep=100) * 1e3
        ref = triton.testing.do_bench(lambda: torch.matmul(a, w.T), warmup=25, rep=100) * 1e3
        ours_graph = triton.testing.do_bench_cudagraph(lambda: op(a, w, out=out, config=cfg), rep=100) * 1e3
        ref_graph = triton.testing.do_bench_cudagraph(lambda: torch.matmul(a, w.T), rep=100) * 1e3
        rows.append(dict(variant=variant, shape=[m, n, k], split_k=split, block_n=tile["BLOCK_N"], device_us=ours,
                         cublas_us=ref, vs_cublas=ref / ours, graph_us=ours_graph, cublas_graph_us=ref_graph,
                         graph_vs_cublas=ref_graph / ours_graph, rel_err=err, bits=bits))
        print(f"{variant:8s} {m}x{n}x{k} 128x{tile['BLOCK_N']} split-k {split}: {ours:7.1f} us, cuBLAS {ref:7.1f} us "
              f"{ref / ours:5.2f}x | graphs {ours_graph:7.1f} vs {ref_graph:7.1f} us {ref_graph / ours_graph:5.2f}x "
              f"rel err {err:.1e} bits {bits}", flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], f"split_probe_{variant}.json"), "w") as f:
            json.dump(rows, f, indent=1)
