"""GEMM + reduce-scatter on FP8 operands: this rank's rows of ``sum_r (a_r * scale_a_r) @ (w_r * scale_w_r).T``.

The kernel of ``gemm_reducescatter``: each tile's product is scaled in fp32 (``gemm.tile_accumulate``; the modes
of ``kernels/fp8.py`` over this rank's K slice), then travels as a bf16 (the output dtype) or fp32
(``partial="fp32"``) partial and is summed on its destination in the same fixed ring order: bitwise
reproducible. FP8 halves the bytes read by the GEMM; the partials are the output's.

Async-TP's ``fused_scaled_matmul_reduce_scatter`` on this op: ``async_tp.py``.
"""

import dataclasses

import torch

from .. import autotune, hardware, shmem
from . import fp8
from . import gemm_reducescatter as rs
from .gemm import check_launchable, output_like
from .gemm_fp8 import fp8_tiles, scaled_mm_torch
from .replay import GraphCache

_CONFIGS = shmem.Plans("gemm_rs_fp8")
_GRAPHS = GraphCache("gemm_rs_fp8")


def default_config(m, n, k, device, world):
    """``gemm_reducescatter.default_config`` with FP8 tiles (``gemm_fp8.fp8_tiles``)."""
    return fp8_tiles(rs.default_config(m, n, k, torch.float8_e4m3fn, device, world), device)


def _tuned_config(a, w, scales, out_dtype, team):
    (m, k), n = a.shape, w.shape[0]
    base = default_config(m, n, k, a.device, team.size)
    if a.device.type != "cuda":
        return base

    def make_runner():  # times an eager call with each candidate, host work included
        x = torch.randn_like(a, dtype=torch.float32).to(a.dtype)
        y = torch.randn_like(w, dtype=torch.float32).to(w.dtype)
        probe = fp8.Scales(scales.mode, torch.ones_like(scales.a), torch.ones_like(scales.w), scales.fast_accum)
        return lambda cfg: _call(x, y, probe, out_dtype, cfg, None, team, ("tune", m, n, k, repr(sorted(cfg.items()))))

    cands = [fp8_tiles(c, a.device) for c in rs.candidate_configs(m, n, k, torch.float8_e4m3fn, a.device, team.size)]
    key = dict(m=m, n=n, k=k, dtype=str(a.dtype).replace("torch.", ""), scaling=scales.mode,
               fast_accum=scales.fast_accum, out=str(out_dtype).replace("torch.", ""))
    return autotune.choose("gemm_rs_fp8", key, cands, make_runner, default=base, group=team.group)


def _call(a, w, scales, out_dtype, cfg, out, team, key):
    """One call on a configuration: the fallback (a scaled GEMM, then reduce_scatter), the kernel from a CUDA graph
    (path "graph", ``key`` names it), or the kernel."""
    shape = (rs.rows_of_rank(a.shape[0], team.size, team.rank)[1], w.shape[0])
    fp8.check_block_k(scales, cfg)
    res = None
    if cfg["path"] == "fallback":
        res = rs.reduce_scatter_rows(scaled_mm_torch(a, w, scales, out_dtype), team.group)
    elif cfg["path"] == "graph" and key is not None:
        def run(x, sx, y, sy):
            return rs._run_overlapped(x, y, torch.empty(shape, dtype=out_dtype, device=x.device), cfg, team,
                                      dataclasses.replace(scales, a=sx, w=sy).kernel_args(cfg))
        res = _GRAPHS.run(key, run, (a, scales.a), (w, scales.w))
    if res is None:
        return rs._run_overlapped(a, w, output_like(out, shape, a, out_dtype), cfg, team, scales.kernel_args(cfg))
    return res if out is None else out.copy_(res)


def scaled_gemm_rs(a, w, scale_a, scale_w, *, scaling=None, out_dtype=None, fast_accum=False, config=None, out=None,
                   group=None):
    """This rank's rows of ``sum over the ranks of group of (a * scale_a) @ (w * scale_w).T`` (rows split like
    ``torch.tensor_split``), summed in a fixed order: bitwise reproducible (what ``gemm_rs`` does, on FP8).

    ``a`` [M, K_local], ``w`` [N, K_local]: FP8 (float8_e4m3fn, or float8_e5m2 for both); ``scale_a`` /
    ``scale_w``: float32 scales of this rank's slices in one of the modes of ``kernels/fp8.py`` ([1] / [1];
    [M, 1] / [N, 1]; [M, ceil(K_local/128)] / [ceil(N/128), ceil(K_local/128)]). The result is ``out_dtype``
    (bfloat16 unless given; float16, float32), a new [rows of this rank, N] tensor or ``out``. ``config``: knobs of
    ``gemm_reducescatter.default_config`` (``partial="fp32"``: exact partials)."""
    scales = fp8.check_scales(a, w, scale_a, scale_w, scaling, fast_accum)
    shmem.check_device(a, "a")
    check_launchable(a)
    out_dtype = fp8.out_dtype_of(out_dtype)
    if hardware.compiling() and config is None and out is None:
        return torch.ops.triton_dist.fused_scaled_matmul_reduce_scatter(
            a, w.t(), scales.a, scales.w if scales.w.numel() == 1 else scales.w.t(), "sum", 0, 0,
            shmem.group_name(group), [a.shape[0], w.shape[0]], None, None, out_dtype, scales.fast_accum)
    team = shmem.op_team("gemm_rs_fp8", group, lambda: dict(
        a=tuple(a.shape), w=tuple(w.shape), dtype=str(a.dtype), scaling=scales.mode, out_dtype=str(out_dtype),
        config=config, out=out is not None))
    (m, k), n = a.shape, w.shape[0]
    shape = (rs.rows_of_rank(m, team.size, team.rank)[1], n)
    if out is not None:
        output_like(out, shape, a, out_dtype)  # a bad `out` is reported whichever path runs
    if m == 0 or n == 0 or k == 0:
        return output_like(out, shape, a, out_dtype).zero_()
    if config is None:
        key = (team.name, m, n, k, a.dtype, scales.mode, scales.fast_accum, out_dtype)
        cfg = _CONFIGS.get(key, lambda: {**default_config(m, n, k, a.device, team.size),
                                         **_tuned_config(a, w, scales, out_dtype, team)})
    else:
        key = (team.name, m, n, k, a.dtype, scales.mode, scales.fast_accum, out_dtype, repr(sorted(config.items())))
        cfg = autotune.with_overrides(default_config(m, n, k, a.device, team.size), config)
    return _call(a, w, scales, out_dtype, cfg, out, team, key)
