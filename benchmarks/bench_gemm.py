"""The GEMM core alone vs cuBLAS on the per-rank AG+GEMM shapes (torchrun --nproc-per-node=N
benchmarks/bench_gemm.py; every rank times its own GPU, the table is the max over ranks).

  ours tuned     triton_dist.kernels.gemm.gemm, autotuned per shape (persistent, TMA, pipelined)
  ours default   the fixed default configuration
  each knob      the sweep's candidates, so the best levers on this GPU are visible
  cuBLAS         torch.matmul(a, w.T)
"""

import os

import torch

import triton_dist as td
from harness import record
from triton_dist.timing import time_us
from triton_dist.kernels import gemm as core

SHAPES = [(8192, 8192, 8192), (8192, 28672, 8192), (8192, 8192, 28672), (2048, 8192, 8192), (512, 8192, 8192),
          (128, 8192, 8192)]


def _label(cfg):
    parts = [f"{cfg['BLOCK_M']}x{cfg['BLOCK_N']}x{cfg['BLOCK_K']}", f"s{cfg['num_stages']}", f"w{cfg['num_warps']}"]
    parts += [name.lower() for name in ("EPILOGUE_SUBTILE", "FLATTEN", "WARP_SPECIALIZE") if cfg.get(name)]
    return " ".join(parts)


def main():
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    td.init(backend="cuda")
    world = td.world_size()
    rows = []
    for m_total, n_total, k in SHAPES:
        m, n = m_total, n_total // world  # the GEMM each rank runs in AG+GEMM
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 16
        out = torch.empty((m, n), device="cuda", dtype=torch.bfloat16)
        ref = (a @ w.T).float()
        core.gemm(a, w, out=out)  # tunes once
        err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
        t_tuned = time_us(lambda: core.gemm(a, w, out=out))
        t_cublas = time_us(lambda: torch.matmul(a, w.T, out=out))
        knobs = {_label(c): time_us(lambda: core.gemm(a, w, out=out, config=c), iters=10, warmup=2)
                 for c in core.gemm_candidates(m, n, k, a.dtype, a.device)}
        best = min(knobs, key=knobs.get)
        tflops = lambda t: 2 * m * n * k / t / 1e6  # noqa: E731
        rows.append({"M": m, "N": n, "K": k, "ours us": t_tuned, "ours TFLOP/s": tflops(t_tuned),
                     "cuBLAS us": t_cublas, "cuBLAS TFLOP/s": tflops(t_cublas), "ours/cuBLAS": t_cublas / t_tuned,
                     "best knob": best, "best knob us": knobs[best],
                     "all knobs": "; ".join(f"{k_}: {v:.0f}" for k_, v in knobs.items()), "max rel err": err})
    record("gemm_core", rows, notes="bf16 per-rank GEMM a[M,K] @ w[N,K].T; median of 20, max over ranks")
    td.finalize()


if __name__ == "__main__":
    main()
