"""Signal latency: ranks 2i and 2i+1 bounce a counter ``iters`` times (``dl.signal`` -> ``dl.wait``).
One-way latency = elapsed / (2 * iters). Also a correctness test of repeated signal/wait pairs."""

import triton
import triton.language as tl

from .. import language as dl
from .. import shmem


@triton.jit
def ping_pong_kernel(flag, count, iters, ctx):
    me = dl.rank(ctx)
    peer = me ^ 1
    base = tl.load(count)  # the flag's value so far: counters keep growing across calls, no resets
    if peer < dl.num_ranks(ctx):
        for i in range(1, iters + 1):
            if me % 2 == 0:
                dl.signal(flag, base + i, peer, ctx)
                dl.wait(flag, base + i, ctx, cmp=dl.EQ)
            else:
                dl.wait(flag, base + i, ctx, cmp=dl.EQ)
                dl.signal(flag, base + i, peer, ctx)
    tl.store(count, base + iters)


class _Signals:
    def __init__(self, group):
        self.flag = shmem.signals((1,), name="ping_pong.flag", group=group)
        self.count = shmem.counters(1, name="ping_pong.count")


def ping_pong(iters=1000, group=None):
    """Run ``iters`` round trips between rank pairs (2i, 2i+1). Returns the flag: it holds the running total of
    iters once both partners finished the call (the partner may start the next call's bounces right after)."""
    if iters < 1:
        raise ValueError("iters must be >= 1")
    team = shmem.op_team("ping_pong", group, lambda: dict(iters=iters))
    ws = shmem.workspace("ping_pong", None, lambda: _Signals(group), group=group)
    shmem.raise_pending_errors()
    ping_pong_kernel[(1,)](ws.flag, ws.count, iters, team.ctx, num_warps=1)
    return ws.flag
