"""Probe: a warp-specialized (DeepGEMM-style) Gluon FP8 GEMM for sm_90, same arguments as
``triton_dist.kernels.gemm_sm90.gemm_fp8_sm90_kernel`` (so ``scripts/ptx_digest.sm90_gemm_signature()`` compiles it).

Partitions (``gl.warp_specialize``; README.md beside this file):
- producer, 1 warp (worker): TMA loads of A [128, 128] and B [128, 128] into a STAGES-deep ring; waits on the
  slot's "empty" mbarrier, arms its "ready" mbarrier with expect-tx.
- consumers: two warpgroups of 64 rows each, each its own partition of 4 warps (``num_warps=4``: the default
  partition is warpgroup 0, a 4-warp worker is warpgroup 1), so that they run out of step: each waits for its
  slot, issues its four m64n128k32 wgmmas into a fresh partial (use_acc=False), waits for them (0 outstanding),
  releases the slot (one arrive per partition: the empty barrier counts 2), then adds the partial into the sum
  (times the block scales). The add overlaps the other warpgroup's wgmmas. Two register sets: sum + partial.
  ``num_warps=8`` instead runs both warpgroups in one 8-warp default partition (a partition barrier before the
  slot's release, empty barrier count 1): the comparison in lockstep.
- epilogue: per-tensor / rowwise scales as ``gemm_sm90._store_tile``; each consumer writes its 64 rows of the
  128x128 C tile into one shared buffer; warpgroup 0 waits for both halves ("c_full", count 2) and stores the
  tile by TMA; it releases the buffer ("c_free") after the store has read it, before the next tile's halves.

Compile check (no GPU): ``python benchmarks/results/2026-12-06_h200x1_run149/check.py`` (README.md).
"""

import inspect

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)

from triton_dist.kernels import gemm_sm90
from triton_dist.kernels.gemm_sm90 import _block_scale, _tile_of

# the names of 3.6 (the GPU image) and 3.7+ (gemm_sm90 takes whichever this Triton has)
_tma_load = gemm_sm90._tma_load
_tma_store = gemm_sm90._tma_store
_partition_barrier = gemm_sm90._cta_barrier  # inside a partition: a named barrier of its warps (README)

PRODUCER_REGS = gl.constexpr(40)  # setmaxnreg of the 1-warp TMA partition (DeepGEMM: 40)
CONSUMER_REGS = gl.constexpr(232)  # setmaxnreg of the 4-warp consumer worker; the default partition gets what is left
# registers a thread has at launch (ptx .maxnreg): 12 warps (4 + 4 + 1, rounded up to whole warpgroups) x 168
# fills the 64K register file; setmaxnreg then moves them from the producer's warpgroup to the consumers'
MAXNREG = 168


@gluon.jit
def _producer(a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, GROUP_M: gl.constexpr, STAGES: gl.constexpr):
    """TMA loads of every K step of this program's tiles (grouped-M order) into the ring; a slot is loaded again
    once both consumers have released it."""
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    BN: gl.constexpr = b_desc.block_type.shape[0]
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    tiles_m = gl.cdiv(M, BM)
    tiles_n = gl.cdiv(N, BN)
    k_tiles = gl.cdiv(K, BK)
    step = 0
    for tile in range(pid, tiles_m * tiles_n, nprog):
        pid_m, pid_n = _tile_of(tile, tiles_m, tiles_n, GROUP_M)
        for kk in range(k_tiles):
            slot = step % STAGES
            # a fresh barrier counts its (virtual) previous phase, parity 1, complete: the first pass is free
            mbarrier.wait(empty.index(slot), ((step // STAGES) & 1) ^ 1)
            bar = ready.index(slot)
            mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
            _tma_load(a_desc, [pid_m * BM, kk * BK], bar, a_bufs.index(slot))
            _tma_load(b_desc, [pid_n * BN, kk * BK], bar, b_bufs.index(slot))
            step += 1


@gluon.jit
def _consumer(a_bufs, b_bufs, ready, empty, c_smem, c_free, c_full, c_desc, scale_a, scale_w, M, N, K, stride_sa,
              stride_sw, ROW0: gl.constexpr, ROWS: gl.constexpr, BLOCK_SCALES: gl.constexpr, GROUP_M: gl.constexpr,
              STAGES: gl.constexpr):
    """Rows ROW0 .. ROW0 + ROWS of every tile of this program, on this partition's warps (ROWS / 16 warps: 64
    rows per warpgroup). Each K step: wait for the slot, its wgmmas into a fresh partial, wait for them, release
    the slot, add the partial into the sum. Then the epilogue (module docstring)."""
    NW: gl.constexpr = gl.num_warps()
    BM: gl.constexpr = a_bufs.type.shape[1]
    BK: gl.constexpr = a_bufs.type.shape[2]
    BN: gl.constexpr = b_bufs.type.shape[1]
    SHARED: gl.constexpr = ROWS < BM  # two consumer partitions share each slot and the C buffer
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, BN, 32])
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    tiles_m = gl.cdiv(M, BM)
    tiles_n = gl.cdiv(N, BN)
    k_tiles = gl.cdiv(K, BK)
    zero = gl.zeros([ROWS, BN], gl.float32, layout=mma)
    step = 0
    it = 0  # this program's tiles so far (the C buffer's barriers' phase)
    for tile in range(pid, tiles_m * tiles_n, nprog):
        pid_m, pid_n = _tile_of(tile, tiles_m, tiles_n, GROUP_M)
        rows = pid_m * BM + ROW0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, mma))
        acc = zero
        for kk in range(k_tiles):
            slot = step % STAGES
            # the step's block scales first: their loads' latency hides behind the wait and the wgmmas
            s_part = _block_scale(scale_a, scale_w, rows, M, pid_n, kk, stride_sa, stride_sw, BLOCK_SCALES)
            mbarrier.wait(ready.index(slot), (step // STAGES) & 1)
            a = a_bufs.index(slot)
            if SHARED:
                a = a.slice(ROW0, ROWS)
            part = warpgroup_mma(a, b_bufs.index(slot).permute((1, 0)), zero, use_acc=False, is_async=True)
            part = warpgroup_mma_wait(num_outstanding=0, deps=(part, ))
            if not SHARED:  # one partition of two warpgroups: thread 0 arrives for both (README: arrive)
                _partition_barrier()
            mbarrier.arrive(empty.index(slot), count=1)
            if BLOCK_SCALES:
                acc = acc + part * s_part[:, None]
            else:
                acc = acc + part
            step += 1
        if not BLOCK_SCALES:
            cols = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, mma))
            s_rows = gl.load(scale_a + rows * stride_sa, mask=rows < M, other=0.0)
            s_cols = gl.load(scale_w + cols * stride_sw, mask=cols < N, other=0.0)
            acc = acc * s_rows[:, None] * s_cols[None, :]
        out = acc.to(c_desc.dtype)
        if SHARED:
            if ROW0 == 0:  # the storer: the previous tile's store has read the buffer
                tma.store_wait(pendings=0)
                mbarrier.arrive(c_free, count=1)
            else:
                mbarrier.wait(c_free, it & 1)
            c_smem.slice(ROW0, ROWS).store(out)
            fence_async_shared()
            _partition_barrier()  # every thread's half written and fenced before thread 0 arrives
            mbarrier.arrive(c_full, count=1)
            if ROW0 == 0:
                mbarrier.wait(c_full, it & 1)
                _tma_store(c_desc, [pid_m * BM, pid_n * BN], c_smem)
        else:
            tma.store_wait(pendings=0)
            c_smem.store(out)
            fence_async_shared()
            _tma_store(c_desc, [pid_m * BM, pid_n * BN], c_smem)
        it += 1
    if ROW0 == 0:
        tma.store_wait(pendings=0)


@gluon.jit
def _consumer_hi(a_bufs, b_bufs, ready, empty, c_smem, c_free, c_full, c_desc, scale_a, scale_w, M, N, K,
                 stride_sa, stride_sw, ROWS: gl.constexpr, BLOCK_SCALES: gl.constexpr, GROUP_M: gl.constexpr,
                 STAGES: gl.constexpr):
    """The worker consumer: rows ROWS .. 2 * ROWS of each tile."""
    _consumer(a_bufs, b_bufs, ready, empty, c_smem, c_free, c_full, c_desc, scale_a, scale_w, M, N, K, stride_sa,
              stride_sw, ROWS, ROWS, BLOCK_SCALES, GROUP_M, STAGES)


@gluon.jit
def ws_fp8_gemm_kernel(a_desc, b_desc, c_desc, scale_a, scale_w, M, N, K, stride_sa, stride_sw,
                       BLOCK_SCALES: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                       EVEN_K_STEPS: gl.constexpr, num_warps: gl.constexpr):
    """``gemm_fp8_sm90_kernel``'s contract (scales, strides, tiles 128x128x128, persistent grouped-M), warp
    specialized. num_warps 4: two 4-warp consumer partitions (out of step); 8: one 8-warp consumer partition.
    EVEN_K_STEPS is unused (kept for the signature)."""
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    BN: gl.constexpr = b_desc.block_type.shape[0]
    SPLIT: gl.constexpr = num_warps == 4  # two consumer partitions of one warpgroup each
    ROWS: gl.constexpr = BM // 2 if SPLIT else BM
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BM, BK], a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BN, BK], b_desc.layout)
    c_smem = gl.allocate_shared_memory(c_desc.dtype, [BM, BN], c_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    c_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)  # the producer's expect; the TMA bytes complete it
        mbarrier.init(empty.index(s), count=2 if SPLIT else 1)  # one arrive per consumer partition
    mbarrier.init(c_bars.index(0), count=1)  # c_free: the storer (warpgroup 0)
    mbarrier.init(c_bars.index(1), count=2)  # c_full: both halves written
    c_free = c_bars.index(0)
    c_full = c_bars.index(1)
    if SPLIT:
        gl.warp_specialize([
            (_consumer, (a_bufs, b_bufs, ready, empty, c_smem, c_free, c_full, c_desc, scale_a, scale_w, M, N, K,
                         stride_sa, stride_sw, 0, ROWS, BLOCK_SCALES, GROUP_M, STAGES)),
            (_consumer_hi, (a_bufs, b_bufs, ready, empty, c_smem, c_free, c_full, c_desc, scale_a, scale_w, M, N,
                            K, stride_sa, stride_sw, ROWS, BLOCK_SCALES, GROUP_M, STAGES)),
            (_producer, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, GROUP_M, STAGES)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])  # worker_num_regs: required by 3.6, optional in 3.9
    else:
        gl.warp_specialize([
            (_consumer, (a_bufs, b_bufs, ready, empty, c_smem, c_free, c_full, c_desc, scale_a, scale_w, M, N, K,
                         stride_sa, stride_sw, 0, ROWS, BLOCK_SCALES, GROUP_M, STAGES)),
            (_producer, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, GROUP_M, STAGES)),
        ], [1], [PRODUCER_REGS])
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(s))
        mbarrier.invalidate(empty.index(s))
    mbarrier.invalidate(c_free)
    mbarrier.invalidate(c_full)


# ----------------------------------------------------------------------------------------------- host side
def meta(mode, stages, num_warps=4):
    """Constexprs and launch options (num_warps 4: the split consumers; 8: one 8-warp consumer partition)."""
    return dict(BLOCK_SCALES=mode == "block", GROUP_M=8, STAGES=stages, EVEN_K_STEPS=False, num_warps=num_warps,
                maxnreg=MAXNREG)


def launch(a, w, c, mode, scale_a, scale_w, stages=5, num_warps=4, grid=None):
    """``c = (a * scale_a) @ (w * scale_w).T`` as ``gemm_sm90.launch`` (FP8 a [M, K], w [N, K], c [M, N]
    TMA-compatible; ``mode`` "tensor" / "row" / "block", scales contiguous as ``fp8.Scales`` makes them), one
    program per SM (at most one per tile). Untested: written without a GPU."""
    import torch
    cfg = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128}
    args = gemm_sm90.arguments(a, w, c, cfg, mode, scale_a, scale_w)
    if grid is None:
        tiles = triton.cdiv(a.shape[0], 128) * triton.cdiv(w.shape[0], 128)
        grid = (min(torch.cuda.get_device_properties(a.device).multi_processor_count, tiles), )
    ws_fp8_gemm_kernel[grid](*args, **meta(mode, stages, num_warps))
    return c


def _signature_matches():
    """The probe keeps gemm_fp8_sm90_kernel's parameters (ptx_digest.sm90_gemm_signature)."""
    ours = list(inspect.signature(ws_fp8_gemm_kernel.fn).parameters)
    theirs = list(inspect.signature(gemm_sm90.gemm_fp8_sm90_kernel.fn).parameters)
    return ours == theirs
