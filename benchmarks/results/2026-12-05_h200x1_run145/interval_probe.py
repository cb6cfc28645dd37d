"""run145's FP8 promotion-interval probe (one GPU): does promoting the tensor cores' partial sums every 256 K
elements instead of every 128 recover the speed the promotion costs, and is it then less accurate than cuBLAS?

A plain (non-persistent) TMA matmul e4m3 x e4m3, device time of CUDA-graph replays (median of 20, bf16 out), and the
error of its fp32 output against the exact fp64 product of the same FP8 values (max and root-mean-square, relative
to the product's max / norm), beside torch._scaled_mm with and without fast accumulation:
  fast     acc = tl.dot(a, b.T, acc)                                    no promotion (wgmma accumulates all of K)
  mia128   acc = tl.dot(a, b.T, acc, max_num_imprecise_acc=128)          the core's promoted mode today, BLOCK_K 128
  pair     p = tl.dot(a0, b0.T); p = tl.dot(a1, b1.T, p); acc += p       two 128-wide K steps per promotion
  mia256   acc = tl.dot(a, b.T, acc, max_num_imprecise_acc=256)          BLOCK_K 256 (fewer stages fit)
Inputs: "randn" (a ~ N(0,1), b ~ N(0,1)/4) and "positive" (their absolute values: every product adds, the case
where a coarse accumulator swamps).
"core": the same question asked of the GEMM core itself (``scaled_gemm``, per-tensor scales, configurations given
as overrides, so no tuning): its 128-wide K steps against 256-wide ones (a stage's bytes doubled: 2 stages, the
result stored in two halves so that shared memory holds the pipeline and the staging buffer).
    python interval_probe.py OUT_DIR [plain|core|both]
Ran: the core part in run144 (benchmarks/results/2026-12-05_h100x1_run144); the plain part has not run (its code
was folded into ``sweep`` afterwards: the same measurements)."""
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
               MODE: tl.constexpr, OUT_BF16: tl.constexpr, GROUP_M: tl.constexpr = 8):
    pid = tl.program_id(0)
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * tiles_n)
    first_m = group * GROUP_M
    rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * tiles_n)) % rows
    pid_n = (pid % (GROUP_M * tiles_n)) // rows
    om, on = pid_m * BLOCK_M, pid_n * BLOCK_N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if MODE == "pair":
        for k in range(0, K, 2 * BLOCK_K):
            x0 = a.load([om, k])
            y0 = b.load([on, k])
            x1 = a.load([om, k + BLOCK_K])
            y1 = b.load([on, k + BLOCK_K])
            p = tl.dot(x0, y0.T)
            p = tl.dot(x1, y1.T, p)
            acc += p
    else:
        for k in range(0, K, BLOCK_K):
            x = a.load([om, k])
            y = b.load([on, k])
            if MODE == "fast":
                acc = tl.dot(x, y.T, acc)
            else:
                acc = tl.dot(x, y.T, acc, max_num_imprecise_acc=BLOCK_K)
    if OUT_BF16:
        c.store([om, on], acc.to(tl.bfloat16))
    else:
        c.store([om, on], acc)


SHAPES = [(8192, 8192, 8192), (4096, 6144, 4096), (2048, 8192, 8192), (8192, 28672, 8192)]
KERNELS = [  # (mode, BLOCK_M, BLOCK_N, BLOCK_K, stages): pair's two loads take a stage's bytes twice
    ("fast", 256, 128, 128, 3), ("mia128", 256, 128, 128, 3), ("mia256", 256, 128, 256, 2),
    ("mia128", 128, 256, 128, 3), ("mia256", 128, 256, 256, 2),
    ("mia128", 128, 128, 128, 5), ("mia256", 128, 128, 256, 3), ("pair", 128, 128, 128, 3),
]


def errors(c, exact):
    d = c.double() - exact
    return (d.abs().max() / exact.abs().max()).item(), (d.norm() / exact.norm()).item()


def sweep(out_path, measure):
    """Every shape and kind of input: cuBLAS with and without fast accumulation, then ``measure(row, a, b, exact,
    timed)`` (ours: each label's device time where ``timed``, and "err <label>"); each row printed and dumped."""
    rows = []
    for m, n, k in SHAPES:
        torch.manual_seed(0)
        base_a, base_b = torch.randn(m, k, device="cuda"), torch.randn(n, k, device="cuda") / 4
        one = torch.ones((), device="cuda")
        for inputs in ("randn", "positive"):
            a = (base_a if inputs == "randn" else base_a.abs()).to(torch.float8_e4m3fn)
            b = (base_b if inputs == "randn" else base_b.abs()).to(torch.float8_e4m3fn)
            exact = a.double() @ b.double().T
            timed = inputs == "randn"  # time once per shape
            row = {"M": m, "N": n, "K": k, "inputs": inputs}
            for fast in (False, True):
                name = f"cuBLAS{' fast' if fast else ''}"
                mm = lambda dt: torch._scaled_mm(a, b.t(), one, one, out_dtype=dt, use_fast_accum=fast)  # noqa
                if timed:
                    row[name] = device_us(lambda: mm(torch.bfloat16))
                row[f"err {name}"] = errors(mm(torch.float32), exact)
            measure(row, a, b, exact, timed)
            for key in [key for key in row if key.startswith("err ")]:
                name = key[4:]
                us = row.get(name)
                speed = (f"{us:8.1f} us {2 * m * n * k / us / 1e6:6.0f} TFLOP/s {row['cuBLAS'] / us:5.2f}x cuBLAS"
                         if us else " " * 46) if timed else ""
                print(f"{m}x{n}x{k} {inputs:8s} {name:30s} {speed} err max {row[key][0]:.2e} rms {row[key][1]:.2e}",
                      flush=True)
            rows.append(row)
            json.dump(rows, open(out_path, "w"), indent=1)


def failed(row, label, exc):
    print(f"{row['M']}x{row['N']}x{row['K']} {label}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)


def plain(row, a, b, exact, timed):
    """The probe kernel in every mode of KERNELS."""
    (m, k), n = a.shape, b.shape[0]
    for mode, bm, bn, bk, stages in KERNELS:
        label = f"{mode} {bm}x{bn}x{bk} s{stages}"
        grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
        da = TensorDescriptor(a, [m, k], [k, 1], [bm, bk])
        db = TensorDescriptor(b, [n, k], [k, 1], [bn, bk])
        try:
            for out_dtype in ((torch.bfloat16, torch.float32) if timed else (torch.float32,)):
                c = torch.empty(m, n, device="cuda", dtype=out_dtype)
                dc = TensorDescriptor(c, [m, n], [n, 1], [bm, bn])
                call = lambda: fp8_matmul[grid](da, db, dc, m, n, k, bm, bn, bk, mode,  # noqa: E731
                                                out_dtype == torch.bfloat16, num_warps=8, num_stages=stages)
                if out_dtype == torch.bfloat16:
                    row[label] = device_us(call)
                else:
                    call()
                    row[f"err {label}"] = errors(c, exact)
        except Exception as exc:
            failed(row, label, exc)


CORE_CONFIGS = {  # label: overrides of gemm_config
    "core 128x256x128 s3 split": dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=128, num_stages=3, SPLIT_N=True),
    "core 256x128x128 s3": dict(BLOCK_M=256, BLOCK_N=128, BLOCK_K=128, num_stages=3, SPLIT_N=False),
    "core 256x128x256 s2 sub": dict(BLOCK_M=256, BLOCK_N=128, BLOCK_K=256, num_stages=2, SPLIT_N=False,
                                    EPILOGUE_SUBTILE=True),
    "core 128x256x256 s2 split sub": dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=256, num_stages=2, SPLIT_N=True,
                                          EPILOGUE_SUBTILE=True),
    "core 128x128x256 s3 sub": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=256, num_stages=3, SPLIT_N=False,
                                    EPILOGUE_SUBTILE=True),
}


def core(row, a, b, exact, timed):
    """The GEMM core (``scaled_gemm``, per-tensor scales) at each of CORE_CONFIGS."""
    from triton_dist.kernels.gemm import scaled_gemm
    one = torch.ones((1,), device="cuda")
    for label, cfg in CORE_CONFIGS.items():
        try:
            if timed:
                out = torch.empty(a.shape[0], b.shape[0], device="cuda", dtype=torch.bfloat16)
                row[label] = device_us(lambda: scaled_gemm(a, b, one, one, out=out, config=cfg))
            c = scaled_gemm(a, b, one, one, out_dtype=torch.float32, config=cfg)
            row[f"err {label}"] = errors(c, exact)
        except Exception as exc:
            failed(row, label, exc)


if __name__ == "__main__":
    part = sys.argv[2] if len(sys.argv) > 2 else "both"
    if part in ("core", "both"):
        sweep(f"{sys.argv[1]}/interval_core.json", core)
    if part in ("plain", "both"):
        sweep(f"{sys.argv[1]}/interval_probe.json", plain)
