"""AllGather + GEMM, overlapped: ``out = all_gather(a) @ w.T`` (the tensor-parallel input projection).

Rank r holds a row shard ``a`` [m, K] and its weight slice ``w`` [N_local, K]; the result [W*m, N_local] needs
every rank's rows. The GEMM starts on the rows it has while the others are on the wire:

    main stream   ready handshake (1 program) -> ag_gemm_kernel (one program per SM):
                      phase 0:     the own rows, read straight from ``a``
                      phase 1 + c: wait until chunk c of every peer has landed, then its tiles (from a_full)
    side streams  one per peer, after the handshake: for each chunk c
                      a_full[r*m + chunk c] on the peer <- a[chunk c]   (copy engine over NVLink, no SM taken)
                      arrived[r*n_chunks + c] on the peer <- epoch      (4-byte copy, stream-ordered after it)

``a_full`` [W*m, K] and ``arrived`` are symmetric. Waits sit between tile loops, never inside one, so software
pipelining and ``FLATTEN`` stay safe. Flags carry device-side epochs (no resets; CUDA graphs replay), and the ready
handshake keeps a rank from overwriting a peer's a_full before that peer entered the call.

Paths (``config["path"]``, chosen per shape by the autotuner on GPU): "overlap" (the above); "graph" (the same
kernels replayed from a cached CUDA graph, for host-bound small M); "fallback" (NCCL all_gather + cuBLAS). At
decode sizes ``gather_first`` waits for every peer's rows, then runs the GEMM core once over all of them.
``activation="silu_gate"``: w = [w_gate; w_up] and each tile stores only silu(gate) * up (``tile_accumulate``).
docs/design/ag_gemm.md has the schedule's reasons and the measurements behind the defaults.

FP8 (``ag_gemm(a8, w8, scale_a=..., scale_w=...)``; ``scaled_ag_gemm``: the scales required) is the same schedule
with half the bytes on the wire. A's scales travel with the rows: each rank's scale rows ([m, S]: S = 1 per-tensor
/ rowwise, ceil(K/128) blockwise; a per-tensor scale repeated per row, so gathered rows keep their own rank's
scale) go into every peer's symmetric ``scale_full`` [W*m, S] on the same side stream, ahead of the rows, so each
chunk's flag, raised after its rows, covers them too. ``tile_accumulate`` applies the scales (``kernels/fp8.py``);
W's never move. The fallback gathers rows and scale rows (as bytes) and runs one scaled GEMM.
"""

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from .. import autotune, hardware, shmem
from .. import language as dl
from ..hardware import cdiv
from . import fp8, library
from .gemm import (b_row_stride, check_launchable, check_matmul_operands, check_tiles, default_num_programs,
                   describe_operands, dot_precision, fp8_tiles, gemm_candidates, gemm_config, is_kn, launch_gemm,
                   matmul_torch, skinny_configs, tile_accumulate, tile_coords, tile_store)
from .launcher import Launcher
from .replay import GraphCache
from .silu_gate import silu_gate, silu_gate_torch

MAX_CHUNKS = 64  # per rank; sizes the `arrived` flags
# At or below this many gathered rows (W * m) the default path is NCCL all_gather + cuBLAS: the GEMM is too short
# to hide the transfer. On GPU the autotuner measures both paths above 256 rows and keeps the faster.
SMALL_M_ROWS = 1024
# At or below this many gathered rows the overlapped kernels run only from a cached CUDA graph (path "graph"): an
# eager call's host work (two launches, four tensor descriptors, the copy-engine pushes) is as long as its GPU work.
GRAPH_ROWS = 2048
FLAGS_BLOCK = tl.constexpr(64)  # peers waited for in one vector wait (>= MAX_RANKS)


# ----------------------------------------------------------------------------------------------- kernels
@triton.jit
def _fence_async_proxy():
    """Make data that generic-proxy writes (peers' stores, copy engines) published be visible to TMA reads."""
    tl.inline_asm_elementwise("fence.proxy.async.global; mov.u32 $0, 0;", "=r", [], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _wait_chunk_of_peers(arrived, chunk, n_chunks, epoch, ctx, me, world, FENCE_ASYNC_PROXY: tl.constexpr):
    """Wait until chunk ``chunk`` of every peer's shard has landed here (one poll round reads all flags)."""
    peers = tl.arange(0, FLAGS_BLOCK)
    dl.wait(arrived + peers * n_chunks + chunk, epoch, ctx, mask=(peers < world) & (peers != me))
    if FENCE_ASYNC_PROXY:
        _fence_async_proxy()


@triton.jit
def _gemm_tiles(a, b, c, a_rows, first_row_tile, tiles_m, num_segments, tiles_n, first_tile,
                program, num_programs, me, world, m_shard, N, K, stride_am, stride_bn, stride_cs, stride_cm,
                REMOTE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                GROUP_M: tl.constexpr, USE_TMA: tl.constexpr, EPILOGUE_SUBTILE: tl.constexpr,
                FLATTEN: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, DOT_PRECISION: tl.constexpr,
                SILU_GATE: tl.constexpr, scale_a=None, scale_w=None, stride_sa=None, stride_sw=None,
                SCALES: tl.constexpr = "", MAX_IMPRECISE_ACC: tl.constexpr = None, B_KN: tl.constexpr = False):
    """One phase: tile-rows [first_row_tile, first_row_tile + tiles_m) of ``num_segments`` segments, grouped-M
    inside a segment. The phase's tiles are numbers first_tile, first_tile + 1, ... of the whole launch; this
    program takes those congruent to ``program`` modulo ``num_programs`` (persistent, balanced across phases).
    Local segment k is rank ``me`` (phase 0, REMOTE=False, A = ``a`` itself) or rank ``(me - 1 - k) mod world``
    (REMOTE, A = a_full). FP8: ``scale_a`` holds the scales of A's rows (``gemm.tile_accumulate``)."""
    phase_tiles = num_segments * tiles_m * tiles_n
    start = ((program - first_tile) % num_programs + num_programs) % num_programs
    for t in tl.range(start, phase_tiles, num_programs, flatten=FLATTEN, warp_specialize=WARP_SPECIALIZE):
        k, pid_m, pid_n = tile_coords(t, tiles_m, tiles_n, num_segments, 0, 1, GROUP_M)
        pid_m += first_row_tile
        if REMOTE:
            seg = (me - 1 - k + 2 * world) % world
            a_row = seg * m_shard + pid_m * BLOCK_M
        else:
            seg = me
            a_row = pid_m * BLOCK_M
        acc = tile_accumulate(a, b, a_row, pid_n * BLOCK_N, a_rows, N, K, stride_am, stride_bn,
                              BLOCK_M, BLOCK_N, BLOCK_K, USE_TMA, DOT_PRECISION, SILU_GATE,
                              scale_a, scale_w, stride_sa, stride_sw, SCALES, MAX_IMPRECISE_ACC, B_KN=B_KN)
        tile_store(c, acc, seg, pid_m * BLOCK_M, pid_n * BLOCK_N, m_shard, N, stride_cs, stride_cm,
                   BLOCK_M, BLOCK_N, USE_TMA, EPILOGUE_SUBTILE)


@triton.jit
def ag_gemm_kernel(a_local, a_full, b, c, arrived, state, ctx,
                   m_shard, N, K, stride_al, stride_af, stride_bn, stride_cs, stride_cm, chunk_rows,
                   N_CHUNKS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   GROUP_M: tl.constexpr, USE_TMA: tl.constexpr, EPILOGUE_SUBTILE: tl.constexpr, FLATTEN: tl.constexpr,
                   WARP_SPECIALIZE: tl.constexpr, FENCE_ASYNC_PROXY: tl.constexpr, DOT_PRECISION: tl.constexpr,
                   SILU_GATE: tl.constexpr, scale_a=None, scale_full=None, scale_w=None, stride_sa=None,
                   stride_sw=None, SCALES: tl.constexpr = "", MAX_IMPRECISE_ACC: tl.constexpr = None,
                   W_KN: tl.constexpr = False):
    """The consumer: own rows first (phase 0), then chunk by chunk the peers' rows as their flags arrive.
    N is the output's width (SILU_GATE: half of b's rows, see ``gemm.tile_accumulate``); FP8: scale_a/scale_full.
    W_KN: ``b`` is the weight's transpose [K, N] as it lies (``gemm.is_kn``), ``stride_bn`` its rows' stride."""
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    me = dl.rank(ctx)
    world = dl.num_ranks(ctx)
    epoch = dl.call_epoch(state)
    tiles_m = tl.cdiv(m_shard, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    _gemm_tiles(a_local, b, c, m_shard, 0, tiles_m, 1, tiles_n, 0, pid, n_programs, me, world,
                m_shard, N, K, stride_al, stride_bn, stride_cs, stride_cm,
                False, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, USE_TMA, EPILOGUE_SUBTILE, FLATTEN, WARP_SPECIALIZE,
                DOT_PRECISION, SILU_GATE, scale_a, scale_w, stride_sa, stride_sw, SCALES, MAX_IMPRECISE_ACC, W_KN)
    chunk_tiles = chunk_rows // BLOCK_M
    done = tiles_m * tiles_n
    # unrolled (N_CHUNKS is a compile-time constant): sibling tile loops, which warp specialisation needs
    for chunk in tl.static_range(N_CHUNKS):
        first_row_tile = chunk * chunk_tiles
        rows_tiles = tl.minimum(tiles_m - first_row_tile, chunk_tiles)
        _wait_chunk_of_peers(arrived, chunk, N_CHUNKS, epoch, ctx, me, world, FENCE_ASYNC_PROXY)
        _gemm_tiles(a_full, b, c, world * m_shard, first_row_tile, rows_tiles, world - 1, tiles_n, done,
                    pid, n_programs, me, world, m_shard, N, K, stride_af, stride_bn, stride_cs, stride_cm,
                    True, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, USE_TMA, EPILOGUE_SUBTILE, FLATTEN,
                    WARP_SPECIALIZE, DOT_PRECISION, SILU_GATE, scale_full, scale_w, stride_sa, stride_sw, SCALES,
                    MAX_IMPRECISE_ACC, W_KN)
        done += (world - 1) * rows_tiles * tiles_n
    dl.finish_call(state, epoch, n_programs)


@triton.jit
def gathered_kernel(arrived, state, ctx, N_CHUNKS: tl.constexpr, FENCE_ASYNC_PROXY: tl.constexpr):
    """Gather first (one program; small M): wait until every chunk of every peer has landed, then end the call's
    epoch. The plain GEMM launched after it reads every rank's rows from a_full in one pass, so the weight is
    streamed from HBM once, not once per phase."""
    me = dl.rank(ctx)
    world = dl.num_ranks(ctx)
    epoch = dl.call_epoch(state)
    for chunk in tl.static_range(N_CHUNKS):
        _wait_chunk_of_peers(arrived, chunk, N_CHUNKS, epoch, ctx, me, world, FENCE_ASYNC_PROXY)
    dl.finish_call(state, epoch, 1)


@triton.jit
def ready_handshake_kernel(ready, state, epoch_out, ctx):
    """Step 1 of a call (one program): this call's epoch -> ``epoch_out`` (the word the copy engines write into
    the peers' flags); tell every peer we entered the call; wait until every peer did."""
    me = dl.rank(ctx)
    world = dl.num_ranks(ctx)
    epoch = dl.call_epoch(state)
    tl.store(epoch_out, epoch)
    dl.enter_call(ready, epoch, me, world, ctx)
    for peer in range(world):
        dl.wait_entered(ready, peer, epoch, ctx)


# ----------------------------------------------------------------------------------------------- launcher
class _Buffers:
    """Per-shape workspace: the gathered rows, their flags and the streams that push them (``shmem.workspace``);
    FP8 (``scale_cols`` S > 0): the gathered rows' scales too, ``scale_full`` [W*m, S] (their flags are the rows')."""

    def __init__(self, m_shard, k, dtype, group, scale_cols=0):
        world, me = shmem.world_size(group), shmem.rank(group)
        self.a_full = shmem.empty((world * m_shard, k), dtype, name="ag_gemm.a_full", group=group)
        self.scale_full = self.scale_full_peers = None
        if scale_cols:
            self.scale_full = shmem.empty((world * m_shard, scale_cols), torch.float32, name="ag_gemm.scale_full",
                                          group=group)
            self.scale_full_peers = shmem.peer_views(self.scale_full, group)
        self.arrived = shmem.signals((world * MAX_CHUNKS,), name="ag_gemm.arrived", group=group)
        self.ready = shmem.signals((world,), name="ag_gemm.ready", group=group)
        dev = shmem.device()
        self.state = shmem.counters(2, name="ag_gemm.epoch")
        self.epoch = shmem.counters(1, name="ag_gemm.epoch_word")
        self.a_full_peers = shmem.peer_views(self.a_full, group)
        self.arrived_peers = shmem.peer_views(self.arrived, group)
        # one side stream per peer, so that every link is busy at once. Not where peers share our GPU: there a
        # copy into a peer's heap is an SM kernel, which our persistent GEMM (filling our SM share while it waits
        # for the peers' rows) would starve, so the copies go on the compute stream ahead of the GEMM
        side = dev.type == "cuda" and not hardware.gpu_shared()
        self.streams = {p: torch.cuda.Stream(dev) for p in range(world) if p != me} if side else {}


def buffers(m_shard, k, dtype, group=None, scale_cols=0, name="ag_gemm"):
    """The workspace of a shard shape on ``group`` (collective on first use); ``scale_cols``: see ``_Buffers``;
    ``name``: whose (``start_gather`` keeps its own, so that an ag_gemm between its start and finish is free)."""
    return shmem.workspace(name, (m_shard, k, dtype, scale_cols),
                           lambda: _Buffers(m_shard, k, dtype, group, scale_cols), group=group)


def _chunking(m_shard, bm, n_chunks):
    """Rows per chunk (a multiple of the row tile ``bm``, so a tile never straddles two chunks) and the chunk
    count (``n_chunks`` asked for)."""
    n_chunks = max(1, min(int(n_chunks), MAX_CHUNKS, cdiv(m_shard, bm)))
    chunk_rows = cdiv(cdiv(m_shard, n_chunks), bm) * bm
    return chunk_rows, cdiv(m_shard, chunk_rows)


class _Transfer:
    """The transfer half of a call, built once per (shard shape, dtype, chunking, group): the workspace, the ready
    handshake and our shard's pushes into every peer (``_start_call``); ``block_m`` None: the group alone (the
    fallback's rows move by NCCL)."""

    def __init__(self, m_shard, k, dtype, group, block_m, n_chunks, scale_cols=0, name="ag_gemm"):
        team = shmem.team(group)
        self.world, self.me, self.group, self.ctx = team.size, team.rank, team.group, team.ctx
        self.m_shard, self.k = m_shard, k
        if block_m is None:
            return
        ws = self.ws = buffers(m_shard, k, dtype, group, scale_cols, name)
        self.chunk_rows, self.n_chunks = _chunking(m_shard, block_m, n_chunks)
        me, world = self.me, self.world
        own = slice(me * m_shard, (me + 1) * m_shard)
        # (stream, [(source rows, destination view, flag view)], destination of our scale rows or None) per peer:
        # no slicing on the hot path
        self.pushes = []
        for step in range(1, world):
            peer = (me + step) % world
            items = []
            for chunk in range(self.n_chunks):
                lo, hi = chunk * self.chunk_rows, min((chunk + 1) * self.chunk_rows, m_shard)
                flag = me * self.n_chunks + chunk
                items.append((lo, hi, ws.a_full_peers[peer][me * m_shard + lo: me * m_shard + hi],
                              ws.arrived_peers[peer][flag: flag + 1]))
            scale_dst = ws.scale_full_peers[peer][own] if scale_cols else None
            self.pushes.append((ws.streams.get(peer), items, scale_dst))
        self.fence = not hardware.interpreting()
        self.handshake = Launcher(ready_handshake_kernel, (1,))


class _Plan(_Transfer):
    """Everything about a call that depends only on (shape, dtype, config, FP8 mode): built once, reused every
    call."""

    def __init__(self, m_shard, n, k, dtype, device, cfg, group, scales=None, out_dtype=None, kn=False):
        """``n``: the weight's rows (the output has half as many with ``cfg["silu_gate"]``); ``scales``,
        ``out_dtype``: an FP8 call's mode (``fp8.scaled_operands``; only the mode is kept); ``kn``: the weight comes
        as the transposed view of a contiguous [K, N] (``gemm.is_kn``)."""
        self.cfg, self.path = cfg, cfg["path"]
        self.silu_gate = bool(cfg.get("silu_gate"))
        self.n = n // 2 if self.silu_gate else n
        self.out_dtype = out_dtype or dtype
        team = shmem.team(group)
        # names its graphs (path "graph")
        self.key = (team.name, m_shard, n, k, dtype, kn, repr(sorted(cfg.items()))) + fp8.plan_key(scales,
                                                                                                    out_dtype)
        scale_cols = 0 if scales is None else fp8.groups(k) if scales.mode == "block" else 1
        fallback = self.path == "fallback"
        super().__init__(m_shard, k, dtype, group, None if fallback else cfg["BLOCK_M"], cfg.get("n_chunks"),
                         scale_cols)
        if fallback:
            return
        tiles = self.world * cdiv(m_shard, cfg["BLOCK_M"]) * cdiv(self.n, cfg["BLOCK_N"])
        self.grid = (max(1, min(cfg.get("num_programs") or default_num_programs(device, cfg), tiles)),)
        self.precision = dot_precision(dtype)


def _push(a, items, epoch, scale_dst, scale_rows):
    """Our shard into one peer's a_full, a flag per chunk; FP8: our scale rows first, so the flags cover them."""
    if scale_rows is not None:
        scale_dst.copy_(scale_rows)
    for lo, hi, dst, flag in items:
        dst.copy_(a[lo:hi])
        flag.copy_(epoch)


def _copy_engine_push(a, plan, scale_rows=None):
    """Side streams copy our shard (and FP8 scale rows) into every peer's a_full, a flag per chunk (copy engines,
    not SMs)."""
    main = torch.cuda.current_stream() if a.is_cuda else None
    for stream, items, scale_dst in plan.pushes:
        if stream is None:  # no side streams (CPU, or peers on our GPU): on the current stream, before the GEMM
            _push(a, items, plan.ws.epoch, scale_dst, scale_rows)
            continue
        stream.wait_stream(main)
        with torch.cuda.stream(stream):
            _push(a, items, plan.ws.epoch, scale_dst, scale_rows)


def _join_pushes(plan):
    """The current stream waits for the side streams' pushes (their sources may be freed after it)."""
    if plan.pushes and plan.pushes[0][0] is not None:
        main = torch.cuda.current_stream()
        for stream, *_ in plan.pushes:
            main.wait_stream(stream)


def _run_overlapped(a, w, plan, return_gathered, scales=None):
    """A call on the kernels: the GEMM (phased, or gather first), then the side streams joined back. FP8
    ``scales``: A's as rows (``fp8.Scales.as_rows``)."""
    ws, world, me, m_shard = plan.ws, plan.world, plan.me, plan.m_shard
    out = torch.empty((world * m_shard, plan.n), dtype=plan.out_dtype, device=a.device)
    if plan.cfg["gather_first"]:
        _gather_first_gemm(a, w, plan, out, scales)
    else:
        _phased_gemm(a, w, plan, out, scales)
    _join_pushes(plan)
    if not return_gathered:
        return out, None
    if not plan.cfg["gather_first"]:  # our rows into our own slot (no peer writes it), then one copy of all rows
        ws.a_full[me * m_shard:(me + 1) * m_shard].copy_(a)
    return out, ws.a_full.clone()


def _start_call(a, plan, scales=None):
    """The ready handshake (this call's epoch), then our shard pushed into every peer by the copy engines (FP8:
    its scales first, on the same streams, so that the rows' flags also cover them)."""
    shmem.raise_pending_errors()
    plan.handshake(plan.ws.ready, plan.ws.state, plan.ws.epoch, plan.ctx)
    _copy_engine_push(a, plan, None if scales is None else scales.a)


def _phased_gemm(a, w, plan, out, scales=None):
    """The overlapped kernel: own rows first, then each chunk of the peers' rows as it lands. Its descriptors are
    built before anything is launched."""
    cfg, ws = plan.cfg, plan.ws
    world, m_shard, n, k = plan.world, plan.m_shard, plan.n, plan.k
    c3 = out.view(world, m_shard, n)
    kn = is_kn(w)  # (a graph replay passes the captured w: its layout, not the plan's, is what is read)
    a_arg, b_arg, c_arg, use_tma = describe_operands(a, w, c3, cfg, kn)
    a_full_arg = describe_operands(ws.a_full, w, c3, {**cfg, "use_tma": use_tma}, kn)[0]
    fp8_args = {} if scales is None else {**scales.kernel_args(cfg, a=scales.a), "scale_full": ws.scale_full}
    _start_call(a, plan, scales)
    ag_gemm_kernel[plan.grid](
        a_arg, a_full_arg, b_arg, c_arg, ws.arrived, ws.state, plan.ctx,
        m_shard, n, k, a.stride(0), ws.a_full.stride(0), b_row_stride(w, kn), m_shard * n, n,
        plan.chunk_rows, N_CHUNKS=plan.n_chunks,
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], GROUP_M=cfg["GROUP_M"],
        USE_TMA=use_tma, EPILOGUE_SUBTILE=bool(cfg["EPILOGUE_SUBTILE"]) and use_tma, FLATTEN=cfg["FLATTEN"],
        WARP_SPECIALIZE=cfg["WARP_SPECIALIZE"], FENCE_ASYNC_PROXY=use_tma and plan.fence,
        DOT_PRECISION=plan.precision, SILU_GATE=plan.silu_gate, num_stages=cfg["num_stages"],
        num_warps=cfg["num_warps"], **fp8_args, **({"W_KN": True} if kn else {}))


def _gather_first_gemm(a, w, plan, out, scales=None):
    """Small M (config ``gather_first``): our rows into a_full too, wait for the peers' rows, then the GEMM core
    over all W*m rows at once (a 128-row tile spans ranks: the weight is read once, where the phased kernel reads
    it once per phase)."""
    ws, me, m_shard = plan.ws, plan.me, plan.m_shard
    own = slice(me * m_shard, (me + 1) * m_shard)
    _start_call(a, plan, scales)
    ws.a_full[own].copy_(a)
    if scales is not None:  # the GEMM reads every rank's scale rows, ours included, from scale_full
        ws.scale_full[own].copy_(scales.a)
    gathered_kernel[(1,)](ws.arrived, ws.state, plan.ctx, N_CHUNKS=plan.n_chunks,
                          FENCE_ASYNC_PROXY=plan.fence and a.is_cuda)
    launch_gemm(ws.a_full, w, out.view(1, plan.world * m_shard, plan.n), plan.cfg, silu_gate=plan.silu_gate,
                scales=scales, scale_rows=ws.scale_full, kn=is_kn(w))


def start_gather(a, group=None):
    """``all_gather(a)`` along dim 0 ([m, K] -> [W*m, K]) started, not waited for: the handshake and our rows'
    pushes by the copy engines (no SM taken), so that the GPU work the caller queues next overlaps the transfer
    (the backward's weight-gradient re-gather behind its input-gradient GEMM, as Megatron-LM does). Returns the
    finish: a call that waits on the GPU for every peer's rows and returns them all, [W*m, K] in its own
    workspace (``name`` "ag_gemm.gather"), valid until the next ``start_gather`` of this shape on this group."""
    team = shmem.team(group)
    m_shard, k = a.shape
    if a.numel() == 0:  # nothing to move (every rank's shard is as empty: ranks pass the same shapes); an empty
        # shard's workspace would be an empty symmetric tensor, which has no peer views
        rows = a.new_empty((team.size * m_shard, k))
        return lambda: rows
    plan = _GATHERS.get((team.name, m_shard, k, a.dtype), lambda: _Transfer(
        m_shard, k, a.dtype, team.group, max(1, m_shard), 1, name="ag_gemm.gather"))
    _start_call(a, plan)
    ws, own = plan.ws, slice(plan.me * m_shard, (plan.me + 1) * m_shard)
    ws.a_full[own].copy_(a)

    def finish():
        gathered_kernel[(1,)](ws.arrived, ws.state, plan.ctx, N_CHUNKS=plan.n_chunks,
                              FENCE_ASYNC_PROXY=plan.fence and a.is_cuda)
        _join_pushes(plan)
        return ws.a_full
    return finish


def _gather(t, plan):
    """all_gather of ``t`` along dim 0 by NCCL (gloo on CPU) into a fresh tensor, as bytes (FP8 rows need no FP8
    support there)."""
    out = torch.empty((plan.world * t.shape[0],) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
    src, dst = t.contiguous().view(torch.uint8), out.view(torch.uint8)
    if t.is_cuda:
        dist.all_gather_into_tensor(dst, src, group=plan.group)
    else:  # gloo
        dist.all_gather(list(dst.chunk(plan.world)), src, group=plan.group)
    return out


def _gather_then_matmul(a, w, plan, return_gathered, scales=None):
    """The small-M path (and a group of one's, whose rows are a's own: nothing to gather): all_gather (FP8: the
    rows' scales too), then one GEMM by torch (``matmul_torch``): exactly the baseline. The SiLU gate of
    high-precision rows is the GEMM core's fused epilogue, which writes no [rows, 2I] pre-activation (torch needs
    it and two more passes over it: docs/design/ag_gemm.md)."""
    gathered = a if plan.world == 1 and not return_gathered else _gather(a, plan)
    if plan.silu_gate and scales is None:
        out = torch.empty((gathered.shape[0], plan.n), dtype=plan.out_dtype, device=a.device)
        launch_gemm(gathered, w, out.view(1, gathered.shape[0], plan.n), plan.cfg, silu_gate=True)
        return out, (gathered if return_gathered else None)
    if scales is not None:
        scales = scales.of_gathered(_gather(scales.rows_of_a(a.shape[0]), plan), w.shape[0])
    out = matmul_torch(gathered, w, scales, plan.out_dtype)
    if plan.silu_gate:
        out = silu_gate_torch(out)
    return out, (gathered if return_gathered else None)


# ----------------------------------------------------------------------------------------------- configs
def choose_path(m_total, n, k, world, device_type="cuda"):
    """The default path for a shape: "fallback" (all_gather + matmul) when the overlap cannot win on a GPU.
    (On CPU, where nothing is about speed, the overlapped kernels always run so that tests exercise them.)"""
    if world == 1:
        return "fallback"
    if device_type == "cuda" and m_total <= SMALL_M_ROWS:
        return "fallback"
    return "overlap"


def default_config(m_shard, n, k, dtype, device, world, silu_gate=False, scales=None):
    """Keys: path ("overlap" / "graph": the overlapped kernels replayed from a cached CUDA graph, for host-bound
    small M, see ``replay.py`` / "fallback"), n_chunks (chunks per shard, flags per peer), and the GEMM core's
    (BLOCK_M/N/K, GROUP_M, num_stages, num_warps, EPILOGUE_SUBTILE, FLATTEN, WARP_SPECIALIZE, use_tma,
    num_programs; see ``gemm.gemm_config``), gather_first (small M: wait for every peer's rows, then one GEMM pass
    over all of them, ``gathered_kernel``), silu_gate (the fused SiLU-gate epilogue; ``n`` counts the weight's
    rows, gate and up: ``_with_silu_gate``); FP8 operands (``scales``): FP8 tiles (``gemm.fp8_tiles``)."""
    m_total = world * m_shard
    cfg = gemm_config(m_total, n, k, dtype, device, scales)
    cfg.update(path=choose_path(m_total, n, k, world, device.type), n_chunks=1, gather_first=False)
    if device.type != "cuda":
        cfg.update(n_chunks=2, num_programs=4)
    return _with_silu_gate(cfg) if silu_gate else cfg


def _with_silu_gate(cfg):
    """A configuration of the plain GEMM over gate and up rows, as the fused SiLU-gate kernel: a tile accumulates
    a gate and an up product of half the width, so it holds as many accumulators as the plain tile (whole ones:
    no ``SPLIT_N``)."""
    return {**cfg, "silu_gate": True, "BLOCK_N": max(16, cfg["BLOCK_N"] // 2), "SPLIT_N": False}


def candidate_configs(m_shard, n, k, dtype, device, world, silu_gate=False, scales=None):
    """The sweep run once per shape on GPU: the fallback, and the overlapped kernel with the GEMM core's own
    candidates (its best configuration is the best one here too: the waits sit outside the tile loops); FP8
    ``dtype`` (``scales``: their mode): as FP8 tiles (``gemm.fp8_tiles``)."""
    if silu_gate:
        return [_with_silu_gate(c) for c in candidate_configs(m_shard, n, k, dtype, device, world, scales=scales)]
    base = default_config(m_shard, n, k, dtype, device, world, scales=scales)
    m_total = world * m_shard
    cands = [{**base, "path": "fallback"}]
    graphs = m_total <= GRAPH_ROWS and world > 1 and device.type == "cuda"
    if graphs:  # host-bound: the kernel from a CUDA graph
        small = gemm_config(m_total, n, k, dtype, device, scales)
        cands += [{**base, **small, "path": "graph"}, {**base, **small, "path": "graph", "BLOCK_M": 64,
                                                           "num_warps": 4}]
        if m_total <= 512:
            cands += [{**base, **small, **c, "path": "graph"} for c in skinny_configs(dtype)]
            # one GEMM pass after the gather: the weight read once (M = 128: twice, 64 rows a phase, otherwise)
            cands += [{**base, **small, **c, "path": "graph", "gather_first": True}
                      for c in [{}] + skinny_configs(dtype)]
    if m_total > 256 and world > 1:
        for g in gemm_candidates(m_total, n, k, dtype, device, scales):
            if g.get("WARP_SPECIALIZE"):  # triton 3.6's warp-specialisation pass rejects this kernel
                continue
            cands.append({**base, **g, "path": "graph" if graphs else "overlap", "n_chunks": base["n_chunks"]})
    return autotune.dedupe([fp8_tiles(c, dtype, device, scales) for c in cands])


def _tuned_config(m_shard, n, k, dtype, device, world, silu_gate, group, scales=None, out_dtype=None):
    base = default_config(m_shard, n, k, dtype, device, world, silu_gate, scales)
    if device.type != "cuda":
        return base

    def make_runner():
        x = torch.randn((m_shard, k), device=device).to(dtype)
        y = torch.randn((n, k), device=device).to(dtype)
        probe = None if scales is None else scales.probe()
        plans = {}  # one plan per candidate, so that the timing sees the per-call cost of the real thing

        def run(cfg):
            key = repr(sorted(cfg.items()))
            if key not in plans:
                plans[key] = _Plan(m_shard, n, k, dtype, device, {**base, **cfg}, group, scales, out_dtype)
            return _run(x, y, plans[key], False, probe)
        return run

    key = dict(m_shard=m_shard, n=n, k=k, dtype=str(dtype).replace("torch.", ""), **fp8.describe(scales, out_dtype))
    if silu_gate:
        key["silu_gate"] = True
    return autotune.choose("ag_gemm", key, candidate_configs(m_shard, n, k, dtype, device, world, silu_gate, scales),
                           make_runner, default=base, group=group)


# (group, m_shard, n, k, dtype, silu_gate, explicit config or None[, FP8 mode]) -> _Plan
_PLANS = shmem.Plans("ag_gemm")
_GRAPHS = GraphCache("ag_gemm")  # path "graph": small problems replayed from CUDA graphs
_GATHERS = shmem.Plans("ag_gemm.gather")  # (group, m_shard, k, dtype) -> _Transfer of start_gather


def _plan_for(a, w, team, config, silu_gate, scales=None, out_dtype=None):
    m_shard, k = a.shape
    n = w.shape[0]
    kn = is_kn(w)
    key = (team.name, m_shard, n, k, a.dtype, silu_gate, kn, None if config is None else repr(sorted(config.items())))
    return _PLANS.get(key + fp8.plan_key(scales, out_dtype), lambda: _Plan(
        m_shard, n, k, a.dtype, a.device,
        _config(m_shard, n, k, a.dtype, a.device, team.size, config, silu_gate, team.group, scales, out_dtype),
        team.group, scales, out_dtype, kn))


def _config(m_shard, n, k, dtype, device, world, config, silu_gate, group, scales=None, out_dtype=None):
    """The call's configuration: tuned, or the caller's overrides of the defaults (the activation is no knob)."""
    if config is None:
        return _tuned_config(m_shard, n, k, dtype, device, world, silu_gate, group, scales, out_dtype)
    cfg = autotune.with_overrides(default_config(m_shard, n, k, dtype, device, world, silu_gate, scales), config)
    check_tiles(cfg, path=("overlap", "graph", "fallback"))
    if silu_gate:
        cfg["silu_gate"] = True
    return cfg


def _run(a, w, plan, return_gathered, scales=None):
    """One call on a plan: the fallback, the kernels replayed from a CUDA graph (path "graph") or the kernels.
    FP8 ``scales`` travel with the rows as A's scale of every row (``fp8.Scales.as_rows``)."""
    if plan.path == "fallback":
        return _gather_then_matmul(a, w, plan, return_gathered, scales)
    if scales is not None:
        scales = scales.as_rows(a.shape[0])
    if plan.path == "graph" and not return_gathered:
        out = _GRAPHS.run_op(plan.key, lambda x, y, s: _run_overlapped(x, y, plan, False, s)[0], a, w, scales)
        if out is not None:
            return out, None
    return _run_overlapped(a, w, plan, return_gathered, scales)


# ----------------------------------------------------------------------------------------------- the op
ACTIVATIONS = ("none", "silu_gate")


def _check_inputs(a, w, activation="none", scales=None, quantize=None, return_gathered=False):
    """The checks of the operands (FP8 ones: with their scales, ``fp8.scaled_operands``), the activation and the
    ``quantize`` mode (the gathered rows are FP8 then: none returned)."""
    if scales is None:  # (w.T of a contiguous weight is read as it lies, where there is no gate)
        check_matmul_operands(a, w, "a", "w", w_as_it_lies=activation == "none" and quantize is None)
    if fp8.check_mode(quantize) is not None and return_gathered:
        raise ValueError("quantize=: the rows cross as FP8, so there are no high-precision gathered rows to return "
                         "or keep (return_gathered / keep_gathered are for calls without quantize)")
    shmem.check_device(a, "a and w")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    pair = 2 * fp8.GROUP if scales is not None and scales.mode == "block" else 2  # halves of whole scale blocks
    if activation == "silu_gate" and w.shape[0] % pair:
        raise ValueError(f"activation='silu_gate' takes w = [gate; up] with a multiple of {pair} rows, got "
                         f"{list(w.shape)}" + (f" ({scales.mode} scaling)" if scales is not None else ""))


def _output_columns(w, activation):
    return w.shape[0] // 2 if activation == "silu_gate" else w.shape[0]


def _ag_gemm_impl(a, w, return_gathered, config=None, activation="none", group=None, scales=None, out_dtype=None):
    team = shmem.op_team("ag_gemm", group, lambda: dict(a=tuple(a.shape), w=tuple(w.shape), dtype=str(a.dtype),
                                                        activation=activation, config=config,
                                                        return_gathered=return_gathered,
                                                        **fp8.describe(scales, out_dtype)))
    world = team.size
    m_shard, k = a.shape
    if m_shard == 0 or k == 0:  # nothing to move or nothing to multiply (silu(0) * 0 = 0)
        out = a.new_zeros((world * m_shard, _output_columns(w, activation)), dtype=out_dtype)
        return out, (a.new_empty((world * m_shard, k)) if return_gathered else None)
    if w.shape[0] == 0:
        config = {"path": "fallback"}
    plan = _plan_for(a, w, team, config, activation == "silu_gate", scales, out_dtype)
    fp8.check_block_k(scales, plan.cfg)
    return _run(a, w, plan, return_gathered, scales)


def _quantized_ag_gemm(a, w, quantize, config, activation, group):
    """``ag_gemm`` of high-precision ``a`` and ``w`` quantised here (``fp8.quantize_operands``, mode ``quantize``):
    the FP8 op, the result in a's dtype. The SiLU gate is fused where the FP8 kernel takes it (blockwise scales:
    whole 128-row blocks per half), else applied by torch to the product."""
    fused = activation == "none" or quantize != "block" or w.shape[0] % (2 * fp8.GROUP) == 0
    a8, w8, scales = fp8.quantize_operands(a, w, quantize)
    out, _ = _ag_gemm_impl(a8, w8, False, config, activation if fused else "none", group, scales, a.dtype)
    return out if fused else silu_gate_torch(out)


def _ag_gemm_op(a, w, return_gathered=False, activation="none", group_name=None, quantize=None, fp8_grads=False):
    _check_inputs(a, w, activation, quantize=quantize, return_gathered=return_gathered)
    fp8.check_fp8_grads(fp8_grads, quantize)  # (the backward's business: kernels/autograd.py)
    check_launchable(a)
    group = shmem.group_named(group_name)
    config = library.caller_config("ag_gemm")
    if quantize is not None:
        return _quantized_ag_gemm(a, w, quantize, config, activation, group), a.new_empty((0, a.shape[1]))
    out, gathered = _ag_gemm_impl(a, w, return_gathered, config, activation=activation, group=group)
    return out, (a.new_empty((0, a.shape[1])) if gathered is None else gathered)


def _ag_gemm_fake(a, w, return_gathered=False, activation="none", group_name=None, quantize=None, fp8_grads=False):
    _check_inputs(a, w, activation, quantize=quantize, return_gathered=return_gathered)
    fp8.check_fp8_grads(fp8_grads, quantize)
    world = shmem.world_size(shmem.group_named(group_name))
    rows = world * a.shape[0]
    return (a.new_empty((rows, _output_columns(w, activation))),
            a.new_empty((rows if return_gathered else 0, a.shape[1])))


library.define('ag_gemm(Tensor a, Tensor w, bool return_gathered=False, str activation="none", '
               'str? group_name=None, str? quantize=None, bool fp8_grads=False) -> (Tensor, Tensor)', _ag_gemm_op,
               _ag_gemm_fake)


def ag_gemm(a, w, return_gathered=False, config=None, activation="none", group=None, keep_gathered=False, *,
            scale_a=None, scale_w=None, scaling=None, out_dtype=None, fast_accum=False, quantize=None, fp8_grads=False):
    """``all_gather(a) @ w.T`` on every rank of ``group`` (default: the heap's), the gather overlapped with the GEMM.

    a: this rank's row shard [m, K]; w: this rank's weight slice [N_local, K] (``linear`` convention); both
    contiguous, same dtype (bfloat16 or float16; float32 for tests; FP8 with scales, below) and on triton_dist's
    device (CPU tensors only under the Triton interpreter). Collective: every rank calls it with the same shapes.
    Returns ``out`` [W*m, N_local], and with ``return_gathered=True`` the tuple ``(out, all_gather(a))``. Also
    available as ``torch.ops.triton_dist.ag_gemm(a, w, return_gathered, activation, group_name, quantize,
    fp8_grads)`` (always returns the pair; the second is empty unless asked for), which works under torch.compile
    and CUDA graphs (call once before capturing); eager calls skip the op dispatcher. ``config``: override the
    tuned configuration (see ``default_config``). ``group``: the tensor-parallel group (default: the heap's).

    ``activation="silu_gate"`` (a gated MLP's input projection): ``w`` is ``[w_gate; w_up]`` stacked by rows
    ([2*I, K]) and the result is ``silu(x @ w_gate.T) * (x @ w_up.T)``, [W*m, I], with x = all_gather(a): both
    products accumulate in fp32 in the same tile and only the gated result is written (no [W*m, 2I] tensor, no
    separate activation pass).

    FP8: ``a`` and ``w`` float8_e4m3fn (or float8_e5m2 for both) with float32 ``scale_a`` (this rank's rows) and
    ``scale_w`` in one of the modes of ``kernels/fp8.py`` ([1] / [1]; [m, 1] / [N_local, 1]; [m, ceil(K/128)] /
    [ceil(N_local/128), ceil(K/128)]; ``scaling`` names it, None: the shapes do) give ``all_gather(a * scale_a) @
    (w * scale_w).T`` in ``out_dtype`` (bfloat16 unless given; float16, float32), ``fast_accum`` as in ``gemm``.
    The rows cross as FP8 with their scales; ``return_gathered`` returns the FP8 rows; with ``silu_gate`` each
    half of w has its own scales (blockwise: N_local a multiple of 256). No autograd; under torch.compile
    through async-TP's ``fused_all_gather_scaled_matmul`` (``kernels/async_tp.py``). FP8 operands without
    scales, scales with other operands: TypeError. ``scaled_ag_gemm``: the same with the scales required.

    ``quantize`` ("tensor", "row", "block"; FP8 training's forward): bfloat16 / float16 / float32 ``a`` and ``w``
    quantised to e4m3 in the call, scales taken on the device from this rank's ``a`` and ``w``
    (``fp8.quantize_operands``; "block": 1x128 groups of a, 128x128 blocks of w), then the FP8 op above, the
    result in a's dtype. Differentiable straight-through: the backward is the one below, from the unquantised
    ``a`` and ``w`` (FP8 forward, gradients in a's dtype). The gathered rows are FP8: no ``return_gathered`` /
    ``keep_gathered``; the other FP8 keywords are not taken (ValueError). ``fp8_grads=True`` (with ``quantize``
    only: ValueError otherwise; a bool: TypeError otherwise): the backward's two GEMMs in FP8 too, each operand
    quantised in the same mode along that GEMM's reduction dimension: ``grad_a = gemm_rs(grad_out, w.T,
    quantize=quantize)``, ``grad_w`` the FP8 core's ``grad_out.T @ all_gather(a)`` (grad_out.T and
    all_gather(a).T quantised; "block": 1x128 groups / 128x128 blocks along the tokens), in a's dtype.

    Autograd: when ``a`` or ``w`` requires grad the call goes through the torch op, whose backward is
    ``grad_a = gemm_rs(grad_out, w.T)`` and ``grad_w = grad_out.T @ all_gather(a)`` (``kernels/autograd.py``);
    the gathered input is gathered again in the backward (as Megatron-LM does) unless ``keep_gathered``
    (memory for one all-gather less). With ``silu_gate`` the pre-activation is kept and the activation is torch's
    (a direct call of the torch op with ``"silu_gate"`` computes it again in its backward). ``config``: the
    forward's (eagerly; the backward's calls take their tuned configurations).
    """
    if not isinstance(a, torch.Tensor) or not isinstance(w, torch.Tensor):
        raise TypeError(f"a and w must be torch.Tensors, got {type(a).__name__} and {type(w).__name__}")
    scales, out_dtype = fp8.scaled_operands(a, w, scale_a, scale_w, scaling, out_dtype, fast_accum,
                                            quantize=quantize)
    fp8.check_fp8_grads(fp8_grads, quantize)
    return _ag_gemm(a, w, scales, out_dtype, return_gathered, config, activation, group, keep_gathered, quantize,
                    fp8_grads)


def scaled_ag_gemm(a, w, scale_a, scale_w, *, scaling=None, out_dtype=None, fast_accum=False, return_gathered=False,
                   config=None, activation="none", group=None):
    """``ag_gemm`` on FP8 operands, the scales required (as in ``torch._scaled_mm``): ``all_gather(a * scale_a) @
    (w * scale_w).T``."""
    scales, out_dtype = fp8.scaled_operands(a, w, scale_a, scale_w, scaling, out_dtype, fast_accum, required=True)
    return _ag_gemm(a, w, scales, out_dtype, return_gathered, config, activation, group)


def _ag_gemm(a, w, scales, out_dtype, return_gathered, config, activation, group, keep_gathered=False,
             quantize=None, fp8_grads=False):
    """The op on its operands' mode (``fp8.scaled_operands``: FP8 ``scales`` or None, the result's dtype; or
    high-precision operands that the op ``quantize``s, and with ``fp8_grads`` differentiates in FP8)."""
    if quantize is not None:  # before any path: the gathered rows are FP8, none to return or keep
        _check_inputs(a, w, activation, quantize=quantize, return_gathered=return_gathered or keep_gathered)
    if scales is None and library.needs_grad(a, w):
        name = shmem.group_name(group)
        # training keeps the SiLU gate's pre-activation (as Megatron keeps SwiGLU's input): the backward then needs
        # no second GEMM; the gate is the differentiable silu_gate op
        op_activation = "none" if activation == "silu_gate" else activation
        out, gathered = library.with_caller_config("ag_gemm", config, lambda: torch.ops.triton_dist.ag_gemm(
            a, w, return_gathered or keep_gathered, op_activation, name, quantize, fp8_grads))
        if activation == "silu_gate":
            out = silu_gate(out)
    elif config is None and hardware.compiling() and (scales is None or activation == "none"):
        out, gathered = _traced_call(a, w, scales, out_dtype, return_gathered, activation, group, quantize)
    else:
        _check_inputs(a, w, activation, scales)
        check_launchable(a)
        if quantize is not None:
            out, gathered = _quantized_ag_gemm(a, w, quantize, config, activation, group), None
        else:
            out, gathered = _ag_gemm_impl(a, w, return_gathered, config, activation, group, scales, out_dtype)
    return (out, gathered) if return_gathered else out


def _traced_call(a, w, scales, out_dtype, return_gathered, activation, group, quantize=None):
    """The call inside torch.compile: through the torch op (``quantize`` inside it); FP8 through async-TP's
    (``async_tp.py``: B = W.t(), B's scales likewise)."""
    name = shmem.group_name(group)
    if scales is None:
        return torch.ops.triton_dist.ag_gemm(a, w, return_gathered, activation, name, quantize)
    gathered, (out,) = torch.ops.triton_dist.fused_all_gather_scaled_matmul(
        a, [w.t()], scales.a, [scales.w if scales.w.numel() == 1 else scales.w.t()], 0, name, [None], [None],
        [out_dtype], [scales.fast_accum])
    return out, gathered


__all__ = ["ag_gemm", "scaled_ag_gemm", "ag_gemm_kernel", "ready_handshake_kernel", "choose_path", "default_config",
           "candidate_configs", "silu_gate_torch", "SMALL_M_ROWS", "ACTIVATIONS"]
