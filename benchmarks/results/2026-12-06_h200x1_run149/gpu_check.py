"""For the next GPU session (sm_90; NOT run yet: written without a GPU): ws_probe against fp64 in every scaling
mode, then timed against cuBLAS ``_scaled_mm`` (tensor / row, no fast accumulation) and gemm_sm90's Gluon kernel.

    python benchmarks/results/2026-12-06_h200x1_run149/gpu_check.py [--warps 4 8] [--stages 4 5 6]
"""

import argparse
import os
import sys

import torch
import triton

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
sys.path[:0] = [HERE, ROOT]

import ws_probe  # noqa: E402
from tests.kernels.fp8_inputs import operands, rel_err  # noqa: E402
from triton_dist.kernels import gemm_sm90  # noqa: E402
from triton_dist.kernels.gemm import scaled_gemm  # noqa: E402

CHECKS = [(1000, 1536, 1040), (272, 136, 48), (4096, 4096, 4096), (128, 4096, 8192), (384, 256, 208)]
TIMED = [(4096, 4096, 4096), (8192, 8192, 8192), (512, 4096, 8192), (4096, 7168, 2048)]


def inputs(m, n, k, mode, seed=0):
    a, sa, w, sw, da, dw = operands(m, n, k, mode, torch.Generator().manual_seed(seed + m + n + k))
    return [t.cuda() for t in (a, sa, w, sw)], (da, dw)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--warps", type=int, nargs="*", default=[4, 8])
    parser.add_argument("--stages", type=int, nargs="*", default=[4, 5, 6])
    args = parser.parse_args()
    for mode in ("tensor", "row", "block"):
        for m, n, k in CHECKS:
            (a, sa, w, sw), (da, dw) = inputs(m, n, k, mode)
            ref = da @ dw.T
            for warps in args.warps:
                for stages in args.stages:
                    out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
                    ws_probe.launch(a, w, out, mode, sa, sw, stages, num_warps=warps)
                    torch.cuda.synchronize()
                    err = rel_err(out.cpu(), ref)
                    print(f"check {mode:6s} {m}x{n}x{k} warps={warps} stages={stages}: rel err {err:.2e}"
                          f"{'' if err < 1e-2 else '  FAIL'}", flush=True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for m, n, k in TIMED:
        for mode in ("tensor", "row", "block"):
            (a, sa, w, sw), _ = inputs(m, n, k, mode)
            out = torch.empty((m, n), device="cuda", dtype=torch.bfloat16)
            grid = (min(sms, triton.cdiv(m, 128) * triton.cdiv(n, 128)), )
            row = {}
            if mode != "block":
                sa_, sw_ = (sa, sw.t()) if mode == "row" else (sa.reshape(()), sw.reshape(()))
                row["cublas"] = triton.testing.do_bench(lambda: torch._scaled_mm(
                    a, w.t(), sa_, sw_, out_dtype=torch.bfloat16, use_fast_accum=False))
            gemm_sm90.TUNER_OFFERS = False  # "core": the Triton core's tuned configuration
            row["core"] = triton.testing.do_bench(lambda: scaled_gemm(a, w, sa, sw, scaling=mode))
            for stages in (5, 6):
                cfg = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8, "num_stages": stages,
                       "num_warps": 8}
                row[f"gemm_sm90 s{stages}"] = triton.testing.do_bench(
                    lambda: gemm_sm90.launch(a, w, out, cfg, mode, sa, sw, grid))
            for warps in args.warps:
                for stages in args.stages:
                    row[f"ws w{warps} s{stages}"] = triton.testing.do_bench(
                        lambda: ws_probe.launch(a, w, out, mode, sa, sw, stages, num_warps=warps, grid=grid))
            base = row.get("cublas")
            print(f"time {mode:6s} {m}x{n}x{k}: " + ", ".join(
                f"{key} {ms * 1e3:.0f} us" + (f" ({base / ms:.2f}x)" if base else "") for key, ms in row.items()),
                flush=True)


if __name__ == "__main__":
    main()
