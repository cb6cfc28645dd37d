"""Misuse never corrupts: what differs between ranks, and indices the host never looks at.

* A call made differently on one rank (another shape) raises on every rank in check mode (on in the tests):
  CollectiveMismatchError naming the ranks, at once. Without check mode the call still ends on every rank within
  the wait timeout (an allocation agreement or a wait gives up). Either way, after ``td.shmem.reset()`` the good
  calls of the op are correct (20 after the checked mismatch, 5 after the unchecked one).
* Page ids, sequence lengths and expert ids outside their tensors are refused on the device (no memory outside
  the tensors is touched) and raise DeviceIndexError naming the op, the tensor and the first bad index.
* Zero-row shards and zero-token ranks work in every op.
* A 400-call soak with random per-rank delays and shapes changing every 50 calls.
"""

import random
import time

import pytest
import torch
import torch.distributed as dist

import triton_dist as td
from triton_dist.kernels import ag_gemm, all_gather, ep_combine, ep_dispatch, gemm_rs, local_flash_decode, \
    sp_flash_decode

from ..conftest import collective_outcome, cpu_only

TIMEOUT_S = 1.5


def _gathered(x):
    parts = [torch.empty_like(x) for _ in range(td.world_size())]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts)


def _good_call(op, seed):
    """One correct call of ``op`` with fresh inputs (the same shapes on every rank); True if it matched."""
    gen = torch.Generator().manual_seed(seed * 100 + td.rank())
    dev = td.shmem.device()
    if op == "all_gather":
        x = torch.randn(3, 4, generator=gen)
        return torch.equal(all_gather(x.to(dev)).cpu(), _gathered(x))
    if op == "ag_gemm":
        a, w = torch.randn(4, 16, generator=gen), torch.randn(16, 16, generator=gen)
        ref = _gathered(a).double() @ w.double().T
        return torch.allclose(ag_gemm(a.to(dev), w.to(dev)).double().cpu(), ref, atol=1e-4)
    if op == "gemm_rs":
        a, w = torch.randn(10, 8, generator=gen), torch.randn(16, 8, generator=gen)
        total = _gathered((a.double() @ w.double().T)[None]).sum(0)
        ref = torch.tensor_split(total, td.world_size())[td.rank()]
        return torch.allclose(gemm_rs(a.to(dev), w.to(dev)).double().cpu(), ref, atol=1e-4)
    if op == "ep_dispatch":
        E, T = 2 * td.world_size(), 5
        idx = torch.stack([torch.randperm(E, generator=gen)[:2] for _ in range(T)])
        wts, x = torch.rand(T, 2, generator=gen), torch.randn(T, 16, generator=gen)
        res = ep_dispatch(x.to(dev), idx.to(dev), wts.to(dev), num_experts=E, max_tokens=8)
        y = ep_combine(res.x, res.handle)
        return torch.allclose(y.double().cpu(), wts.double().sum(1, keepdim=True) * x.double(), atol=1e-5)
    if op == "sp_flash_decode":
        q = _gathered(torch.randn(2, 4, 16, generator=gen)[None])[0]
        k, v = torch.randn(2, 8, 2, 16, generator=gen), torch.randn(2, 8, 2, 16, generator=gen)
        lens = torch.tensor([8, 3], dtype=torch.int32)
        out = sp_flash_decode(q.to(dev), k.to(dev), v.to(dev), lens.to(dev))
        ks, vs = _gathered(k[None]), _gathered(v[None])
        ref = torch.empty(2, 4, 16, dtype=torch.float64)
        for b, n in enumerate(lens.tolist()):
            kb = ks[:, b, :n].reshape(-1, 2, 16).double().repeat_interleave(2, 1)
            vb = vs[:, b, :n].reshape(-1, 2, 16).double().repeat_interleave(2, 1)
            p = torch.softmax(torch.einsum("hd,thd->ht", q[b].double(), kb) / 4.0, dim=-1)
            ref[b] = torch.einsum("ht,thd->hd", p, vb)
        return torch.allclose(out.double().cpu(), ref, atol=1e-5)
    raise ValueError(op)


def _mismatched_call(op):
    """``op`` with a shape that differs on the last rank (the reported misuse cases)."""
    dev = td.shmem.device()
    odd = td.rank() == td.world_size() - 1
    if op == "all_gather":
        all_gather(torch.ones(4 if odd else 3, 4, device=dev))
    elif op == "ag_gemm":
        ag_gemm(torch.ones(5 if odd else 4, 16, device=dev), torch.ones(16, 16, device=dev))
    elif op == "gemm_rs":
        gemm_rs(torch.ones(11 if odd else 10, 8, device=dev), torch.ones(16, 8, device=dev))
    elif op == "ep_dispatch":
        E = 2 * td.world_size()
        ep_dispatch(torch.ones(5, 16, device=dev), torch.zeros(5, 2, dtype=torch.int64, device=dev),
                    torch.ones(5, 2, device=dev), num_experts=E, max_tokens=9 if odd else 8)
    elif op == "sp_flash_decode":
        b = 3 if odd else 2
        sp_flash_decode(torch.ones(b, 4, 16, device=dev), torch.ones(b, 8, 2, 16, device=dev),
                        torch.ones(b, 8, 2, 16, device=dev), torch.full((b,), 8, dtype=torch.int32, device=dev))


OPS = ["all_gather", "ag_gemm", "gemm_rs", "ep_dispatch", "sp_flash_decode"]


def _mismatch_then_recover(op, check_calls, warm, good_calls):
    """Per rank: (the error's type, its message, seconds to it), and whether ``good_calls`` good calls after
    reset() were correct. ``warm``: the op ran with the good shapes first (its workspaces exist)."""
    td.shmem.check_calls(check_calls)
    if warm:
        _good_call(op, 0)
    td.shmem.set_wait_timeout(TIMEOUT_S)  # short for the mismatched call only (a loaded machine is slow)
    error = collective_outcome(lambda: _mismatched_call(op))
    td.shmem.set_wait_timeout(60)  # (the good calls must not time out while a slow peer catches up)
    td.shmem.reset()
    td.shmem.check_calls(True)
    good = all(_good_call(op, 1 + i) for i in range(good_calls))
    return error, good


@cpu_only
@pytest.mark.parametrize("op", OPS)
def test_a_mismatched_call_raises_on_every_rank_then_reset_recovers(ranks, op):
    for check_calls, warm, good_calls in ((True, True, 20), (False, False, 5)):
        for rank, ((kind, msg, seconds), good) in enumerate(ranks(3, _mismatch_then_recover, op, check_calls,
                                                                  warm, good_calls)):
            assert seconds < TIMEOUT_S + 2, (op, check_calls, rank, seconds, msg)
            if check_calls:
                assert kind == "CollectiveMismatchError" and "rank 2" in msg, (op, rank, kind, msg)
            else:
                assert kind in (None, "CollectiveMismatchError", "WaitTimeoutError"), (op, rank, kind, msg)
            assert good, (op, check_calls, rank)


def _bad_indices():
    """Each kind of bad index on this rank's own inputs (every rank alike): the error raised, then a good call."""
    dev = td.shmem.device()
    k = torch.randn(4, 4, 2, 16, device=dev)  # 4 pages of 4 tokens
    q = torch.randn(2, 4, 16, device=dev)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=dev)
    lens = torch.tensor([8, 5], dtype=torch.int32, device=dev)
    cases = {"page id -1": (table.clone().index_fill_(1, torch.tensor([1], device=dev), -1), lens),
             "page id >= num_pages": (table + 2, lens),
             "page id 10**7": (torch.full_like(table, 10**7), lens),
             "negative kv_lens": (table, torch.tensor([-1, 5], dtype=torch.int32, device=dev)),
             "kv_lens above capacity": (table, torch.tensor([8, 9], dtype=torch.int32, device=dev))}
    messages = {}
    for name, (t, n) in cases.items():
        for op in ("sp", "local"):
            try:
                if op == "sp":
                    out = sp_flash_decode(q, k, k, n, block_table=t)
                else:
                    out, _ = local_flash_decode(q, k, k, n, block_table=t)
                td.shmem.check_errors()
                messages[f"{op} {name}"] = "no error"
            except td.shmem.DeviceIndexError as exc:
                messages[f"{op} {name}"] = str(exc)
                assert torch.isfinite(out).all()  # masked: nothing read outside the cache
            td.shmem.clear_errors()
    E = 2 * td.world_size()
    idx = torch.tensor([[0, 1], [99, 2], [-5, 3]], device=dev)
    try:
        ep_dispatch(torch.ones(3, 16, device=dev), idx, torch.ones(3, 2, device=dev), num_experts=E, max_tokens=4,
                    check_ids=False)
        td.shmem.check_errors()
        messages["expert id 99"] = "no error"
    except td.shmem.DeviceIndexError as exc:
        messages["expert id 99"] = str(exc)
    td.shmem.clear_errors()
    return messages, _good_call("sp_flash_decode", 7)


@cpu_only
def test_bad_indices_are_refused_on_the_device(ranks):
    for messages, good_after in ranks(3, _bad_indices):
        for name, msg in messages.items():
            assert "outside [0," in msg, (name, msg)
        assert "block_table" in messages["sp page id 10**7"] and "10000000" in messages["sp page id 10**7"]
        assert "kv_lens" in messages["local negative kv_lens"] and "-1" in messages["local negative kv_lens"]
        assert "ep_dispatch" in messages["expert id 99"] and "99" in messages["expert id 99"]
        assert good_after


def _zero_rows():
    dev = td.shmem.device()
    w, r = td.world_size(), td.rank()
    ok = all_gather(torch.ones(0, 4, device=dev)).shape == (0, 4)
    ok &= ag_gemm(torch.ones(0, 16, device=dev), torch.ones(8, 16, device=dev)).shape == (0, 8)
    ok &= bool((gemm_rs(torch.ones(0, 8, device=dev), torch.ones(16, 8, device=dev)) == 0).all())
    a = torch.ones(w - 1, 8, device=dev)  # fewer rows than ranks: the last rank gets none
    out = gemm_rs(a, torch.ones(16, 8, device=dev))
    ok &= out.shape == ((1 if r < w - 1 else 0), 16) and bool((out == 8 * w).all())
    E = 2 * w
    for T in (0, 3):  # no rank has tokens; only rank 0 has
        t = T if r == 0 else 0
        idx = torch.arange(2 * t, device=dev).view(t, 2) % E
        x = torch.randn(t, 16, device=dev)
        res = ep_dispatch(x, idx, torch.ones(t, 2, device=dev), num_experts=E, max_tokens=4)
        ok &= torch.allclose(ep_combine(res.x, res.handle), 2 * x)
    ok &= sp_flash_decode(torch.ones(0, 4, 16, device=dev), torch.ones(0, 8, 2, 16, device=dev),
                          torch.ones(0, 8, 2, 16, device=dev), torch.zeros(0, dtype=torch.int32, device=dev)).numel() == 0
    return ok


@cpu_only
def test_zero_rows_and_zero_tokens_in_every_op(ranks):
    assert ranks(3, _zero_rows) == [True] * 3


def _soak(calls):
    rng = random.Random(td.rank())
    shapes = random.Random(7)  # the same shape sequence on every rank
    dev = td.shmem.device()
    bad = []
    for i in range(calls):
        if i % 50 == 0:
            rows, cols = shapes.randint(0, 6), shapes.randint(1, 9)
            out = td.shmem.empty((td.world_size() * rows, cols), torch.float32, name=f"soak{i}")
        time.sleep(rng.random() * 0.003)  # ranks arrive in a different order every call
        x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(i * 10 + td.rank()))
        if not torch.equal(all_gather(x.to(dev), out=out).cpu(), _gathered(x)):
            bad.append(i)
        if i % 100 == 99 and not _good_call("gemm_rs", i):
            bad.append(f"gemm_rs {i}")
    return bad


@cpu_only
def test_soak_with_random_delays_and_changing_shapes(ranks):
    assert ranks(3, _soak, 400, timeout=900) == [[]] * 3
