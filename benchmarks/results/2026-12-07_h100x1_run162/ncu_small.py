"""run162 probe: where bf16 GEMMs at small M lose to cuBLAS (run158, device time: 128x4096x8192 0.73x,
512x4096x8192 0.74x, 1024x1024x8192 0.82x), never profiled. Each shape is tuned and run first (outside the
profiled range), then one call of ours (the tuner's pick, printed) and one ``torch.matmul`` run inside
``torch.cuda.profiler`` start/stop: steps.sh profiles only those (``ncu --profile-from-start off``) with the
memory and stall sections, so the two kernels' DRAM throughput, waves, occupancy and stall reasons sit side by side.
"""

import torch

from bench_gemm import _label
from triton_dist.kernels.gemm import _CONFIGS, gemm

SHAPES = [(128, 4096, 8192), (512, 4096, 8192), (1024, 1024, 8192)]
for m, n, k in SHAPES:
    a = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    w = torch.randn(n, k, device="cuda").to(torch.bfloat16)
    for _ in range(3):  # tunes, then runs through the eager plan
        out = gemm(a, w)
        ref = torch.matmul(a, w.t())
    torch.cuda.synchronize()
    err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
    tuned = _CONFIGS.find((m, n, k, a.dtype, a.device))
    print(f"{m}x{n}x{k}: ours {_label(tuned) if tuned else '?'} rel err vs torch {err:.1e}", flush=True)
torch.cuda.synchronize()
torch.cuda.profiler.start()
for m, n, k in SHAPES:
    a = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    w = torch.randn(n, k, device="cuda").to(torch.bfloat16)
    gemm(a, w)
    torch.matmul(a, w.t())
torch.cuda.synchronize()
torch.cuda.profiler.stop()
