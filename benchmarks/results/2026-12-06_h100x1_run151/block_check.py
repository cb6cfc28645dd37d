"""run151: the Gluon mainloop's block scales a step ahead (gemm_sm90, after a281745) on one GPU: device time
(triton.testing.do_bench: one GPU, no communication) of 128-blockwise against per-tensor, both through the Gluon
kernel at the tuner's configurations, and cuBLAS per-tensor.

    PYTHONPATH=$PWD:$PWD/benchmarks python benchmarks/results/2026-12-06_h100x1_run151/block_check.py
"""

import torch
import triton

from bench_gemm import cublas_fp8, fp8_operands
from triton_dist.kernels import gemm_sm90
from triton_dist.kernels.gemm import gemm_config, scaled_gemm

for m, n, k in [(8192, 8192, 8192), (4096, 6144, 4096), (2048, 8192, 8192)]:
    row = {}
    for mode in ("tensor", "block"):
        a, sa, w, sw = fp8_operands(m, n, k, mode, "cuda")
        base = gemm_config(m, n, k, a.dtype, a.device, SPLIT_K=1)
        for cfg in gemm_sm90.candidates(base, torch.bfloat16, mode == "block"):
            out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            row[f"{mode} {cfg['BLOCK_N']} s{cfg['num_stages']}"] = triton.testing.do_bench(
                lambda: scaled_gemm(a, w, sa, sw, scaling=mode, out=out, config=cfg)) * 1e3
        if mode == "tensor":
            row["cublas tensor"] = triton.testing.do_bench(cublas_fp8(a, w, sa, sw, "tensor", False)) * 1e3
    base = row["cublas tensor"]
    print(f"{m}x{n}x{k}: " + ", ".join(f"{key} {us:.0f} us ({base / us:.2f}x)" for key, us in row.items()),
          flush=True)
