"""The GEMM core on FP8 operands: ``out = (a * scale_a) @ (w * scale_w).T`` in fp32, stored as bf16 (or fp16 /
fp32), with the three scaling modes of ``kernels/fp8.py`` (per-tensor, rowwise, 128-blockwise).

The kernel is the core's own ``gemm_kernel`` (persistent, TMA, the same autotuner): ``tile_accumulate`` takes
the scales (``SCALES="rows"``: one multiply of the fp32 tile after the K loop; ``"blocks"``: each 128-wide K
step's product scaled, then added) and ``tile_store`` converts to the output's dtype. FP8 tiles keep the bf16
tiles' bytes per pipeline stage: BLOCK_K 128 (fp8 wgmma takes K in steps of 32). Without ``fast_accum`` the
tensor cores' partial sums are promoted to fp32 every K step (``max_num_imprecise_acc``), as cuBLAS does without
fast accumulation; with it they accumulate through the whole K loop.

    q, s = fp8.quantize(x, "row")                     # or quantize_fp8(x): 1x128 groups, a Triton kernel
    out = gemm(q, w8, scale_a=s, scale_w=sw)          # the same as scaled_gemm(q, w8, s, sw)
"""

import torch

from .. import autotune
from . import fp8
from .gemm import (_CONFIGS, check_launchable, gemm_candidates, gemm_config, launch_gemm, output_like,
                   skinny_configs)

FP8_BLOCK_K = 128


def fp8_tiles(cfg, device):
    """A bf16 configuration as an FP8 one: the same bytes per pipeline stage (BLOCK_K 128 on a GPU)."""
    return {**cfg, "BLOCK_K": FP8_BLOCK_K} if device.type == "cuda" else dict(cfg)


def scaled_gemm_config(m, n, k, device, **overrides):
    """``gemm.gemm_config`` for FP8 operands (see ``fp8_tiles``)."""
    return {**fp8_tiles(gemm_config(m, n, k, torch.float8_e4m3fn, device), device), **overrides}


def scaled_gemm_candidates(m, n, k, device):
    """The core's tuning sweep as FP8 tiles, the skinny ones included for small M."""
    cands = [fp8_tiles(c, device) for c in gemm_candidates(m, n, k, torch.bfloat16, device)]
    if m <= 512:
        base = scaled_gemm_config(m, n, k, device)
        cands += [{**base, **c, "BLOCK_K": FP8_BLOCK_K} for c in skinny_configs(torch.bfloat16)]
    return autotune.dedupe(cands)


def scaled_mm_torch(a, w, scales, out_dtype):
    """The same product by torch: ``torch._scaled_mm`` (cuBLAS on a GPU) for per-tensor and rowwise scales, our
    core where cuBLAS takes none of it (block scales in this form, e5m2 x e5m2, rowwise into fp16 / fp32, N or K
    not a multiple of 16). The
    baseline and the fallback paths' GEMM."""
    cublas_takes = not (w.shape[0] % 16 or a.shape[1] % 16)  # N and K in multiples of 16 (cuBLAS' alignment)
    if scales.mode == "block" or a.dtype == torch.float8_e5m2 or not cublas_takes or \
            (scales.mode == "row" and out_dtype != torch.bfloat16):
        return scaled_gemm(a, w, scales.a, scales.w, scaling=scales.mode, out_dtype=out_dtype,
                           fast_accum=scales.fast_accum)
    sw = scales.w.reshape(1, -1) if scales.mode == "row" else scales.w.reshape(())
    sa = scales.a if scales.mode == "row" else scales.a.reshape(())
    return torch._scaled_mm(a, w.t(), sa, sw, out_dtype=out_dtype, use_fast_accum=scales.fast_accum)


def scaled_gemm(a, w, scale_a, scale_w, *, scaling=None, out=None, out_dtype=None, fast_accum=False, config=None):
    """``(a * scale_a) @ (w * scale_w).T`` for FP8 ``a`` [M, K] and ``w`` [N, K] (float8_e4m3fn, or float8_e5m2 for
    both) with float32 scales of one of the modes of ``kernels/fp8.py`` (``scaling``: "tensor", "row" or "block";
    None: named by the scales' shapes). The result [M, N] is ``out_dtype`` (bfloat16 by default; float16,
    float32) or goes into ``out``. ``fast_accum``: accumulate in the tensor cores' own precision through the whole
    K loop (faster; ``torch._scaled_mm(use_fast_accum=True)``). TypeError / ValueError for operands, scales or
    a GPU (compute capability < 8.9) that do not fit."""
    scales = fp8.check_scales(a, w, scale_a, scale_w, scaling, fast_accum)
    check_launchable(a)
    out_dtype = fp8.out_dtype_of(out_dtype)
    m, k = a.shape
    n = w.shape[0]
    out = output_like(out, (m, n), a, out_dtype)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    key = (m, n, k, a.dtype, scales.mode, scales.fast_accum, out_dtype, a.device)
    if config is None:
        cfg = _CONFIGS.get(key, lambda: {**scaled_gemm_config(m, n, k, a.device),
                                         **_tuned_config(m, n, k, a.dtype, scales, out_dtype, a.device)})
    else:
        cfg = autotune.with_overrides(scaled_gemm_config(m, n, k, a.device), config)
    fp8.check_block_k(scales, cfg)
    launch_gemm(a, w, out.view(1, m, n), cfg, scales=scales.kernel_args(cfg))
    return out


def _tuned_config(m, n, k, dtype, scales, out_dtype, device):
    def make_runner():  # only called when tuning actually happens
        from ..timing import graph_of

        a = torch.randn((m, k), device=device).to(dtype)
        w = torch.randn((n, k), device=device).to(dtype)
        probe = fp8.Scales(scales.mode, torch.ones_like(scales.a), torch.ones_like(scales.w), scales.fast_accum)
        out = torch.empty((m, n), dtype=out_dtype, device=device)
        graphs = {}

        def run(cfg):  # device time, each candidate replayed from a CUDA graph (see gemm._tuned_gemm_config)
            key = repr(sorted(cfg.items()))
            if key not in graphs:
                graphs[key] = graph_of(lambda: launch_gemm(a, w, out.view(1, m, n), cfg,
                                                           scales=probe.kernel_args(cfg)))
            graphs[key].replay()
        return run

    key = dict(m=m, n=n, k=k, dtype=str(dtype).replace("torch.", ""), scaling=scales.mode,
               fast_accum=scales.fast_accum, out=str(out_dtype).replace("torch.", ""))
    cands = [c for c in scaled_gemm_candidates(m, n, k, device)
             if scales.mode != "block" or fp8.GROUP % c["BLOCK_K"] == 0]
    return autotune.choose("gemm_fp8", key, cands, make_runner, default=scaled_gemm_config(m, n, k, device),
                           collective=False)
