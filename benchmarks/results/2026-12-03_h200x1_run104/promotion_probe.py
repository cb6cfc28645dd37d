"""run104's FP8 promotion probe (one H200): what the fp32 promotion of the tensor cores' partial sums costs, by
how it is written. A plain (non-persistent) TMA matmul e4m3 -> bf16 at 8192^3 and 2048x8192x8192, device time of
CUDA-graph replays (median of 20), against torch._scaled_mm with and without fast accumulation:
  fast       acc = tl.dot(a, b.T, acc)                                   (no promotion)
  mia        acc = tl.dot(a, b.T, acc, max_num_imprecise_acc=BLOCK_K)   (the core's promoted mode today)
  add        acc += tl.dot(a, b.T)                                       (a fresh partial per K step)
  lagged     p = tl.dot(a, b.T); acc += p_prev; p_prev = p               (the add one step behind the MMA, so the
                                                                           CUDA-core adds can overlap the next wgmma)
    python promotion_probe.py OUT_DIR"""
import json
import os
import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "2026-12-03_h200x1_run102"))
from fp8_probe import device_us  # noqa: E402  (CUDA-graph replays, median of 20)


@triton.jit
def fp8_matmul(a, b, c, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               MODE: tl.constexpr, GROUP_M: tl.constexpr = 8):
    pid = tl.program_id(0)
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * tiles_n)
    first_m = group * GROUP_M
    rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * tiles_n)) % rows
    pid_n = (pid % (GROUP_M * tiles_n)) // rows
    om, on = pid_m * BLOCK_M, pid_n * BLOCK_N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    prev = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        x = a.load([om, k])
        y = b.load([on, k])
        if MODE == "fast":
            acc = tl.dot(x, y.T, acc)
        elif MODE == "mia":
            acc = tl.dot(x, y.T, acc, max_num_imprecise_acc=BLOCK_K)
        elif MODE == "add":
            acc += tl.dot(x, y.T)
        else:
            p = tl.dot(x, y.T)
            acc += prev
            prev = p
    if MODE == "lagged":
        acc += prev
    c.store([om, on], acc.to(tl.bfloat16))


def main(out_dir):
    rows = []
    for m, n, k in [(8192, 8192, 8192), (2048, 8192, 8192)]:
        a = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
        b = (torch.randn(n, k, device="cuda") / 4).to(torch.float8_e4m3fn)
        one = torch.ones((), device="cuda")
        exact = (a.float() @ b.float().T)
        row = {"M": m, "N": n, "K": k}
        for fast in (False, True):
            row[f"cuBLAS{' fast' if fast else ''}"] = device_us(
                lambda: torch._scaled_mm(a, b.t(), one, one, out_dtype=torch.bfloat16, use_fast_accum=fast))
        for bm, bn, stages in [(128, 256, 3), (128, 128, 4), (128, 128, 5)]:
            c = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            da = TensorDescriptor(a, [m, k], [k, 1], [bm, 128])
            db = TensorDescriptor(b, [n, k], [k, 1], [bn, 128])
            dc = TensorDescriptor(c, [m, n], [n, 1], [bm, bn])
            grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
            for mode in ("fast", "mia", "add", "lagged"):
                label = f"{mode} {bm}x{bn} s{stages}"
                try:
                    call = lambda: fp8_matmul[grid](da, db, dc, m, n, k, bm, bn, 128, mode,  # noqa: E731
                                                    num_warps=8, num_stages=stages)
                    us = device_us(call)
                    call()
                    err = ((c.float() - exact).abs().max() / exact.abs().max()).item()
                except Exception as exc:
                    print(f"{m}x{n}x{k} {label}: {type(exc).__name__}: {str(exc)[:150]}", flush=True)
                    continue
                row[label] = us
                row[f"err {label}"] = err
                print(f"{m}x{n}x{k} {label:22s} {us:8.1f} us  {2 * m * n * k / us / 1e6:6.0f} TFLOP/s  "
                      f"cuBLAS {row['cuBLAS']:.1f} / fast {row['cuBLAS fast']:.1f}  err {err:.2e}", flush=True)
        rows.append(row)
        json.dump(rows, open(f"{out_dir}/promotion_probe.json", "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
