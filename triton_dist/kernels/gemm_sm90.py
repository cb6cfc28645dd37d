"""The GEMM core's warp-specialized mainloop for Hopper (sm_90), written in Gluon: ``C = (A * scale_a) @ (W *
scale_w).T`` with the tensor cores' partial sums promoted to fp32 every K step, at close to fast-accumulation speed
(docs/design/fp8.md: what was measured); and ``C = A @ W.T`` for bf16 / fp16 operands through the same pipeline
(64-wide K steps, the wgmmas adding into the fp32 sums themselves: nothing to promote, no scales).

Without fast accumulation (``torch._scaled_mm``'s default) the core adds each 128-wide K step's wgmma result into
an fp32 sum. Written in Triton, the compiler waits for a step's wgmmas before those adds, so the tensor cores idle
while they run (docs/design/fp8.md). Gluon (``triton.experimental.gluon``, part of Triton: explicit layouts,
shared memory, mbarriers, TMA, asynchronous ``warpgroup_mma`` and warp specialization) lets the kernel run the
adds beside the wgmmas, as DeepGEMM does: the program's warps are split into partitions (``gl.warp_specialize``)
that run out of step.

- **The producer** (one warp, few registers): TMA loads of A [128, 128] and W [BLOCK_N, 128] into a ring of
  ``STAGES`` shared-memory slots, as far ahead as the ring allows, across tiles. A slot's "ready" mbarrier
  completes when its bytes have landed; its "empty" mbarrier when both consumers are done with it.
- **Two consumers** (one warpgroup each, rows 0-63 and 64-127 of the tile): per K step, wait for the slot, run its
  wgmmas into a fresh partial, wait for them, release the slot, add the partial into the fp32 sum (times the
  step's block scales). While one warpgroup adds, the other's wgmmas run. A thread holds two register sets: the
  sum and a partial. At BLOCK_N = 256 the step runs as two 128-column pieces, one after the other, so a thread
  holds two sums and one partial (an A tile then serves 256 columns instead of 128: less L2 traffic per FLOP).
  With block scales the second piece's wgmmas wait for the first piece's adds (``_zeros_after``): ptxas would
  issue them before the last adds, and a second partial outgrows a thread's registers.
- **The epilogue**: per-tensor / rowwise scales multiply the finished sum; each consumer writes its 64 rows of a
  piece into one shared buffer, and the first consumer stores the piece by TMA once both halves are in.

Persistent: one program per SM walks its tiles in grouped-M order. Where the tiles leave the last round's SMs
mostly idle (``tail_split``: at 8192^3, 4096 tiles of 128x128 on 132 SMs, the 32nd round holds 4), the
configuration's TAIL_SPLIT cuts each of that round's tiles into K shares that fill the round: each share's sums go
to an fp32 workspace, and the last share to arrive adds them in share order (bitwise the same whichever is last;
no program waits for another) and stores the tile. No wgmma is in flight at a loop's back edge or across a run-time
branch (ptxas would then serialize every wgmma of the kernel: docs/design/fp8.md).

``gemm`` runs it where its autotuner picks a configuration with ``MAINLOOP="gluon"`` (``candidates``, offered
where ``TUNER_OFFERS``; for 16-bit operands where ``TUNER_OFFERS_16BIT``) or ``config=`` asks for it: FP8 operands
with promoted scales or bf16 / fp16 ones, on an sm_90 GPU, TMA-compatible operands. Everything else is the Triton
core (``gemm.py``), which the fused ops' kernels call tile by tile.
"""

import dataclasses
import functools
import os

import torch

try:  # triton >= 3.5
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                   warpgroup_mma_wait)
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
    # TMA copies: async_load / async_store since triton 3.7; the older names before (the GPU image's 3.6)
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
    # inside a partition: a barrier of its own warps (3.6: thread_barrier)
    _partition_barrier = getattr(gl, "barrier", None) or gl.thread_barrier
    # cp.async of single values into shared memory: async_load since triton 3.7, the older name before
    _copy_to_shared = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
except ImportError:  # pragma: no cover - a Triton without Gluon: the Triton core only
    gluon = None

from .. import hardware
from . import fp8
from .launcher import Launchers

# a thread's registers at launch: 12 warps (4 + 4 + 1, rounded up to whole warpgroups) x 168 fill the 64K register
# file; setmaxnreg then moves them from the producer's warpgroup to the consumers' (``gemm_fp8_sm90_kernel``)
MAXNREG = 168


if gluon is not None:
    SCALE_BLOCK = gl.constexpr(128)  # the side of a W scale block (and of A's scale groups along K)
    PRODUCER_REGS = gl.constexpr(40)  # setmaxnreg of the producer warp's warpgroup (it only issues TMA loads)
    CONSUMER_REGS = gl.constexpr(232)  # the second consumer's; the first (the default partition) gets the rest

    @gluon.jit
    def _tile_of(tile, tiles_m, tiles_n, GROUP_M: gl.constexpr):
        """(pid_m, pid_n) of ``tile`` in grouped-M order: GROUP_M rows of tiles sweep the columns together, so
        that their A and W tiles meet in L2 (the Triton core's ``tile_coords`` for one segment)."""
        group = GROUP_M * tiles_n
        first_m = (tile // group) * GROUP_M
        rows = gl.minimum(tiles_m - first_m, GROUP_M)
        return first_m + (tile % group) % rows, (tile % group) // rows

    @gluon.jit
    def _items(tiles, tail_split, SPLIT_TAIL: gl.constexpr):
        """(work items, whole tiles) of the programs' walk: every tile whole, or with SPLIT_TAIL the tiles of the
        last, partial round (``tiles % programs`` of them) each in ``tail_split`` K shares, so that the round's
        work spreads over the idle SMs (``_span``)."""
        if SPLIT_TAIL:
            whole = tiles - tiles % gl.num_programs(0)
            return whole + (tiles - whole) * tail_split, whole
        else:
            return tiles, tiles

    @gluon.jit
    def _span(item, whole, tail_split, k_tiles, SPLIT_TAIL: gl.constexpr):
        """The tile of work item ``item`` and its K steps [first, last): all of them below ``whole`` (every item
        without SPLIT_TAIL), else the item's share of a tail tile's (shares in K order: the tail tile's items are
        neighbours)."""
        if SPLIT_TAIL:
            tile = item
            first = item * 0
            last = k_tiles
            if item >= whole:
                tile = whole + (item - whole) // tail_split
                share = (item - whole) % tail_split
                first = share * k_tiles // tail_split
                last = (share + 1) * k_tiles // tail_split
            return tile, first, last
        else:
            return item, 0, k_tiles

    @gluon.jit
    def _producer(a_desc, b_desc, a_bufs, b_bufs, sa_bufs, sw_bufs, ready, empty, scale_a, scale_w, M, N, K,
                  stride_sa, stride_sw, stride_sak, tail_split, BLOCK_SCALES: gl.constexpr, GROUP_M: gl.constexpr,
                  STAGES: gl.constexpr, SPLIT_TAIL: gl.constexpr):
        """TMA loads of every K step of this program's tiles into the ring; a slot is loaded again once both
        consumers have released it. With BLOCK_SCALES the step's scales come along into the slot (cp.async, whose
        completion the slot's ready barrier also awaits): A's of the tile's rows, W's of the blocks its columns meet."""
        BM: gl.constexpr = a_desc.block_type.shape[0]
        BK: gl.constexpr = a_desc.block_type.shape[1]
        BN: gl.constexpr = b_desc.block_type.shape[0]
        tiles_m = gl.cdiv(M, BM)
        tiles_n = gl.cdiv(N, BN)
        k_tiles = gl.cdiv(K, BK)
        n_blocks = gl.cdiv(N, SCALE_BLOCK)
        row_of: gl.constexpr = gl.BlockedLayout([BM // 32], [32], [1], [0])
        piece_of: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
        first_item = gl.program_id(0)
        n_items, whole = _items(tiles_m * tiles_n, tail_split, SPLIT_TAIL)
        step = 0  # over all this program's tiles: the slot is step % STAGES, its pass (step // STAGES)
        for item in range(first_item, n_items, gl.num_programs(0)):
            tile, k_first, k_last = _span(item, whole, tail_split, k_tiles, SPLIT_TAIL)
            pid_m, pid_n = _tile_of(tile, tiles_m, tiles_n, GROUP_M)
            rows = pid_m * BM + gl.arange(0, BM, layout=row_of)
            # the W blocks of the tile's columns (BLOCK_N 128 or 256: the tile starts on a block)
            pieces = pid_n * (BN // SCALE_BLOCK) + gl.arange(0, 2, layout=piece_of)
            for kk in range(k_first, k_last):
                slot = step % STAGES
                # a fresh barrier counts its (virtual) previous phase, parity 1, complete: the first pass is free
                mbarrier.wait(empty.index(slot), ((step // STAGES) & 1) ^ 1)
                bar = ready.index(slot)
                if BLOCK_SCALES:  # before the expect (the phase's last arrival): the copies' arrival counts in it
                    _copy_to_shared(sa_bufs.index(slot), scale_a + rows * stride_sa + kk * stride_sak, mask=rows < M)
                    _copy_to_shared(sw_bufs.index(slot), scale_w + pieces * stride_sw + kk, mask=pieces < n_blocks)
                    async_copy.mbarrier_arrive(bar)
                mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
                _tma_load(a_desc, [pid_m * BM, kk * BK], bar, a_bufs.index(slot))
                _tma_load(b_desc, [pid_n * BN, kk * BK], bar, b_bufs.index(slot))
                step += 1

    @gluon.jit
    def _mma(a, b, zero, AFTER: gl.constexpr = False):
        """``a @ b.T`` of shared-memory tiles into a fresh fp32 partial, waited for. AFTER: ``zero`` holds zeros
        computed from another sum (``_zeros_after``): added to, so the wgmmas wait for that sum."""
        part = warpgroup_mma(a, b.permute((1, 0)), zero, use_acc=AFTER, is_async=True)
        return warpgroup_mma_wait(num_outstanding=0, deps=(part, ))

    @gluon.jit
    def _zeros_after(acc, zero, runtime_zero, BLOCK_SCALES: gl.constexpr):
        """The fresh partial of the piece after ``acc``'s: with block scales zeros that depend on every value of
        ``acc`` (its bits and a zero the compiler cannot know, in an asm statement that stays after the adds), so
        that the piece's wgmmas wait for the adds into ``acc``: ptxas would hoist them above, two partials live,
        and spill. Else ``zero``."""
        if BLOCK_SCALES:
            return gl.inline_asm_elementwise("and.b32 $0, $1, $2;", "=f,f,r", [acc, runtime_zero],
                                             dtype=gl.float32, is_pure=False, pack=1)
        else:
            return zero

    @gluon.jit
    def _promote(acc, part, scale, BLOCK_SCALES: gl.constexpr):
        """``acc + part``; with BLOCK_SCALES times the step's ``scale`` per row (A's block times W's)."""
        if BLOCK_SCALES:
            return acc + part * scale[:, None]
        else:
            return acc + part

    @gluon.jit
    def _piece_scale(sa_buf, sw_buf, P: gl.constexpr, PN: gl.constexpr, ROW0: gl.constexpr, ROWS: gl.constexpr,
                     layout: gl.constexpr, BLOCK_SCALES: gl.constexpr):
        """The block scales of a step for the tile's piece ``P`` (its columns P * PN on: within the tile's W block
        P * PN // 128) from its slot (after its ready barrier): ``scale_a[row, kb] * scale_w[block, kb]`` for this
        consumer's rows ([ROWS] in ``layout``); 0 without block scales (unused). Read from shared memory when the
        piece's sum takes them: no register holds a scale across a wgmma."""
        if BLOCK_SCALES:
            s_a = sa_buf.slice(ROW0, ROWS).load(layout)
            pair: gl.constexpr = gl.BlockedLayout([2], [32], [gl.num_warps()], [0])  # both in every thread
            block = gl.arange(0, 2, layout=pair) == P * PN // SCALE_BLOCK
            return s_a * gl.sum(gl.where(block, sw_buf.load(pair), 0.0), axis=0)
        else:
            return 0.0

    @gluon.jit
    def _piece_step(acc, a, b, sa, sw, empty, slot, zero, s_first, P: gl.constexpr, PIECES: gl.constexpr,
                    ROW0: gl.constexpr, BLOCK_SCALES: gl.constexpr):
        """A K step of the tile's piece ``P`` (of PIECES, each as wide as ``zero``): its wgmmas into a fresh
        partial (``zero``: with block scales after piece 0 the zeros of ``_zeros_after``), the step's block scales
        (``s_first`` for piece 0, read from the slot after the wgmmas for the others), the ``slot`` released after
        the last piece's wgmmas and scales, the partial added into ``acc`` times the scales."""
        PN: gl.constexpr = zero.type.shape[1]
        part = _mma(a, b.slice(P * PN, PN), zero, BLOCK_SCALES and P > 0)
        if P == 0:
            scale = s_first
        else:
            scale = _piece_scale(sa, sw, P, PN, ROW0, zero.type.shape[0], gl.SliceLayout(1, zero.type.layout),
                                 BLOCK_SCALES)
        if P == PIECES - 1:
            if BLOCK_SCALES and P > 0:  # the scales just read from the slot: every thread's read before thread 0
                _partition_barrier()    # frees it (the producer's next load would overwrite them)
            mbarrier.arrive(empty.index(slot), count=1)
        acc = _promote(acc, part, scale, BLOCK_SCALES)
        return acc

    @gluon.jit
    def _accumulate_step(acc, acc1, a, b, empty, slot, PIECES: gl.constexpr):
        """A K step of 16-bit operands: the tensor cores add into the fp32 sums themselves (fp32 accumulation
        needs no promotion), each piece's wgmmas issued, both waited for, then the ``slot`` released."""
        PN: gl.constexpr = acc.type.shape[1]
        acc = warpgroup_mma(a, b.slice(0, PN).permute((1, 0)), acc, is_async=True)
        if PIECES > 1:
            acc1 = warpgroup_mma(a, b.slice(PN, PN).permute((1, 0)), acc1, is_async=True)
            acc, acc1 = warpgroup_mma_wait(num_outstanding=0, deps=(acc, acc1))
        else:
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(empty.index(slot), count=1)
        return acc, acc1

    @gluon.jit
    def _store_buffer(out, c_desc, c_smem, c_free, c_full, phase, row0, col0, ROW0: gl.constexpr):
        """This consumer's rows ``out`` of C's block at (``row0``, ``col0``) (as wide as the shared buffer) through
        the buffer: the first consumer (ROW0 0) frees it (the previous store has read it) and, once both
        consumers' rows are in, stores the block by TMA."""
        if ROW0 == 0:
            tma.store_wait(pendings=0)
            mbarrier.arrive(c_free, count=1)
        else:
            mbarrier.wait(c_free, phase)
        c_smem.slice(ROW0, out.type.shape[0]).store(out)
        fence_async_shared()
        _partition_barrier()  # every thread's rows written and fenced before thread 0 arrives
        mbarrier.arrive(c_full, count=1)
        if ROW0 == 0:
            mbarrier.wait(c_full, phase)
            _tma_store(c_desc, [row0, col0], c_smem)

    @gluon.jit
    def _scaled(acc, scale_a, scale_w, rows, col0, M, N, stride_sa, stride_sw, BLOCK_SCALES: gl.constexpr):
        """The finished sum ``acc`` of ``rows`` (columns from ``col0``) times its per-tensor / rowwise scales
        (block scales: applied every K step already; 16-bit operands, ``scale_a`` None: none)."""
        if not BLOCK_SCALES and scale_a is not None:
            cols = col0 + gl.arange(0, acc.type.shape[1], layout=gl.SliceLayout(0, acc.type.layout))
            s_rows = gl.load(scale_a + rows * stride_sa, mask=rows < M, other=0.0)
            s_cols = gl.load(scale_w + cols * stride_sw, mask=cols < N, other=0.0)
            acc = acc * s_rows[:, None] * s_cols[None, :]
        return acc

    @gluon.jit
    def _store_piece(acc, c_desc, c_smem, c_free, c_full, phase, scale_a, scale_w, rows, row0, col0, M, N,
                     stride_sa, stride_sw, ROW0: gl.constexpr, BLOCK_SCALES: gl.constexpr):
        """This consumer's ``rows`` of the piece of C at (``row0``, ``col0``): scaled (per-tensor / rowwise),
        converted, stored through the shared buffer (``_store_buffer``) at once, or, where the buffer is half the
        piece's width (EPILOGUE_SUBTILE: 16 KiB of shared memory for the ring), in two halves (phases ``phase``
        and ``phase ^ 1``)."""
        ROWS: gl.constexpr = acc.type.shape[0]
        PN: gl.constexpr = acc.type.shape[1]
        out = _scaled(acc, scale_a, scale_w, rows, col0, M, N, stride_sa, stride_sw, BLOCK_SCALES).to(c_desc.dtype)
        if c_smem.type.shape[1] == PN:
            _store_buffer(out, c_desc, c_smem, c_free, c_full, phase, row0, col0, ROW0)
        else:  # columns c and c + PN / 2 of a row sit in one thread: split them apart
            lo, hi = gl.split(gl.permute(gl.reshape(out, [ROWS, 2, PN // 2]), [0, 2, 1]))
            _store_buffer(lo, c_desc, c_smem, c_free, c_full, phase, row0, col0, ROW0)
            _store_buffer(hi, c_desc, c_smem, c_free, c_full, phase ^ 1, row0, col0 + PN // 2, ROW0)

    @gluon.jit
    def _store_tile(acc, acc1, c_desc, c_smem, c_free, c_full, pieces, scale_a, scale_w, rows, pid_m, pid_n, M, N,
                    stride_sa, stride_sw, ROW0: gl.constexpr, PIECES: gl.constexpr, STORES: gl.constexpr,
                    BLOCK_SCALES: gl.constexpr):
        """This consumer's rows of the whole tile (``pid_m``, ``pid_n``): its piece sums ``acc`` (and ``acc1``)
        through the shared buffer, ``pieces`` the buffer's stores so far; returns the count after these."""
        PN: gl.constexpr = acc.type.shape[1]
        BM: gl.constexpr = 2 * acc.type.shape[0]
        _store_piece(acc, c_desc, c_smem, c_free, c_full, pieces & 1, scale_a, scale_w, rows, pid_m * BM,
                     pid_n * (PN * PIECES), M, N, stride_sa, stride_sw, ROW0, BLOCK_SCALES)
        pieces += STORES
        if PIECES > 1:
            _store_piece(acc1, c_desc, c_smem, c_free, c_full, pieces & 1, scale_a, scale_w, rows, pid_m * BM,
                         pid_n * (PN * PIECES) + PN, M, N, stride_sa, stride_sw, ROW0, BLOCK_SCALES)
            pieces += STORES
        return pieces

    @gluon.jit
    def _tail_epilogue(acc, acc1, c, stride_cm, partials, tile_counts, item, whole, tail_split, scale_a, scale_w,
                       rows, col0, M, N, stride_sa, stride_sw, ROW0: gl.constexpr, PIECES: gl.constexpr,
                       BLOCK_SCALES: gl.constexpr):
        """The end of a tail tile's K share (SPLIT_TAIL): this consumer's rows of the share's sums stored as an
        fp32 partial; the consumer whose share arrives last at the counter of these rows adds the tile's partials
        in share order (the same bits whichever arrives last), sets the counter back to 0 and stores the rows to
        C from registers (the other consumer's rows may finish in another program: not through the shared
        buffer). No one waits, so nothing hangs whichever programs run at once."""
        mma: gl.constexpr = acc.type.layout
        ROWS: gl.constexpr = acc.type.shape[0]
        PN: gl.constexpr = acc.type.shape[1]
        TILE: gl.constexpr = 2 * ROWS * PN * PIECES  # a partial tile's fp32 values
        cols = gl.arange(0, PN, layout=gl.SliceLayout(0, mma))
        # (64-bit offsets: each thread's then differ by constants, folded into its stores' and loads' addresses)
        at = (ROW0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, mma))).to(gl.int64)[:, None] * (PN * PIECES) + \
            cols[None, :]
        tail_tile = (item - whole) // tail_split
        tile_partials = partials + tail_tile * tail_split * TILE
        share = tile_partials + (item - whole) % tail_split * TILE
        gl.store(share + at, acc)
        if PIECES > 1:
            gl.store(share + PN + at, acc1)
        _partition_barrier()  # every thread's partial stored before the release below
        counter = tile_counts + tail_tile * 2 + ROW0 // ROWS
        if gl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == tail_split - 1:
            gl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")
            if PN > 128:  # (16-bit operands' 256-wide piece) 128 columns at a time: a 256-wide sum and the partial
                # loaded into it would outgrow a thread's registers
                half: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                               instr_shape=[16, 128, 16])
                h_cols = gl.arange(0, 128, layout=gl.SliceLayout(0, half))
                h_at = (ROW0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, half))).to(gl.int64)[:, None] * PN + \
                    h_cols[None, :]
                h_rows = gl.convert_layout(rows, gl.SliceLayout(1, half))
                for h in gl.static_range(PN // 128):
                    _finish_columns(tile_partials, h * 128, h_at, h_cols, TILE, tail_split, c, stride_cm, scale_a,
                                    scale_w, h_rows, col0, M, N, stride_sa, stride_sw, BLOCK_SCALES)
            else:
                for p in gl.static_range(PIECES):
                    _finish_columns(tile_partials, p * PN, at, cols, TILE, tail_split, c, stride_cm, scale_a, scale_w,
                                    rows, col0, M, N, stride_sa, stride_sw, BLOCK_SCALES)

    @gluon.jit
    def _finish_columns(tile_partials, OFFSET: gl.constexpr, at, cols, TILE: gl.constexpr, tail_split, c, stride_cm,
                        scale_a, scale_w, rows, col0, M, N, stride_sa, stride_sw, BLOCK_SCALES: gl.constexpr):
        """Columns ``col0 + OFFSET + cols`` of a tail tile's ``rows``, by the last share: every share's partial
        (``tile_partials``: the first share's, the others TILE apart; ``at``: the rows' and columns' offsets) added
        in share order, scaled, stored to C."""
        total = gl.load(tile_partials + OFFSET + at, cache_modifier=".cg")  # (".cg": from L2, where the other SMs'
        for other in range(1, tail_split):                                   # partials are)
            total += gl.load(tile_partials + other * TILE + OFFSET + at, cache_modifier=".cg")
        out = _scaled(total, scale_a, scale_w, rows, col0 + OFFSET, M, N, stride_sa, stride_sw,
                      BLOCK_SCALES).to(c.dtype.element_ty)
        c_cols = col0 + OFFSET + cols
        gl.store(c + rows.to(gl.int64)[:, None] * stride_cm + c_cols[None, :], out,
                 mask=(rows < M)[:, None] & (c_cols < N)[None, :])

    @gluon.jit
    def _consumer(a_bufs, b_bufs, sa_bufs, sw_bufs, ready, empty, c_smem, c_free, c_full, c_desc, scale_a, scale_w,
                  M, N, K, stride_sa, stride_sw, c, stride_cm, partials, tile_counts, tail_split, ROW0: gl.constexpr,
                  BLOCK_SCALES: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                  EPILOGUE_SUBTILE: gl.constexpr, SPLIT_TAIL: gl.constexpr):
        """Rows ROW0 .. ROW0 + 64 of every tile of this program, on this partition's warpgroup: per K step wait
        for the slot, its wgmmas (a piece of PN columns at a time: C's buffer width, twice that with
        EPILOGUE_SUBTILE or, for 16-bit operands, a whole 256-wide tile), release the slot, promote; then the
        epilogue."""
        BM: gl.constexpr = a_bufs.type.shape[1]
        BK: gl.constexpr = a_bufs.type.shape[2]
        BN: gl.constexpr = b_bufs.type.shape[1]
        FP8: gl.constexpr = a_bufs.dtype.is_fp8()  # (else 16-bit operands: no scales, no promotion)
        CW: gl.constexpr = c_smem.type.shape[1]
        # buffer stores per piece: 16-bit operands keep no partial beside the sum, so their 256-wide tile is one
        # piece (each wgmma 64x256: A read from shared memory once for all 256 columns), stored in two
        STORES: gl.constexpr = 2 if EPILOGUE_SUBTILE or (not FP8 and BN == 2 * CW) else 1
        PN: gl.constexpr = CW * STORES
        PIECES: gl.constexpr = BN // PN  # 1 or 2: a sum each, one partial at a time
        ROWS: gl.constexpr = BM // 2
        # (a wgmma's K: 32 bytes of operands)
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                      instr_shape=[16, PN, 256 // a_bufs.dtype.primitive_bitwidth])
        rows_of: gl.constexpr = gl.SliceLayout(1, mma)  # a value per row of the consumer's piece
        tiles_m = gl.cdiv(M, BM)
        tiles_n = gl.cdiv(N, BN)
        k_tiles = gl.cdiv(K, BK)
        zero = gl.zeros([ROWS, PN], gl.float32, layout=mma)
        runtime_zero = M >> 31  # (M >= 0)
        first_item = gl.program_id(0)
        n_items, whole = _items(tiles_m * tiles_n, tail_split, SPLIT_TAIL)
        step = 0
        pieces = 0  # C buffer stores so far (the buffer's barriers' phase)
        for item in range(first_item, n_items, gl.num_programs(0)):
            tile, k_first, k_last = _span(item, whole, tail_split, k_tiles, SPLIT_TAIL)
            pid_m, pid_n = _tile_of(tile, tiles_m, tiles_n, GROUP_M)
            rows = pid_m * BM + ROW0 + gl.arange(0, ROWS, layout=rows_of)
            acc = zero
            acc1 = zero  # (the tile's second piece, where PIECES is 2)
            for kk in range(k_first, k_last):
                slot = step % STAGES
                mbarrier.wait(ready.index(slot), (step // STAGES) & 1)
                a = a_bufs.index(slot).slice(ROW0, ROWS)
                b = b_bufs.index(slot)
                if FP8:
                    sa = sa_bufs.index(slot)
                    sw = sw_bufs.index(slot)
                    # the first piece's scales before its wgmmas (their loads' latency hidden), the others' after
                    s_first = _piece_scale(sa, sw, 0, PN, ROW0, ROWS, rows_of, BLOCK_SCALES)
                    acc = _piece_step(acc, a, b, sa, sw, empty, slot, zero, s_first, 0, PIECES, ROW0,
                                      BLOCK_SCALES)
                    if PIECES > 1:
                        acc1 = _piece_step(acc1, a, b, sa, sw, empty, slot,
                                           _zeros_after(acc, zero, runtime_zero, BLOCK_SCALES), s_first, 1, PIECES,
                                           ROW0, BLOCK_SCALES)
                else:
                    acc, acc1 = _accumulate_step(acc, acc1, a, b, empty, slot, PIECES)
                step += 1
            if SPLIT_TAIL:
                if item < whole:
                    pieces = _store_tile(acc, acc1, c_desc, c_smem, c_free, c_full, pieces, scale_a, scale_w, rows,
                                         pid_m, pid_n, M, N, stride_sa, stride_sw, ROW0, PIECES, STORES, BLOCK_SCALES)
                else:
                    _tail_epilogue(acc, acc1, c, stride_cm, partials, tile_counts, item, whole, tail_split, scale_a,
                                   scale_w, rows, pid_n * BN, M, N, stride_sa, stride_sw, ROW0, PIECES,
                                   BLOCK_SCALES)
            else:
                pieces = _store_tile(acc, acc1, c_desc, c_smem, c_free, c_full, pieces, scale_a, scale_w, rows,
                                     pid_m, pid_n, M, N, stride_sa, stride_sw, ROW0, PIECES, STORES, BLOCK_SCALES)
        if ROW0 == 0:
            tma.store_wait(pendings=0)

    @gluon.jit
    def _second_consumer(a_bufs, b_bufs, sa_bufs, sw_bufs, ready, empty, c_smem, c_free, c_full, c_desc, scale_a,
                         scale_w, M, N, K, stride_sa, stride_sw, c, stride_cm, partials, tile_counts, tail_split,
                         BLOCK_SCALES: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                         EPILOGUE_SUBTILE: gl.constexpr, SPLIT_TAIL: gl.constexpr):
        """The worker consumer: rows 64 .. 127 of each tile."""
        _consumer(a_bufs, b_bufs, sa_bufs, sw_bufs, ready, empty, c_smem, c_free, c_full, c_desc, scale_a, scale_w,
                  M, N, K, stride_sa, stride_sw, c, stride_cm, partials, tile_counts, tail_split,
                  a_bufs.type.shape[1] // 2, BLOCK_SCALES, GROUP_M, STAGES, EPILOGUE_SUBTILE, SPLIT_TAIL)

    @gluon.jit
    def gemm_fp8_sm90_kernel(a_desc, b_desc, c_desc, scale_a, scale_w, M, N, K, stride_sa, stride_sw, stride_sak,
                             BLOCK_SCALES: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                             num_warps: gl.constexpr, EPILOGUE_SUBTILE: gl.constexpr = False, c=None, stride_cm=None,
                             partials=None, tile_counts=None, tail_split=None, SPLIT_TAIL: gl.constexpr = False):
        """Persistent ``C = A @ B.T`` of FP8 A [M, K], B [N, K] (tensor descriptors: A's block 128x128, B's
        BLOCK_N x 128 with BLOCK_N 128 or 256, C's 128 x the pieces' width, 128 or 64, or with EPILOGUE_SUBTILE
        half of 128: a piece stored in two halves; bf16 / fp16 A and B: blocks 64 wide, ``scale_a`` and
        ``scale_w`` None, no scales, no promotion) with promotion every K step; scales:
        ``scale_a[row * stride_sa]`` x ``scale_w[col * stride_sw]`` after the K loop (per-tensor: strides 0), or
        with BLOCK_SCALES ``scale_a[row * stride_sa + kb * stride_sak]`` x ``scale_w[n_block * stride_sw + kb]`` on
        each step's partial (A's scales row-major, stride_sak 1, or K-major, stride_sa 1: a step's scales in
        contiguous bytes, fewer copies than rows apart). num_warps 4: each consumer is one warpgroup. SPLIT_TAIL:
        the last round's tiles in ``tail_split`` K shares each, summed through fp32 ``partials`` (room for
        every share of every tail tile) and ``tile_counts`` (two int32 per tail tile, zero between launches), the
        finished rows stored to ``c`` (row stride ``stride_cm``) from registers."""
        BM: gl.constexpr = a_desc.block_type.shape[0]
        BK: gl.constexpr = a_desc.block_type.shape[1]
        BN: gl.constexpr = b_desc.block_type.shape[0]
        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BM, BK], a_desc.layout)
        b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BN, BK], b_desc.layout)
        c_smem = gl.allocate_shared_memory(c_desc.dtype, c_desc.block_type.shape, c_desc.layout)
        # a slot's block scales (BLOCK_SCALES: A's of its rows, W's of the two blocks its columns meet; else unused)
        plain: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
        sa_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, BM if BLOCK_SCALES else 2], plain)
        sw_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, 2], plain)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        c_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(ready.index(s), count=1)  # the producer's expect; the TMA bytes complete it
            mbarrier.init(empty.index(s), count=2)  # one arrive per consumer
        c_free = c_bars.index(0)  # the buffer may be written: the first consumer, after the last store read it
        c_full = c_bars.index(1)  # both consumers' rows are in
        mbarrier.init(c_free, count=1)
        mbarrier.init(c_full, count=2)
        gl.warp_specialize([
            (_consumer, (a_bufs, b_bufs, sa_bufs, sw_bufs, ready, empty, c_smem, c_free, c_full, c_desc, scale_a,
                         scale_w, M, N, K, stride_sa, stride_sw, c, stride_cm, partials, tile_counts, tail_split, 0,
                         BLOCK_SCALES, GROUP_M, STAGES, EPILOGUE_SUBTILE, SPLIT_TAIL)),
            (_second_consumer, (a_bufs, b_bufs, sa_bufs, sw_bufs, ready, empty, c_smem, c_free, c_full, c_desc,
                                scale_a, scale_w, M, N, K, stride_sa, stride_sw, c, stride_cm, partials, tile_counts,
                                tail_split, BLOCK_SCALES, GROUP_M, STAGES, EPILOGUE_SUBTILE, SPLIT_TAIL)),
            (_producer, (a_desc, b_desc, a_bufs, b_bufs, sa_bufs, sw_bufs, ready, empty, scale_a, scale_w, M, N, K,
                         stride_sa, stride_sw, stride_sak, tail_split, BLOCK_SCALES, GROUP_M, STAGES, SPLIT_TAIL)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])  # (worker_num_regs: required by 3.6, optional since)
        for s in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(s))
            mbarrier.invalidate(empty.index(s))
        mbarrier.invalidate(c_free)
        mbarrier.invalidate(c_full)


# ----------------------------------------------------------------------------------------------- host side
BLOCK_NS = (128, 256)  # one 128-column piece per K step, or two (an A tile then serves 256 columns)
DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16, torch.float16)  # the operands it takes
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
SHARED_BYTES = 227 * 1024  # an sm_90 program's shared memory

# Offered to gemm's tuner for FP8 unless TRITON_DIST_GLUON_MAINLOOP=0 (the tuner times it against the Triton core's
# configurations), for 16-bit operands too with TRITON_DIST_GLUON_MAINLOOP=all; ``config={"MAINLOOP": "gluon"}``
# runs it either way.
TUNER_OFFERS = os.environ.get("TRITON_DIST_GLUON_MAINLOOP", "1") != "0"
TUNER_OFFERS_16BIT = os.environ.get("TRITON_DIST_GLUON_MAINLOOP", "1") == "all"
# the most K shares of a tail tile the tuner offers (where ``tail_split`` finds a tail to split; docs/design/fp8.md)
TUNER_TAIL_SPLIT = 8


def available(device, dtype, scales, out_dtype):
    """Whether this mainloop can run a ``gemm`` call: Gluon present, an sm_90 GPU (wgmma), FP8 operands with
    promoted scales (fast accumulation is the Triton core's: it needs no overlap) or bf16 / fp16 operands without
    scales, a result it stores."""
    operands = (scales is not None and dtype in fp8.FP8_DTYPES and not scales.fast_accum) or \
        (scales is None and dtype in (torch.bfloat16, torch.float16))
    return (gluon is not None and device.type == "cuda" and not hardware.interpreting()
            and hardware.compute_major(device.index) == 9 and operands and out_dtype in OUT_DTYPES)


def block_k(dtype):
    """The K step of ``dtype`` operands: 128 bytes of a row (FP8 128, 16-bit 64), the TMA swizzle's width."""
    return 128 // dtype.itemsize


def _shared_bytes(block_n, stages, out_dtype, block_scales=False, subtile=False):
    """The ring of A and W tiles (128 bytes of each row a slot) with their block scales (fp32: A's 128 rows, W's
    two blocks) and the buffer of a 128 x 128 C piece (``subtile``: 128 x 64, a piece stored in two halves)."""
    c_buffer = 128 * (64 if subtile else 128) * out_dtype.itemsize
    return stages * ((128 + block_n) * 128 + 4 * ((128 if block_scales else 2) + 2)) + c_buffer


def takes(cfg, out_dtype, block_scales=False, dtype=torch.float8_e4m3fn):
    """Whether ``cfg`` is a configuration this kernel runs for operands of ``dtype`` and a result of ``out_dtype``
    (with block scales or not): A tiles of 128 rows, BLOCK_N of ``BLOCK_NS`` (in 128-column pieces: no SPLIT_N),
    BLOCK_K ``block_k(dtype)``, each consumer one warpgroup (num_warps 4), a ring of at least two slots within the
    shared memory (beside a C buffer of half a piece with EPILOGUE_SUBTILE)."""
    return ((cfg["BLOCK_M"], cfg["BLOCK_K"]) == (128, block_k(dtype)) and cfg["BLOCK_N"] in BLOCK_NS
            and cfg["num_warps"] == 4
            and not cfg.get("SPLIT_N") and cfg["num_stages"] >= 2
            and _shared_bytes(cfg["BLOCK_N"], cfg["num_stages"], out_dtype, block_scales,
                              bool(cfg.get("EPILOGUE_SUBTILE"))) <= SHARED_BYTES)


def candidates(base, out_dtype=torch.bfloat16, block_scales=False, subtile=False, dtype=torch.float8_e4m3fn):
    """Tuner configurations of this mainloop from ``base`` (``gemm_config``'s keys) for operands of ``dtype``: each
    BLOCK_N with the two deepest rings that fit beside a result of ``out_dtype`` (with block scales or not);
    ``subtile``: also the one slot more that a half-width C buffer makes room for (EPILOGUE_SUBTILE), where it
    does (the tuner leaves it out: docs/design/fp8.md)."""
    def depths(bn, subtile):
        return [s for s in range(2, 8) if _shared_bytes(bn, s, out_dtype, block_scales, subtile) <= SHARED_BYTES]

    cands = []
    for bn in BLOCK_NS:
        deepest = [(s, False) for s in depths(bn, False)[-2:]]
        deepest += [(s, True) for s in depths(bn, True)[-1:] if subtile and s > deepest[-1][0]]
        cands += [{**base, "MAINLOOP": "gluon", "BLOCK_M": 128, "BLOCK_N": bn, "BLOCK_K": block_k(dtype),
                   "num_warps": 4, "num_stages": s, "GROUP_M": 8, "SPLIT_N": False, "EPILOGUE_SUBTILE": subtile,
                   "SPLIT_K": 1, "programs_per_sm": None} for s, subtile in deepest]
    return cands


def default_config(base, out_dtype=torch.bfloat16, block_scales=False, block_n=128, dtype=torch.float8_e4m3fn):
    """The ``candidates`` configuration at ``block_n`` with the deepest ring: what a caller's ``config`` naming
    only ``MAINLOOP="gluon"`` gets for the knobs it leaves out (a whole-piece C buffer)."""
    return [c for c in candidates(base, out_dtype, block_scales, dtype=dtype)
            if c["BLOCK_N"] == block_n and not c["EPILOGUE_SUBTILE"]][-1]


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


def _template(shape, strides, block, dtype):
    """A Gluon TMA descriptor's fields but its base (``_described``), for a 2-D tensor (checked by the caller:
    ``gemm.tma_compatible``) of ``shape``, ``strides`` and ``dtype`` with ``block``."""
    return {**_descriptor_defaults(), "shape": list(shape), "strides": list(strides), "block_shape": block,
            "layout": _smem_layout(tuple(block), dtype)}


_NEW = object.__new__


def _described(t, template):
    """The descriptor of ``t`` with the fields of ``template``, built without the dataclass's checks of it again
    (``gemm.tma_descriptor``'s reason)."""
    desc = _NEW(GluonDescriptor)
    desc.__dict__.update(template)
    desc.base = t
    return desc


_LAUNCH = Launchers(gemm_fp8_sm90_kernel, "gemm_sm90_launch") if gluon is not None else None


def launch(a, w, c, cfg, mode, scale_a, scale_w, grid, tail=None):
    """``c = (a * scale_a) @ (w * scale_w).T`` for FP8 ``a`` [M, K], ``w`` [N, K] into ``c`` [M, N] (2-D,
    TMA-compatible) with scales of ``mode`` (as ``fp8.Scales`` holds them; bf16 / fp16 operands: mode and scales
    None, ``c = a @ w.T``) and ``cfg`` (a ``candidates`` configuration) on ``grid`` (one program per SM, at most
    one per tile; every SM's where the tail tiles split);
    ``tail``: the split tail's arguments (``tail_arguments``) or None."""
    args = Arguments(a, w, c, cfg, mode, scale_a, scale_w)(a, w, c, scale_a, scale_w)
    _LAUNCH(grid, *args, named=tail, **meta(cfg, mode, tail is not None))
    return c


def tail_arguments(c, split, workspace):
    """The kernel's arguments of a split tail: ``c`` itself (its finished tail rows are stored from registers),
    the split and ``workspace`` (``partials`` and ``tile_counts``: ``gemm.split_k_workspace``)."""
    return dict(c=c, stride_cm=c.stride(0), tail_split=split, **workspace)


class Arguments:
    """The kernel's runtime arguments for calls on operands of one layout (that of ``a``, ``w``, ``c`` and the
    scales given here): ``Arguments(...)(a, w, c, scale_a, scale_w)``, the descriptors' fields and the integers
    worked out once (a bound ``Launcher`` takes the arguments as they are: ``gemm.EagerGemm``)."""

    def __init__(self, a, w, c, cfg, mode, scale_a, scale_w):
        (m, k), n = a.shape, w.shape[0]
        bk = block_k(a.dtype)
        self.templates = (_template(a.shape, a.stride(), [128, bk], a.dtype),
                          _template(w.shape, w.stride(), [cfg["BLOCK_N"], bk], w.dtype),
                          _template(c.shape, c.stride(), [128, 64 if cfg.get("EPILOGUE_SUBTILE") else 128], c.dtype))
        self.ints = (m, n, k) + ((0, 0) if mode in ("tensor", None) else (scale_a.stride(0), scale_w.stride(0))) + \
            (scale_a.stride(1) if mode == "block" else 1,)

    def __call__(self, a, w, c, scale_a, scale_w):
        ta, tw, tc = self.templates
        return (_described(a, ta), _described(w, tw), _described(c, tc), scale_a, scale_w) + self.ints

    def described(self):
        """{position: make} of a ``Launcher`` given ``a``, ``w`` and ``c`` themselves."""
        return {at: (lambda t, template=template: _described(t, template))
                for at, template in enumerate(self.templates)}


def meta(cfg, mode, split_tail=False):
    """The kernel's constexprs and launch options for ``cfg`` and scales of ``mode`` (``split_tail``: the tail
    tiles split, ``tail_split`` > 1)."""
    return dict(BLOCK_SCALES=mode == "block", GROUP_M=cfg["GROUP_M"], STAGES=cfg["num_stages"], num_warps=4,
                EPILOGUE_SUBTILE=bool(cfg.get("EPILOGUE_SUBTILE")), maxnreg=MAXNREG,
                **({"SPLIT_TAIL": True} if split_tail else {}))


def tail_split(cfg, m, n, k, programs):
    """The K shares of each tile of the last round for ``cfg`` (its TAIL_SPLIT: the most) at [m, n, k] on
    ``programs`` programs: as many as fill the round (``tail_tiles``), each at least one K step; 1 (whole tiles)
    where the round is empty or at least half full."""
    most = cfg.get("TAIL_SPLIT") or 1
    tail = tail_tiles(cfg, m, n, programs)
    return 1 if most < 2 or not tail else max(1, min(most, programs // tail, -(-k // cfg["BLOCK_K"])))


def tail_tiles(cfg, m, n, programs):
    """The tiles of the last round (what ``tail_split`` splits)."""
    return -(-m // 128) * -(-n // cfg["BLOCK_N"]) % programs
