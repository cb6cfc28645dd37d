"""run162 probe for Nsight Compute's per-instruction stall sampling (never collected: run152 had only the summary
sections): the Gluon FP8 mainloop at 4096x6144x4096, the same tile and ring (128x128x128, 5 slots), per-tensor
then 128-blockwise with A's scales K-major (the layout the op runs best). Where do the block-scaled consumers'
cycles go that the per-tensor ones do not spend? Each mode runs twice (the first compiles); steps.sh profiles the
second, one mode (NCU_MODES) per report, and writes the SASS lines that hold the most stall samples per mode
(ncu_source_summary.py).
"""

import os

import torch

from bench_gemm import fp8_operands
from triton_dist.kernels import gemm_sm90
from triton_dist.kernels.gemm import gemm_config, scaled_gemm

m, n, k = 4096, 6144, 4096
base = gemm_config(m, n, k, torch.float8_e4m3fn, torch.device("cuda"), SPLIT_K=1)
cfg = {**gemm_sm90.default_config(base, torch.bfloat16, block_scales=True), "num_stages": 5}
out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
for mode in os.environ.get("NCU_MODES", "tensor,block").split(","):
    a, sa, w, sw = fp8_operands(m, n, k, mode, "cuda")
    if mode == "block":
        sa = sa.t().contiguous().t()  # [M, K/128] of strides (1, M): K-major
    for _ in range(2):
        scaled_gemm(a, w, sa, sw, scaling=mode, out=out, config=cfg)
    torch.cuda.synchronize()
    print(mode, cfg["BLOCK_N"], cfg["num_stages"], tuple(sa.stride()), flush=True)
