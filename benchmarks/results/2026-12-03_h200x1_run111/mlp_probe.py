"""run111's MLP probe (one H200, W = 1): the gated input projection of a TP-MLP, 4096 tokens, 4096 -> 14336, bf16,
device time (CUDA graph replays, median of 20, in turn): HF's (two cuBLAS GEMMs, bf16 silu * up), the fallback
path's (one cuBLAS GEMM over [gate; up], silu * up in fp32: ``silu_gate_torch``), and the GEMM core's fused SiLU
gate (``launch_gemm(silu_gate=True)``: no [M, 2I] tensor), default and a few tiles; and the down projection.
    python mlp_probe.py OUT_DIR"""
import json
import sys

import torch

from triton_dist.kernels.allgather_gemm import silu_gate_torch
from triton_dist.kernels.gemm import gemm, gemm_config, launch_gemm

sys.path.insert(0, __file__.rsplit("/", 2)[0] + "/2026-12-03_h200x1_run102")
from fp8_probe import device_us  # noqa: E402

TILES = {"default": {}, "128x128 s4": dict(BLOCK_N=128, num_stages=4), "128x256 s3": dict(BLOCK_N=256, num_stages=3),
         "128x128 s4 sub": dict(BLOCK_N=128, num_stages=4, EPILOGUE_SUBTILE=True),
         "128x128 s5 ws": dict(BLOCK_N=128, num_stages=5, WARP_SPECIALIZE=True)}


def main(out_dir):
    rows = []
    for m, h, inter in [(4096, 4096, 14336), (2048, 2048, 5632), (16384, 4096, 14336)]:
        x = torch.randn(m, h, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(2 * inter, h, device="cuda", dtype=torch.bfloat16) / h ** 0.5
        wg, wu = w[:inter], w[inter:]
        out = torch.empty(m, inter, device="cuda", dtype=torch.bfloat16)
        row = {"M": m, "H": h, "I": inter}
        row["hf"] = device_us(lambda: torch.nn.functional.silu(x @ wg.t()) * (x @ wu.t()))
        row["fallback"] = device_us(lambda: silu_gate_torch(x @ w.t()))
        ref = silu_gate_torch(x.float() @ w.float().t())
        base = gemm_config(m, 2 * inter, h, x.dtype, x.device)
        for label, over in TILES.items():
            cfg = {**base, "BLOCK_N": max(16, base["BLOCK_N"] // 2), "SPLIT_N": False, **over}
            call = lambda: launch_gemm(x, w, out.view(1, m, inter), cfg, silu_gate=True)  # noqa: E731
            try:
                row[f"fused {label}"] = device_us(call)
            except Exception as exc:
                print(f"{m}x{h}x{inter} fused {label}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                continue
            call()
            row[f"err {label}"] = ((out.float() - ref).abs().max() / ref.abs().max()).item()
        wd = torch.randn(h, inter, device="cuda", dtype=torch.bfloat16) / inter ** 0.5
        act = torch.randn(m, inter, device="cuda", dtype=torch.bfloat16)
        row["down cuBLAS"] = device_us(lambda: act @ wd.t())
        row["down ours"] = device_us(lambda: gemm(act, wd))
        print({k: (round(v, 1) if isinstance(v, float) and v > 0.01 else v) for k, v in row.items()}, flush=True)
        rows.append(row)
    json.dump(rows, open(f"{out_dir}/mlp_probe.json", "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
