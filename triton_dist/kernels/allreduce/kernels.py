"""The all-reduce kernel: one launch sums a tensor over the ranks of a group and finishes every row with an
epilogue (store it; or residual add + RMSNorm, optionally quantised to FP8).

The tensor is cut into rows of ``row_len`` elements (the flat all-reduce: rows of BLOCK; all_reduce_rmsnorm: its
tokens). Program p of every rank owns the rows p, p+P, p+2P, ... (of the whole tensor in one-shot, of every
rank's slice in two-shot, slices split like ``torch.tensor_split``), so it only ever waits on program p of the
peers: never on a later program of its own launch (the interpreter runs those after it).

    ONE_SHOT  stage its rows of x in staging[epoch parity]            (ZERO_COPY: x is in the heap, nothing to copy)
              signal arrived[p, me] on every peer; wait arrived[p, q] of every peer q
              each row: s = x_0 + x_1 + ... + x_{W-1}                 (fp32, rank order, peers' rows read from their
              epilogue(row, s)                                          heaps: every rank adds the same numbers in
              ZERO_COPY: signal done[p, me], wait done[p, q]            the same order -> the same bits)
                         (no peer reads our x after we return)
    TWO_SHOT  stage its rows of the peers' slices; signal arrived; wait arrived
              each row of OUR slice: s = sum in rank order; publish s in reduced[parity]; epilogue(row, s)
              signal published[p, me] on every peer
              for q = me+1, me+2, ...: wait published[p, q]; each row of q's slice: epilogue(row, q's reduced row)

Every element is summed by one rank (two-shot) or by every rank in the same order (one-shot), from the same
inputs: bitwise identical everywhere, and the two algorithms agree bit for bit. Epilogues: STORE (out = s in
out's dtype, published in that dtype); RMSNORM (new_residual = residual + s, normed = new_residual *
rsqrt(mean(new_residual^2) + eps) * weight; published in fp32, so that every rank adds its own residual to the same
sum); RMSNORM_FP8 (normed / scale as e4m3, scale = amax(|normed|) / 448 per row).
"""

import triton
import triton.language as tl

from ... import language as dl
from ..fp8 import E4M3_MAX, round_to_e4m3

# The epilogues (constexpr EPILOGUE); the host passes the plain numbers.
EPILOGUE_STORE, EPILOGUE_RMSNORM, EPILOGUE_RMSNORM_FP8 = 0, 1, 2
STORE = tl.constexpr(EPILOGUE_STORE)
RMSNORM_FP8 = tl.constexpr(EPILOGUE_RMSNORM_FP8)
FP8_MAX = tl.constexpr(E4M3_MAX)  # the largest finite float8_e4m3fn


@triton.jit
def sum_over_ranks(own, shared, mask, me, ctx, WORLD: tl.constexpr):
    """fp32 sum of one block over ranks 0, 1, ..., WORLD-1, in that order: this rank's values at ``own`` (local
    pointers), rank q's at ``shared`` on rank q (pointers into a symmetric buffer). Unrolled: the WORLD loads of a
    block are in flight together."""
    for q in tl.static_range(WORLD):
        if q == me:
            v = tl.load(own, mask=mask, other=0.0).to(tl.float32)
        else:
            v = dl.get(shared, q, ctx, mask=mask, other=0.0).to(tl.float32)
        if q == 0:
            total = v
        else:
            total += v
    return total


@triton.jit
def signal_peers_and_wait(flags, epoch, me, ctx, WORLD: tl.constexpr, WORLD_P2: tl.constexpr):
    """Raise ``flags[me]`` to ``epoch`` on every peer, then wait until every peer q raised our ``flags[q]``."""
    dl.enter_call(flags, epoch, me, WORLD, ctx, SKIP_SELF=True)
    peers = tl.arange(0, WORLD_P2)
    dl.wait(flags + peers, epoch, ctx, mask=(peers < WORLD) & (peers != me))


@triton.jit
def _slice(s, rows, WORLD: tl.constexpr):
    """(first row, rows) of rank s's slice (the ``torch.tensor_split`` rule)."""
    base = rows // WORLD
    extra = rows % WORLD
    return s * base + tl.minimum(s, extra), base + (s < extra).to(tl.int32)


@triton.jit
def _row(row, cols, row_len, numel):
    offs = tl.cast(row, tl.int64) * row_len + cols
    return offs, (cols < row_len) & (offs < numel)


@triton.jit
def _stage(x, shared, first, count, pid, n_programs, cols, row_len, numel):
    for r in range(pid, count, n_programs):
        offs, mask = _row(first + r, cols, row_len, numel)
        tl.store(shared + offs, tl.load(x + offs, mask=mask), mask=mask)


@triton.jit
def _epilogue(s, row, offs, mask, cols, out, residual, weight, new_residual, scales, row_len, eps,
              EPILOGUE: tl.constexpr):
    """Finish one row from its fp32 sum ``s`` (see the module docstring)."""
    if EPILOGUE == STORE:
        tl.store(out + offs, s.to(out.dtype.element_ty), mask=mask)
    else:
        res = (tl.load(residual + offs, mask=mask, other=0.0).to(tl.float32) + s).to(new_residual.dtype.element_ty)
        tl.store(new_residual + offs, res, mask=mask)
        v = res.to(tl.float32)  # the norm of the residual as stored, which the next layer adds to
        rstd = tl.math.rsqrt(tl.sum(v * v, 0) / row_len + eps)
        y = v * rstd * tl.load(weight + cols, mask=cols < row_len, other=0.0).to(tl.float32)
        if EPILOGUE == RMSNORM_FP8:
            scale = tl.max(tl.abs(y), 0) / FP8_MAX
            q = round_to_e4m3(tl.clamp(y / tl.where(scale > 0, scale, 1.0), -FP8_MAX, FP8_MAX))
            tl.store(out + offs, q.to(out.dtype.element_ty), mask=mask)
            tl.store(scales + row, scale)
        else:
            tl.store(out + offs, y.to(out.dtype.element_ty), mask=mask)


@triton.jit
def all_reduce_kernel(x, out, residual, weight, new_residual, scales, staging, reduced, arrived, published, done,
                      state, rows, row_len, numel, stage_elems, slice_elems, eps, ctx,
                      BLOCK: tl.constexpr, WORLD: tl.constexpr, WORLD_P2: tl.constexpr, TWO_SHOT: tl.constexpr,
                      ZERO_COPY: tl.constexpr, EPILOGUE: tl.constexpr):
    """One all-reduce call on this rank. ``x``, ``out`` (and the RMSNorm tensors) contiguous, ``rows`` rows of
    ``row_len`` <= BLOCK elements, ``numel`` in all. ``staging``: symmetric [2, stage_elems] in x's dtype (unused
    with ZERO_COPY: x itself is symmetric); ``reduced``: symmetric [2, slice_elems] (two-shot); ``arrived``,
    ``published``, ``done``: symmetric int32 [P, WORLD] flags; ``state``: this rank's int32[2] epoch counter."""
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    me = dl.rank(ctx)
    epoch = dl.call_epoch(state)
    parity = (epoch % 2).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    flags = pid * WORLD  # this program's row of every flag array
    if ZERO_COPY:
        shared = x
    else:  # double-buffered by epoch parity: a peer still reading the last call's copy reads the other half
        shared = staging + parity * stage_elems
        if TWO_SHOT:  # the peers read our rows of their slices; our own slice never leaves x
            for i in range(1, WORLD):
                first, count = _slice((me + i) % WORLD, rows, WORLD)
                _stage(x, shared, first, count, pid, n_programs, cols, row_len, numel)
        else:
            _stage(x, shared, 0, rows, pid, n_programs, cols, row_len, numel)
    signal_peers_and_wait(arrived + flags, epoch, me, ctx, WORLD, WORLD_P2)

    if TWO_SHOT:
        mine = reduced + parity * slice_elems
        first, count = _slice(me, rows, WORLD)
        for r in range(pid, count, n_programs):
            offs, mask = _row(first + r, cols, row_len, numel)
            s = sum_over_ranks(x + offs, shared + offs, mask, me, ctx, WORLD)
            tl.store(mine + tl.cast(r, tl.int64) * row_len + cols, s.to(mine.dtype.element_ty), mask=mask)
            _epilogue(s, first + r, offs, mask, cols, out, residual, weight, new_residual, scales, row_len, eps,
                      EPILOGUE)
        dl.enter_call(published + flags, epoch, me, WORLD, ctx, SKIP_SELF=True)
        for i in range(1, WORLD):  # every peer's reduced slice, starting at the next rank (spreads the load)
            q = (me + i) % WORLD
            dl.wait(published + flags + q, epoch, ctx)
            first, count = _slice(q, rows, WORLD)
            for r in range(pid, count, n_programs):
                offs, mask = _row(first + r, cols, row_len, numel)
                s = dl.get(mine + tl.cast(r, tl.int64) * row_len + cols, q, ctx, mask=mask, other=0.0)
                s = s.to(tl.float32)
                _epilogue(s, first + r, offs, mask, cols, out, residual, weight, new_residual, scales, row_len,
                          eps, EPILOGUE)
    else:
        for r in range(pid, rows, n_programs):
            offs, mask = _row(r, cols, row_len, numel)
            s = sum_over_ranks(x + offs, shared + offs, mask, me, ctx, WORLD)
            _epilogue(s, r, offs, mask, cols, out, residual, weight, new_residual, scales, row_len, eps, EPILOGUE)
        if ZERO_COPY:  # the peers read our x: return only once they are done with it
            signal_peers_and_wait(done + flags, epoch, me, ctx, WORLD, WORLD_P2)
    dl.finish_call(state, epoch, n_programs)
