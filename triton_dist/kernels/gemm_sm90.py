"""The GEMM core's FP8 mainloop for Hopper (sm_90), written in Gluon: ``C = (A * scale_a) @ (W * scale_w).T`` with
the tensor cores' partial sums promoted to fp32 every K step, meant to run at fast-accumulation speed
(docs/design/fp8.md: what was measured).

Without fast accumulation (``torch._scaled_mm``'s default) the core adds each 128-wide K step's wgmma result into
an fp32 sum. Written in Triton, the compiler waits for a step's wgmmas before those adds, so the tensor cores
idle while they run (docs/design/fp8.md). Gluon (``triton.experimental.gluon``, part of Triton: explicit layouts,
shared memory, mbarriers, TMA and asynchronous ``warpgroup_mma``) lets the kernel say what should overlap: each
K step's wgmmas go into a fresh partial, and the previous step's partial is added to the sum while they run
(``warpgroup_mma_wait(num_outstanding=1)``). A thread then holds the sum and two partials, 3 x 64 fp32 registers
at a 128x128 tile on 8 warps (two warpgroups of 64 rows each), the largest tile whose three fit. No partial in
flight may cross a loop boundary or a run-time branch: ptxas would then serialize every wgmma of the kernel
(docs/design/fp8.md).

Persistent: one program per SM walks its tiles in grouped-M order; TMA loads run ``STAGES`` K steps ahead, across
tile boundaries, into a ring of shared-memory slots (one mbarrier each). Scales: per-tensor / rowwise multiply the
tile once it is complete; 128-blockwise (1x128 groups of A, 128x128 blocks of W: DeepSeek-V3) multiply each step's
partial before its add. A finished tile is converted to C's dtype and stored by TMA.

``gemm`` runs it where its autotuner picks a configuration with ``MAINLOOP="gluon"`` (``candidates``, offered where
``TUNER_OFFERS``) or ``config=`` asks for it: FP8 operands with scales and promotion, on an sm_90 GPU,
TMA-compatible operands. Everything else is the Triton core (``gemm.py``), which the fused ops' kernels call tile
by tile.
"""

import dataclasses
import functools
import os

import torch
import triton

try:  # triton >= 3.5
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                   warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
    # TMA copies: async_load / async_store since triton 3.7; the older names before (the GPU image's 3.6)
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
    _cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier  # (3.6: thread_barrier)
except ImportError:  # pragma: no cover - a Triton without Gluon: the Triton core only
    gluon = None

from .. import hardware
from . import fp8
from .launcher import Launchers


if gluon is not None:
    @gluon.jit
    def _tile_of(tile, tiles_m, tiles_n, GROUP_M: gl.constexpr):
        """(pid_m, pid_n) of ``tile`` in grouped-M order: GROUP_M rows of tiles sweep the columns together, so
        that their A and W tiles meet in L2 (the Triton core's ``tile_coords`` for one segment)."""
        group = GROUP_M * tiles_n
        first_m = (tile // group) * GROUP_M
        rows = gl.minimum(tiles_m - first_m, GROUP_M)
        return first_m + (tile % group) % rows, (tile % group) // rows

    @gluon.jit
    def _load_step(a_desc, b_desc, a_bufs, b_bufs, ready, step, total, pid, nprog, k_tiles, tiles_m, tiles_n,
                   GROUP_M: gl.constexpr, STAGES: gl.constexpr):
        """The TMA loads of this program's K step ``step`` (counted over all its tiles; none past ``total``) into
        ring slot ``step % STAGES``, completing on that slot's mbarrier."""
        BM: gl.constexpr = a_desc.block_type.shape[0]
        BK: gl.constexpr = a_desc.block_type.shape[1]
        BN: gl.constexpr = b_desc.block_type.shape[0]
        slot = step % STAGES
        pid_m, pid_n = _tile_of(pid + (step // k_tiles) * nprog, tiles_m, tiles_n, GROUP_M)
        k = (step % k_tiles) * BK
        live = step < total
        bar = ready.index(slot)
        mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes, pred=live)
        _tma_load(a_desc, [pid_m * BM, k], bar, a_bufs.index(slot), pred=live)
        _tma_load(b_desc, [pid_n * BN, k], bar, b_bufs.index(slot), pred=live)

    @gluon.jit
    def _block_scale(scale_a, scale_w, rows, M, pid_n, kb, stride_sa, stride_sw, BLOCK_SCALES: gl.constexpr):
        """Block scales of K block ``kb`` for the tile's rows: ``scale_a[row, kb] * scale_w[pid_n, kb]`` (the tile
        is 128 columns wide: one block of W); 0 without block scales (unused)."""
        if BLOCK_SCALES:
            return gl.load(scale_a + rows * stride_sa + kb, mask=rows < M, other=0.0) * \
                gl.load(scale_w + pid_n * stride_sw + kb)
        else:
            return 0.0

    @gluon.jit
    def _store_tile(c_desc, c_smem, acc, scale_a, scale_w, pid_m, pid_n, M, N, stride_sa, stride_sw,
                    BLOCK_SCALES: gl.constexpr, mma: gl.constexpr):
        """The finished fp32 tile (pid_m, pid_n): scaled (per-tensor / rowwise), converted to C's dtype, staged in
        ``c_smem`` once the previous tile's TMA store has left it, and stored by TMA (clipped to M x N)."""
        BM: gl.constexpr = c_desc.block_type.shape[0]
        BN: gl.constexpr = c_desc.block_type.shape[1]
        if not BLOCK_SCALES:
            rows = pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, mma))
            cols = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, mma))
            s_rows = gl.load(scale_a + rows * stride_sa, mask=rows < M, other=0.0)
            s_cols = gl.load(scale_w + cols * stride_sw, mask=cols < N, other=0.0)
            acc = acc * s_rows[:, None] * s_cols[None, :]
        tma.store_wait(pendings=0)
        c_smem.store(acc.to(c_desc.dtype))
        fence_async_shared()
        _tma_store(c_desc, [pid_m * BM, pid_n * BN], c_smem)

    @gluon.jit
    def _issue(step, zero, a_desc, b_desc, a_bufs, b_bufs, ready, scale_a, scale_w, rows, M, pid_n, k_tiles,
               stride_sa, stride_sw, BLOCK_SCALES: gl.constexpr, STAGES: gl.constexpr):
        """K step ``step``'s wgmmas, issued into a fresh partial once its slot has landed; returns the partial (in
        flight) and the step's block scales."""
        slot = step % STAGES
        mbarrier.wait(ready.index(slot), (step // STAGES) & 1)
        s_part = _block_scale(scale_a, scale_w, rows, M, pid_n, step % k_tiles, stride_sa, stride_sw, BLOCK_SCALES)
        part = warpgroup_mma(a_bufs.index(slot), b_bufs.index(slot).permute((1, 0)), zero, use_acc=False,
                             is_async=True)
        return part, s_part

    @gluon.jit
    def _retire(step, part, acc, s_part, a_desc, b_desc, a_bufs, b_bufs, ready, total, pid, nprog, k_tiles,
                tiles_m, tiles_n, BLOCK_SCALES: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr):
        """K step ``step``'s finished partial added into ``acc`` times its block scales; its slot is loaded again,
        STAGES steps ahead."""
        _cta_barrier()  # both warpgroups are past the slot before it is loaded again
        _load_step(a_desc, b_desc, a_bufs, b_bufs, ready, step + STAGES, total, pid, nprog, k_tiles, tiles_m,
                   tiles_n, GROUP_M, STAGES)
        if BLOCK_SCALES:
            return acc + part * s_part[:, None]
        else:
            return acc + part

    @gluon.jit
    def gemm_fp8_sm90_kernel(a_desc, b_desc, c_desc, scale_a, scale_w, M, N, K, stride_sa, stride_sw,
                             BLOCK_SCALES: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                             EVEN_K_STEPS: gl.constexpr, num_warps: gl.constexpr):
        """Persistent ``C = A @ B.T`` of FP8 A [M, K], B [N, K] (tensor descriptors, 128x128x128 tiles) with
        promotion every K step; scales: ``scale_a[row * stride_sa]`` x ``scale_w[col * stride_sw]`` after the K
        loop (per-tensor: strides 0), or with BLOCK_SCALES ``scale_a[row * stride_sa + kb]`` x
        ``scale_w[pid_n * stride_sw + kb]`` on each step's partial. EVEN_K_STEPS: cdiv(K, 128) is even.

        Each K step's wgmmas are issued before the previous step's partial is waited for and added, so the adds
        run beside them. Two steps per iteration, their partials alternating between two names: a partial in
        flight is never copied (a loop-carried swap, or a branch on the steps' parity at run time, would copy
        one, and ptxas then serializes every wgmma of the kernel: its C7514)."""
        BM: gl.constexpr = a_desc.block_type.shape[0]
        BK: gl.constexpr = a_desc.block_type.shape[1]
        BN: gl.constexpr = b_desc.block_type.shape[0]
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                      instr_shape=[16, BN, 32])
        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BM, BK], a_desc.layout)
        b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BN, BK], b_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(ready.index(s), count=1)
        c_smem = gl.allocate_shared_memory(c_desc.dtype, [BM, BN], c_desc.layout)

        pid = gl.program_id(0)
        nprog = gl.num_programs(0)
        tiles_m = gl.cdiv(M, BM)
        tiles_n = gl.cdiv(N, BN)
        k_tiles = gl.cdiv(K, BK)
        total = gl.cdiv(tiles_m * tiles_n - pid, nprog) * k_tiles  # this program's K steps over all its tiles
        for s in gl.static_range(STAGES):
            _load_step(a_desc, b_desc, a_bufs, b_bufs, ready, s, total, pid, nprog, k_tiles, tiles_m, tiles_n,
                       GROUP_M, STAGES)
        zero = gl.zeros([BM, BN], gl.float32, layout=mma)
        first = 0  # this tile's first K step, counted over the program's tiles (the TMA ring runs across them)
        for tile in range(pid, tiles_m * tiles_n, nprog):
            pid_m, pid_n = _tile_of(tile, tiles_m, tiles_n, GROUP_M)
            rows = pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, mma))
            part, s_part = _issue(first, zero, a_desc, b_desc, a_bufs, b_bufs, ready, scale_a, scale_w, rows, M,
                                  pid_n, k_tiles, stride_sa, stride_sw, BLOCK_SCALES, STAGES)
            part = warpgroup_mma_wait(num_outstanding=0, deps=(part, ))
            acc = zero
            for kk in range(1, k_tiles - 1, 2):
                odd, s_odd = _issue(first + kk, zero, a_desc, b_desc, a_bufs, b_bufs, ready, scale_a, scale_w, rows,
                                    M, pid_n, k_tiles, stride_sa, stride_sw, BLOCK_SCALES, STAGES)
                acc = _retire(first + kk - 1, part, acc, s_part, a_desc, b_desc, a_bufs, b_bufs, ready, total, pid,
                              nprog, k_tiles, tiles_m, tiles_n, BLOCK_SCALES, GROUP_M, STAGES)
                part, s_part = _issue(first + kk + 1, zero, a_desc, b_desc, a_bufs, b_bufs, ready, scale_a, scale_w,
                                      rows, M, pid_n, k_tiles, stride_sa, stride_sw, BLOCK_SCALES, STAGES)
                odd = warpgroup_mma_wait(num_outstanding=1, deps=(odd, ))  # step kk's, issued above
                acc = _retire(first + kk, odd, acc, s_odd, a_desc, b_desc, a_bufs, b_bufs, ready, total, pid,
                              nprog, k_tiles, tiles_m, tiles_n, BLOCK_SCALES, GROUP_M, STAGES)
                part = warpgroup_mma_wait(num_outstanding=0, deps=(part, ))
            last = first + k_tiles - 1
            if EVEN_K_STEPS:  # one step left to issue
                odd, s_odd = _issue(last, zero, a_desc, b_desc, a_bufs, b_bufs, ready, scale_a, scale_w, rows, M,
                                    pid_n, k_tiles, stride_sa, stride_sw, BLOCK_SCALES, STAGES)
                acc = _retire(last - 1, part, acc, s_part, a_desc, b_desc, a_bufs, b_bufs, ready, total, pid, nprog,
                              k_tiles, tiles_m, tiles_n, BLOCK_SCALES, GROUP_M, STAGES)
                odd = warpgroup_mma_wait(num_outstanding=0, deps=(odd, ))
                acc = _retire(last, odd, acc, s_odd, a_desc, b_desc, a_bufs, b_bufs, ready, total, pid, nprog,
                              k_tiles, tiles_m, tiles_n, BLOCK_SCALES, GROUP_M, STAGES)
            else:
                acc = _retire(last, part, acc, s_part, a_desc, b_desc, a_bufs, b_bufs, ready, total, pid, nprog,
                              k_tiles, tiles_m, tiles_n, BLOCK_SCALES, GROUP_M, STAGES)
            _store_tile(c_desc, c_smem, acc, scale_a, scale_w, pid_m, pid_n, M, N, stride_sa, stride_sw,
                        BLOCK_SCALES, mma)
            first += k_tiles
        tma.store_wait(pendings=0)
        for s in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(s))


# ----------------------------------------------------------------------------------------------- host side
TILE = (128, 128, 128)  # BLOCK_M, BLOCK_N, BLOCK_K: see the module docstring
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# Offered to gemm's tuner only where TRITON_DIST_GLUON_MAINLOOP=1: correct on the GPU, but not yet faster than the
# Triton core (docs/design/fp8.md); ``config={"MAINLOOP": "gluon"}`` runs it either way.
TUNER_OFFERS = os.environ.get("TRITON_DIST_GLUON_MAINLOOP") == "1"


def available(device, dtype, scales, out_dtype):
    """Whether this mainloop can run a ``gemm`` call: Gluon present, an sm_90 GPU (wgmma), FP8 operands with
    promoted scales (fast accumulation is the Triton core's: it needs no overlap), a result it stores."""
    return (gluon is not None and device.type == "cuda" and not hardware.interpreting()
            and hardware.compute_major(device.index) == 9 and dtype in fp8.FP8_DTYPES and scales is not None
            and not scales.fast_accum and out_dtype in OUT_DTYPES)


def takes(cfg):
    """Whether ``cfg`` is a configuration this kernel runs: its tile on 8 warps (two warpgroups of 64 rows), at
    least two pipeline stages (a step's slot is loaded again while the next step's wgmmas read theirs)."""
    return ((cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]) == TILE and cfg["num_warps"] == 8
            and cfg["num_stages"] >= 2)


def candidates(base, stages=(4, 5, 6)):
    """Tuner configurations of this mainloop from ``base`` (``gemm_config``'s keys): 128x128x128 on 8 warps, the
    pipeline ``stages`` deep (6 fills the shared memory with a bf16 result; an fp32 one fits 5)."""
    bm, bn, bk = TILE
    return [{**base, "MAINLOOP": "gluon", "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": 8,
             "num_stages": s, "GROUP_M": 8, "SPLIT_N": False, "EPILOGUE_SUBTILE": False, "SPLIT_K": 1,
             "programs_per_sm": None} for s in stages]


_GL_DTYPES = {}


def _gl_dtype(dtype):
    if not _GL_DTYPES:
        _GL_DTYPES.update({torch.float8_e4m3fn: gl.float8e4nv, torch.float8_e5m2: gl.float8e5,
                           torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32})
    return _GL_DTYPES[dtype]


@functools.lru_cache(maxsize=None)
def _smem_layout(block, dtype):
    return gl.NVMMASharedLayout.get_default_for(list(block), _gl_dtype(dtype))


@functools.lru_cache(maxsize=None)
def _descriptor_defaults():
    """The descriptor dataclass's fields that have defaults (this Triton's: "padding", 3.9 adds more)."""
    return {f.name: f.default for f in dataclasses.fields(GluonDescriptor) if f.default is not dataclasses.MISSING}


def _descriptor(t, block):
    """A Gluon TMA descriptor of the 2-D ``t`` (checked by the caller: ``gemm.tma_compatible``), built without
    the dataclass's checks of it again (``gemm.tma_descriptor``'s reason)."""
    desc = object.__new__(GluonDescriptor)
    desc.__dict__.update(_descriptor_defaults())
    desc.base, desc.shape, desc.strides, desc.block_shape = t, list(t.shape), list(t.stride()), block
    desc.layout = _smem_layout(tuple(block), t.dtype)
    return desc


_LAUNCH = Launchers(gemm_fp8_sm90_kernel, "gemm_sm90_launch") if gluon is not None else None


def launch(a, w, c, cfg, mode, scale_a, scale_w, grid):
    """``c = (a * scale_a) @ (w * scale_w).T`` for FP8 ``a`` [M, K], ``w`` [N, K] into ``c`` [M, N] (2-D,
    TMA-compatible) with scales of ``mode`` (contiguous: ``fp8.Scales``) and ``cfg`` (a ``candidates``
    configuration) on ``grid`` (one program per SM, at most one per tile)."""
    _LAUNCH(grid, *arguments(a, w, c, cfg, mode, scale_a, scale_w), **meta(cfg, mode, a.shape[1]))
    return c


def arguments(a, w, c, cfg, mode, scale_a, scale_w):
    """The kernel's runtime arguments for ``launch``'s call (a bound ``Launcher`` takes them as they are)."""
    (m, k), n = a.shape, w.shape[0]
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    strides = (0, 0) if mode == "tensor" else (scale_a.stride(0), scale_w.stride(0))
    return (_descriptor(a, [bm, bk]), _descriptor(w, [bn, bk]), _descriptor(c, [bm, bn]), scale_a, scale_w, m, n, k,
            *strides)


def meta(cfg, mode, k):
    """The kernel's constexprs and launch options for ``cfg``, scales of ``mode`` and inner dimension ``k``."""
    return dict(BLOCK_SCALES=mode == "block", GROUP_M=cfg["GROUP_M"], STAGES=cfg["num_stages"],
                EVEN_K_STEPS=triton.cdiv(k, cfg["BLOCK_K"]) % 2 == 0, num_warps=cfg["num_warps"])
