"""The symmetric heap: same offsets on every rank, any shape/dtype, peer views, reuse after free, clear errors for
exhaustion / non-symmetric tensors / no init, and nothing left in /dev/shm afterwards (also when a rank dies)."""

import glob
import os
import signal

import pytest
import torch
import torch.distributed as dist

import triton_dist as td
from triton_dist.launch import RankError, RankPool

from ..conftest import cpu_only, gpu_only


def _offsets(*tensors):
    base = td.shmem.peer_view(tensors[0], td.rank()).data_ptr() - tensors[0].data_ptr()
    assert base == 0
    heap0 = td.shmem.context()[4 + td.rank()].item()
    return [t.data_ptr() - heap0 for t in tensors]


def _check_symmetric_offsets():
    a = td.shmem.empty((3, 5), torch.float16)
    b = td.shmem.empty((7,), torch.int8)
    c = td.shmem.zeros((2, 3, 4), torch.bfloat16)
    d = td.shmem.empty((), torch.float64)
    e = td.shmem.empty((0, 4), torch.float32)
    mine = _offsets(a, b, c, d)
    everyone = [None] * td.world_size()
    dist.all_gather_object(everyone, mine)
    return (all(o == mine for o in everyone) and all(o % 256 == 0 for o in mine)
            and c.abs().sum().item() == 0 and d.shape == () and e.numel() == 0 and td.shmem.is_symmetric(a))


@pytest.mark.parametrize("world", [2, 4])
def test_same_offsets_on_every_rank(ranks, world):
    assert ranks(world, _check_symmetric_offsets) == [True] * world


def _check_peer_views():
    w, r = td.world_size(), td.rank()
    t = td.shmem.empty((w, 6), torch.float32, name="mailbox")
    t.fill_(-1)
    td.shmem.barrier()
    for p, view in enumerate(td.shmem.peer_views(t)):  # write my row into every peer's copy
        view[r].copy_(torch.arange(6, dtype=torch.float32, device=t.device) + 10 * r)
    td.shmem.barrier()
    expected = torch.stack([torch.arange(6, dtype=torch.float32) + 10 * q for q in range(w)])
    sliced = td.shmem.peer_view(t[1:, 2:5], (r + 1) % w)  # views of views keep their strides
    return torch.equal(t.cpu(), expected) and torch.equal(sliced.cpu(), expected[1:, 2:5])


@pytest.mark.parametrize("world", [2, 4])
def test_peer_views_read_and_write_peers(ranks, world):
    assert ranks(world, _check_peer_views) == [True] * world


def _check_reuse_and_exhaustion():
    import gc

    a = td.shmem.empty((1000,), torch.float32)
    first = a.data_ptr()
    view = a[10:]
    del a
    gc.collect()
    b = td.shmem.empty((1000,), torch.float32)
    kept_alive = b.data_ptr() != first  # a view still holds the block
    del view, b
    gc.collect()
    c = td.shmem.empty((1000,), torch.float32)
    reused = c.data_ptr() == first
    try:
        td.shmem.empty((1 << 40,), torch.uint8)
        exhausted = None
    except td.shmem.HeapExhaustedError as exc:
        exhausted = str(exc)
    return kept_alive, reused, exhausted


@pytest.mark.parametrize("world", [2])
def test_blocks_are_reused_only_when_every_view_is_gone(ranks, world):
    for kept_alive, reused, exhausted in ranks(world, _check_reuse_and_exhaustion):
        assert kept_alive and reused
        assert exhausted and "heap exhausted" in exhausted and "heap_size" in exhausted


def _check_errors_for_bad_tensors():
    msgs = []
    for bad in (torch.zeros(3, device=td.shmem.device()), "not a tensor"):
        try:
            td.shmem.check_symmetric(bad, "flags")
        except (TypeError, ValueError) as exc:
            msgs.append(f"{type(exc).__name__}: {exc}")
    for call in (lambda: td.shmem.empty((2,), "float32"), lambda: td.shmem.empty((-1, 2)),
                 lambda: td.shmem.peer_view(td.shmem.empty((2,)), 99)):
        try:
            call()
        except (TypeError, ValueError) as exc:
            msgs.append(type(exc).__name__)
    return msgs


@pytest.mark.parametrize("world", [2])
def test_clear_errors_for_bad_tensors(ranks, world):
    msgs = ranks(world, _check_errors_for_bad_tensors)[0]
    assert msgs[0].startswith("ValueError: flags is not a symmetric tensor")
    assert msgs[1].startswith("TypeError")
    assert msgs[2:] == ["TypeError", "ValueError", "ValueError"]


def _ops_reject_the_other_gpu():
    """Every op, handed a tensor on a GPU other than triton_dist's: ValueError naming the tensor (a kernel launched
    on this GPU would otherwise read another GPU's memory as its own)."""
    from triton_dist.kernels import ag_gemm, all_gather, ep_dispatch, gemm_rs, sp_flash_decode

    other = torch.device("cuda", (torch.cuda.current_device() + 1) % torch.cuda.device_count())
    here = td.shmem.device()
    x = torch.randn(8, 16, device=other, dtype=torch.bfloat16)
    w = torch.randn(8, 16, device=here, dtype=torch.bfloat16)
    idx = torch.zeros(8, 2, device=other, dtype=torch.int64)
    q = torch.randn(1, 4, 16, device=other, dtype=torch.bfloat16)
    kv = torch.randn(1, 32, 1, 16, device=here, dtype=torch.bfloat16)
    calls = [lambda: all_gather(x), lambda: ag_gemm(x, w), lambda: gemm_rs(x, w),
             lambda: ep_dispatch(x, idx, idx.float(), num_experts=4, max_tokens=8),
             lambda: sp_flash_decode(q, kv, kv, torch.full((1,), 32, device=here, dtype=torch.int32))]
    msgs = []
    for call in calls:
        try:
            call()
            msgs.append("accepted")
        except ValueError as exc:
            msgs.append(str(exc))
    td.shmem.check_device(w, "w")  # the right GPU passes
    return msgs


@gpu_only
def test_ops_reject_tensors_on_another_gpu(ranks):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two visible GPUs")
    for msgs in ranks(2, _ops_reject_the_other_gpu):
        # ag_gemm's operand check speaks first ("a is on cuda:1 but w is on cuda:0"); the rest name triton_dist's GPU
        assert all(m != "accepted" and " is on cuda:" in m for m in msgs), msgs
        assert sum("but triton_dist runs on cuda:" in m for m in msgs) == 4, msgs


@cpu_only
def test_not_initialised_is_a_clear_error():
    if td.shmem.is_initialized():
        pytest.skip("this process is a rank")
    with pytest.raises(td.shmem.NotInitializedError, match="triton_dist.init"):
        td.shmem.empty((2,))


def _files():
    return set(glob.glob("/dev/shm/triton_dist_*"))


def _pid():
    return os.getpid()


def _die():
    if td.rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return True


@cpu_only
def test_no_files_left_behind_even_when_a_rank_dies():
    before = _files()
    with RankPool(2) as pool:
        assert _files() == before  # unlinked as soon as every rank mapped them
        pool.run(_pid)
    assert _files() == before
    pool = RankPool(2)
    with pytest.raises(RankError, match="rank 1"):
        pool.run(_die, timeout=60)
    pool.close()
    assert _files() == before
