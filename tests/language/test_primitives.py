"""Every dl primitive across ranks: put/get with masks, signal/wait (set/add, every comparison, blocks), fence,
barrier, epochs over 100 calls, and a wait that times out instead of hanging."""

import pytest
import torch
import triton
import triton.language as tl

import triton_dist as td
import triton_dist.language as dl

from ..conftest import ON_GPU_RANKS, gpu_only

WORLDS = [2, 4]


def _dtype(name):
    return getattr(torch, name)


def _device():
    return td.shmem.device()


@triton.jit
def _put_ring_kernel(src, dst, n, ctx, BLOCK: tl.constexpr):
    """Every rank writes its row into row `me` of every peer's dst, masked to n columns."""
    me = dl.rank(ctx)
    for peer in range(dl.num_ranks(ctx)):
        for start in range(0, n, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            m = offs < n
            dl.put(dst + me * n + offs, tl.load(src + offs, mask=m), peer, ctx, mask=m)


@triton.jit
def _get_all_kernel(src, dst, n, ctx, BLOCK: tl.constexpr):
    """Every rank reads every peer's src row into its own dst[peer]."""
    for peer in range(dl.num_ranks(ctx)):
        for start in range(0, n, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            m = offs < n
            tl.store(dst + peer * n + offs, dl.get(src + offs, peer, ctx, mask=m, other=0), mask=m)


def _check_put_get(n, dtype_name):
    dtype = _dtype(dtype_name)
    w, r = td.world_size(), td.rank()
    gen = torch.Generator().manual_seed(1234 + r)
    mine = (torch.randn(n, generator=gen) * 100).to(dtype).to(_device())
    src = td.shmem.empty((n,), dtype, name="src")
    src.copy_(mine)
    dst = td.shmem.empty((w, n), dtype, name="dst")
    dst.fill_(-7)  # poison
    pad = td.shmem.empty((w, n + 5), dtype, name="pad")
    pad.fill_(-3)
    td.shmem.barrier()
    _put_ring_kernel[(1,)](src, dst, n, td.shmem.context(), BLOCK=64)
    td.shmem.barrier()
    expected = torch.stack([(torch.randn(n, generator=torch.Generator().manual_seed(1234 + q)) * 100).to(dtype)
                            for q in range(w)])
    assert torch.equal(dst.cpu(), expected), "put"
    got = td.shmem.empty((w, n), dtype, name="got")
    got.fill_(-9)
    _get_all_kernel[(1,)](src, got, n, td.shmem.context(), BLOCK=64)
    assert torch.equal(got.cpu(), expected), "get"
    td.shmem.barrier()
    return True


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("n,dtype", [(37, "float32"), (200, "float16"), (1, "int32"), (129, "bfloat16")])
def test_put_get_masked(ranks, world, n, dtype):
    assert ranks(world, _check_put_get, n, dtype) == [True] * world


def test_put_get_8_ranks(ranks):
    assert ranks(8, _check_put_get, 19, "float16") == [True] * 8


@triton.jit
def _signal_kernel(flags, value, ctx, OP: tl.constexpr):
    me = dl.rank(ctx)
    for peer in range(dl.num_ranks(ctx)):
        dl.signal(flags + me, value, peer, ctx, op=OP)


@triton.jit
def _wait_block_kernel(flags, out, value, n, ctx, CMP: tl.constexpr, BLOCK: tl.constexpr):
    idx = tl.arange(0, BLOCK)
    seen = dl.wait(flags + idx, value, ctx, cmp=CMP, mask=idx < n)
    tl.store(out + idx, seen, mask=idx < n)


@triton.jit
def _wait_scalar_kernel(flag, out, value, ctx, CMP: tl.constexpr):
    tl.store(out, dl.wait(flag, value, ctx, cmp=CMP))


def _check_signal_wait():
    w = td.world_size()
    flags = td.shmem.zeros((w,), torch.int32, name="flags")
    out = torch.full((w,), -1, dtype=torch.int32, device=_device())
    ctx = td.shmem.context()
    td.shmem.barrier()
    _signal_kernel[(1,)](flags, 5, ctx, OP="set")
    _wait_block_kernel[(1,)](flags, out, 5, w, ctx, CMP="eq", BLOCK=8)
    assert out.tolist() == [5] * w
    td.shmem.barrier()  # nobody adds below before everyone has seen the 5s
    _signal_kernel[(1,)](flags, 3, ctx, OP="add")
    _wait_block_kernel[(1,)](flags, out, 8, w, ctx, CMP="ge", BLOCK=8)
    assert out.tolist() == [8] * w
    _wait_block_kernel[(1,)](flags, out, 7, w, ctx, CMP="gt", BLOCK=8)
    _wait_block_kernel[(1,)](flags, out, 0, w, ctx, CMP="ne", BLOCK=8)
    one = torch.full((1,), -1, dtype=torch.int32, device=_device())
    _wait_scalar_kernel[(1,)](flags[w - 1:], one, 8, ctx, CMP="eq")
    assert one.item() == 8
    td.shmem.barrier()
    # wrap-around: a counter just past 2**31 still counts as "after" one just before it
    flags.fill_(-(2**31))
    _wait_scalar_kernel[(1,)](flags, one, 2**31 - 1, ctx, CMP="gt")
    assert one.item() == -(2**31)
    td.shmem.barrier()
    return True


@pytest.mark.parametrize("world", WORLDS + [8])
def test_signal_wait(ranks, world):
    assert all(ranks(world, _check_signal_wait))


def _check_wait_timeout():
    w, r = td.world_size(), td.rank()
    flags = td.shmem.zeros((3, w), torch.int32, name="never_signalled")
    out = torch.zeros(1, dtype=torch.int32, device=_device())
    td.shmem.set_wait_timeout(0.02)
    message = None
    try:
        if r == 1:
            _wait_scalar_kernel[(1,)](flags[2:, 1:], out, 4, td.shmem.context(), CMP="ge")
            try:
                td.shmem.check_errors()
            except td.shmem.WaitTimeoutError as exc:
                message = str(exc)
            td.shmem.clear_errors()
            td.shmem.check_errors()  # cleared
    finally:
        td.shmem.set_wait_timeout(60)
    td.shmem.barrier()
    return message


@pytest.mark.parametrize("world", WORLDS)
def test_wait_times_out_with_a_named_error(ranks, world):
    messages = ranks(world, _check_wait_timeout)
    msg = messages[1]
    assert msg is not None
    assert "rank 1" in msg and "never_signalled" in msg and "(2, 1)" in msg and ">= 4" in msg and "last saw 0" in msg


def _check_block_timeout_names_first_missing():
    w = td.world_size()
    flags = td.shmem.zeros((8,), torch.int32, name="partly")
    flags[:3] = 1
    out = torch.zeros(8, dtype=torch.int32, device=_device())
    td.shmem.set_wait_timeout(0.02)
    _wait_block_kernel[(1,)](flags, out, 1, 6, td.shmem.context(), CMP="ge", BLOCK=8)
    td.shmem.set_wait_timeout(60)
    try:
        td.shmem.check_errors()
    except td.shmem.WaitTimeoutError as exc:
        msg = str(exc)
    else:
        msg = None
    td.shmem.clear_errors()
    del w
    return msg


@pytest.mark.parametrize("world", [2])
def test_block_wait_timeout_names_first_missing_flag(ranks, world):
    for msg in ranks(world, _check_block_timeout_names_first_missing):
        assert msg is not None and "element (3,) of symmetric tensor 'partly'" in msg


@triton.jit
def _barrier_exchange_kernel(buf, iters, ctx):
    """Each round: write round number into every peer's slot, barrier, check all slots, barrier."""
    me = dl.rank(ctx)
    world = dl.num_ranks(ctx)
    bad = 0
    for i in range(1, iters + 1):
        for peer in range(world):
            dl.put(buf + me, i, peer, ctx)
        dl.barrier_all(ctx)
        for q in range(world):
            bad += (tl.load(buf + q, volatile=True) != i).to(tl.int32)
        dl.barrier_all(ctx)
    tl.store(buf + world, bad)


def _check_barrier(iters):
    w = td.world_size()
    buf = td.shmem.zeros((w + 1,), torch.int32, name="barrier_buf")
    td.shmem.barrier()
    _barrier_exchange_kernel[(1,)](buf, iters, td.shmem.context())
    td.shmem.barrier()
    return int(buf[w])


@pytest.mark.parametrize("world", WORLDS + [8])
def test_barrier_orders_puts_repeatedly(ranks, world):
    assert ranks(world, _check_barrier, 20 if world < 8 else 5) == [0] * world


@triton.jit
def _fence_publish_kernel(data, flag, ctx):
    """Rank 0 puts data then a fence then a relaxed flag store to rank 1; rank 1 waits and reads."""
    me = dl.rank(ctx)
    if me == 0:
        dl.put(data, 42, 1, ctx)
        dl.fence(ctx)
        dl.signal(flag, 1, 1, ctx)
    if me == 1:
        dl.wait(flag, 1, ctx)
        tl.store(data + 1, tl.load(data, volatile=True))


def _check_fence():
    data = td.shmem.zeros((2,), torch.int32, name="fence_data")
    flag = td.shmem.zeros((1,), torch.int32, name="fence_flag")
    td.shmem.barrier()
    _fence_publish_kernel[(1,)](data, flag, td.shmem.context())
    td.shmem.barrier()
    return data.tolist()


@pytest.mark.parametrize("world", [2])
def test_fence(ranks, world):
    assert ranks(world, _check_fence)[1] == [42, 42]


@triton.jit
def _epoch_kernel(state, log, ctx):
    epoch = dl.call_epoch(state)
    tl.atomic_add(log + tl.program_id(0), epoch)
    dl.finish_call(state, epoch, tl.num_programs(0))


def _check_epochs(calls):
    state = torch.zeros(2, dtype=torch.int32, device=_device())
    log = torch.zeros(3, dtype=torch.int32, device=_device())
    for _ in range(calls):
        _epoch_kernel[(3,)](state, log, td.shmem.context())
    return state.tolist(), log.tolist()


@pytest.mark.parametrize("world", [2])
def test_epochs_advance_once_per_call(ranks, world):
    state, log = ranks(world, _check_epochs, 100)[0]
    assert state == [100, 0]
    assert log == [100 * 101 // 2] * 3


@triton.jit
def _rank_kernel(out, ctx):
    tl.store(out, dl.rank(ctx))
    tl.store(out + 1, dl.num_ranks(ctx))


def _check_rank():
    out = torch.zeros(2, dtype=torch.int32, device=_device())
    _rank_kernel[(1,)](out, td.shmem.context())
    return out.tolist()


@pytest.mark.parametrize("world", WORLDS + [8])
def test_rank_and_num_ranks(ranks, world):
    assert ranks(world, _check_rank) == [[r, world] for r in range(world)]


@triton.jit
def _launch_control_kernel(out, ON: tl.constexpr):
    dl.launch_dependents(ON)
    dl.wait_prior_kernel(ON)
    tl.store(out, 1)
    dl.bulk_stores_done(ON)


def test_launch_control_primitives_are_no_ops_when_off():
    """launch_dependents / wait_prior_kernel / bulk_stores_done with ON=False: nothing (the interpreter runs no
    inline assembly, and the kernels pass ON=False there); the kernel around them still runs."""
    out = torch.zeros(1, dtype=torch.int32, device="cuda" if ON_GPU_RANKS else "cpu")
    _launch_control_kernel[(1,)](out, ON=False)
    assert int(out[0]) == 1


_SM90_CASES = {
    "_put_ring_kernel": (dict(src="*fp32", dst="*fp32", n="i32", ctx="*i64", BLOCK="constexpr"), {"BLOCK": 64}),
    "_get_all_kernel": (dict(src="*fp16", dst="*fp16", n="i32", ctx="*i64", BLOCK="constexpr"), {"BLOCK": 64}),
    "_signal_kernel": (dict(flags="*i32", value="i32", ctx="*i64", OP="constexpr"), {"OP": "add"}),
    # value == 1 arrives as a compile-time constant (Triton specialises it): the timeout record must cope
    "_wait_block_kernel": (dict(flags="*i32", out="*i32", value="constexpr", n="i32", ctx="*i64", CMP="constexpr",
                                BLOCK="constexpr"), {"value": 1, "CMP": "ge", "BLOCK": 8}),
    "_wait_scalar_kernel": (dict(flag="*i32", out="*i32", value="i32", ctx="*i64", CMP="constexpr"), {"CMP": "gt"}),
    "_barrier_exchange_kernel": (dict(buf="*i32", iters="i32", ctx="*i64"), {}),
    "_fence_publish_kernel": (dict(data="*i32", flag="*i32", ctx="*i64"), {}),
    "_epoch_kernel": (dict(state="*i32", log="*i32", ctx="*i64"), {}),
    "_launch_control_kernel": (dict(out="*i32", ON="constexpr"), {"ON": True}),
}


@pytest.mark.parametrize("kernel", sorted(_SM90_CASES))
def test_primitives_compile_for_sm90(kernel):
    from ..sm90 import compile_sm90

    signature, constexprs = _SM90_CASES[kernel]
    ops = compile_sm90("tests.language.test_primitives", kernel, signature, constexprs)["ops"]
    if "wait" in kernel or "barrier" in kernel or "fence" in kernel:
        assert any("acquire" in op for op in ops), ops
    if kernel == "_launch_control_kernel":  # programmatic dependent launch and the bulk-store wait, emitted
        assert {"griddepcontrol.launch_dependents", "griddepcontrol.wait", "cp.async.bulk.wait_group"} <= set(ops), ops


# The same checks on GPU ranks: one per GPU, or several sharing a GPU where the machine has fewer (the shared-gpu
# backend, under MPS): real memory ordering between processes, which the interpreter cannot show.
@gpu_only
@pytest.mark.parametrize("world", WORLDS + [8])
def test_gpu_primitives(ranks, world):
    assert ranks(world, _check_rank) == [[r, world] for r in range(world)]
    assert ranks(world, _check_put_get, 129, "bfloat16") == [True] * world
    assert all(ranks(world, _check_signal_wait))
    assert ranks(world, _check_barrier, 200) == [0] * world


@gpu_only
@pytest.mark.parametrize("world", WORLDS)
def test_gpu_wait_times_out_with_a_named_error(ranks, world):
    test_wait_times_out_with_a_named_error(ranks, world)
