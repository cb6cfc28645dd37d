"""run160 probe (one GPU, device time by ``do_bench``, rounds in turn, medians): does the Gluon FP8 mainloop's
tile order leave L2 traffic on the table? The tuner fixes ``GROUP_M`` 8 (eight rows of tiles sweep the columns
together). At 8192³ blockwise with A's scales K-major was 0.84x per-tensor cuBLAS in run159 (issue 34: 0.85x),
our per-tensor 128 tile 0.92-0.94x. A 128x128 FP8 tile moves 32 KB from L2 per 4.2 MFLOP step: near the L2's
bandwidth at ~1 PFLOP/s, so which tiles run at once (and meet in L2) may matter. Rows: GROUP_M 4 / 8 / 16 / 32
at 4 and 5 slots, block scales K-major, and the per-tensor 128 tile at GROUP_M 8 / 16.

Also: do the operands' bits cost time? At the power limit a GPU's clock follows the tensor cores' switching,
which the values drive. Per-tensor and blockwise ("grouped") operands differ (one amax per tensor vs per 128 values: the
blockwise e4m3 values use more of the range), so "cuBLAS tensor, grouped bits" times cuBLAS's per-tensor GEMM on
the blockwise operands' FP8 bytes (unit scales), and "ours tensor, grouped bits" ours: if these lose to the same
kernels on per-tensor bytes, part of blockwise's gap to per-tensor cuBLAS is the data, not the kernel.

    PYTHONPATH=$PWD:$PWD/benchmarks torchrun --nproc-per-node=1 benchmarks/results/2026-12-07_h100x1_run160/group_probe.py
"""

import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "2026-12-07_h100x1_run157"))
from bench_gemm import cublas_fp8  # noqa: E402
from probe import BLOCK_SHAPES, block_case, start, time_block_contenders, write  # noqa: E402
from triton_dist import hardware  # noqa: E402
from triton_dist.kernels import gemm_sm90  # noqa: E402

ROUNDS = int(os.environ.get("GROUP_ROUNDS", 3))


def launcher(a, w, c, cfg, mode, sa, sw, mod=gemm_sm90):
    """The Gluon kernel's launch as ``gemm_sm90.launch`` makes it, bound once (no host path timed); ``mod``: the
    shipped module or a probe's variant of it (run162's ``scale_order.py``)."""
    args = mod.Arguments(a, w, c, cfg, mode, sa, sw)(a, w, c, sa, sw)
    tiles = -(-a.shape[0] // 128) * -(-w.shape[0] // cfg["BLOCK_N"])
    grid = (min(tiles, hardware.num_sms(a.device.index)),)
    meta = mod.meta(cfg, mode)
    return lambda: mod._LAUNCH(grid, *args, **meta)


def medians(shape, calls, per_round):
    """Rows of ``calls`` ({name: fn}, the bar first) at ``shape`` from ``time_block_contenders``' rounds: each
    contender's median, its rounds and (block rows) relative error, and its ratio to the bar, printed."""
    rows = []
    for name in calls:
        times = [r["device_us"] for rr in per_round for r in rr if r["name"] == name]
        errs = {r["rel_err"] for rr in per_round for r in rr if r["name"] == name}
        rows.append(dict(shape=list(shape), name=name, median_us=statistics.median(times), rounds_us=times,
                         rel_err=max(errs, key=str)))
    for r in rows:
        r["vs_cublas"] = rows[0]["median_us"] / r["median_us"]
        print(f"MEDIAN {'x'.join(map(str, shape))} {r['name']:22s} {r['median_us']:8.1f} us {r['vs_cublas']:5.2f}x "
              f"rounds {' '.join(f'{t:.1f}' for t in r['rounds_us'])}", flush=True)
    return rows


if __name__ == "__main__":
    start()
    rows = []
    for m, n, k in BLOCK_SHAPES:
        (at, sat, wt, swt), (ab, sab, wb, swb), want, out = block_case(m, n, k)
        sab_k = sab.t().contiguous().t()  # [M, K/128] of strides (1, M): K-major
        calls = {"cuBLAS tensor": cublas_fp8(at, wt, sat, swt, "tensor", False)}
        one = torch.ones((), device="cuda")
        calls["cuBLAS tensor, grouped bits"] = cublas_fp8(ab, wb, one, one, "tensor", False)
        cfg8 = {**gemm_sm90.default_config({"GROUP_M": 8}, torch.bfloat16, False), "num_stages": 5}
        calls["ours tensor, grouped bits"] = launcher(ab, wb, out, cfg8, "tensor", one, one)
        for group in (8, 16):
            cfg = {**gemm_sm90.default_config({"GROUP_M": group}, torch.bfloat16, False), "num_stages": 5}
            calls[f"ours tensor s5 g{group}"] = launcher(at, wt, out, cfg, "tensor", sat, swt)
        for stages in (4, 5):
            for group in (4, 8, 16, 32):
                cfg = {**gemm_sm90.default_config({"GROUP_M": group}, torch.bfloat16, True), "num_stages": stages}
                calls[f"block kmajor s{stages} g{group}"] = launcher(ab, wb, out, cfg, "block", sab_k, swb)
        per_round = [time_block_contenders((m, n, k), calls, want, out, round=r) for r in range(ROUNDS)]
        rows += medians((m, n, k), calls, per_round)
    write(rows, "group_probe.json")
