"""Ping-pong: repeated signal/wait pairs between rank pairs keep exact counts across calls (no resets)."""

import pytest

import triton_dist as td
from triton_dist.kernels.pingpong import ping_pong

from ..sm90 import compile_sm90


def _bounce(calls, iters):
    values = []
    for it in iters[:calls]:
        flag = ping_pong(it)
        td.shmem.barrier()  # the partner may already be bouncing the next call's first value into our flag
        values.append(int(flag[0]))
        td.shmem.barrier()
    return values


@pytest.mark.parametrize("world", [2, 4])
def test_ping_pong_counts_accumulate_across_calls(ranks, world):
    iters = [7, 3, 5]  # shrinking counts must still never satisfy a wait early
    for values in ranks(world, _bounce, 3, iters):
        assert values == [7, 10, 15]


def test_ping_pong_rejects_zero_iterations(ranks):
    assert all(ranks(2, _reject_zero))


def _reject_zero():
    try:
        ping_pong(0)
    except ValueError:
        return True
    return False


def test_ping_pong_compiles_for_sm90():
    ops = compile_sm90("triton_dist.kernels.pingpong", "ping_pong_kernel",
                       dict(flag="*i32", count="*i32", iters="i32", ctx="*i64"))["ops"]
    assert any("release" in k for k in ops) and any("acquire" in k for k in ops), ops
