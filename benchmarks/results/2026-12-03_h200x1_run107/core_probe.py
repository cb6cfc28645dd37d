"""run107's probe (one H200): the GEMM core's promoted FP8 tiles with SPLIT_N (128x256 as two 128-wide accumulators,
the default since this commit) against the same tiles as one accumulator (SPLIT_N off, the default before) and
cuBLAS ``torch._scaled_mm`` without fast accumulation, per-tensor and rowwise, e4m3 -> bf16. Device time of
CUDA-graph replays (median of 20; run102's ``device_us``), contenders one after another, fixed configurations (no
autotuning), errors against cuBLAS.
    python core_probe.py OUT_DIR"""
import json
import os
import sys

import torch

from triton_dist.kernels import fp8
from triton_dist.kernels.gemm import gemm, gemm_config

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "2026-12-03_h200x1_run102"))
from fp8_probe import device_us  # noqa: E402

SHAPES = [(8192, 8192, 8192), (8192, 28672, 8192), (4096, 6144, 4096), (2048, 8192, 8192)]


def main(out_dir):
    rows = []
    for m, n, k in SHAPES:
        x, y = torch.randn(m, k, device="cuda"), torch.randn(n, k, device="cuda") / 16
        row = {"M": m, "N": n, "K": k}
        for mode in ("tensor", "row"):
            a, sa = fp8.quantize(x, mode)
            w, sw = fp8.quantize(y, mode)
            sa_, sw_ = (sa, sw.t()) if mode == "row" else (sa.reshape(()), sw.reshape(()))
            ref = lambda: torch._scaled_mm(a, w.t(), sa_, sw_, out_dtype=torch.bfloat16)  # noqa: E731
            exact = ref().float()
            row[f"cuBLAS {mode}"] = device_us(ref)
            base = gemm_config(m, n, k, a.dtype, a.device, fp8.Scales(mode, sa, sw, False))
            for label, cfg in (("split", base), ("one accumulator", {**base, "SPLIT_N": False})):
                out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
                call = lambda: gemm(a, w, out=out, scale_a=sa, scale_w=sw, scaling=mode, config=cfg)  # noqa: E731
                us = device_us(call)
                out.fill_(float("nan"))
                call()
                err = ((out.float() - exact).abs().max() / exact.abs().max()).item()
                row[f"ours {mode} {label}"], row[f"err {mode} {label}"] = us, err
                tile = f"{cfg['BLOCK_M']}x{cfg['BLOCK_N']} s{cfg['num_stages']} split={cfg['SPLIT_N']}"
                print(f"{m}x{n}x{k} {mode:6s} {label:16s} {tile:24s} {us:8.1f} us "
                      f"{2 * m * n * k / us / 1e6:6.0f} TFLOP/s  cuBLAS {row[f'cuBLAS {mode}']:8.1f} -> "
                      f"{row[f'cuBLAS {mode}'] / us:.2f}x  err {err:.1e}", flush=True)
        rows.append(row)
        json.dump(rows, open(f"{out_dir}/core_probe.json", "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
