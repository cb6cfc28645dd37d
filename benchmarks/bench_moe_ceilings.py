"""How close are ep_dispatch / ep_combine to the hardware? (torchrun --nproc-per-node=2 benchmarks/bench_moe_ceilings.py)

The bytes of the MoE benchmark at T=4096 tokens per rank (H=7168, bf16, top-8, 2 ranks), moved by plain Triton
kernels with the same tiles and programs as our kernels but no layout, flags or bookkeeping:
  scatter   read each of T rows once, write it to 8 distinct random rows of an [8T, H] buffer: the HBM writes of a
            dispatch on one rank (its own 4 slot rows per token + the peer's ~4 per token landing here).
  gather    y[t] = sum of 8 weighted random rows of an [8T, H] buffer: the expert-output reads and y writes of a
            combine on one rank.
  push      every row to the other rank (one store per row over NVLink, both ranks at once): the link bytes of
            a dispatch or a combine; with 16 to 128 programs (how much one program can keep in flight).
  sender    the data movement of dispatch's senders without their bookkeeping: 16-token chunks taken in a
            stride, each row pushed to the peer and stored into 4 local rows; optionally with the next tile's
            load issued before the current tile's stores (prefetch) and a release signal to the peer per chunk;
            with more, smaller programs (several per SM).
  roles     the same bytes with the roles split: programs [0, P) only push, the others only write the local
            rows (a pusher waiting on the link does not hold up local stores behind it).
  skeleton  a whole dispatch's bytes and flags without its layout bookkeeping: senders push each row to the
            peer and write it into 4 local rows, flagging each 16-token chunk; receivers wait for the peer's chunks
            and copy each arrived row into 3 more rows (~588 MB through HBM and 58.7 MB over the link per rank).
            ep_dispatch's structure; variants: two programs per SM, and the roles split three ways (pushers,
            local-row writers, receivers) - which structure comes nearest the ~165 µs floor before porting it.
  combine skeleton  the same for ep_combine: senders sum 4 weighted expert rows per peer token and push the
            partial, flagging each chunk; receivers sum 4 rows of their own tokens, wait, add the peer's partial
            and write y (~647 MB through HBM, 58.7 MB over the link).
Each is timed per call from a CUDA graph of 20 calls (device time), median of 20 replays, max over ranks.
"""

import os

import torch
import torch.distributed as dist
import triton
import triton.language as tl

import triton_dist as td
import triton_dist.language as dl
from harness import record
from triton_dist import shmem
from triton_dist.timing import graph_us

T, H, K = 4096, 7168, 8
BT, BH = 16, 512


@triton.jit
def scatter_kernel(x, out, rows, T, H, K: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr):
    for t0 in range(tl.program_id(0) * BT, T, tl.num_programs(0) * BT):
        t = t0 + tl.arange(0, BT)
        for h0 in range(0, H, BH):
            hh = h0 + tl.arange(0, BH)
            tile = tl.load(x + t[:, None].to(tl.int64) * H + hh[None, :], mask=t[:, None] < T)
            for j in tl.static_range(K):
                r = tl.load(rows + t * K + j, mask=t < T)
                tl.store(out + r[:, None].to(tl.int64) * H + hh[None, :], tile, mask=t[:, None] < T)


@triton.jit
def gather_kernel(src, y, rows, w, T, H, K: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr):
    for t0 in range(tl.program_id(0) * BT, T, tl.num_programs(0) * BT):
        t = t0 + tl.arange(0, BT)
        for h0 in range(0, H, BH):
            hh = h0 + tl.arange(0, BH)
            acc = tl.zeros([BT, BH], dtype=tl.float32)
            for j in tl.static_range(K):
                r = tl.load(rows + t * K + j, mask=t < T)
                wj = tl.load(w + t * K + j, mask=t < T, other=0.0)
                v = tl.load(src + r[:, None].to(tl.int64) * H + hh[None, :], mask=t[:, None] < T, other=0.0)
                acc += wj[:, None] * v.to(tl.float32)
            tl.store(y + t[:, None].to(tl.int64) * H + hh[None, :], acc.to(y.dtype.element_ty), mask=t[:, None] < T)


@triton.jit
def push_kernel(x, dst, T, H, ctx, BT: tl.constexpr, BH: tl.constexpr):
    peer = (dl.rank(ctx) + 1) % dl.num_ranks(ctx)
    for t0 in range(tl.program_id(0) * BT, T, tl.num_programs(0) * BT):
        t = t0 + tl.arange(0, BT)
        for h0 in range(0, H, BH):
            hh = h0 + tl.arange(0, BH)
            offs = t[:, None].to(tl.int64) * H + hh[None, :]
            dl.put(dst + offs, tl.load(x + offs, mask=t[:, None] < T), peer, ctx, mask=t[:, None] < T)


@triton.jit
def _store_into_rows(out, tile, rows, t, T, hh, H, first, N: tl.constexpr):
    """Store a [BT, BH] tile of token rows t into out's rows rows[t, first .. first + N) (rows: [T, 8])."""
    for j in tl.static_range(N):
        r = tl.load(rows + t * 8 + first + j, mask=t < T)
        tl.store(out + r[:, None].to(tl.int64) * H + hh[None, :], tile, mask=t[:, None] < T)


@triton.jit
def sender_kernel(x, dst, out, rows, flags, T, H, ctx, LOCAL: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr,
                  PREFETCH: tl.constexpr, SIGNAL: tl.constexpr):
    peer = (dl.rank(ctx) + 1) % dl.num_ranks(ctx)
    for t0 in range(tl.program_id(0) * BT, T, tl.num_programs(0) * BT):
        t = t0 + tl.arange(0, BT)
        tm = t[:, None] < T
        src = x + t[:, None].to(tl.int64) * H
        tile = tl.load(src + tl.arange(0, BH)[None, :], mask=tm)
        for h0 in range(0, H, BH):
            hh = h0 + tl.arange(0, BH)
            if PREFETCH:  # the next tile's load is in flight while this one's stores issue
                nxt = tl.load(src + BH + hh[None, :], mask=tm & (hh[None, :] + BH < H))
            else:
                tile = tl.load(src + hh[None, :], mask=tm)
            dl.put(dst + t[:, None].to(tl.int64) * H + hh[None, :], tile, peer, ctx, mask=tm)
            _store_into_rows(out, tile, rows, t, T, hh, H, 0, LOCAL)
            if PREFETCH:
                tile = nxt
        if SIGNAL:
            dl.signal(flags + t0 // BT, 1, peer, ctx)


@triton.jit
def roles_kernel(x, dst, out, rows, T, H, n_push, ctx, LOCAL: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr):
    peer = (dl.rank(ctx) + 1) % dl.num_ranks(ctx)
    pid = tl.program_id(0)
    pushes = pid < n_push
    first = tl.where(pushes, pid, pid - n_push)
    stride = tl.where(pushes, n_push, tl.num_programs(0) - n_push)
    for t0 in range(first * BT, T, stride * BT):
        t = t0 + tl.arange(0, BT)
        tm = t[:, None] < T
        for h0 in range(0, H, BH):
            hh = h0 + tl.arange(0, BH)
            tile = tl.load(x + t[:, None].to(tl.int64) * H + hh[None, :], mask=tm)
            if pushes:
                dl.put(dst + t[:, None].to(tl.int64) * H + hh[None, :], tile, peer, ctx, mask=tm)
            else:
                _store_into_rows(out, tile, rows, t, T, hh, H, 0, LOCAL)


@triton.jit
def _copy_chunk_into_rows(src, out, rows, c, T, H, first, N: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr):
    """Tokens [c * BT, c * BT + BT) of src [T, H], tile by tile, into out's rows rows[t, first .. first + N)."""
    t = c * BT + tl.arange(0, BT)
    for h0 in range(0, H, BH):
        hh = h0 + tl.arange(0, BH)
        tile = tl.load(src + t[:, None].to(tl.int64) * H + hh[None, :], mask=t[:, None] < T)
        _store_into_rows(out, tile, rows, t, T, hh, H, first, N)


@triton.jit
def dispatch_skeleton_kernel(x, recv, out, rows, flags, state, T, H, n_push, n_local, ctx, BT: tl.constexpr,
                             BH: tl.constexpr, SENDERS_WRITE_LOCAL: tl.constexpr):
    """Programs [0, n_push) push (and write the 4 local rows when SENDERS_WRITE_LOCAL), the next n_local write the
    local rows (when not), the rest receive."""
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    peer = (dl.rank(ctx) + 1) % dl.num_ranks(ctx)
    epoch = dl.call_epoch(state)
    n_chunks = tl.cdiv(T, BT)
    if pid < n_push:
        for c in range(pid, n_chunks, n_push):
            t = c * BT + tl.arange(0, BT)
            tm = t[:, None] < T
            for h0 in range(0, H, BH):
                hh = h0 + tl.arange(0, BH)
                tile = tl.load(x + t[:, None].to(tl.int64) * H + hh[None, :], mask=tm)
                dl.put(recv + t[:, None].to(tl.int64) * H + hh[None, :], tile, peer, ctx, mask=tm)
                if SENDERS_WRITE_LOCAL:
                    _store_into_rows(out, tile, rows, t, T, hh, H, 0, 4)
            dl.signal(flags + c, epoch, peer, ctx)
    elif pid < n_push + n_local:
        for c in range(pid - n_push, n_chunks, n_local):
            _copy_chunk_into_rows(x, out, rows, c, T, H, 0, 4, BT, BH)
    else:
        for c in range(pid - n_push - n_local, n_chunks, n_prog - n_push - n_local):
            dl.wait(flags + c, epoch, ctx)
            _copy_chunk_into_rows(recv, out, rows, c, T, H, 4, 3, BT, BH)
    dl.finish_call(state, epoch, n_prog)


@triton.jit
def combine_skeleton_kernel(src, w, y, partials, rows, flags, state, T, H, n_push, ctx, BT: tl.constexpr,
                            BH: tl.constexpr):
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    peer = (dl.rank(ctx) + 1) % dl.num_ranks(ctx)
    epoch = dl.call_epoch(state)
    n_chunks = tl.cdiv(T, BT)
    if pid < n_push:  # the peer's tokens: their 4 slots here (rows[:, 0:4])
        for c in range(pid, n_chunks, n_push):
            t = c * BT + tl.arange(0, BT)
            tm = t[:, None] < T
            for h0 in range(0, H, BH):
                hh = h0 + tl.arange(0, BH)
                acc = _weighted_rows(src, w, rows, t, T, hh, H, 0, BT, BH)
                dl.put(partials + t[:, None].to(tl.int64) * H + hh[None, :], acc.to(partials.dtype.element_ty),
                       peer, ctx, mask=tm)
            dl.signal(flags + c, epoch, peer, ctx)
    else:  # my tokens: their 4 slots here (rows[:, 4:8]) plus the peer's partial
        for c in range(pid - n_push, n_chunks, n_prog - n_push):
            t = c * BT + tl.arange(0, BT)
            tm = t[:, None] < T
            for h0 in range(0, H, BH):
                hh = h0 + tl.arange(0, BH)
                acc = _weighted_rows(src, w, rows, t, T, hh, H, 4, BT, BH)
                if h0 == 0:
                    dl.wait(flags + c, epoch, ctx)
                acc += tl.load(partials + t[:, None].to(tl.int64) * H + hh[None, :], mask=tm).to(tl.float32)
                tl.store(y + t[:, None].to(tl.int64) * H + hh[None, :], acc.to(y.dtype.element_ty), mask=tm)
    dl.finish_call(state, epoch, n_prog)


@triton.jit
def _weighted_rows(src, w, rows, t, T, hh, H, first, BT: tl.constexpr, BH: tl.constexpr):
    """fp32 sum over j = first..first+3 of w[t, j] * src[rows[t, j], hh] (tokens t >= T: zeros)."""
    acc = tl.zeros([BT, BH], dtype=tl.float32)
    for j in tl.static_range(4):
        r = tl.load(rows + t * 8 + first + j, mask=t < T, other=0)
        wj = tl.load(w + t * 8 + first + j, mask=t < T, other=0.0)
        acc += wj[:, None] * tl.load(src + r[:, None].to(tl.int64) * H + hh[None, :]).to(tl.float32)
    return acc


def main():
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    td.init(backend="cuda", heap_size=1 << 30)
    g = torch.Generator(device="cuda").manual_seed(td.rank())
    x = torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16)
    big = torch.randn(K * T, H, device="cuda", generator=g).to(torch.bfloat16)
    rows = torch.randperm(K * T, device="cuda", generator=g).to(torch.int32).view(T, K).contiguous()
    w = torch.rand(T, K, device="cuda", generator=g)
    y = torch.empty_like(x)
    dst = shmem.empty((T, H), torch.bfloat16, name="ceiling.dst")
    flags = shmem.signals((T // BT,), name="ceiling.flags")
    recv = shmem.empty((T, H), torch.bfloat16, name="ceiling.recv")
    skeleton_flags = shmem.signals((T // BT,), name="ceiling.skeleton_flags")
    skeleton_state = shmem.counters(2, name="ceiling.skeleton_state")
    partials = shmem.empty((T, H), torch.bfloat16, name="ceiling.partials")
    shmem.barrier()
    ctx = shmem.context()

    # correctness first: each kernel against torch
    scatter_kernel[(128,)](x, big, rows, T, H, K=K, BT=BT, BH=BH, num_warps=8)
    gather_kernel[(128,)](big, y, rows, w, T, H, K=K, BT=BT, BH=BH, num_warps=16)
    push_kernel[(128,)](x, dst, T, H, ctx, BT=BT, BH=BH, num_warps=8)
    shmem.barrier()
    big2 = torch.zeros_like(big)
    sender_kernel[(64,)](x, dst, big2, rows, flags, T, H, ctx, LOCAL=4, BT=BT, BH=BH, PREFETCH=True, SIGNAL=True,
                         num_warps=8)
    shmem.barrier()
    ok_sender = torch.equal(big2[rows[:, :4].long()], x[:, None, :].expand(T, 4, H))
    big2.zero_()
    roles_kernel[(192,)](x, dst, big2, rows, T, H, 64, ctx, LOCAL=4, BT=BT, BH=BH, num_warps=4)
    shmem.barrier()
    ok_sender &= torch.equal(big2[rows[:, :4].long()], x[:, None, :].expand(T, 4, H))
    big2.zero_()
    dispatch_skeleton_kernel[(192,)](x, recv, big2, rows, skeleton_flags, skeleton_state, T, H, 64, 64, ctx, BT=BT,
                                     BH=BH, SENDERS_WRITE_LOCAL=False, num_warps=4)
    shmem.barrier()
    every = [torch.empty_like(x) for _ in range(td.world_size())]
    dist.all_gather(every, x)
    peer_x = every[(td.rank() - 1) % td.world_size()]
    ok_sender &= torch.equal(big2[rows[:, :4].long()], x[:, None, :].expand(T, 4, H)) and \
        torch.equal(big2[rows[:, 4:7].long()], peer_x[:, None, :].expand(T, 3, H)) and torch.equal(recv, peer_x)
    ref = (w[:, :, None] * x.float()[:, None, :]).sum(1)  # big's rows of token t all hold x[t]
    ok = torch.equal(big[rows.long()], x[:, None, :].expand(T, K, H)) and \
        torch.allclose(y.float(), ref, rtol=2e-2, atol=2e-2)
    ok &= torch.equal(dst, peer_x) and ok_sender
    combine_skeleton_kernel[(128,)](big, w, y, partials, rows, skeleton_flags, skeleton_state, T, H, 52, ctx, BT=BT,
                                    BH=BH, num_warps=16)
    shmem.barrier()
    sent = (w[:, :4, None] * big[rows[:, :4].long()].float()).sum(1).to(torch.bfloat16)  # what this rank pushed
    every_sent = [torch.empty_like(sent) for _ in range(td.world_size())]
    dist.all_gather(every_sent, sent)
    own = (w[:, 4:, None] * big[rows[:, 4:].long()].float()).sum(1)
    y_ref = own + every_sent[(td.rank() - 1) % td.world_size()].float()
    ok &= torch.allclose(y.float(), y_ref, rtol=2e-2, atol=2e-2)
    assert ok, f"rank {td.rank()}: a ceiling kernel moved the wrong bytes"

    row_bytes = H * 2
    cases = [("scatter (dispatch's HBM writes)", 128, 8, T * row_bytes + K * T * row_bytes,
              lambda: scatter_kernel[(128,)](x, big, rows, T, H, K=K, BT=BT, BH=BH, num_warps=8)),
             ("gather (combine's expert-row reads)", 128, 16, K * T * row_bytes + T * row_bytes,
              lambda: gather_kernel[(128,)](big, y, rows, w, T, H, K=K, BT=BT, BH=BH, num_warps=16))]
    for n in (16, 32, 64, 128):
        cases.append((f"push to the peer, {n} programs", n, 8, T * row_bytes,
                      lambda n=n: push_kernel[(n,)](x, dst, T, H, ctx, BT=BT, BH=BH, num_warps=8)))
    for local, pre, sig in ((0, False, False), (4, False, False), (4, True, False), (4, False, True),
                            (4, True, True)):
        name = f"sender: push + {local} local rows{', prefetch' if pre else ''}{', signal per chunk' if sig else ''}"
        cases.append((name, 64, 8, T * row_bytes * (2 + local),
                      lambda local=local, pre=pre, sig=sig: sender_kernel[(64,)](
                          x, dst, big2, rows, flags, T, H, ctx, LOCAL=local, BT=BT, BH=BH, PREFETCH=pre, SIGNAL=sig,
                          num_warps=8)))
    for n, warps in ((128, 4), (256, 4)):
        cases.append((f"sender: push + 4 local rows, {n} programs", n, warps, T * row_bytes * 6,
                      lambda n=n, warps=warps: sender_kernel[(n,)](
                          x, dst, big2, rows, flags, T, H, ctx, LOCAL=4, BT=BT, BH=BH, PREFETCH=False, SIGNAL=False,
                          num_warps=warps)))
    for n, push, warps in ((128, 32, 8), (128, 64, 8), (192, 64, 4), (256, 64, 4), (256, 128, 4)):
        cases.append((f"roles: {push} push, {n - push} write the 4 local rows", n, warps, T * row_bytes * 7,
                      lambda n=n, push=push, warps=warps: roles_kernel[(n,)](
                          x, dst, big2, rows, T, H, push, ctx, LOCAL=4, BT=BT, BH=BH, num_warps=warps)))
    # (programs, pushers, local-row writers (0: the pushers write them), warps)
    for n, push, local, warps in ((128, 64, 0, 8), (132, 66, 0, 8), (128, 52, 0, 8), (256, 128, 0, 4),
                                  (128, 48, 40, 8), (256, 64, 96, 4), (256, 48, 112, 4), (256, 64, 128, 4)):
        roles = f"{push} push + write local rows" if not local else f"{push} push, {local} write local rows"
        cases.append((f"skeleton: {roles}, {n - push - local} receive", n, warps, T * row_bytes * 10,
                      lambda n=n, push=push, local=local, warps=warps: dispatch_skeleton_kernel[(n,)](
                          x, recv, big2, rows, skeleton_flags, skeleton_state, T, H, push, local, ctx, BT=BT, BH=BH,
                          SENDERS_WRITE_LOCAL=local == 0, num_warps=warps)))
    for n, push, warps in ((128, 52, 16), (128, 64, 16), (132, 52, 16), (256, 104, 8)):
        cases.append((f"combine skeleton: {push} senders of {n}", n, warps, T * row_bytes * 11,
                      lambda n=n, push=push, warps=warps: combine_skeleton_kernel[(n,)](
                          big, w, y, partials, rows, skeleton_flags, skeleton_state, T, H, push, ctx, BT=BT, BH=BH,
                          num_warps=warps)))
    out = []
    for name, n, warps, nbytes, fn in cases:
        t = torch.tensor([graph_us(fn, calls=20)], device="cuda")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        us = float(t.item())
        out.append({"kernel": name, "programs": n, "warps": warps, "MB": nbytes / 1e6, "us/call": us,
                    "GB/s": nbytes / us / 1e3, "correct": ok})
    record("moe_ceilings", out, notes=(
        f"T={T} rows of H={H} bf16 per rank, tiles {BT}x{BH}; per call from a graph of 20, max over 2 ranks. "
        "MB = bytes read + written (scatter, gather, sender: x read, the pushed rows, local rows written; skeleton: "
        "every HBM byte of one rank) or sent to the peer (push)."))
    td.finalize()


if __name__ == "__main__":
    main()
