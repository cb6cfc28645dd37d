"""GEMM + reduce-scatter, overlapped: the tensor-parallel output projection.

Every rank r holds ``a_r`` [M, K_local] (its slice of the hidden dimension) and ``w_r`` [N, K_local] (torch
linear convention). The op returns, on rank d, rank d's rows of ``sum_r a_r @ w_r.T``.

Rows per rank (ragged M is fine): like ``torch.tensor_split(rows, W)``: rank d owns ``M // W + (d < M % W)``
rows starting at ``d * (M // W) + min(d, M % W)``. So M = 10 on 4 ranks gives 3, 3, 2, 2 rows.

The idea (one persistent kernel per rank, no extra reduction pass)::

    rank r walks the GEMM tiles destination by destination, in ring order:
        rows of rank r+1, rows of rank r+2, ..., and its OWN rows last
      a tile for a peer d:   acc = a_r[d's rows] @ w_r.T         (fp32 accumulator, tile BLOCK_M x BLOCK_N)
                             wait once per program until d has entered this call    (ready[r] on d)
                             dl.put(acc as the partial dtype -> recv[slot of r] on d)   (NVLink stores)
                             dl.signal(arrived[slot of r, tile] on d, epoch)  <- DEFERRED until the program's next
                                 tile is computed: by then the stores have drained and the release costs nothing
      an OWN tile:           acc = a_r[r's rows] @ w_r.T
                             dl.wait(arrived[every slot, tile] >= epoch)      (peers did these tiles long ago)
                             out = sum over ranks q = 0, 1, ..., W-1 of (acc if q == r else recv[slot of q])
                                   -> this is the fused reduction: no separate reduce kernel, no re-read of out

Data movement per rank: (W-1)/W of the partial sums leave over NVLink, spread over the first (W-1)/W of the
compute (the tiles of the next rank in the ring go first, so they have the longest time to land); the own rows
come last and only read partials that are already in local memory.

Deterministic sum: the W partial tiles of an output tile are added in fp32 in the FIXED rank order 0, 1, ..., W-1
(``((p_0 + p_1) + p_2) + ...``), where a peer's partial arrives rounded to the partial dtype (the output dtype by
default, like torch.matmul + reduce_scatter; fp32 with ``partial="fp32"``) and the own partial is the fp32
accumulator. No atomics touch data, so the same inputs give bitwise-identical outputs on every run.

Flags carry the call's epoch (``dl.call_epoch``/``dl.finish_call``): no resets, no host syncs, CUDA-graph safe.
``recv`` on rank d is written by rank r only after d has entered the call (the ``ready`` handshake of
``allgather.py``), so d has finished reading the previous call's partials.

Interpreter rule: the programs of a launch run one after another there, so on CPU the launcher starts one
program per tile (in tile order, every push of a rank precedes its first wait); on GPUs the kernel is persistent
(``num_programs`` = SM count) and the tile order is the same wave by wave.

Small problems go to ``torch.matmul`` + ``reduce_scatter_tensor`` (``config["fallback_below_m"]``), so no shape is
slower than that baseline.
"""

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from .. import language as dl
from .. import shmem


# ----------------------------------------------------------------------------------------------- device side
@triton.jit
def _tile_position(tile, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    """Grouped ("swizzled") order inside one destination's rows: GROUP_M row-tiles share every column tile of w
    while they are hot in L2."""
    per_group = GROUP_M * tiles_n
    group = tile // per_group
    first_m = group * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    tm = first_m + (tile % per_group) % group_rows
    tn = (tile % per_group) // group_rows
    return tm, tn


@triton.jit
def _tile_matmul(a, w, rows, row_ok, cols, col_ok, K, stride_am, stride_ak, stride_wn, stride_wk,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc[BLOCK_M, BLOCK_N] = a[rows, :] @ w[cols, :].T in fp32 (masked rows/cols/K read as zeros)."""
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a + rows.to(tl.int64)[:, None] * stride_am + ks[None, :] * stride_ak
    w_ptrs = w + cols.to(tl.int64)[None, :] * stride_wn + ks[:, None] * stride_wk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        k_ok = ks < K - k
        a_tile = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_tile = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = tl.dot(a_tile, w_tile, acc)
        a_ptrs += BLOCK_K * stride_ak
        w_ptrs += BLOCK_K * stride_wk
    return acc


@triton.jit
def gemm_rs_kernel(a, w, out, recv, arrived, ready, state, M, N, K,
                   stride_am, stride_ak, stride_wn, stride_wk, ctx,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                   SLOTS_BLOCK: tl.constexpr):
    """One launch = one gemm_rs call on this rank. ``recv``: symmetric [W-1, rows_max, N] partial sums from the
    peers (slot of source q on rank d: (q - d - 1) mod W); ``arrived``: symmetric int32 [W-1, tiles_per_dest];
    ``ready``: symmetric int32 [W]; ``state``: this rank's int32[2] epoch counter; ``out``: [own rows, N]."""
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
        for peer in range(world):
            if peer != me:
                dl.signal(ready + me, epoch, peer, ctx)

    pending_peer = -1  # the deferred signal: (peer, flag index) of the last tile this program pushed
    pending_flag = 0
    ready_peer = -1  # the peer whose `ready` this program has already seen
    for item in range(pid, world * tiles_per_dest, n_programs):
        dest = (me + 1 + item // tiles_per_dest) % world  # next rank in the ring first, own rows last
        tile = item % tiles_per_dest
        tm, tn = _tile_position(tile, tiles_m, tiles_n, GROUP_M)
        dest_rows = rows_base + (dest < rows_extra).to(tl.int32)
        dest_start = dest * rows_base + tl.minimum(dest, rows_extra)
        rows = tm * BLOCK_M + tl.arange(0, BLOCK_M)  # rows inside the destination's block of rows
        cols = tn * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < dest_rows
        col_ok = cols < N
        tile_ok = row_ok[:, None] & col_ok[None, :]
        acc = _tile_matmul(a + dest_start.to(tl.int64) * stride_am, w, rows, row_ok, cols, col_ok, K,
                           stride_am, stride_ak, stride_wn, stride_wk, BLOCK_M, BLOCK_N, BLOCK_K)

        if pending_peer >= 0:  # the previous push had a whole tile of compute to drain: publish it now
            dl.signal(arrived + pending_flag, epoch, pending_peer, ctx)
            pending_peer = -1
        tile_offsets = rows.to(tl.int64)[:, None] * N + cols[None, :]
        if dest != me:
            if ready_peer != dest:
                dl.wait(ready + dest, epoch, ctx)
                ready_peer = dest
            slot = (me - dest - 1 + world) % world
            dl.put(recv + slot * slot_elems + tile_offsets, acc.to(recv.dtype.element_ty), dest, ctx, mask=tile_ok)
            pending_flag = slot * tiles_per_dest + tile
            pending_peer = dest
        else:
            slots = tl.arange(0, SLOTS_BLOCK)
            dl.wait(arrived + slots * tiles_per_dest + tile, epoch, ctx, mask=slots < world - 1)
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for src in range(world):  # the fixed summation order: rank 0, 1, ..., W-1
                if src == me:
                    total += acc
                else:
                    slot = (src - me - 1 + world) % world
                    total += tl.load(recv + slot * slot_elems + tile_offsets, mask=tile_ok).to(tl.float32)
            tl.store(out + tile_offsets, total.to(out.dtype.element_ty), mask=tile_ok)
    if pending_peer >= 0:
        dl.signal(arrived + pending_flag, epoch, pending_peer, ctx)
    dl.finish_call(state, epoch, n_programs)


# ----------------------------------------------------------------------------------------------- host side
def rows_of_rank(m, world, rank):
    """(first row, number of rows) of rank ``rank``'s share of ``m`` rows (tensor_split rule)."""
    base, extra = divmod(m, world)
    return rank * base + min(rank, extra), base + (1 if rank < extra else 0)


class _Workspace:
    """The symmetric buffers of one partial dtype, created collectively on first use and grown (collectively:
    every rank sees the same shapes) when a larger problem comes; reused by every later call."""

    _cache = {}

    def __init__(self, dtype, recv_elems, n_flags):
        world = shmem.world_size()
        self.recv_elems, self.n_flags = recv_elems, n_flags
        self.recv = shmem.empty((max(recv_elems, 1),), dtype, name="gemm_rs.recv")
        self.arrived = shmem.zeros((max(n_flags, 1),), torch.int32, name="gemm_rs.arrived")
        self.ready = shmem.zeros((world,), torch.int32, name="gemm_rs.ready")
        self.state = torch.zeros(2, dtype=torch.int32, device=shmem.device())
        shmem.barrier()  # peers signal into these flags only after everyone zeroed them

    @classmethod
    def get(cls, dtype, recv_elems, n_flags):
        ws = cls._cache.get(dtype)
        if ws is None or ws.recv_elems < recv_elems or ws.n_flags < n_flags:
            if ws is not None:
                recv_elems, n_flags = max(recv_elems, ws.recv_elems), max(n_flags, ws.n_flags)
                del cls._cache[dtype], ws
            cls._cache[dtype] = cls(dtype, recv_elems, n_flags)
        return cls._cache[dtype]


def release_workspaces():
    """Free the cached symmetric buffers (collective: call it on every rank)."""
    _Workspace._cache.clear()


_SM_COUNT = {}


def _sm_count(device):
    if device.index not in _SM_COUNT:
        _SM_COUNT[device.index] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SM_COUNT[device.index]


def default_config(m, n, k, world, device_type):
    """Launch parameters. Keys: block_m, block_n, block_k, group_m, num_warps, num_stages, num_programs (0: one
    program per tile, needed under the interpreter), partial ("out": partials travel in the output dtype, "fp32":
    exact fp32 partials at twice the traffic), fallback_below_m (use torch.matmul + reduce_scatter_tensor when
    M is below this; "always"/"never" force a path)."""
    if device_type == "cpu":
        return {"block_m": 16, "block_n": 16, "block_k": 16, "group_m": 4, "num_warps": 4, "num_stages": 1,
                "num_programs": 0, "partial": "out", "fallback_below_m": 0}
    rows = -(-m // world)
    if rows >= 2048:
        tiles = {"block_m": 128, "block_n": 256, "block_k": 64, "num_warps": 8, "num_stages": 3}
    else:
        tiles = {"block_m": 128 if rows > 64 else 64, "block_n": 128, "block_k": 64, "num_warps": 4 if rows <= 64 else 8,
                 "num_stages": 4}
    return {**tiles, "group_m": 8, "num_programs": -1, "partial": "out", "fallback_below_m": 256 * world}


_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check_inputs(a, w):
    if not isinstance(a, torch.Tensor) or not isinstance(w, torch.Tensor):
        raise TypeError(f"a and w must be torch.Tensors, got {type(a).__name__} and {type(w).__name__}")
    if a.dtype not in _DTYPES or w.dtype != a.dtype:
        raise TypeError(f"a and w must share one dtype of float16/bfloat16/float32, got {a.dtype} and {w.dtype}")
    if a.dim() != 2 or w.dim() != 2:
        raise ValueError(f"a must be [M, K_local] and w [N, K_local], got {list(a.shape)} and {list(w.shape)}")
    if a.shape[1] != w.shape[1]:
        raise ValueError(f"a [M, K_local] and w [N, K_local] disagree on K_local: {list(a.shape)} vs {list(w.shape)}")


def _check_device(a, w):
    dev = shmem.device()
    if a.device.type != dev.type or w.device.type != dev.type or (dev.type == "cuda" and (a.device != w.device)):
        raise ValueError(f"a ({a.device}) and w ({w.device}) must be on triton_dist's device {dev}")


def _group():
    return shmem.heap._runtime().group  # the process group triton_dist was initialised with


def gemm_rs_torch(a, w):
    """The baseline, also the small-problem path: ``torch.matmul`` then NCCL ``reduce_scatter_tensor`` (rows
    padded to equal chunks when M % W != 0). Same row split as ``gemm_rs``."""
    world, me = shmem.world_size(), shmem.rank()
    m, n = a.shape[0], w.shape[0]
    partial = torch.matmul(a, w.t())
    if world == 1:
        return partial
    rows_max = -(-m // world)
    if m % world:
        padded = partial.new_zeros((world * rows_max, n))
        for d in range(world):
            start, rows = rows_of_rank(m, world, d)
            padded[d * rows_max: d * rows_max + rows] = partial[start: start + rows]
        partial = padded
    out = partial.new_empty((rows_max, n))
    dist.reduce_scatter_tensor(out, partial, group=_group())
    return out[: rows_of_rank(m, world, me)[1]]


def _gemm_rs(a, w, config=None, out=None):
    _check_inputs(a, w)
    _check_device(a, w)
    world, me = shmem.world_size(), shmem.rank()
    (m, k), n = a.shape, w.shape[0]
    own_rows = rows_of_rank(m, world, me)[1]
    if out is None:
        out = torch.empty((own_rows, n), dtype=a.dtype, device=a.device)
    elif (not isinstance(out, torch.Tensor) or tuple(out.shape) != (own_rows, n) or out.dtype != a.dtype
          or out.device != a.device or not out.is_contiguous()):
        what = f"{out.dtype} {list(out.shape)} on {out.device}" if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"out must be a contiguous {a.dtype} tensor of shape {[own_rows, n]} on {a.device}, "
                         f"got {what}")
    cfg = {**default_config(m, n, k, world, a.device.type), **(config or {})}
    fallback = cfg["fallback_below_m"]
    if fallback == "always" or world == 1 or (fallback != "never" and m < fallback):
        return out.copy_(gemm_rs_torch(a, w))
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    partial_dtype = torch.float32 if cfg["partial"] == "fp32" else a.dtype
    rows_max = -(-m // world)
    bm, bn = cfg["block_m"], cfg["block_n"]
    tiles_per_dest = triton.cdiv(rows_max, bm) * triton.cdiv(n, bn)
    ws = _Workspace.get(partial_dtype, (world - 1) * rows_max * n, (world - 1) * tiles_per_dest)
    n_items = world * tiles_per_dest
    programs = cfg["num_programs"]
    if programs == 0:
        programs = n_items
    elif programs < 0:
        programs = _sm_count(a.device)
    programs = max(1, min(programs, n_items))
    shmem.raise_pending_errors()
    gemm_rs_kernel[(programs,)](
        a, w, out, ws.recv, ws.arrived, ws.ready, ws.state, m, n, k,
        a.stride(0), a.stride(1), w.stride(0), w.stride(1), shmem.context(),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=cfg["block_k"], GROUP_M=cfg["group_m"],
        SLOTS_BLOCK=triton.next_power_of_2(max(world - 1, 1)),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out


def _output_shape(a, w):
    _check_inputs(a, w)
    return rows_of_rank(a.shape[0], shmem.world_size(), shmem.rank())[1], w.shape[0]


@torch.library.custom_op("triton_dist::gemm_rs", mutates_args=())
def _gemm_rs_op(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return _gemm_rs(a, w)


@_gemm_rs_op.register_fake
def _(a, w):
    return a.new_empty(_output_shape(a, w))


def gemm_rs(a, w, config=None, out=None):
    """This rank's rows of ``sum over ranks of a @ w.T`` (rows split like ``torch.tensor_split``, see the module
    docstring), summed in the fixed rank order 0..W-1 (bitwise reproducible).

    ``a``: [M, K_local], ``w``: [N, K_local] (torch linear convention), float16/bfloat16 (float32 works too), on
    triton_dist's device; every rank passes the same shapes. Returns a new [rows of this rank, N] tensor.
    ``config``: overrides of ``default_config`` (tiles, programs, partial dtype, fallback threshold); without it
    the call goes through ``torch.ops.triton_dist.gemm_rs`` (torch.compile and CUDA graphs welcome).
    ``out``: optional preallocated [rows of this rank, N] result (contiguous, a's dtype and device).
    """
    _check_inputs(a, w)
    if config is None and out is None:
        return torch.ops.triton_dist.gemm_rs(a, w)
    return _gemm_rs(a, w, config, out)
