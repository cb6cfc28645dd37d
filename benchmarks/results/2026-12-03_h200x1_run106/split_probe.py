"""run106's FP8 split-accumulator probe (one H200). A 128x256 FP8 tile with the tensor cores' partial sums promoted
to fp32 every K step needs two fp32 [128, 256] values per program (the sum and the step's partial): 256 registers a
thread at 8 warps, so it spills (run104/105). Here the tile's columns are two 128-wide halves, each its own dot and
its own accumulator: the partial of one half is 64 registers, sum + partial 192. Plain (non-persistent) TMA matmul
e4m3 -> bf16, device time of CUDA-graph replays (median of 20), against torch._scaled_mm:
  fast / mia           one [128, 256] dot per K step (no promotion / max_num_imprecise_acc=BLOCK_K)
  split_fast / split_mia / split_add   two [128, 128] dots per K step (no promotion / mia / acc += dot)
  split_rescale        block scales through mia: acc = dot(a, b, acc / s, mia) * s (s: the step's scales)
  split_block          split_add times 128-blockwise scales (A: 1x128 groups, B: 128x128 blocks: a scalar per half)
  block128             one [128, 128] dot, acc += dot * scales (the core's block-scaled tile today)
    python split_probe.py OUT_DIR         # run on a GPU
    python split_probe.py --compile       # registers / spills / wgmma waits of each variant, sm_90a, no GPU"""
import json
import os
import re
import sys

import triton
import triton.language as tl


@triton.jit
def fp8_matmul(a, b, c, scale_a, scale_b, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, MODE: tl.constexpr, GROUP_M: tl.constexpr = 8):
    pid = tl.program_id(0)
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * tiles_n)
    first_m = group * GROUP_M
    rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * tiles_n)) % rows
    pid_n = (pid % (GROUP_M * tiles_n)) // rows
    om, on = pid_m * BLOCK_M, pid_n * BLOCK_N
    HALF: tl.constexpr = BLOCK_N // 2
    k_blocks = tl.cdiv(K, 128)
    offs_m = om + tl.arange(0, BLOCK_M)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    left = tl.zeros((BLOCK_M, HALF), dtype=tl.float32)
    right = tl.zeros((BLOCK_M, HALF), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        x = a.load([om, k])
        if MODE == "fast":
            acc = tl.dot(x, b.load([on, k]).T, acc)
        elif MODE == "mia":
            acc = tl.dot(x, b.load([on, k]).T, acc, max_num_imprecise_acc=BLOCK_K)
        elif MODE == "block128":
            s = (tl.load(scale_a + offs_m * k_blocks + k // 128)[:, None]
                 * tl.load(scale_b + (on // 128) * k_blocks + k // 128))
            acc += tl.dot(x, b.load([on, k]).T) * s
        elif MODE == "split_fast":
            left = tl.dot(x, b.load([on, k]).T, left)
            right = tl.dot(x, b.load([on + HALF, k]).T, right)
        elif MODE == "split_mia" or MODE == "split_mia_join":
            left = tl.dot(x, b.load([on, k]).T, left, max_num_imprecise_acc=BLOCK_K)
            right = tl.dot(x, b.load([on + HALF, k]).T, right, max_num_imprecise_acc=BLOCK_K)
        elif MODE == "split_add":
            left += tl.dot(x, b.load([on, k]).T)
            right += tl.dot(x, b.load([on + HALF, k]).T)
        elif MODE == "split_rescale":  # block scales through mia: acc = (acc / s + partial) * s
            s_a = tl.load(scale_a + offs_m * k_blocks + k // 128)[:, None]
            s_left = s_a * tl.load(scale_b + (on // 128) * k_blocks + k // 128)
            s_right = s_a * tl.load(scale_b + ((on + HALF) // 128) * k_blocks + k // 128)
            left = tl.dot(x, b.load([on, k]).T, left * (1.0 / s_left), max_num_imprecise_acc=BLOCK_K) * s_left
            right = tl.dot(x, b.load([on + HALF, k]).T, right * (1.0 / s_right),
                           max_num_imprecise_acc=BLOCK_K) * s_right
        elif MODE == "split_serial":  # split_block, the right half's dot after the left half's add
            s_a = tl.load(scale_a + offs_m * k_blocks + k // 128)[:, None]
            left += tl.dot(x, b.load([on, k]).T) * (s_a * tl.load(scale_b + (on // 128) * k_blocks + k // 128))
            y = b.load([on + HALF, k])
            right += tl.dot(x, y.T) * (s_a * tl.load(scale_b + ((on + HALF) // 128) * k_blocks + k // 128))
        else:  # split_block
            s_a = tl.load(scale_a + offs_m * k_blocks + k // 128)[:, None]
            s_left = tl.load(scale_b + (on // 128) * k_blocks + k // 128)
            s_right = tl.load(scale_b + ((on + HALF) // 128) * k_blocks + k // 128)
            left += tl.dot(x, b.load([on, k]).T) * (s_a * s_left)
            right += tl.dot(x, b.load([on + HALF, k]).T) * (s_a * s_right)
    if MODE == "fast" or MODE == "mia" or MODE == "block128":
        c.store([om, on], acc.to(tl.bfloat16))
    elif MODE == "split_mia_join":  # the halves joined into one [128, 256] tile, stored as halves again
        acc = tl.reshape(tl.permute(tl.join(left, right), (0, 2, 1)), (BLOCK_M, BLOCK_N))
        left, right = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, HALF)), (0, 2, 1)))
        c.store([om, on], left.to(tl.bfloat16))
        c.store([om, on + HALF], right.to(tl.bfloat16))
    else:
        c.store([om, on], left.to(tl.bfloat16))
        c.store([om, on + HALF], right.to(tl.bfloat16))


SPLIT = ("split_fast", "split_mia", "split_mia_join", "split_add", "split_block", "split_rescale", "split_serial")
VARIANTS = [("fast", 256, 3), ("mia", 256, 3), ("split_fast", 256, 3), ("split_mia", 256, 3), ("split_mia", 256, 4), ("split_mia_join", 256, 3),
            ("split_add", 256, 3), ("split_add", 256, 4), ("split_block", 256, 3), ("split_rescale", 256, 3), ("split_rescale", 256, 4), ("split_serial", 256, 3),
            ("block128", 128, 4), ("block128", 128, 5)]


def compile_report():
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    import subprocess
    import tempfile
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    for mode, bn, stages in VARIANTS:
        half = bn // 2 if mode in SPLIT else bn
        sig = dict(a="tensordesc<fp8e4nv[128,128]>", b=f"tensordesc<fp8e4nv[{half},128]>",
                   c=f"tensordesc<bf16[128,{half}]>", scale_a="*fp32", scale_b="*fp32", M="i32", N="i32", K="i32",
                   BLOCK_M="constexpr", BLOCK_N="constexpr", BLOCK_K="constexpr", MODE="constexpr",
                   GROUP_M="constexpr")
        src = ASTSource(fn=fp8_matmul, signature=sig,
                        constexprs=dict(BLOCK_M=128, BLOCK_N=bn, BLOCK_K=128, MODE=mode, GROUP_M=8))
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                             options=dict(num_warps=8, num_stages=stages)).asm["ptx"]
        with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
            f.write(ptx)
            f.flush()
            log = subprocess.run([ptxas, "-arch=sm_90a", "-v", f.name, "-o", os.devnull], capture_output=True,
                                 text=True).stderr
        waits = sorted(set(re.findall(r"wgmma.wait_group.sync.aligned (\d+)", ptx)))
        regs, spills = re.findall(r"Used (\d+) registers", log), re.findall(r"(\d+) bytes spill stores", log)
        print(f"{mode:12s} 128x{bn} s{stages}: {regs} registers, {spills} B spilled, wgmma waits {waits}, "
              f"{ptx.count('wgmma.mma_async')} wgmma")


def main(out_dir):
    import torch
    from triton.tools.tensor_descriptor import TensorDescriptor
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "2026-12-03_h200x1_run102"))
    from fp8_probe import device_us  # CUDA-graph replays, median of 20
    rows = []
    for m, n, k in [(8192, 8192, 8192), (2048, 8192, 8192), (4096, 6144, 4096)]:
        a = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
        b = (torch.randn(n, k, device="cuda") / 4).to(torch.float8_e4m3fn)
        sa = torch.rand(m, k // 128, device="cuda") + 0.5
        sb = torch.rand(n // 128, k // 128, device="cuda") + 0.5
        one = torch.ones((), device="cuda")
        exact = a.float() @ b.float().T
        exact_block = ((a.float().view(m, k // 128, 128) * sa[:, :, None]).view(m, k)
                       @ (b.float().view(n // 128, 128, k // 128, 128) * sb[:, None, :, None]).view(n, k).T)
        row = {"M": m, "N": n, "K": k}
        for fast in (False, True):
            row[f"cuBLAS{' fast' if fast else ''}"] = device_us(
                lambda: torch._scaled_mm(a, b.t(), one, one, out_dtype=torch.bfloat16, use_fast_accum=fast))
        for mode, bn, stages in VARIANTS:
            half = bn // 2 if mode in SPLIT else bn
            c = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
            da = TensorDescriptor(a, [m, k], [k, 1], [128, 128])
            db = TensorDescriptor(b, [n, k], [k, 1], [half, 128])
            dc = TensorDescriptor(c, [m, n], [n, 1], [128, half])
            grid = (triton.cdiv(m, 128) * triton.cdiv(n, bn),)
            label = f"{mode} 128x{bn} s{stages}"
            try:
                call = lambda: fp8_matmul[grid](da, db, dc, sa, sb, m, n, k, 128, bn, 128, mode,  # noqa: E731
                                                num_warps=8, num_stages=stages)
                us = device_us(call)
                c.fill_(float("nan"))
                call()
                ref = exact_block if "block" in mode else exact
                err = ((c.float() - ref).abs().max() / ref.abs().max()).item()
            except Exception as exc:
                print(f"{m}x{n}x{k} {label}: {type(exc).__name__}: {str(exc)[:150]}", flush=True)
                continue
            row[label], row[f"err {label}"] = us, err
            print(f"{m}x{n}x{k} {label:24s} {us:8.1f} us  {2 * m * n * k / us / 1e6:6.0f} TFLOP/s  "
                  f"x{row['cuBLAS'] / us:.2f} of cuBLAS {row['cuBLAS']:.1f} (fast {row['cuBLAS fast']:.1f})  "
                  f"err {err:.2e}", flush=True)
        rows.append(row)
        json.dump(rows, open(f"{out_dir}/split_probe.json", "w"), indent=1)


if __name__ == "__main__":
    compile_report() if sys.argv[1] == "--compile" else main(sys.argv[1])
