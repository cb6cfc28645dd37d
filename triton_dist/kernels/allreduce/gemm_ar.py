"""GEMM + all-reduce in one persistent kernel: the tensor-parallel row-parallel projection at decode sizes.

Rank r holds ``a_r`` [M, K_local] and ``w_r`` [N, K_local]; every rank gets ``out = sum_r a_r @ w_r.T`` [M, N].
Each rank walks the same output tiles in the same order (program p: tiles p, p+P, ...), and a tile's partial sum
is *published*, not pushed: stored once into this rank's symmetric ``partials`` (a local, L2-resident store) and
announced with a flag on every peer, who read it over NVLink when they reduce that tile:

    for each tile of program p:
        acc = a_r[tile rows] @ w_r[tile cols].T                      (the GEMM core's tile_accumulate, fp32)
        partials[parity][tile] = acc in the partial dtype; signal flag[tile, r] on every peer
        the program's previous tile (its partials had a whole tile of GEMM to land):
            wait flag[tile', q] of every peer q
            out[tile'] = p_0 + p_1 + ... + p_{W-1}                    (fp32, rank order, the own partial re-read)

No separate all-reduce launch, no write of the full partial product to HBM and back (a partial tile goes to L2
and is read from there and over NVLink). Every rank sums the same stored partials in the same order: bitwise
identical on every rank, whatever the schedule. ``partials`` is double-buffered by epoch parity like the
all-reduce's buffers (a rank finishes call n only after every peer published tiles in call n), so no ready
handshake. Program p only waits on the peers' program p: never on a later program of its own launch.
Small-M GEMMs are weight-bandwidth bound; at shapes where the fusion does not pay, the tuned path is
``torch.matmul`` + ``dist.all_reduce`` (``gemm_ar_torch``).
"""

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from ... import autotune, hardware, shmem
from ... import language as dl
from ...hardware import cdiv, next_power_of_2
from .. import library
from ..launcher import Launcher
from ..gemm import (check_launchable, check_matmul_operands, dot_precision, skinny_configs, tile_accumulate,
                    tile_coords, tile_store, tma_compatible, tma_descriptor)
from . import config as knobs
from .host import NCCL, grown_workspace, plan_pair
from .kernels import sum_over_ranks


# ----------------------------------------------------------------------------------------------- device side
@triton.jit
def _reduce_tile(tile, mine, out, flags, epoch, me, M, N, tiles_m, tiles_n, ctx, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr, WORLD: tl.constexpr, WORLD_P2: tl.constexpr):
    """out[tile] = the sum of every rank's partial of ``tile`` in rank order, once every peer published it."""
    _, pid_m, pid_n = tile_coords(tile, tiles_m, tiles_n, 1, 0, 1, GROUP_M)
    peers = tl.arange(0, WORLD_P2)
    dl.wait(flags + tile * WORLD + peers, epoch, ctx, mask=(peers < WORLD) & (peers != me))
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    at = mine + rows.to(tl.int64)[:, None] * N + cols[None, :]
    total = sum_over_ranks(at, at, (rows < M)[:, None] & (cols < N)[None, :], me, ctx, WORLD)
    # out is one segment: stride 0 (the segment index, any tensor, is multiplied away)
    tile_store(out, total, pid_m, pid_m * BLOCK_M, pid_n * BLOCK_N, M, N, 0, N, BLOCK_M, BLOCK_N, False)


@triton.jit
def gemm_ar_kernel(a, w, out, partials, flags, state, M, N, K, stride_am, stride_wn, partial_elems, ctx,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                   USE_TMA: tl.constexpr, DOT_PRECISION: tl.constexpr, WORLD: tl.constexpr,
                   WORLD_P2: tl.constexpr):
    """One gemm_ar call on this rank. ``a`` [M, K], ``w`` [N, K]: tensor descriptors (USE_TMA) or pointers;
    ``out`` [M, N] contiguous; ``partials``: symmetric [2, partial_elems] (epoch parity halves of [M, N]);
    ``flags``: symmetric int32 [tiles, WORLD]; ``state``: this rank's int32[2] epoch counter."""
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    me = dl.rank(ctx)
    epoch = dl.call_epoch(state)
    parity = epoch % 2
    mine = partials + parity.to(tl.int64) * partial_elems
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    pending = -1  # the program's previous tile, reduced once the next one is computed
    for tile in range(pid, tiles_m * tiles_n, n_programs):
        _, pid_m, pid_n = tile_coords(tile, tiles_m, tiles_n, 1, 0, 1, GROUP_M)
        acc = tile_accumulate(a, w, pid_m * BLOCK_M, pid_n * BLOCK_N, M, N, K, stride_am, stride_wn,
                              BLOCK_M, BLOCK_N, BLOCK_K, USE_TMA, DOT_PRECISION)
        tile_store(partials, acc, parity, pid_m * BLOCK_M, pid_n * BLOCK_N, M, N, partial_elems, N, BLOCK_M, BLOCK_N,
                   False)  # partials[parity] as segment `parity` of [2, partial_elems]
        dl.enter_call(flags + tile * WORLD, epoch, me, WORLD, ctx, SKIP_SELF=True)  # published on every peer
        if pending >= 0:
            _reduce_tile(pending, mine, out, flags, epoch, me, M, N, tiles_m, tiles_n, ctx, BLOCK_M, BLOCK_N,
                         GROUP_M, WORLD, WORLD_P2)
        pending = tile
    if pending >= 0:
        _reduce_tile(pending, mine, out, flags, epoch, me, M, N, tiles_m, tiles_n, ctx, BLOCK_M, BLOCK_N,
                     GROUP_M, WORLD, WORLD_P2)
    dl.finish_call(state, epoch, n_programs)


# ----------------------------------------------------------------------------------------------- host side
class _Partials:
    """The symmetric buffers of one partial dtype: partials [2, partial_elems], flags [tiles, W], the epoch."""

    def __init__(self, dtype, sizes, group):
        self.sizes = sizes
        self.partial_elems, n_flags = sizes
        self.partials = shmem.empty((2 * self.partial_elems,), dtype, name="gemm_ar.partials", group=group)
        self.flags = shmem.signals((n_flags,), name="gemm_ar.flags", group=group)
        self.state = shmem.counters(2, name="gemm_ar.epoch")


def default_config(m, n, k, dtype, device):
    """``path`` ("fused" | "nccl": torch.matmul + dist.all_reduce), ``partial`` ("out": partial tiles in the
    output dtype, like matmul + all_reduce; "fp32": exact partials at twice the traffic), the GEMM tiles
    (BLOCK_M/N/K, GROUP_M, num_stages, num_warps), ``use_tma`` (None: when the operands allow) and
    ``num_programs`` (None: one per tile, at most one per SM)."""
    if device.type != "cuda":
        tiles = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=2, num_stages=1, num_warps=4)
    elif dtype == torch.float32:
        tiles = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, GROUP_M=8, num_stages=4, num_warps=4)
    else:  # decode: narrow tiles put every SM on the weight stream
        tiles = dict(BLOCK_M=64 if m <= 64 else 128, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, num_stages=4, num_warps=4)
    return dict(path="fused", partial="out", use_tma=None, num_programs=None, **tiles)


def candidates(m, n, k, dtype, device):
    base = default_config(m, n, k, dtype, device)
    cands = [base, {**base, "path": "nccl"}, {**base, "partial": "fp32"},
             {**base, "BLOCK_N": 32, "num_stages": 6}, {**base, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8}]
    cands += [{**base, **c} for c in skinny_configs(dtype)]
    return autotune.dedupe(cands)


def gemm_ar_torch(a, w, group=None):
    """The baseline and the "nccl" path: ``torch.matmul`` then ``dist.all_reduce`` (NCCL; gloo on CPU)."""
    out = torch.matmul(a, w.t())
    dist.all_reduce(out, group=shmem.team(group).group)
    return out


_PLANS = shmem.Plans("gemm_ar")


class _Plan:
    """One launch of ``gemm_ar_kernel`` for a shape and configuration: grid, constants, workspace."""

    def __init__(self, a, w, cfg, team):
        m, n, world = a.shape[0], w.shape[0], team.size
        bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
        tiles = cdiv(m, bm) * cdiv(n, bn)
        dtype = torch.float32 if cfg["partial"] == "fp32" else a.dtype
        self.ws = grown_workspace("gemm_ar", dtype, lambda sizes: _Partials(dtype, sizes, team.group),
                                  (m * n, tiles * world), team.group)
        self.use_tma = cfg["use_tma"] is not False and tma_compatible(a, w)
        programs = knobs.num_programs({"num_programs": cfg["num_programs"]}, tiles, a.device)
        self.blocks = ([bm, bk], [bn, bk])
        self.kernel = Launcher(gemm_ar_kernel, (programs,), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                               GROUP_M=cfg["GROUP_M"], USE_TMA=self.use_tma, DOT_PRECISION=dot_precision(a.dtype),
                               WORLD=world, WORLD_P2=dl.rank_lanes(world), num_warps=cfg["num_warps"],
                               num_stages=cfg["num_stages"])
        self.ctx = team.ctx

    def launch(self, a, w, out):
        ws = self.ws
        if self.use_tma:
            a_arg, w_arg = tma_descriptor(a, self.blocks[0]), tma_descriptor(w, self.blocks[1])
        else:
            a_arg, w_arg = a, w
        shmem.raise_pending_errors()
        self.kernel(a_arg, w_arg, out, ws.partials, ws.flags, ws.state, a.shape[0], w.shape[0], a.shape[1],
                    a.stride(0), w.stride(0), ws.partial_elems, self.ctx)


def _configs(a, w, config, team):
    """(eager, captured) configurations: ``config`` over the default, or on GPU the tuned ones (``config.tuned``)."""
    (m, k), n = a.shape, w.shape[0]
    base = default_config(m, n, k, a.dtype, a.device)
    if config is not None or not knobs.tunable(a.device, team.size):
        cfg = autotune.with_overrides(base, config)
        return cfg, cfg

    def make_call():
        x, y = torch.randn_like(a), torch.randn_like(w)
        return lambda cfg: _gemm_ar(x, y, cfg, team)

    key = dict(m=next_power_of_2(m), n=n, k=k, dtype=str(a.dtype))
    return knobs.tuned("gemm_ar", key, candidates(m, n, k, a.dtype, a.device), base, make_call, team.group)


def _gemm_ar(a, w, config, team):
    key = (team.name, a.shape, w.shape, a.dtype, config and repr(sorted(config.items())))
    plan = _PLANS.get(key, lambda: plan_pair(_configs(a, w, config, team), lambda cfg: (
        NCCL if cfg["path"] == "nccl" else _Plan(a, w, cfg, team))))[hardware.capturing()]
    if plan is NCCL:
        return gemm_ar_torch(a, w, team.group)
    out = torch.empty((a.shape[0], w.shape[0]), dtype=a.dtype, device=a.device)
    plan.launch(a, w, out)
    return out


def gemm_ar(a, w, group=None, config=None):
    """``all_reduce(a @ w.T)`` over the ranks of ``group`` (default: the heap's): the row-parallel projection
    (``a`` [M, K_local] this rank's slice of the activations' hidden dimension, ``w`` [N, K_local] its slice of
    the weight), in one kernel whose tiles are summed as they finish, in rank order: bitwise identical on every
    rank and run. float16/bfloat16 (float32 works too); every rank passes the same shapes; returns [M, N].
    ``config``: overrides of ``default_config``; without it GPU calls use the tuned configuration (which may be
    torch.matmul + NCCL). CUDA graphs: call it once per shape before capturing. Autograd (inputs that require
    grad go through the torch op; ``config``: its forward's, eagerly): G = all_reduce(grad), grad_a = G @ w,
    grad_w = G.T @ a (``kernels/autograd.py``)."""
    check_matmul_operands(a, w)
    shmem.check_device(a, "a")
    check_launchable(a)
    if library.needs_grad(a, w):
        return library.with_caller_config("gemm_ar", config, lambda: torch.ops.triton_dist.gemm_ar(
            a, w, shmem.group_name(group)))
    if config is None and hardware.compiling():
        return torch.ops.triton_dist.gemm_ar(a, w, shmem.group_name(group))
    team = shmem.op_team("gemm_ar", group, lambda: dict(a=tuple(a.shape), w=tuple(w.shape), dtype=str(a.dtype),
                                                        config=config))
    if a.shape[0] == 0 or w.shape[0] == 0 or a.shape[1] == 0:
        return torch.zeros((a.shape[0], w.shape[0]), dtype=a.dtype, device=a.device)
    return _gemm_ar(a, w, config, team)


def _gemm_ar_op(a, w, group_name=None):
    with torch.no_grad():  # (below autograd: the public function must not route back to the op)
        return gemm_ar(a, w, shmem.group_named(group_name), library.caller_config("gemm_ar"))


def _gemm_ar_fake(a, w, group_name=None):
    check_matmul_operands(a, w)
    return a.new_empty((a.shape[0], w.shape[0]))


library.define("gemm_ar(Tensor a, Tensor w, str? group_name=None) -> Tensor", _gemm_ar_op, _gemm_ar_fake)
