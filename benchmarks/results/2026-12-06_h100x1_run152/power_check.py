"""run152 (prepared 2026-12-06, not run): is blockwise FP8 slower than per-tensor in the same Gluon kernel because
of its data? Block-quantized operands fill every 128-block to e4m3's full range (denser bit patterns than one
per-tensor scale leaves), and the tensor cores of a power-capped H100 / H200 then clock lower. run150 / run151
measured blockwise at ~1.35x per-tensor's time with near-identical SASS in the K loop.

Each contender runs 40 calls back to back under ``harness.clocks_during`` (NVML: median SM clock, mean board
power, throttle reasons; µs per call from CUDA events), M = N = K = 8192 (and 4096 x 6144 x 4096):
  cuBLAS tensor, tensor data     ``_scaled_mm`` on per-tensor-quantized operands (the bar)
  cuBLAS tensor, block data      the same call on the block-quantized e4m3 values (their scales ignored:
                                 timing only)
  gluon tensor, tensor data      gemm_sm90 per-tensor at its best 128-wide configuration (run151: 128 s5)
  gluon tensor, block data       the same on the block-quantized values
  gluon block, block data        gemm_sm90 with block scales (128 s6), as the op runs it
  gluon block, tensor data       block scales that are all the per-tensor scales, on per-tensor data

    PYTHONPATH=$PWD:$PWD/benchmarks python benchmarks/results/2026-12-06_gpu_run152/power_check.py
"""

import torch

from bench_gemm import cublas_fp8, fp8_operands
from harness import clocks_during
from triton_dist.kernels import gemm_sm90
from triton_dist.kernels.gemm import gemm_config, scaled_gemm


def gluon_cfg(m, n, k, block_n, stages):
    base = gemm_config(m, n, k, torch.float8_e4m3fn, torch.device("cuda"), SPLIT_K=1)
    return next(c for c in gemm_sm90.candidates(base, torch.bfloat16, False)
                if (c["BLOCK_N"], c["num_stages"]) == (block_n, stages))


for m, n, k in [(8192, 8192, 8192), (4096, 6144, 4096)]:
    at, sat, wt, swt = fp8_operands(m, n, k, "tensor", "cuda")
    ab, sab, wb, swb = fp8_operands(m, n, k, "block", "cuda")
    # block scales that are the per-tensor ones everywhere (shapes of the block mode's)
    sat_b = sat.reshape(1, 1).expand(sab.shape).contiguous()
    swt_b = swt.reshape(1, 1).expand(swb.shape).contiguous()
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    t128, b128 = gluon_cfg(m, n, k, 128, 5), gluon_cfg(m, n, k, 128, 6)
    calls = {
        "cuBLAS tensor, tensor data": cublas_fp8(at, wt, sat, swt, "tensor", False),
        "cuBLAS tensor, block data": cublas_fp8(ab, wb, sat, swt, "tensor", False),
        "gluon tensor, tensor data": lambda: scaled_gemm(at, wt, sat, swt, scaling="tensor", out=out, config=t128),
        "gluon tensor, block data": lambda: scaled_gemm(ab, wb, sat, swt, scaling="tensor", out=out, config=t128),
        "gluon block, block data": lambda: scaled_gemm(ab, wb, sab, swb, scaling="block", out=out, config=b128),
        "gluon block, tensor data": lambda: scaled_gemm(at, wt, sat_b, swt_b, scaling="block", out=out,
                                                        config=b128),
    }
    for name, fn in calls.items():
        r = clocks_during(fn)
        print(f"{m}x{n}x{k} {name:28s} {r['us']:8.1f} us  {r['MHz']:5.0f} MHz  {r['W']:5.0f} W  "
              f"{r['J'] * 1e3:7.1f} mJ/call  throttle {r['throttle']}", flush=True)
