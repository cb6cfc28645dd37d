"""run111's tile probe (one H200): 16-warp FP8 tiles (four consumer warpgroups, each 64 rows: the accumulators
and the promoted partial sums in half the registers per thread; ptxas caps them at 128 and spills 144-240 B on
sm_90a) against the 8-warp defaults, block scales and promoted rowwise, device time vs cuBLAS (run110's
block_probe, run102's fp8_probe timing).
    python tile_probe.py OUT_DIR"""
import json
import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 2)[0] + "/2026-12-03_h200x1_run110")
import block_probe  # noqa: E402
from block_probe import SHAPES, device_us, fp8, gemm, gemm_config  # noqa: E402

block_probe.TILES = {"default": {}, "256x128 w16 s3": dict(BLOCK_M=256, BLOCK_N=128, num_warps=16, num_stages=3),
                     "256x128 w16 s4": dict(BLOCK_M=256, BLOCK_N=128, num_warps=16, num_stages=4)}
ROWS = {"default": {}, "256x128 w8 s3": dict(BLOCK_M=256, BLOCK_N=128, num_stages=3, SPLIT_N=False),
        "256x128 w16 s3": dict(BLOCK_M=256, BLOCK_N=128, num_warps=16, num_stages=3, SPLIT_N=False),
        "128x256 w16 s3": dict(BLOCK_M=128, BLOCK_N=256, num_warps=16, num_stages=3, SPLIT_N=False)}


def rows(out_dir):
    result = []
    for m, n, k in SHAPES[:1] + SHAPES[2:]:
        x, y = torch.randn(m, k, device="cuda"), torch.randn(n, k, device="cuda") / 16
        a, sa = fp8.quantize(x, "row")
        w, sw = fp8.quantize(y, "row")
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        ref = lambda: torch._scaled_mm(a, w.t(), sa, sw.t(), out_dtype=torch.bfloat16)  # noqa: E731
        cublas = device_us(ref)
        exact = ref().float()
        row = {"M": m, "N": n, "K": k, "cuBLAS row": cublas}
        for label, over in ROWS.items():
            cfg = {**gemm_config(m, n, k, a.dtype, a.device, fp8.Scales("row", sa, sw, False)), **over}
            call = lambda: gemm(a, w, out=out, scale_a=sa, scale_w=sw, config=cfg)  # noqa: E731
            try:
                us = device_us(call)
            except Exception as exc:
                print(f"{m}x{n}x{k} row {label}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                continue
            call()
            err = ((out.float() - exact).abs().max() / exact.abs().max()).item()
            row[f"ours {label}"] = us
            print(f"{m}x{n}x{k} row {label:16s} {us:8.1f} us cuBLAS {cublas:8.1f} -> {cublas / us:.2f}x err {err:.1e}",
                  flush=True)
        result.append(row)
    json.dump(result, open(f"{out_dir}/tile_probe_rows.json", "w"), indent=1)


if __name__ == "__main__":
    rows(sys.argv[1])
    block_probe.main(sys.argv[1])
