"""run136's FP8 probe (one H200): can two resident programs per SM hide the promotion that one 8-warp program
cannot? A persistent TMA matmul e4m3 -> bf16 whose programs are single warpgroups (num_warps 4) with small tiles
(64x128, 64x256, 128x128 split in column halves), so that while one program adds its K step's partial sum into the
fp32 accumulator (or scales a block-scaled step), the other's wgmmas run: the ping-pong cuBLAS / CUTLASS do with
two consumer warpgroups, here from the hardware's warp scheduler. Against the core's best 8-warp tile (256x128,
one program per SM) and torch._scaled_mm, device time of CUDA-graph replays (median of 20), in turn.
    python pingpong_probe.py OUT_DIR          # on the GPU
    python pingpong_probe.py --compile        # anywhere: registers, spills and shared memory per variant (sm_90a)"""
import json
import os
import statistics
import sys

import torch
import triton
import triton.language as tl


@triton.jit
def fp8_matmul(a, b, c, sa, sb, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               MODE: tl.constexpr, SPLIT: tl.constexpr, GROUP_M: tl.constexpr):
    """Persistent C = A @ B.T; MODE "fast" (no promotion), "mia" (max_num_imprecise_acc = BLOCK_K: promoted every
    K step), "block" (each K step's product times sa[row, kb] * sb[col // 128, kb]: DeepSeek-V3 scales; BLOCK_N
    <= 128). SPLIT: the tile's columns as two accumulators (one dot each per K step)."""
    pid = tl.program_id(0)
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    HALF: tl.constexpr = BLOCK_N // 2
    for tile in tl.range(pid, tiles_m * tiles_n, tl.num_programs(0)):
        group = tile // (GROUP_M * tiles_n)
        first_m = group * GROUP_M
        rows_in_group = tl.minimum(tiles_m - first_m, GROUP_M)
        pid_m = first_m + (tile % (GROUP_M * tiles_n)) % rows_in_group
        pid_n = (tile % (GROUP_M * tiles_n)) // rows_in_group
        om, on = pid_m * BLOCK_M, pid_n * BLOCK_N
        rows = om + tl.arange(0, BLOCK_M)
        if SPLIT:
            acc_l = tl.zeros((BLOCK_M, HALF), dtype=tl.float32)
            acc_r = tl.zeros((BLOCK_M, HALF), dtype=tl.float32)
            for ki in range(k_tiles):
                x = a.load([om, ki * BLOCK_K])
                if MODE == "fast":
                    acc_l = tl.dot(x, b.load([on, ki * BLOCK_K]).T, acc_l)
                    acc_r = tl.dot(x, b.load([on + HALF, ki * BLOCK_K]).T, acc_r)
                else:
                    acc_l = tl.dot(x, b.load([on, ki * BLOCK_K]).T, acc_l, max_num_imprecise_acc=BLOCK_K)
                    acc_r = tl.dot(x, b.load([on + HALF, ki * BLOCK_K]).T, acc_r, max_num_imprecise_acc=BLOCK_K)
            acc = tl.reshape(tl.permute(tl.join(acc_l, acc_r), (0, 2, 1)), (BLOCK_M, BLOCK_N))
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            prev = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for ki in range(k_tiles):
                x = a.load([om, ki * BLOCK_K])
                y = b.load([on, ki * BLOCK_K])
                if MODE == "fast":
                    acc = tl.dot(x, y.T, acc)
                elif MODE == "mia":
                    acc = tl.dot(x, y.T, acc, max_num_imprecise_acc=BLOCK_K)
                elif MODE == "lagged":
                    p = tl.dot(x, y.T)
                    acc += prev
                    prev = p
                else:
                    s = tl.load(sa + rows * k_tiles + ki) * tl.load(sb + (on // 128) * k_tiles + ki)
                    acc += tl.dot(x, y.T) * s[:, None]
            acc += prev
        c.store([om, on], acc.to(tl.bfloat16))


# (label, BLOCK_M, BLOCK_N, num_warps, num_stages, SPLIT, programs per SM, modes)
VARIANTS = [
    ("core 256x128 w8 s3", 256, 128, 8, 3, False, 1, ("fast", "mia")),
    ("128x128 w8 s4", 128, 128, 8, 4, False, 1, ("mia", "block")),
    ("64x128 w4 s4 x2", 64, 128, 4, 4, False, 2, ("fast", "mia", "block")),
    ("64x128 w4 s3 x2", 64, 128, 4, 3, False, 2, ("mia", "block")),
    ("64x128 w4 s2 x3", 64, 128, 4, 2, False, 3, ("mia", "block")),
    ("64x256 w4 s2 x2", 64, 256, 4, 2, False, 2, ("fast", "mia")),
    ("64x256 split w4 s2 x2", 64, 256, 4, 2, True, 2, ("mia",)),
    ("128x128 split w4 s2 x1", 128, 128, 4, 2, True, 1, ("mia",)),
    ("64x128 w4 s4 x1", 64, 128, 4, 4, False, 1, ("mia",)),
    ("128x128 split w4 s2 x2", 128, 128, 4, 2, True, 2, ("mia",)),
    ("128x256 split w8 s3", 128, 256, 8, 3, True, 1, ("mia",)),
]
SHAPES = [(8192, 8192, 8192), (8192, 28672, 8192), (4096, 6144, 4096), (2048, 8192, 8192)]


def compile_only():
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "scripts"))
    from ptx_digest import registers
    for label, bm, bn, warps, stages, split, per_sm, modes in VARIANTS:
        for mode in modes:
            bcols = bn // 2 if split else bn
            sig = dict(a=f"tensordesc<fp8e4nv[{bm},128]>", b=f"tensordesc<fp8e4nv[{bcols},128]>",
                       c=f"tensordesc<bf16[{bm},{bn}]>", sa="*fp32", sb="*fp32", M="i32", N="i32", K="i32",
                       BLOCK_M="constexpr", BLOCK_N="constexpr", BLOCK_K="constexpr", MODE="constexpr",
                       SPLIT="constexpr", GROUP_M="constexpr")
            src = ASTSource(fn=fp8_matmul, signature=sig, constexprs=dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128,
                                                                          MODE=mode, SPLIT=split, GROUP_M=8))
            k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps,
                                                                                   num_stages=stages))
            print(f"{label:24s} {mode:6s} {registers(k.asm['ptx']):28s} shared {k.metadata.shared} B "
                  f"(x{per_sm}: {per_sm * k.metadata.shared})", flush=True)


def device_us(fn, iters=20):
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        g.replay()
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1) * 1000)
    return statistics.median(times)


def main(out_dir):
    from triton.tools.tensor_descriptor import TensorDescriptor
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for m, n, k in SHAPES:
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
        print(f"{m}x{n}x{k} cuBLAS {row['cuBLAS']:.1f} us, fast {row['cuBLAS fast']:.1f}", flush=True)
        for label, bm, bn, warps, stages, split, per_sm, modes in VARIANTS:
            c = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
            da = TensorDescriptor(a, [m, k], [k, 1], [bm, 128])
            db = TensorDescriptor(b, [n, k], [k, 1], [bn // 2 if split else bn, 128])
            dc = TensorDescriptor(c, [m, n], [n, 1], [bm, bn])
            grid = (min(per_sm * sms, triton.cdiv(m, bm) * triton.cdiv(n, bn)),)
            for mode in modes:
                name = f"{mode} {label}"
                try:
                    call = lambda: fp8_matmul[grid](da, db, dc, sa, sb, m, n, k, bm, bn, 128, mode,  # noqa: E731
                                                    split, 8, num_warps=warps, num_stages=stages)
                    us = device_us(call)
                    c.fill_(float("nan"))
                    call()
                    ref = exact_block if mode == "block" else exact
                    err = ((c.float() - ref).abs().max() / ref.abs().max()).item()
                except Exception as exc:
                    print(f"{m}x{n}x{k} {name}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                    continue
                row[name], row[f"err {name}"] = us, err
                print(f"{m}x{n}x{k} {name:30s} {us:8.1f} us {2 * m * n * k / us / 1e6:6.0f} TFLOP/s "
                      f"{row['cuBLAS'] / us:5.2f}x cuBLAS  err {err:.1e}", flush=True)
        rows.append(row)
        json.dump(rows, open(f"{out_dir}/pingpong_probe.json", "w"), indent=1)


if __name__ == "__main__":
    compile_only() if sys.argv[1] == "--compile" else main(sys.argv[1])
