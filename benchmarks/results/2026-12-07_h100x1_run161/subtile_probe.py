"""run161 probe (one GPU, device time by ``do_bench``, rounds in turn, medians): does the sixth ring slot that
``EPILOGUE_SUBTILE`` (a C buffer half a piece wide, 5c88ec8) makes room for close blockwise FP8's gap? run160:
with block scales 5 slots beat 4 by 1-7 % (a slot waits for its TMA tiles and its scales' cp.async), 6 did not
fit beside the whole C buffer. Rows at issue 34's four shapes, 128 tile:
  block {kmajor, rows} s5          the tuner's best so far (whole buffer)
  block {kmajor, rows} s5 subtile  the same ring with the half buffer: what the two-half epilogue costs
  block {kmajor, rows} s6 subtile  the sixth slot
  ours tensor s6 / s6 subtile      per-tensor, whose ring already has six: the epilogue's cost there
  ours tensor 256 s3 / s4          per-tensor's 256 tile (run160's tuner took 128 s6 at 8192^3 only: 0.93x)
  ... tail<S>                      the row's configuration with TAIL_SPLIT S: the last round's tiles in K shares
                                   (only where it splits: at 8192^3 the 128 tile's 32nd round holds 4 of 132 SMs'
                                   tiles; 8192x28672x8192's 256 tile 40)
  block kmajor s5 / s6 subtile tma  ``tma_scales.py``'s variant: the scales by TMA with the tiles (one expect-tx,
                                   no cp.async): does a slot then wait on one load instead of the later of two?
Each block row's result (poisoned with NaN first) is checked against fp64.

    PYTHONPATH=$PWD:$PWD/benchmarks torchrun --nproc-per-node=1 benchmarks/results/<run>/subtile_probe.py
"""

import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", run) for run in ("2026-12-07_h100x1_run157", "2026-12-07_h100x1_run160")]
sys.path.insert(0, HERE)
from bench_gemm import cublas_fp8  # noqa: E402
from group_probe import launcher, medians  # noqa: E402  (run160's: the bound Gluon launch, rounds' medians)
from probe import BLOCK_SHAPES, block_case, start, time_block_contenders, write  # noqa: E402
from triton_dist import hardware  # noqa: E402
from triton_dist.kernels import gemm_sm90  # noqa: E402
from triton_dist.kernels.gemm import split_k_workspace  # noqa: E402
import tma_scales  # noqa: E402  (this directory's variant)

ROUNDS = int(os.environ.get("SUBTILE_ROUNDS", 3))




def tail_launcher(a, w, c, cfg, mode, sa, sw):
    """The Gluon kernel's bound launch with its last round's tiles split (``cfg``'s TAIL_SPLIT) on every SM, as
    ``gemm.launch_gemm`` makes it; None where the shape leaves nothing to split."""
    (m, k), n, programs = a.shape, w.shape[0], hardware.num_sms(a.device.index)
    split = gemm_sm90.tail_split(cfg, m, n, k, programs)
    if split == 1:
        return None
    args = gemm_sm90.Arguments(a, w, c, cfg, mode, sa, sw)(a, w, c, sa, sw)
    tail = gemm_sm90.tail_arguments(c, split, split_k_workspace(
        a.device, gemm_sm90.tail_tiles(cfg, m, n, programs), split, cfg, counters=2))
    meta = gemm_sm90.meta(cfg, mode, True)
    return lambda: gemm_sm90._LAUNCH((programs,), *args, named=tail, **meta)


def with_tails(calls, name, a, w, c, cfg, mode, sa, sw, splits=(4, 8)):
    """``calls`` plus the row ``name`` with each TAIL_SPLIT of ``splits`` where the shape splits."""
    for most in splits:
        fn = tail_launcher(a, w, c, {**cfg, "TAIL_SPLIT": most}, mode, sa, sw)
        if fn is not None:
            calls[f"{name} tail{most}"] = fn


start()
tma_variant = tma_scales.variant()
rows = []
for m, n, k in BLOCK_SHAPES:
    (at, sat, wt, swt), (ab, sab, wb, swb), want, out = block_case(m, n, k)
    sab_k = sab.t().contiguous().t()  # [M, K/128] of strides (1, M): K-major
    calls = {"cuBLAS tensor": cublas_fp8(at, wt, sat, swt, "tensor", False)}
    tensor = gemm_sm90.default_config({"GROUP_M": 8}, torch.bfloat16, False)
    for subtile in (False, True):
        calls[f"ours tensor s6{' subtile' if subtile else ''}"] = launcher(
            at, wt, out, {**tensor, "num_stages": 6, "EPILOGUE_SUBTILE": subtile}, "tensor", sat, swt)
    for stages in (3, 4):  # the 256-column tile (an A tile serves twice the columns: less L2 traffic per FLOP)
        calls[f"ours tensor 256 s{stages}"] = launcher(
            at, wt, out, {**tensor, "BLOCK_N": 256, "num_stages": stages}, "tensor", sat, swt)
    with_tails(calls, "ours tensor s6", at, wt, out, {**tensor, "num_stages": 6}, "tensor", sat, swt)
    with_tails(calls, "ours tensor 256 s3", at, wt, out, {**tensor, "BLOCK_N": 256, "num_stages": 3}, "tensor",
               sat, swt)
    block = gemm_sm90.default_config({"GROUP_M": 8}, torch.bfloat16, True)
    for layout, scales in (("kmajor", sab_k), ("rows", sab)):
        for stages, subtile in ((5, False), (5, True), (6, True)):
            cfg = {**block, "num_stages": stages, "EPILOGUE_SUBTILE": subtile}
            assert gemm_sm90.takes(cfg, torch.bfloat16, True), cfg
            calls[f"block {layout} s{stages}{' subtile' if subtile else ''}"] = launcher(
                ab, wb, out, cfg, "block", scales, swb)
        with_tails(calls, f"block {layout} s5", ab, wb, out, {**block, "num_stages": 5}, "block", scales, swb, (8,))
    for stages, subtile in ((5, False), (6, True)) if os.environ.get("SUBTILE_TMA", "1") == "1" else ():
        cfg = {**block, "num_stages": stages, "EPILOGUE_SUBTILE": subtile}
        calls[f"block kmajor s{stages}{' subtile' if subtile else ''} tma"] = tma_scales.launcher(
            tma_variant, ab, wb, out, cfg, sab_k, swb)
    per_round = [time_block_contenders((m, n, k), calls, want, out, round=r) for r in range(ROUNDS)]
    rows += medians((m, n, k), calls, per_round)  # (each round's lines give the block rows' errors)
write(rows, "subtile_probe.json")
