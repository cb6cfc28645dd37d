"""run152 (prepared 2026-12-06, not run): the Gluon FP8 mainloop at 4096^3, per-tensor then 128-blockwise, the
same tile (128x128x128, 6 stages), for Nsight Compute: where do the block-scaled consumers' cycles go (warp
stall reasons, issue slots, L1 / L2 traffic) that the per-tensor ones do not spend? Each mode runs twice (the
first compiles); steps.sh profiles the second of each.

    ncu --clock-control none -k regex:gemm_fp8_sm90 --launch-skip 1 --launch-count 3 ... python ncu_block.py
"""

import torch

from bench_gemm import fp8_operands
from triton_dist.kernels import gemm_sm90
from triton_dist.kernels.gemm import gemm_config, scaled_gemm

m = n = k = 4096
base = gemm_config(m, n, k, torch.float8_e4m3fn, torch.device("cuda"), SPLIT_K=1)
cfg = gemm_sm90.default_config(base, torch.bfloat16, block_scales=True)
out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
for mode in ("tensor", "block"):
    a, sa, w, sw = fp8_operands(m, n, k, mode, "cuda")
    for _ in range(2):
        scaled_gemm(a, w, sa, sw, scaling=mode, out=out, config=cfg)
    torch.cuda.synchronize()
    print(mode, cfg["BLOCK_N"], cfg["num_stages"], flush=True)
