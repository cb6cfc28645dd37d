"""run153 (prepared 2026-12-06): the Gluon mainloop's block scales through the ring (the producer's cp.async into
the slot, the consumers' shared-memory loads after its ready barrier) instead of the consumers' global loads, whose
products ptxas placed before the first wgmma of a step (the step's wgmmas waited out the loads' latency). Per shape:
cuBLAS per-tensor (the bar, without fast accumulation), ours per-tensor 128 s5 (the same kernel without block
scales), ours blockwise 128 at 5 and 4 stages; each 40 calls back to back (``harness.clocks_during``: µs per
call, SM clock, power), in turn; the blockwise result's error against an fp64 reference of the same operands.

    PYTHONPATH=$PWD:$PWD/benchmarks python benchmarks/results/2026-12-06_gpu_run153/block_check.py
"""

import json
import os

import torch

from bench_gemm import cublas_fp8, fp8_operands
from harness import clocks_during
from triton_dist.kernels import fp8, gemm_sm90
from triton_dist.kernels.gemm import gemm_config, scaled_gemm


def gluon_cfg(m, n, k, block_n, stages, block_scales):
    base = gemm_config(m, n, k, torch.float8_e4m3fn, torch.device("cuda"), SPLIT_K=1)
    return next(c for c in gemm_sm90.candidates(base, torch.bfloat16, block_scales)
                if (c["BLOCK_N"], c["num_stages"]) == (block_n, stages))


rows = []
for m, n, k in [(8192, 8192, 8192), (8192, 28672, 8192), (4096, 6144, 4096), (2048, 8192, 8192)]:
    at, sat, wt, swt = fp8_operands(m, n, k, "tensor", "cuda")
    ab, sab, wb, swb = fp8_operands(m, n, k, "block", "cuda")
    out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    scaled_gemm(ab, wb, sab, swb, scaling="block", out=out, config=gluon_cfg(m, n, k, 128, 5, True))
    want = (ab.double() * fp8.expand(sab, "group", m, k).double()) @ \
        (wb.double() * fp8.expand(swb, "block", n, k).double()).T
    err = ((out.double() - want).norm() / want.norm()).item()
    calls = {
        "cuBLAS tensor": cublas_fp8(at, wt, sat, swt, "tensor", False),
        "gluon tensor 128 s5": lambda: scaled_gemm(at, wt, sat, swt, scaling="tensor", out=out,
                                                   config=gluon_cfg(m, n, k, 128, 5, False)),
        "gluon block 128 s5": lambda: scaled_gemm(ab, wb, sab, swb, scaling="block", out=out,
                                                  config=gluon_cfg(m, n, k, 128, 5, True)),
        "gluon block 128 s4": lambda: scaled_gemm(ab, wb, sab, swb, scaling="block", out=out,
                                                  config=gluon_cfg(m, n, k, 128, 4, True)),
    }
    times = {name: clocks_during(fn) for name, fn in calls.items()}
    bar = times["cuBLAS tensor"]["us"]
    for name, r in times.items():
        rows.append(dict(shape=[m, n, k], name=name, us=r["us"], MHz=r["MHz"], W=r["W"], vs_cublas=bar / r["us"],
                         block_rel_err=err))
        print(f"{m}x{n}x{k} {name:22s} {r['us']:8.1f} us  {bar / r['us']:5.2f}x cuBLAS per-tensor  "
              f"{r['MHz']:5.0f} MHz {r['W']:4.0f} W   (blockwise rel err {err:.2e})", flush=True)
if os.environ.get("OUT"):
    with open(os.path.join(os.environ["OUT"], "block_check.json"), "w") as f:
        json.dump(rows, f, indent=1)
