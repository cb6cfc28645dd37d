"""run108's probe (one H200): promoted rowwise FP8 ``scaled_gemm`` autotuned (its candidates include every split-column
tile also as one accumulator) against ``torch._scaled_mm`` without fast accumulation, e4m3 -> bf16, device time of
CUDA-graph replays (median of 20; run102's ``device_us``), with the configuration the tuner chose.
    python tuned_probe.py OUT_DIR"""
import json
import os
import sys

import torch

from triton_dist.kernels import fp8
from triton_dist.kernels.gemm import _CONFIGS, scaled_gemm

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "2026-12-03_h200x1_run102"))
from fp8_probe import device_us  # noqa: E402

SHAPES = [(8192, 8192, 8192), (8192, 28672, 8192), (2048, 8192, 8192)]


def main(out_dir):
    rows = []
    for m, n, k in SHAPES:
        a, sa = fp8.quantize(torch.randn(m, k, device="cuda"), "row")
        w, sw = fp8.quantize(torch.randn(n, k, device="cuda") / 16, "row")
        ref = lambda: torch._scaled_mm(a, w.t(), sa, sw.t(), out_dtype=torch.bfloat16)  # noqa: E731
        ours = lambda: scaled_gemm(a, w, sa, sw, scaling="row")  # noqa: E731
        exact = ref().float()
        err = ((ours().float() - exact).abs().max() / exact.abs().max()).item()  # tunes once
        chosen = [v for key, v in _CONFIGS._plans.items() if key[:3] == (m, n, k)]
        cublas_us, ours_us = device_us(ref), device_us(ours)
        cfg = chosen[-1] if chosen else {}
        tile = f"{cfg.get('BLOCK_M')}x{cfg.get('BLOCK_N')} s{cfg.get('num_stages')} split={cfg.get('SPLIT_N')} " \
               f"ws={cfg.get('WARP_SPECIALIZE')} sub={cfg.get('EPILOGUE_SUBTILE')} g{cfg.get('GROUP_M')}"
        rows.append({"M": m, "N": n, "K": k, "cuBLAS us": cublas_us, "ours tuned us": ours_us, "config": tile,
                     "err": err})
        print(f"{m}x{n}x{k} row promoted: ours tuned {ours_us:8.1f} us ({tile})  cuBLAS {cublas_us:8.1f} -> "
              f"{cublas_us / ours_us:.2f}x  err {err:.1e}", flush=True)
        json.dump(rows, open(f"{out_dir}/tuned_probe.json", "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
