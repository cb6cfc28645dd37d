"""run147's probe: the Gluon FP8 mainloop (kernels/gemm_sm90.py) once ptxas keeps its wgmmas asynchronous.

run146 measured it at 0.37-0.58x of ``_scaled_mm``: ptxas had serialized every wgmma (its C7514: a partial still in
flight was copied at a loop's back edge). The kernel now keeps no partial in flight across a loop boundary and
``tests/kernels/test_gemm_sm90.py`` asserts ptxas's silence. Measured here, against fp64, ``_scaled_mm`` and the
Triton core tuned without the Gluon mainloop, per-tensor, rowwise and 128-blockwise, at 4, 5 and 6 stages.

    python mainloop_probe.py OUT_DIR       # on a Hopper GPU
"""
import json
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "2026-12-03_h200x1_run102"))
from fp8_probe import device_us  # noqa: E402  (CUDA-graph replays, median of 20)

SHAPES = [(8192, 8192, 8192), (4096, 6144, 4096), (2048, 8192, 8192), (8192, 28672, 8192), (512, 4096, 8192),
          (1000, 3072, 1152), (4096, 4096, 3200)]  # the last two: an odd count of K steps
STAGES = (4, 5, 6)


def rel_err(c, exact):
    d = c.double() - exact
    return (d.norm() / exact.norm()).item()


def gluon(a, w, sa, sw, mode, stages, out_dtype=torch.bfloat16):
    from triton_dist.kernels import gemm_sm90
    m, n = a.shape[0], w.shape[0]
    c = torch.empty(m, n, device=a.device, dtype=out_dtype)
    cfg = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_stages=stages, num_warps=8)
    sms = torch.cuda.get_device_properties(a.device).multi_processor_count
    grid = (min(sms, triton.cdiv(m, 128) * triton.cdiv(n, 128)),)
    sa = sa.reshape(sa.shape[0], -1) if sa.numel() > 1 else sa.reshape(1, 1)
    sw = sw.reshape(sw.shape[0], -1) if sw.numel() > 1 else sw.reshape(1, 1)
    return gemm_sm90.launch(a, w, c, cfg, mode, sa, sw, grid)


def main(out_dir):
    from triton_dist.kernels import fp8 as fp8_mod
    from triton_dist.kernels import gemm_sm90
    from triton_dist.kernels.gemm import scaled_gemm
    gemm_sm90.TUNER_OFFERS = False  # "core": the Triton core's tuned configuration
    rows = []
    for m, n, k in SHAPES:
        torch.manual_seed(0)
        x, y = torch.randn(m, k, device="cuda"), torch.randn(n, k, device="cuda") / 4
        for mode in ("tensor", "row", "block"):
            row = {"M": m, "N": n, "K": k, "scaling": mode, "gpu": torch.cuda.get_device_name()}
            a_mode = "group" if mode == "block" else mode
            (a, sa), (w, sw) = fp8_mod.quantize(x, a_mode), fp8_mod.quantize(y, mode)
            exact = (a.double() * fp8_mod.expand(sa, a_mode, m, k)) @ (w.double() * fp8_mod.expand(sw, mode, n, k)).T
            if mode == "block":  # block scales: per-tensor cuBLAS as the bar (issue 34)
                one = torch.ones((), device="cuda")
                a1, w1 = x.to(torch.float8_e4m3fn), y.to(torch.float8_e4m3fn)
                row["cuBLAS us"] = device_us(lambda: torch._scaled_mm(a1, w1.t(), one, one, out_dtype=torch.bfloat16))
            else:
                sw_ = sw.reshape(1, -1) if mode == "row" else sw
                row["cuBLAS us"] = device_us(lambda: torch._scaled_mm(a, w.t(), sa, sw_, out_dtype=torch.bfloat16))
            row["err core"] = rel_err(scaled_gemm(a, w, sa, sw, scaling=mode, out_dtype=torch.float32), exact)
            row["core us"] = device_us(lambda: scaled_gemm(a, w, sa, sw, scaling=mode))
            for s in STAGES:
                try:
                    if s == 5:
                        row["err gluon"] = rel_err(gluon(a, w, sa, sw, mode, s, torch.float32), exact)
                    row[f"gluon s{s} us"] = device_us(lambda: gluon(a, w, sa, sw, mode, s))
                except Exception as exc:
                    print(f"{m}x{n}x{k} {mode} s{s}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            bar = row["cuBLAS us"]
            cells = [f"{name} {row[name + ' us']:.1f} ({bar / row[name + ' us']:.2f}x)"
                     for name in ["core"] + [f"gluon s{s}" for s in STAGES] if name + " us" in row]
            print(f"{m}x{n}x{k} {mode:6s} cuBLAS {bar:.1f} us | " + " | ".join(cells)
                  + f" | err core {row['err core']:.1e} gluon {row.get('err gluon', float('nan')):.1e}", flush=True)
            rows.append(row)
            json.dump(rows, open(f"{out_dir}/mainloop_probe.json", "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
