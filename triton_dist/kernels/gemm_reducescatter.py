"""GEMM + reduce-scatter, overlapped: the tensor-parallel output projection.

Rank r holds ``a_r`` [M, K_local] and ``w_r`` [N, K_local]; the op returns, on rank d, rank d's rows of
``sum_r a_r @ w_r.T``, rows split like ``torch.tensor_split(rows, W)`` (ragged M is fine). One persistent kernel
per rank, no separate reduction pass:

    rank r walks its tiles destination by destination: rows of rank r+1, r+2, ..., its OWN rows last
      tile for peer d:  acc = a_r[d's rows] @ w_r.T                  (fp32)
                        wait once per program until d entered the call       (dl.wait_entered)
                        dl.put(acc -> recv[slot of r] on d); dl.signal(arrived[slot, tile] on d), the signal
                        deferred until the program's next tile is computed (the stores have drained by then)
      OWN tile:         acc = a_r[r's rows] @ w_r.T; wait for every peer's partial of the tile;
                        out = ((acc + recv[from r+1]) + recv[from r+2]) + ...   (the fused reduction)

The sum on rank d runs in the FIXED ring order d, d+1, ..., d-1 whatever the timing: bitwise reproducible. Peers'
partials travel in the output dtype (``partial="fp32"``: exact, twice the bytes). Flags carry device-side epochs:
no resets, no host syncs, CUDA-graph safe. Under the interpreter (programs run one after another) the launcher
starts one program per tile, so every push of a rank precedes its first wait. Small problems go to torch.matmul +
``reduce_scatter_tensor`` or to the kernel replayed from a CUDA graph (``path``), chosen per shape by the
autotuner on GPU. docs/design/gemm_rs.md has the measurements behind the defaults.

FP8 (``gemm_rs(a8, w8, scale_a=..., scale_w=...)``; ``scaled_gemm_rs``: the scales required) is the same kernel:
each tile's product is scaled in fp32 (``gemm.tile_accumulate``; the modes of ``kernels/fp8.py`` over this rank's
K slice) before it leaves as a partial in the output dtype (bf16 unless asked otherwise; fp32 with
``partial="fp32"``), summed in the same fixed order. FP8 halves the bytes the GEMM reads; the partials are the
output's.
"""

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from .. import autotune, hardware, shmem
from .. import language as dl
from ..hardware import cdiv, next_power_of_2
from . import fp8, library
from .gemm import (b_row_stride, c_block, check_launchable, check_tiles, default_num_programs, describe_operands,
                   dot_precision, fp8_tiles, gemm_config, is_kn, matmul_torch, output_like, skinny_configs,
                   tile_accumulate, tile_coords, tile_store, tma_descriptor)
from .replay import GraphCache

# The crossover: below this many rows (M, all ranks together) the default path is torch.matmul + NCCL
# reduce_scatter_tensor. On GPU the autotuner times both paths for every shape and keeps the faster.
SMALL_M_ROWS = 64


# ----------------------------------------------------------------------------------------------- device side
@triton.jit
def gemm_rs_kernel(a, w, out, recv, recv_peer, arrived, ready, state, M, N, K, stride_am, stride_wn, own_rows,
                   ctx, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                   USE_TMA: tl.constexpr, EPILOGUE_SUBTILE: tl.constexpr, DEFER_SIGNAL: tl.constexpr,
                   DOT_PRECISION: tl.constexpr, SLOTS_BLOCK: tl.constexpr, REMOTE_TMA: tl.constexpr,
                   scale_a=None, scale_w=None, stride_sa=None, stride_sw=None, SCALES: tl.constexpr = "",
                   MAX_IMPRECISE_ACC: tl.constexpr = None, W_KN: tl.constexpr = False):
    """One launch = one gemm_rs call on this rank. ``a`` [M, K], ``w`` [N, K] (W_KN: w.T [K, N], the weight as it
    lies; ``stride_wn`` its rows' stride) and ``out`` [1, own_rows, N]:
    tensor descriptors (USE_TMA) or pointers to contiguous tensors. ``recv``: symmetric [W-1, rows_max, N]
    partial sums from the peers (slot of source q on rank d: (q - d - 1) mod W); ``arrived``: symmetric int32
    [W-1, tiles_per_dest]; ``ready``: symmetric int32 [W]; ``state``: this rank's int32[2] epoch counter.
    REMOTE_TMA (W = 2): partials go to the peer by TMA stores through ``recv_peer``, a descriptor of the peer's
    recv [1, its rows, N] (asynchronous: the program computes on while they cross). FP8 operands: their scales
    (``gemm.tile_accumulate``), applied before the partials leave."""
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    me = dl.rank(ctx)
    world = dl.num_ranks(ctx)
    epoch = dl.call_epoch(state)

    rows_base = M // world
    rows_extra = M % world
    rows_max = tl.cdiv(M, world)
    tiles_m = tl.cdiv(rows_max, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    tiles_per_dest = tiles_m * tiles_n
    slot_elems = rows_max.to(tl.int64) * N

    if pid == 0:  # every peer may now overwrite its partials in our recv (we are done with the last call's)
        dl.enter_call(ready, epoch, me, world, ctx, SKIP_SELF=True)

    pending_peer = -1  # the deferred signal: (peer, flag index) of the last tile this program pushed
    pending_flag = 0
    ready_peer = -1  # the peer whose `ready` this program has already seen
    for item in range(pid, world * tiles_per_dest, n_programs):
        # destinations in the order me+1, me+2, ..., me (own rows last); grouped-M order inside one
        dest, pid_m, pid_n = tile_coords(item, tiles_m, tiles_n, world, me + 1, 1, GROUP_M)
        tile = item % tiles_per_dest  # the flag of this tile (the same tile order on every rank)
        dest_rows = rows_base + (dest < rows_extra).to(tl.int32)
        dest_start = dest * rows_base + tl.minimum(dest, rows_extra)
        # rows past the destination's block belong to the next one: computed, never stored
        acc = tile_accumulate(a, w, dest_start + pid_m * BLOCK_M, pid_n * BLOCK_N, M, N, K, stride_am, stride_wn,
                              BLOCK_M, BLOCK_N, BLOCK_K, USE_TMA, DOT_PRECISION, False, scale_a, scale_w, stride_sa,
                              stride_sw, SCALES, MAX_IMPRECISE_ACC, B_KN=W_KN)

        if pending_peer >= 0:  # the previous push had a whole tile of compute to drain: publish it now
            dl.bulk_stores_done(REMOTE_TMA)
            dl.signal(arrived + pending_flag, epoch, pending_peer, ctx)
            pending_peer = -1
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # rows inside the destination's block of rows
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        tile_ok = (rows < dest_rows)[:, None] & (cols < N)[None, :]
        tile_offsets = rows.to(tl.int64)[:, None] * N + cols[None, :]
        if dest != me:
            if ready_peer != dest:
                dl.wait_entered(ready, dest, epoch, ctx)
                ready_peer = dest
            slot = (me - dest - 1 + world) % world
            if REMOTE_TMA:
                tile_store(recv_peer, acc, 0, pid_m * BLOCK_M, pid_n * BLOCK_N, dest_rows, N, 0, N, BLOCK_M,
                           BLOCK_N, True, EPILOGUE_SUBTILE)
            else:
                dl.put(recv + slot * slot_elems + tile_offsets, acc.to(recv.dtype.element_ty), dest, ctx,
                       mask=tile_ok)
            if DEFER_SIGNAL:
                pending_flag = slot * tiles_per_dest + tile
                pending_peer = dest
            else:
                dl.bulk_stores_done(REMOTE_TMA)
                dl.signal(arrived + slot * tiles_per_dest + tile, epoch, dest, ctx)
        else:
            slots = tl.arange(0, SLOTS_BLOCK)
            dl.wait(arrived + slots * tiles_per_dest + tile, epoch, ctx, mask=slots < world - 1)
            # the fixed summation order: own partial, then ranks me+1, me+2, ... (slot 0, 1, ...), added into the
            # accumulator in place (one extra tile of registers, whatever W is)
            for slot in range(world - 1):
                acc += tl.load(recv + slot * slot_elems + tile_offsets, mask=tile_ok).to(tl.float32)
            own_segment = dest - me  # == 0: out is [1, own_rows, N], one segment
            tile_store(out, acc, own_segment, pid_m * BLOCK_M, pid_n * BLOCK_N, own_rows, N, own_rows * N, N,
                       BLOCK_M, BLOCK_N, USE_TMA, EPILOGUE_SUBTILE)
    if pending_peer >= 0:
        dl.bulk_stores_done(REMOTE_TMA)
        dl.signal(arrived + pending_flag, epoch, pending_peer, ctx)
    dl.finish_call(state, epoch, n_programs)


# ----------------------------------------------------------------------------------------------- host side
def rows_of_rank(m, world, rank):
    """(first row, number of rows) of rank ``rank``'s share of ``m`` rows (tensor_split rule). ``m`` may be a
    SymInt (a fake impl under torch.compile with dynamic shapes)."""
    base, extra = m // world, m % world
    return rank * base + min(rank, extra), base + (1 if rank < extra else 0)


class _Buffers:
    """The symmetric buffers of one partial dtype: ``recv`` (peers' partial tiles), ``arrived`` (a flag per
    partial tile), ``ready`` (the handshake) and this rank's epoch counter."""

    def __init__(self, dtype, recv_elems, n_flags, group):
        world = shmem.world_size(group)
        self.recv_elems, self.n_flags = recv_elems, n_flags
        self.recv = shmem.empty((max(recv_elems, 1),), dtype, name="gemm_rs.recv", group=group)
        self.arrived = shmem.signals((max(n_flags, 1),), name="gemm_rs.arrived", group=group)
        self.ready = shmem.signals((world,), name="gemm_rs.ready", group=group)
        self.state = shmem.counters(2, name="gemm_rs.epoch")


def _workspace(dtype, recv_elems, n_flags, group):
    """One workspace per partial dtype and group, grown (collectively: every rank sees the same shapes) when a
    larger problem comes."""
    old = shmem.workspaces.peek("gemm_rs", dtype, group)
    if old is not None:
        recv_elems, n_flags = max(recv_elems, old.recv_elems), max(n_flags, old.n_flags)
    return shmem.workspace("gemm_rs", dtype, lambda: _Buffers(dtype, recv_elems, n_flags, group),
                           fits=lambda ws: ws.recv_elems >= recv_elems and ws.n_flags >= n_flags, group=group)


def _run_overlapped(a, w, out, cfg, team, scales=None):
    """The kernel on ``out`` (``scales``: FP8 operands' ``fp8.Scales``; ``w`` contiguous, or a transposed view of a
    contiguous [K, N]: ``is_kn``)."""
    world, group = team.size, team.group
    (m, k), n = a.shape, w.shape[0]
    kn = is_kn(w)
    own_rows = out.shape[0]
    partial_dtype = torch.float32 if cfg["partial"] == "fp32" else out.dtype
    rows_max = cdiv(m, world)
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    tiles_per_dest = cdiv(rows_max, bm) * cdiv(n, bn)
    ws = _workspace(partial_dtype, (world - 1) * rows_max * n, (world - 1) * tiles_per_dest, group)
    out3 = out.view(1, own_rows, n)
    # TMA whenever allowed (use_tma None or True) and the operands are aligned; a rank with no rows of its own
    # has no output to describe
    a_arg, w_arg, out_arg, use_tma = describe_operands(a, w, out3, cfg if own_rows > 0 else {**cfg, "use_tma": False},
                                                       kn)
    subtile = bool(cfg["EPILOGUE_SUBTILE"]) and use_tma
    # partials by TMA stores into the peer's recv: 2 ranks (one peer, one descriptor), TMA on
    peer_rows = rows_of_rank(m, world, 1 - team.rank)[1] if world == 2 else 0
    remote_tma = bool(cfg.get("remote_tma")) and use_tma and peer_rows > 0
    recv_peer = ws.recv
    if remote_tma:
        view = shmem.peer_view(ws.recv, 1 - team.rank, group)[:peer_rows * n].view(1, peer_rows, n)
        recv_peer = tma_descriptor(view, c_block(cfg))
    n_items = world * tiles_per_dest
    programs = cfg.get("num_programs")
    if programs is None:
        programs = hardware.num_sms(a.device.index) if a.is_cuda else 0
    programs = n_items if programs == 0 else max(1, min(int(programs), n_items))
    shmem.raise_pending_errors()
    gemm_rs_kernel[(programs,)](
        a_arg, w_arg, out_arg, ws.recv, recv_peer, ws.arrived, ws.ready, ws.state, m, n, k, a.stride(0),
        b_row_stride(w, kn), own_rows, team.ctx,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg["GROUP_M"], USE_TMA=use_tma, EPILOGUE_SUBTILE=subtile,
        DEFER_SIGNAL=bool(cfg["DEFER_SIGNAL"]), DOT_PRECISION=dot_precision(a.dtype),
        SLOTS_BLOCK=next_power_of_2(max(world - 1, 1)), REMOTE_TMA=remote_tma,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **({} if scales is None else scales.kernel_args(cfg)),
        **({"W_KN": True} if kn else {}))
    return out


def gemm_rs_torch(a, w, group=None, scales=None, out_dtype=None):
    """The baseline, also the small-problem path: ``torch.matmul`` (FP8 ``scales``: ``gemm.matmul_torch``) then
    ``reduce_scatter_tensor`` (NCCL; gloo on CPU), rows padded to equal chunks when M % W != 0. Same row split as
    ``gemm_rs``."""
    return reduce_scatter_rows(matmul_torch(a, w, scales, out_dtype), group)


def reduce_scatter_rows(partial, group=None):
    """This rank's rows (``rows_of_rank``) of the sum over ``group`` of every rank's ``partial`` [M, N]."""
    team = shmem.team(group)
    world, me = team.size, team.rank
    m, n = partial.shape
    if world == 1:
        return partial
    rows_max = cdiv(m, world)
    if m % world:
        padded = partial.new_zeros((world * rows_max, n))
        for d in range(world):
            start, rows = rows_of_rank(m, world, d)
            padded[d * rows_max: d * rows_max + rows] = partial[start: start + rows]
        partial = padded
    out = partial.new_empty((rows_max, n))
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor  # torch >= 2.13 name
    reduce_scatter(out, partial, group=team.group)
    return out[: rows_of_rank(m, world, me)[1]]


# ----------------------------------------------------------------------------------------------- configs
def choose_path(m, world, device_type="cuda"):
    """The default path: "fallback" (torch.matmul + reduce_scatter_tensor) for one rank or, on GPU, tiny M (on
    CPU, where nothing is about speed, the kernel always runs so that tests exercise it)."""
    if world == 1 or (device_type == "cuda" and m < SMALL_M_ROWS):
        return "fallback"
    return "overlap"


def default_config(m, n, k, dtype, device, world, scales=None):
    """Launch parameters, ``triton_dist.kernels.gemm.gemm_config`` for the per-destination GEMM plus:
    path ("overlap" | "graph": the overlapped kernel replayed from a cached CUDA graph, see ``replay.py`` |
    "fallback"), partial ("out": peers' partial sums travel in the output dtype, like
    matmul + reduce_scatter; "fp32": exact partials at twice the traffic), DEFER_SIGNAL (publish a pushed tile
    after the program's next tile is computed, so the release never waits for NVLink), remote_tma (2 ranks, TMA
    on: partial tiles go to the peer by TMA stores, asynchronous to the program, instead of stores from
    registers), num_programs (None: one per SM on GPU, one per tile under the interpreter; 0: one per tile)."""
    rows_max = cdiv(m, world)
    cfg = gemm_config(rows_max, n, k, dtype, device, scales)
    # FLATTEN / WARP_SPECIALIZE stay off: the tile loop's body waits and signals between tiles
    cfg.update(path=choose_path(m, world, device.type), partial="out", DEFER_SIGNAL=True, FLATTEN=False,
               WARP_SPECIALIZE=False, remote_tma=False)
    if device.type == "cuda" and rows_max <= 64:  # 128-row tiles would be mostly padding
        cfg = fp8_tiles({**cfg, "BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 4, "num_stages": 4}, dtype, device, scales)
    return cfg


def candidate_configs(m, n, k, dtype, device, world, scales=None):
    """The small sweep the autotuner runs once per shape on GPU (both paths; the partial dtype never changes); FP8
    ``dtype`` (``scales``: their mode): as FP8 tiles (``gemm.fp8_tiles``)."""
    base = default_config(m, n, k, dtype, device, world, scales)
    rows_max = cdiv(m, world)
    cands = [{**base, "path": "fallback"}]
    if world > 1 and m >= world:
        over = {**base, "path": "overlap"}
        big = dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_stages=3, num_warps=8)
        cands += [over,
                  {**over, **big},
                  {**over, **big, "EPILOGUE_SUBTILE": True, "num_stages": 4},
                  {**over, **big, "DEFER_SIGNAL": False},
                  {**over, "BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_stages": 4, "num_warps": 8},
                  {**over, "BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "num_stages": 4, "num_warps": 4}]
        if m <= 2048 and device.type == "cuda":  # host-bound sizes: replay from a CUDA graph, or launch with
            # plain pointers (half the host time of three TMA descriptors)
            small = [over, {**over, "BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_stages": 4, "num_warps": 8},
                     {**over, "BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "num_stages": 4, "num_warps": 4}]
            if rows_max > 64:  # 128x256: at M = 512 one wave of tiles (the own tiles' programs wait for partials
                # computed alongside, not a wave later); with 64 rows per rank half of each tile would be padding
                small.append({**over, **big, "EPILOGUE_SUBTILE": True, "num_stages": 4})
            if m <= 512:
                small += [{**over, **c} for c in skinny_configs(dtype)]
            cands += [{**c, "path": "graph"} for c in small] + [{**c, "use_tma": False} for c in small[::2]]
        if device.type == "cuda":  # a few SMs left to the NVLink stores
            sms = default_num_programs(device)
            cands += [{**over, **big, "num_programs": sms - 4}, {**over, **big, "num_programs": sms - 8},
                      {**over, **big, "num_programs": sms - 4, "GROUP_M": 4}]
            # partials by TMA stores; verified on the CUDA symmetric-memory backend only
            if world == 2 and shmem.backend() == "cuda":
                cands += [{**over, **big, "remote_tma": True},
                          {**over, **big, "num_programs": sms - 4, "remote_tma": True},
                          {**over, **big, "num_programs": sms - 4, "remote_tma": True, "GROUP_M": 16}]
    return autotune.dedupe([fp8_tiles(c, dtype, device, scales) for c in cands])


def _config_for(a, w, team, scales=None, out_dtype=None):
    world = team.size
    (m, k), n = a.shape, w.shape[0]
    base = default_config(m, n, k, a.dtype, a.device, world, scales)
    if a.device.type != "cuda":
        return base

    def make_runner():  # times what an eager call costs with each candidate, host work included
        x = torch.randn_like(a, dtype=torch.float32).to(a.dtype)
        y = torch.randn_like(w, dtype=torch.float32).to(w.dtype)
        probe = None if scales is None else scales.probe()
        return lambda cfg: _gemm_rs_impl(x, y, cfg, None, team.group, probe, out_dtype)

    key = dict(m=m, n=n, k=k, dtype=str(a.dtype).replace("torch.", ""), **fp8.describe(scales, out_dtype))
    return autotune.choose("gemm_rs", key, candidate_configs(m, n, k, a.dtype, a.device, world, scales), make_runner,
                           default=base, group=team.group)


# ----------------------------------------------------------------------------------------------- the op
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_CONFIGS = shmem.Plans("gemm_rs")  # (group, m, n, k, dtype[, config][, FP8 mode]) -> the tuned configuration
_GRAPHS = GraphCache("gemm_rs")  # path "graph": small problems replayed from CUDA graphs


def _check_inputs(a, w, scales=None):
    if scales is not None:  # FP8 operands: checked with their scales (``fp8.scaled_operands``)
        check_launchable(a)
        return
    if not isinstance(a, torch.Tensor) or not isinstance(w, torch.Tensor):
        raise TypeError(f"a and w must be torch.Tensors, got {type(a).__name__} and {type(w).__name__}")
    if a.dtype not in _DTYPES or w.dtype != a.dtype:
        raise TypeError(f"a and w must share one dtype of float16/bfloat16/float32, got {a.dtype} and {w.dtype}")
    if a.dim() != 2 or w.dim() != 2:
        raise ValueError(f"a must be [M, K_local] and w [N, K_local], got {list(a.shape)} and {list(w.shape)}")
    if a.shape[1] != w.shape[1]:
        raise ValueError(f"a [M, K_local] and w [N, K_local] disagree on K_local: {list(a.shape)} vs {list(w.shape)}")


def _gemm_rs_impl(a, w, config=None, out=None, group=None, scales=None, out_dtype=None):
    """The op on checked inputs (``_check_inputs``); ``scales``, ``out_dtype``: ``fp8.scaled_operands``'."""
    out_dtype = out_dtype or a.dtype
    shmem.check_device(a, "a")
    shmem.check_device(w, "w")
    team = shmem.op_team("gemm_rs", group, lambda: dict(a=tuple(a.shape), w=tuple(w.shape), dtype=str(a.dtype),
                                                        config=config, out=out is not None,
                                                        **fp8.describe(scales, out_dtype)))
    world, me = team.size, team.rank
    (m, k), n = a.shape, w.shape[0]
    shape = (rows_of_rank(m, world, me)[1], n)  # this rank's rows of the result
    if out is not None:
        output_like(out, shape, a, out_dtype)  # a bad `out` is reported whichever path runs
    if m == 0 or n == 0 or k == 0:  # nothing to reduce: empty, or all zeros when K is 0
        return output_like(out, shape, a, out_dtype).zero_()
    a = a.contiguous()
    kn = scales is None and is_kn(w)  # w.T of a contiguous weight: read as it lies (the backward's grad @ w)
    w = w if kn else w.contiguous()
    if config is None:  # one dict lookup per call once the shape is tuned
        key = (team.name, m, n, k, a.dtype, kn) + fp8.plan_key(scales, out_dtype)
        cfg = _CONFIGS.get(key, lambda: {**default_config(m, n, k, a.dtype, a.device, world, scales),
                                         **_config_for(a, w, team, scales, out_dtype)})
    else:
        key = (team.name, m, n, k, a.dtype, kn, repr(sorted(config.items()))) + fp8.plan_key(scales, out_dtype)
        cfg = check_tiles(autotune.with_overrides(default_config(m, n, k, a.dtype, a.device, world, scales), config),
                          path=("overlap", "graph", "fallback"), partial=("out", "fp32"))
    fp8.check_block_k(scales, cfg)
    res = None
    if cfg["path"] == "fallback":
        res = gemm_rs_torch(a, w, team.group, scales, out_dtype)
    elif cfg["path"] == "graph":  # None: not replayable now (first call of the shape, a capture, CPU)
        res = _GRAPHS.run_op(key, lambda x, y, s: _run_overlapped(
            x, y, torch.empty(shape, dtype=out_dtype, device=x.device), cfg, team, s), a, w, scales)
    if res is None:
        return _run_overlapped(a, w, output_like(out, shape, a, out_dtype), cfg, team, scales)
    return res if out is None else out.copy_(res)


def _output_shape(a, w, group, quantize=None, fp8_grads=False):
    _check_inputs(a, w)
    fp8.check_fp8_grads(fp8_grads, fp8.check_mode(quantize))
    return rows_of_rank(a.shape[0], shmem.world_size(group), shmem.rank(group))[1], w.shape[0]


def _gemm_rs_fake(a, w, group_name=None, quantize=None, fp8_grads=False):
    return a.new_empty(_output_shape(a, w, shmem.group_named(group_name), quantize, fp8_grads))


def _quantized_gemm_rs(a, w, quantize, config=None, out=None, group=None):
    """``gemm_rs`` of high-precision ``a`` and ``w`` quantised here (``fp8.quantize_operands``, mode ``quantize``,
    over this rank's K slice): the FP8 op, the result in a's dtype."""
    a8, w8, scales = fp8.quantize_operands(a, w, quantize)
    return _gemm_rs_impl(a8, w8, config, out, group, scales, a.dtype)


def _gemm_rs_op(a, w, group_name=None, quantize=None, fp8_grads=False):
    _check_inputs(a, w)
    fp8.check_fp8_grads(fp8_grads, quantize)  # (the backward's business: kernels/autograd.py)
    config = library.caller_config("gemm_rs")
    if quantize is not None:
        return _quantized_gemm_rs(a, w, quantize, config, group=shmem.group_named(group_name))
    return _gemm_rs_impl(a, w, config, group=shmem.group_named(group_name))


library.define("gemm_rs(Tensor a, Tensor w, str? group_name=None, str? quantize=None, bool fp8_grads=False) -> Tensor",
               _gemm_rs_op, _gemm_rs_fake)


def gemm_rs(a, w, config=None, out=None, group=None, *, scale_a=None, scale_w=None, scaling=None, out_dtype=None,
            fast_accum=False, quantize=None, fp8_grads=False):
    """This rank's rows of ``sum over the ranks of group of a @ w.T`` (``group`` default: the heap's; rows split
    like ``torch.tensor_split``, see the module docstring), summed in a fixed order (own partial, then ranks r+1,
    r+2, ...: bitwise reproducible).

    ``a``: [M, K_local], ``w``: [N, K_local] (torch linear convention; a transposed view ``v.T`` of a contiguous
    [K_local, N] is read as it lies, no copy), float16/bfloat16 (float32 works too; FP8 with scales, below), on
    triton_dist's device; every rank passes the same shapes. Returns a new [rows of this
    rank, N] tensor. ``config``: overrides of ``default_config`` (path, tiles, programs, partial dtype, ...);
    without it the call uses the autotuned configuration. Also available as ``torch.ops.triton_dist.gemm_rs(a,
    w)`` (torch.compile traces through it; eager calls of this function skip the op dispatcher). CUDA graphs: call
    it once before capturing, so that tuning and workspaces happen outside the capture.
    ``out``: optional preallocated [rows of this rank, N] result (contiguous, the result's dtype, a's device).

    FP8: ``a`` and ``w`` float8_e4m3fn (or float8_e5m2 for both) with float32 ``scale_a`` / ``scale_w`` of this
    rank's slices in one of the modes of ``kernels/fp8.py`` ([1] / [1]; [M, 1] / [N, 1]; [M, ceil(K_local/128)] /
    [ceil(N/128), ceil(K_local/128)]; ``scaling`` names it, None: the shapes do) give this rank's rows of ``sum_r
    (a_r * scale_a_r) @ (w_r * scale_w_r).T`` in ``out_dtype`` (bfloat16 unless given; float16, float32; the
    partials travel in it, or in fp32 with ``partial="fp32"``), ``fast_accum`` as in ``gemm``. No autograd; under
    torch.compile through async-TP's ``fused_scaled_matmul_reduce_scatter`` (``kernels/async_tp.py``). FP8
    operands without scales, scales with other operands: TypeError. ``scaled_gemm_rs``: the same with the scales
    required.

    ``quantize`` ("tensor", "row", "block"; FP8 training's forward): bfloat16 / float16 / float32 ``a`` and ``w``
    quantised to e4m3 in the call, scales taken on the device from this rank's ``a`` and ``w`` (``fp8.
    quantize_operands``: over its K slice; "block": 1x128 groups of a, 128x128 blocks of w), then the FP8 op
    above, the result in a's dtype. Differentiable straight-through: the backward is the one below, from the
    unquantised ``a`` and ``w`` (FP8 forward, gradients in a's dtype). The other FP8 keywords are not taken
    (ValueError). ``fp8_grads=True`` (with ``quantize`` only: ValueError otherwise; a bool: TypeError otherwise):
    the backward's two GEMMs in FP8 too, each operand quantised in the same mode along that GEMM's reduction
    dimension: ``grad_a = ag_gemm(grad_out, w.T, quantize=quantize)`` (each rank's rows of G quantised by that
    rank), ``grad_w`` the FP8 core's ``G.T @ a`` (G gathered on its own, unquantised; G.T and a.T quantised
    along the M rows), in a's dtype.

    Autograd: when ``a`` or ``w`` requires grad the call goes through the torch op (``config``: its forward's,
    eagerly; ``out`` is for calls without grad), whose backward gathers every rank's output rows' gradient G [M,
    N] with the gather overlapped: ``grad_a = ag_gemm(grad_out, w.T) = G @ w``, ``grad_w = G.T @ a``
    (``kernels/autograd.py``).
    """
    scales, out_dtype = fp8.scaled_operands(a, w, scale_a, scale_w, scaling, out_dtype, fast_accum,
                                            quantize=quantize)
    fp8.check_fp8_grads(fp8_grads, quantize)
    return _gemm_rs(a, w, config, out, group, scales, out_dtype, quantize, fp8_grads)


def scaled_gemm_rs(a, w, scale_a, scale_w, *, scaling=None, out_dtype=None, fast_accum=False, config=None, out=None,
                   group=None):
    """``gemm_rs`` on FP8 operands, the scales required (as in ``torch._scaled_mm``): this rank's rows of ``sum_r
    (a_r * scale_a_r) @ (w_r * scale_w_r).T``."""
    return _gemm_rs(a, w, config, out, group, *fp8.scaled_operands(a, w, scale_a, scale_w, scaling, out_dtype,
                                                                   fast_accum, required=True))


def _gemm_rs(a, w, config, out, group, scales, out_dtype, quantize=None, fp8_grads=False):
    """The op on its operands' mode (``fp8.scaled_operands``: FP8 ``scales`` or None, the result's dtype; or
    high-precision operands that the op ``quantize``s, and with ``fp8_grads`` differentiates in FP8)."""
    _check_inputs(a, w, scales)
    through_op = scales is None and library.needs_grad(a, w)
    if through_op and out is not None:
        raise ValueError("gemm_rs: out= is for calls without grad (under torch.no_grad())")
    if through_op:  # (config=: the op's forward, eagerly)
        return library.with_caller_config("gemm_rs", config, lambda: _op_call(a, w, scales, out_dtype, group,
                                                                              quantize, fp8_grads))
    if config is None and out is None and hardware.compiling():
        return _op_call(a, w, scales, out_dtype, group, quantize, fp8_grads)
    if quantize is not None:
        return _quantized_gemm_rs(a, w, quantize, config, out, group)
    return _gemm_rs_impl(a, w, config, out, group, scales, out_dtype)


def _op_call(a, w, scales, out_dtype, group, quantize=None, fp8_grads=False):
    """The call through the torch op (autograd, torch.compile; ``quantize`` inside it); FP8 through async-TP's
    (``async_tp.py``: B = W.t(), B's scales likewise)."""
    name = shmem.group_name(group)
    if scales is None:
        return torch.ops.triton_dist.gemm_rs(a, w, name, quantize, fp8_grads)
    return torch.ops.triton_dist.fused_scaled_matmul_reduce_scatter(
        a, w.t(), scales.a, scales.w if scales.w.numel() == 1 else scales.w.t(), "sum", 0, 0, name,
        [a.shape[0], w.shape[0]], None, None, out_dtype, scales.fast_accum)
