"""run126's FP8 promotion probe (planned for one H200): a promoted FP8 tile as two accumulators split along M
(256x128 as two 128-row halves, each its own dot per K step, the B tile feeding both), next to run106's split
along N and the single accumulators the tuner chose (run108: 256x128 s3, 0.81x of ``_scaled_mm``). A plain
(non-persistent) TMA matmul e4m3 -> bf16, ``max_num_imprecise_acc = BLOCK_K`` (the core's promoted mode), device
time of CUDA-graph replays (median of 20) against ``torch._scaled_mm`` with and without fast accumulation.
    python split_m_probe.py OUT_DIR       # on a GPU: time every variant
    python split_m_probe.py --registers   # anywhere (triton 3.6 on the path): registers and spills per variant
"""
import json
import os
import sys

import torch
import triton
import triton.language as tl

VARIANTS = {  # label: (BLOCK_M, BLOCK_N, split: "" / "m" / "n", num_stages)
    "128x256 one s3": (128, 256, "", 3), "128x256 split-n s3": (128, 256, "n", 3),
    "256x128 one s3": (256, 128, "", 3), "256x128 split-m s3": (256, 128, "m", 3),
    "256x128 split-m s4": (256, 128, "m", 4), "128x128 one s5": (128, 128, "", 5),
}
BLOCK_K = 128


@triton.jit
def promoted_matmul(a, b, c, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    SPLIT: tl.constexpr, GROUP_M: tl.constexpr = 8):
    pid = tl.program_id(0)
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * tiles_n)
    first_m = group * GROUP_M
    rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * tiles_n)) % rows
    pid_n = (pid % (GROUP_M * tiles_n)) // rows
    om, on = pid_m * BLOCK_M, pid_n * BLOCK_N
    if SPLIT == "m":  # two [BLOCK_M / 2, BLOCK_N] accumulators: A's descriptor holds half the rows
        HALF: tl.constexpr = BLOCK_M // 2
        top = tl.zeros((HALF, BLOCK_N), dtype=tl.float32)
        bottom = tl.zeros((HALF, BLOCK_N), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            y = b.load([on, k])
            top = tl.dot(a.load([om, k]), y.T, top, max_num_imprecise_acc=BLOCK_K)
            bottom = tl.dot(a.load([om + HALF, k]), y.T, bottom, max_num_imprecise_acc=BLOCK_K)
        c.store([om, on], top.to(tl.bfloat16))
        c.store([om + HALF, on], bottom.to(tl.bfloat16))
    elif SPLIT == "n":  # two [BLOCK_M, BLOCK_N / 2] accumulators: B's descriptor holds half the rows
        HALF_N: tl.constexpr = BLOCK_N // 2
        left = tl.zeros((BLOCK_M, HALF_N), dtype=tl.float32)
        right = tl.zeros((BLOCK_M, HALF_N), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            x = a.load([om, k])
            left = tl.dot(x, b.load([on, k]).T, left, max_num_imprecise_acc=BLOCK_K)
            right = tl.dot(x, b.load([on + HALF_N, k]).T, right, max_num_imprecise_acc=BLOCK_K)
        c.store([om, on], left.to(tl.bfloat16))
        c.store([om, on + HALF_N], right.to(tl.bfloat16))
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            acc = tl.dot(a.load([om, k]), b.load([on, k]).T, acc, max_num_imprecise_acc=BLOCK_K)
        c.store([om, on], acc.to(tl.bfloat16))


def blocks(bm, bn, split):
    """The descriptors' blocks (A, B, C) of a variant."""
    a_rows = bm // 2 if split == "m" else bm
    b_rows = bn // 2 if split == "n" else bn
    c_block = [bm // 2, bn] if split == "m" else [bm, bn // 2] if split == "n" else [bm, bn]
    return [a_rows, BLOCK_K], [b_rows, BLOCK_K], c_block


def registers():
    """Each variant compiled for sm_90a (no GPU needed): registers and spilled bytes (scripts/ptx_digest.py)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "scripts"))
    from ptx_digest import registers as ptxas_registers

    for label, (bm, bn, split, stages) in VARIANTS.items():
        a_b, b_b, c_b = blocks(bm, bn, split)
        sig = dict(a=f"tensordesc<fp8e4nv[{a_b[0]},{a_b[1]}]>", b=f"tensordesc<fp8e4nv[{b_b[0]},{b_b[1]}]>",
                   c=f"tensordesc<bf16[{c_b[0]},{c_b[1]}]>", M="i32", N="i32", K="i32", BLOCK_M="constexpr",
                   BLOCK_N="constexpr", BLOCK_K="constexpr", SPLIT="constexpr", GROUP_M="constexpr")
        consts = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=BLOCK_K, SPLIT=split, GROUP_M=8)
        src = ASTSource(fn=promoted_matmul, signature=sig, constexprs=consts)
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                             options=dict(num_warps=8, num_stages=stages)).asm["ptx"]
        print(f"{label:22s} {ptxas_registers(ptx)}", flush=True)


def main(out_dir):
    from triton.tools.tensor_descriptor import TensorDescriptor

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "2026-12-03_h200x1_run102"))
    from fp8_probe import device_us  # noqa: E402  (CUDA-graph replays, median of 20)

    rows = []
    for m, n, k in [(8192, 8192, 8192), (8192, 28672, 8192), (4096, 6144, 4096), (2048, 8192, 8192)]:
        a = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
        b = (torch.randn(n, k, device="cuda") / 4).to(torch.float8_e4m3fn)
        one = torch.ones((), device="cuda")
        exact = a.float() @ b.float().T
        row = {"M": m, "N": n, "K": k}
        for fast in (False, True):
            row[f"cuBLAS{' fast' if fast else ''}"] = device_us(
                lambda: torch._scaled_mm(a, b.t(), one, one, out_dtype=torch.bfloat16, use_fast_accum=fast))
        for label, (bm, bn, split, stages) in VARIANTS.items():
            c = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
            a_b, b_b, c_b = blocks(bm, bn, split)
            da, db = TensorDescriptor(a, [m, k], [k, 1], a_b), TensorDescriptor(b, [n, k], [k, 1], b_b)
            dc = TensorDescriptor(c, [m, n], [n, 1], c_b)
            grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
            try:
                call = lambda: promoted_matmul[grid](da, db, dc, m, n, k, bm, bn, BLOCK_K, split,  # noqa: E731
                                                     num_warps=8, num_stages=stages)
                us = device_us(call)
                call()
                err = ((c.float() - exact).abs().max() / exact.abs().max()).item()
            except Exception as exc:
                print(f"{m}x{n}x{k} {label}: {type(exc).__name__}: {str(exc)[:150]}", flush=True)
                continue
            row[label], row[f"err {label}"] = us, err
            print(f"{m}x{n}x{k} {label:22s} {us:8.1f} us  {2 * m * n * k / us / 1e6:6.0f} TFLOP/s  "
                  f"cuBLAS {row['cuBLAS']:.1f} ({row['cuBLAS'] / us:.2f}x) / fast {row['cuBLAS fast']:.1f}  "
                  f"err {err:.2e}", flush=True)
        rows.append(row)
        json.dump(rows, open(f"{out_dir}/split_m_probe.json", "w"), indent=1)


if __name__ == "__main__":
    if sys.argv[1:] == ["--registers"]:
        registers()
    else:
        main(sys.argv[1])
