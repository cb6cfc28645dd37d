"""AllGather + GEMM on FP8 operands: ``out = all_gather(a * scale_a) @ (w * scale_w).T``, bf16 (or fp16/fp32) out.

The schedule of ``allgather_gemm`` with half the bytes on the wire: the copy engines gather the FP8 shard into
the peers' ``a_full`` and the kernels multiply chunks as they land. A's scales travel with the rows: every rank
pushes its scale rows ([m, S]: S = 1 per-tensor / rowwise, ceil(K/128) blockwise; a per-tensor scale repeated
per row, so gathered rows keep their own rank's scale) into every peer's ``scale_full`` on the same side stream,
ahead of the rows, so each chunk's flag, raised after its rows, covers them too. ``tile_accumulate`` applies the
scales (``kernels/fp8.py``); W's never move.

Async-TP's ``fused_all_gather_scaled_matmul`` on this op: ``async_tp.py``.
"""

import dataclasses

import torch
import torch.distributed as dist

from .. import autotune, hardware, shmem
from . import allgather_gemm as agm
from . import fp8
from .gemm import check_launchable
from .gemm_fp8 import fp8_tiles, scaled_mm_torch
from .replay import GraphCache


class _ScaleBuffers:
    """The gathered scales of a shard shape: ``scale_full`` [W * m, S] (symmetric) and its peers' views."""

    def __init__(self, m_shard, s, group):
        world = shmem.world_size(group)
        self.scale_full = shmem.empty((world * m_shard, s), torch.float32, name="ag_gemm.scale_full", group=group)
        self.peers = shmem.peer_views(self.scale_full, group)


class _Plan(agm._Plan):
    """``allgather_gemm._Plan`` (FP8 rows) plus where this rank's scale rows go on every peer."""

    def __init__(self, m_shard, n, k, dtype, device, cfg, group, mode, out_dtype):
        super().__init__(m_shard, n, k, dtype, device, cfg, group)
        self.key += (mode, out_dtype)
        self.out_dtype = out_dtype
        if self.path == "fallback":
            return
        s = fp8.groups(k) if mode == "block" else 1  # one per row workspace (its handshake guards them)
        self.scale_ws = shmem.workspace("ag_gemm_fp8", (m_shard, k, dtype, s), lambda: _ScaleBuffers(m_shard, s, group),
                                        group=group)
        rows = slice(self.me * m_shard, (self.me + 1) * m_shard)
        self.scale_pushes = [(stream, self.scale_ws.peers[(self.me + step) % self.world][rows])
                             for step, (stream, _) in enumerate(self.pushes, 1)]  # the rows' streams, in order
        self.own_scales = self.scale_ws.scale_full[rows]


class _Call:
    """One call's scales, what ``allgather_gemm``'s launchers take as ``fp8``."""

    def __init__(self, plan, scales, rows):
        self.plan, self.rows, self.out_dtype = plan, rows, plan.out_dtype
        self.kernel_args = {**scales.kernel_args(plan.cfg, a=rows), "scale_full": plan.scale_ws.scale_full}
        self.gathered_args = scales.kernel_args(plan.cfg, a=plan.scale_ws.scale_full)

    def push_scales(self):
        """Our scale rows into every peer's scale_full (after the handshake, before the rows and their flags)."""
        main = torch.cuda.current_stream() if self.rows.is_cuda else None
        for stream, dst in self.plan.scale_pushes:
            if stream is None:  # no side streams (CPU, or peers on our GPU): on the current stream
                dst.copy_(self.rows)
                continue
            stream.wait_stream(main)
            with torch.cuda.stream(stream):
                dst.copy_(self.rows)
        if self.plan.cfg["gather_first"]:  # one GEMM over every rank's rows reads ours from scale_full too
            self.plan.own_scales.copy_(self.rows)


def _gather(t, team):
    """all_gather of ``t`` along dim 0 by NCCL (gloo on CPU), as bytes (FP8 rows need no FP8 support there)."""
    out = torch.empty((team.size * t.shape[0],) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
    src, dst = t.contiguous().view(torch.uint8), out.view(torch.uint8)
    if t.is_cuda:
        dist.all_gather_into_tensor(dst, src, group=team.group)
    else:
        dist.all_gather(list(dst.chunk(team.size)), src, group=team.group)
    return out


def _gather_then_matmul(a, w, scales, plan, return_gathered):
    """The small-M path: NCCL all_gather of the rows and their scale rows, then one scaled GEMM (cuBLAS)."""
    team = shmem.team(plan.group)
    gathered = _gather(a, team)
    rows = _gather(scales.rows_of_a(a.shape[0]), team)
    sw = scales.w.reshape(1, 1).expand(w.shape[0], 1) if scales.mode == "tensor" else scales.w
    mode = "block" if scales.mode == "block" else "row"  # per-tensor scales of several ranks: one per row
    out = scaled_mm_torch(gathered, w, fp8.Scales(mode, rows, sw.contiguous(), scales.fast_accum), plan.out_dtype)
    if plan.silu_gate:
        out = agm.silu_gate_torch(out)
    return out, (gathered if return_gathered else None)


_PLANS = shmem.Plans("ag_gemm_fp8")
_GRAPHS = GraphCache("ag_gemm_fp8")


def _run(a, w, scales, plan, return_gathered):
    if plan.path == "fallback":
        return _gather_then_matmul(a, w, scales, plan, return_gathered)
    rows = scales.rows_of_a(a.shape[0])
    if plan.path == "graph" and not return_gathered:
        def call(x, sx, y, sy):
            return agm._run_overlapped(x, y, plan, False, _Call(plan, dataclasses.replace(scales, a=sx, w=sy), sx))[0]
        out = _GRAPHS.run(plan.key, call, (a, rows), (w, scales.w))
        if out is not None:
            return out, None
    return agm._run_overlapped(a, w, plan, return_gathered, _Call(plan, scales, rows))


def default_config(m_shard, n, k, device, world, silu_gate=False):
    """``allgather_gemm.default_config`` with FP8 tiles (``gemm_fp8.fp8_tiles``)."""
    return fp8_tiles(agm.default_config(m_shard, n, k, torch.float8_e4m3fn, device, world, silu_gate), device)


def _config(a, w, scales, out_dtype, team, config, silu_gate):
    (m_shard, k), n = a.shape, w.shape[0]
    base = default_config(m_shard, n, k, a.device, team.size, silu_gate)
    if config is not None:
        return {**autotune.with_overrides(base, config), **({"silu_gate": True} if silu_gate else {})}
    if a.device.type != "cuda":
        return base

    def make_runner():
        x = torch.randn((m_shard, k), device=a.device).to(a.dtype)
        y = torch.randn((n, k), device=a.device).to(a.dtype)
        probe = fp8.Scales(scales.mode, torch.ones_like(scales.a), torch.ones_like(scales.w), scales.fast_accum)
        plans = {}

        def run(cfg):
            key = repr(sorted(cfg.items()))
            if key not in plans:
                plans[key] = _Plan(m_shard, n, k, a.dtype, a.device, {**base, **cfg}, team.group, scales.mode,
                                   out_dtype)
            return _run(x, y, probe, plans[key], False)
        return run

    cands = [fp8_tiles(c, a.device) for c in agm.candidate_configs(m_shard, n, k, torch.float8_e4m3fn, a.device,
                                                                   team.size, silu_gate)]
    key = dict(m_shard=m_shard, n=n, k=k, dtype=str(a.dtype).replace("torch.", ""), scaling=scales.mode,
               fast_accum=scales.fast_accum, out=str(out_dtype).replace("torch.", ""), silu_gate=silu_gate)
    return autotune.choose("ag_gemm_fp8", key, cands, make_runner, default=base, group=team.group)


def scaled_ag_gemm(a, w, scale_a, scale_w, *, scaling=None, out_dtype=None, fast_accum=False, return_gathered=False,
                   config=None, activation="none", group=None):
    """``all_gather(a * scale_a) @ (w * scale_w).T`` on every rank of ``group``, the FP8 gather overlapped with the
    GEMM (what ``ag_gemm`` runs when given scales). ``a`` [m, K] (this rank's rows), ``w`` [N_local, K]: FP8;
    ``scale_a`` / ``scale_w``: float32 scales of this rank's rows and of w in one of the modes of ``kernels/fp8.py``
    ([1] / [1]; [m, 1] / [N_local, 1]; [m, ceil(K/128)] / [ceil(N_local/128), ceil(K/128)]). Returns ``out``
    [W*m, N_local] in ``out_dtype`` (bfloat16 unless given), with ``return_gathered`` also all_gather(a) (FP8).
    ``activation="silu_gate"``: w = [w_gate; w_up] as in ``ag_gemm`` (blockwise: N_local a multiple of 256)."""
    scales = fp8.check_scales(a, w, scale_a, scale_w, scaling, fast_accum)
    shmem.check_device(a, "a and w")
    check_launchable(a)
    out_dtype = fp8.out_dtype_of(out_dtype)
    if hardware.compiling() and config is None and activation == "none":
        return _compiled_call(a, w, scales, out_dtype, return_gathered, group)
    if activation not in agm.ACTIVATIONS:
        raise ValueError(f"activation must be one of {agm.ACTIVATIONS}, got {activation!r}")
    silu_gate = activation == "silu_gate"
    if silu_gate and w.shape[0] % (2 * fp8.GROUP if scales.mode == "block" else 2):
        raise ValueError(f"activation='silu_gate' takes w = [gate; up] with halves of whole scale blocks, got "
                         f"{list(w.shape)} ({scales.mode} scaling)")
    team = shmem.op_team("ag_gemm_fp8", group, lambda: dict(
        a=tuple(a.shape), w=tuple(w.shape), dtype=str(a.dtype), scaling=scales.mode, out_dtype=str(out_dtype),
        activation=activation, config=config, return_gathered=return_gathered))
    (m_shard, k), n = a.shape, w.shape[0]
    n_out = n // 2 if silu_gate else n
    if m_shard == 0 or k == 0:
        out = torch.zeros((team.size * m_shard, n_out), dtype=out_dtype, device=a.device)
        return (out, a.new_empty((team.size * m_shard, k))) if return_gathered else out
    key = (team.name, m_shard, n, k, a.dtype, scales.mode, scales.fast_accum, out_dtype, silu_gate,
           None if config is None else repr(sorted(config.items())))
    plan = _PLANS.get(key, lambda: _Plan(m_shard, n, k, a.dtype, a.device,
                                         _config(a, w, scales, out_dtype, team, config, silu_gate)
                                         if n else {**default_config(m_shard, n, k, a.device, team.size),
                                                    "path": "fallback"},
                                         team.group, scales.mode, out_dtype))
    out, gathered = _run(a, w, scales, plan, return_gathered)
    return (out, gathered) if return_gathered else out


# ----------------------------------------------------------------------------------------------- torch.compile
def _compiled_call(a, w, scales, out_dtype, return_gathered, group):
    """``scaled_ag_gemm`` inside torch.compile: through the torch op."""
    gathered, (out,) = torch.ops.triton_dist.fused_all_gather_scaled_matmul(
        a, [w.t()], scales.a, [scales.w if scales.w.numel() == 1 else scales.w.t()], 0, shmem.group_name(group),
        [None], [None], [out_dtype], [scales.fast_accum])  # (async_tp.py: B = W.t(), B's scales likewise)
    return (out, gathered) if return_gathered else out


__all__ = ["scaled_ag_gemm", "default_config"]
