"""run110's block-scale probe (one H200): the core's 128-blockwise FP8 tiles after dd40abf (a gate tile's step
scale = A's column x one scalar per W block) against cuBLAS per-tensor ``torch._scaled_mm`` (cuBLAS takes no
block scales in this form), device time (CUDA graph replays, median of 20; contenders in turn). run102 (before):
128x128 0.42-0.50x.
    python block_probe.py OUT_DIR"""
import json
import sys

import torch

from triton_dist.kernels import fp8
from triton_dist.kernels.gemm import gemm, gemm_config

sys.path.insert(0, __file__.rsplit("/", 2)[0] + "/2026-12-03_h200x1_run102")
from fp8_probe import SHAPES, device_us  # noqa: E402

TILES = {"default": {}, "128x128 s4": dict(BLOCK_N=128, num_stages=4), "128x128 s5": dict(BLOCK_N=128, num_stages=5),
         "128x128 s5 g16": dict(BLOCK_N=128, num_stages=5, GROUP_M=16),
         "256x128 s3": dict(BLOCK_M=256, BLOCK_N=128, num_stages=3)}


def main(out_dir):
    rows = []
    for m, n, k in SHAPES:
        x, y = torch.randn(m, k, device="cuda"), torch.randn(n, k, device="cuda") / 16
        at, st = fp8.quantize(x, "tensor")
        wt, swt = fp8.quantize(y, "tensor")
        cublas = device_us(lambda: torch._scaled_mm(at, wt.t(), st.reshape(()), swt.reshape(()),
                                                    out_dtype=torch.bfloat16))
        a, sa = fp8.quantize(x, "group")
        w, sw = fp8.quantize(y, "block")
        exact = (fp8.expand(sa, "group", m, k) * a.float()) @ (fp8.expand(sw, "block", n, k) * w.float()).t()
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        row = {"M": m, "N": n, "K": k, "cuBLAS tensor": cublas}
        for label, over in TILES.items():
            cfg = {**gemm_config(m, n, k, a.dtype, a.device, fp8.Scales("block", sa, sw, False)), **over}
            call = lambda: gemm(a, w, out=out, scale_a=sa, scale_w=sw, scaling="block", config=cfg)  # noqa: E731
            try:
                us = device_us(call)
            except Exception as exc:
                print(f"{m}x{n}x{k} {label}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                continue
            call()
            err = ((out.float() - exact).abs().max() / exact.abs().max()).item()
            row[f"ours {label}"], row[f"err {label}"] = us, err
            print(f"{m}x{n}x{k} block {label:16s} {us:8.1f} us {2 * m * n * k / us / 1e6:6.0f} TFLOP/s cuBLAS tensor "
                  f"{cublas:8.1f} -> {cublas / us:.2f}x err {err:.1e}", flush=True)
        rows.append(row)
        json.dump(rows, open(f"{out_dir}/block_probe.json", "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
