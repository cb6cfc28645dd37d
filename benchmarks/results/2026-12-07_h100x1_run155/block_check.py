"""run155 (run154's, which crashed: its timers need a process group; now under torchrun): is blockwise FP8
short of issue 34's bar (0.85x of per-tensor cuBLAS) in the kernel or in how run153 timed it? run153 ran each contender's 40 calls in a block, cuBLAS first, on a power-capped
H100: blockwise matched our per-tensor kernel on the same 128x128 tile within 0-12 %, both ~0.82x cuBLAS, while
run151 (do_bench) had our per-tensor 128 tile at 1.03x. Here per shape every contender is timed three ways:
  in turn      ``harness.in_turn``: 7 rounds of 10 back-to-back calls, each round in another order (median)
  device       ``triton.testing.do_bench`` (one GPU, no communication): L2 flushed before every call
  J/call       ``harness.clocks_during``: 40 back-to-back calls, board energy per call, median SM clock
Contenders: cuBLAS per-tensor (no fast accumulation: the bar), ours per-tensor at 128 s5, ours blockwise at 128
s4 / s5 and at 256 in 64-column pieces (SPLIT_N: no spills in the K loop) s3 / s4.

    PYTHONPATH=$PWD:$PWD/benchmarks torchrun --nproc-per-node=1 benchmarks/results/2026-12-07_h100x1_run155/block_check.py
"""

import json
import os

import torch
import triton

import triton_dist as td
from bench_gemm import cublas_fp8, fp8_operands
from harness import clocks_during, in_turn
from triton_dist.kernels import fp8
from triton_dist.kernels.gemm import scaled_gemm

torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
td.init(backend="cuda")  # the timers take the max over ranks (here one)

rows = []
for m, n, k in [(8192, 8192, 8192), (8192, 28672, 8192), (4096, 6144, 4096), (2048, 8192, 8192)]:
    at, sat, wt, swt = fp8_operands(m, n, k, "tensor", "cuda")
    ab, sab, wb, swb = fp8_operands(m, n, k, "block", "cuda")
    out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    want = (ab.double() * fp8.expand(sab, "group", m, k).double()) @ \
        (wb.double() * fp8.expand(swb, "block", n, k).double()).T

    def ours(mode, block_n, stages, split=False):
        a, w, sa, sw = (ab, wb, sab, swb) if mode == "block" else (at, wt, sat, swt)
        cfg = {"MAINLOOP": "gluon", "BLOCK_N": block_n, "num_stages": stages, "SPLIT_N": split}  # rest: defaults
        return lambda: scaled_gemm(a, w, sa, sw, scaling=mode, out=out, config=cfg)

    calls = {"cuBLAS tensor": cublas_fp8(at, wt, sat, swt, "tensor", False),
             "ours tensor 128 s5": ours("tensor", 128, 5),
             "ours block 128 s4": ours("block", 128, 4), "ours block 128 s5": ours("block", 128, 5),
             "ours block 256/64 s3": ours("block", 256, 3, True), "ours block 256/64 s4": ours("block", 256, 4, True)}
    errs = {}
    for name, fn in calls.items():  # compile, check the block results against fp64
        if name.startswith("ours block"):
            out.fill_(float("nan"))
            fn()
            errs[name] = ((out.double() - want).norm() / want.norm()).item()
        else:
            fn()
    torch.cuda.synchronize()
    turn = in_turn(calls, rounds=7)
    bar_turn = turn["cuBLAS tensor"]
    dev = {name: triton.testing.do_bench(fn, warmup=50, rep=200) * 1e3 for name, fn in calls.items()}
    energy = {name: clocks_during(fn) for name, fn in calls.items()}
    for name in calls:
        r = dict(shape=[m, n, k], name=name, in_turn_us=turn[name], vs_cublas_in_turn=bar_turn / turn[name],
                 device_us=dev[name], vs_cublas_device=dev["cuBLAS tensor"] / dev[name],
                 back_to_back_us=energy[name]["us"], MHz=energy[name]["MHz"], W=energy[name]["W"],
                 J_per_call=energy[name].get("J"), rel_err=errs.get(name))
        rows.append(r)
        print(f"{m}x{n}x{k} {name:20s} in turn {r['in_turn_us']:8.1f} us {r['vs_cublas_in_turn']:5.2f}x | device "
              f"{r['device_us']:8.1f} us {r['vs_cublas_device']:5.2f}x | 40 in a row {r['back_to_back_us']:8.1f} us "
              f"{r['MHz']:5.0f} MHz {r['W']:4.0f} W {r['J_per_call'] or float('nan'):.3f} J"
              + (f" | rel err {r['rel_err']:.2e}" if r["rel_err"] is not None else ""), flush=True)
if os.environ.get("OUT"):
    with open(os.path.join(os.environ["OUT"], "block_check.json"), "w") as f:
        json.dump(rows, f, indent=1)
