"""run158 probe (one GPU, device time by ``do_bench``, three rounds in turn, medians): two questions run157 left on
blockwise FP8 (128 tile, 0.80-0.91x per-tensor cuBLAS on one H100):

ring    run157 timed the block tile at 4 slots (``probe.py``'s config) and our per-tensor 128 tile at 5; the tuner
        offers block scales 4 and 5 (6 do not fit beside the C buffer and the scales). Is the 5th slot worth it?
kmajor  A's block scales K-major ([K/128, M], torch._scaled_mm's layout) were 2-7 % faster at three shapes and
        2.4 % slower at one in a single round (run157 ``scale_probe.py``): rounds in turn, medians, both depths.

    PYTHONPATH=$PWD:$PWD/benchmarks torchrun --nproc-per-node=1 benchmarks/results/2026-12-07_h100x1_run158/ring_probe.py
"""

import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "2026-12-07_h100x1_run157"))
from bench_gemm import cublas_fp8  # noqa: E402
from probe import BLOCK_SHAPES, block_case, start, time_block_contenders, write  # noqa: E402
from scale_probe import launcher, variant  # noqa: E402  (run157's: the Gluon kernel with A's scales K-major)
from triton_dist.kernels import gemm_sm90  # noqa: E402

ROUNDS = int(os.environ.get("RING_ROUNDS", 3))

start()
kmajor = variant("kmajor")
rows = []
for m, n, k in BLOCK_SHAPES:
    (at, sat, wt, swt), (ab, sab, wb, swb), want, out = block_case(m, n, k)
    sab_k = sab.t().contiguous()  # [K/128, M]
    calls = {"cuBLAS tensor": cublas_fp8(at, wt, sat, swt, "tensor", False)}
    for stages in (5, 6):
        cfg = {**gemm_sm90.default_config({"GROUP_M": 8}, torch.bfloat16, False), "num_stages": stages}
        calls[f"ours tensor 128 s{stages}"] = launcher(gemm_sm90, at, wt, out, cfg, "tensor", sat, swt)
    for stages in (4, 5):
        cfg = {**gemm_sm90.default_config({"GROUP_M": 8}, torch.bfloat16, True), "num_stages": stages}
        calls[f"block rows s{stages}"] = launcher(gemm_sm90, ab, wb, out, cfg, "block", sab, swb)
        calls[f"block kmajor s{stages}"] = launcher(kmajor, ab, wb, out, cfg, "block", sab_k, swb, stride_sa=m)
    per_round = [time_block_contenders((m, n, k), calls, want, out, round=r) for r in range(ROUNDS)]
    for name in calls:
        times = [r["device_us"] for rr in per_round for r in rr if r["name"] == name]
        errs = {r["rel_err"] for rr in per_round for r in rr if r["name"] == name}
        med = statistics.median(times)
        rows.append(dict(shape=[m, n, k], name=name, median_us=med, rounds_us=times, rel_err=max(errs, key=str)))
    bar = rows[-len(calls)]["median_us"]
    for r in rows[-len(calls):]:
        r["vs_cublas"] = bar / r["median_us"]
        print(f"MEDIAN {m}x{n}x{k} {r['name']:22s} {r['median_us']:8.1f} us {r['vs_cublas']:5.2f}x "
              f"rounds {' '.join(f'{t:.1f}' for t in r['rounds_us'])}", flush=True)
write(rows, "ring_probe.json")
