"""Every public op on the GPU in each dtype it takes (bfloat16, float16, float32), at the run's GPU count (one GPU:
groups of one), odd shapes, against fp64 references built from every rank's inputs (``torch.distributed``), fresh
random inputs, outputs poisoned where the op takes ``out``. The ops' own test files cover bf16 at many more shapes
and the tuned configurations; this file covers the dtypes (with the default configurations: no tuning) and that
each op refuses a dtype it does not take with a TypeError naming the ones it does."""

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import triton_dist as td
from triton_dist.kernels import (ag_gemm, all_gather, all_reduce, all_reduce_rmsnorm, ep_combine, ep_dispatch,
                                 gemm_ar, gemm_rs, grouped_gemm, local_flash_decode, sp_flash_decode)
from triton_dist.kernels.gemm import gemm

from ..conftest import gpu_only

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3, torch.float32: 1e-4}  # relative to the reference's max


def _gathered(t):
    parts = [torch.empty_like(t) for _ in range(td.world_size())]
    dist.all_gather(parts, t.contiguous())
    return parts


def _rel(got, ref):
    got, ref = got.double(), ref.double()
    if not torch.isfinite(got).all():
        return math.inf
    return ((got - ref).abs().max() / ref.abs().max().clamp(min=1e-30)).item()


def _every_op(dtype):
    """{op: relative error against fp64} for one dtype, on this rank."""
    import os

    os.environ["TRITON_DIST_AUTOTUNE"] = "0"  # default configurations (tuned ones: each op's own GPU tests)
    dev, rank, world = td.shmem.device(), td.rank(), td.world_size()
    g = torch.Generator(device=dev).manual_seed(17 + rank)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, device=dev, generator=g) * scale).to(dtype)

    errs = {}
    x = rand(5, 33)
    errs["all_gather"] = _rel(all_gather(x), torch.cat(_gathered(x)))

    a, w = rand(37, 96), rand(80, 96, scale=96 ** -0.5)  # w: the same on every rank (a weight shard)
    dist.broadcast(w, 0)
    full = torch.cat(_gathered(a)).double()
    errs["ag_gemm"] = _rel(ag_gemm(a, w), full @ w.double().T)
    wg = rand(2 * 48, 96, scale=96 ** -0.5)
    dist.broadcast(wg, 0)
    h = full @ wg.double().T
    errs["ag_gemm silu_gate"] = _rel(ag_gemm(a, wg, activation="silu_gate"), F.silu(h[:, :48]) * h[:, 48:])

    a, w = rand(70, 64), rand(48, 64, scale=64 ** -0.5)  # this rank's K shard of both
    total = sum(ai.double() @ wi.double().T for ai, wi in zip(_gathered(a), _gathered(w)))
    out = torch.full((torch.tensor_split(torch.empty(70), world)[rank].numel(), 48), float("nan"), dtype=dtype,
                     device=dev)
    errs["gemm_rs"] = _rel(gemm_rs(a, w, out=out), torch.tensor_split(total, world)[rank])
    errs["gemm"] = _rel(gemm(a, w, out=torch.full((70, 48), float("nan"), dtype=dtype, device=dev)),
                        a.double() @ w.double().T)

    a, w = rand(6, 128), rand(200, 128, scale=128 ** -0.5)
    errs["gemm_ar"] = _rel(gemm_ar(a, w), sum(ai.double() @ wi.double().T for ai, wi in zip(_gathered(a),
                                                                                             _gathered(w))))
    x = rand(3, 1000)
    errs["all_reduce"] = _rel(all_reduce(x, out=torch.full_like(x, float("nan"))),
                              sum(t.double() for t in _gathered(x)))
    x, res, wt = rand(7, 256), rand(7, 256), rand(256)
    new_res = (res.double() + sum(t.double() for t in _gathered(x))).to(dtype).double()
    normed, got_res = all_reduce_rmsnorm(x, res, wt, 1e-6)
    ref = new_res * torch.rsqrt(new_res.pow(2).mean(-1, keepdim=True) + 1e-6) * wt.double()
    errs["all_reduce_rmsnorm"] = max(_rel(normed, ref), _rel(got_res, new_res))

    # grouped_gemm: 5 experts, ragged groups (one empty), silu_gate
    counts = [9, 0, 17, 3, 11]
    offsets = torch.tensor([0] + torch.tensor(counts).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    xs, we = rand(sum(counts), 64), rand(5, 2 * 32, 64, scale=64 ** -0.5)
    got = grouped_gemm(xs, we, offsets, activation="silu_gate")
    ref = torch.zeros(sum(counts), 32, dtype=torch.float64, device=dev)
    for e in range(5):
        rows = slice(int(offsets[e]), int(offsets[e + 1]))
        he = xs[rows].double() @ we[e].double().T
        ref[rows] = F.silu(he[:, :32]) * he[:, 32:]
    errs["grouped_gemm silu_gate"] = _rel(got, ref)

    # ep_dispatch + ep_combine with identity experts: y = (sum of the token's weights) * x, at 600 tokens (chunked)
    T, H, E, K = 600, 96, 8 * world, 3
    xt = rand(T, H)
    idx = torch.rand(T, E, device=dev, generator=g).topk(K, dim=1).indices
    wts = torch.rand(T, K, device=dev, generator=g)
    recv = ep_dispatch(xt, idx, wts, num_experts=E, max_tokens=T)
    y = ep_combine(recv.x, recv.handle, out=torch.full_like(xt, float("nan")))
    errs["ep_dispatch+ep_combine"] = _rel(y, wts.double().sum(1, keepdim=True) * xt.double())

    # flash-decode: GQA 8 / 2 heads, D 64, ragged shards (one empty sequence on rank 0)
    B, HQ, HKV, D, S = 3, 8, 2, 64, 50
    q = rand(B, HQ, D)
    dist.broadcast(q, 0)
    k, v = rand(B, S, HKV, D), rand(B, S, HKV, D)
    lens = torch.tensor([S, 17, 0 if rank == 0 else 5], dtype=torch.int32, device=dev)
    ks, vs, ls = _gathered(k), _gathered(v), _gathered(lens)
    ref = torch.zeros(B, HQ, D, dtype=torch.float64, device=dev)
    for b in range(B):
        kb = torch.cat([ks[r][b, :int(ls[r][b])] for r in range(world)]).double().repeat_interleave(HQ // HKV, 1)
        vb = torch.cat([vs[r][b, :int(ls[r][b])] for r in range(world)]).double().repeat_interleave(HQ // HKV, 1)
        if kb.shape[0]:
            p = torch.softmax(torch.einsum("hd,thd->ht", q[b].double(), kb) / math.sqrt(D), dim=-1)
            ref[b] = torch.einsum("ht,thd->hd", p, vb)
    errs["sp_flash_decode"] = _rel(sp_flash_decode(q, k, v, lens), ref)
    o, _ = local_flash_decode(q, k, v, lens)
    own = torch.zeros_like(ref)
    for b in range(B):
        n = int(lens[b])
        if n:
            kb, vb = (t[b, :n].double().repeat_interleave(HQ // HKV, 1) for t in (k, v))
            own[b] = torch.einsum("ht,thd->hd", torch.softmax(torch.einsum("hd,thd->ht", q[b].double(), kb)
                                                              / math.sqrt(D), dim=-1), vb)
    errs["local_flash_decode"] = _rel(o, own)
    return errs


@gpu_only
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
def test_every_op_in_every_dtype_on_gpus(ranks, dtype):
    for errs in ranks(ranks.gpu_world, _every_op, dtype):
        bad = {op: err for op, err in errs.items() if not err < TOL[dtype]}
        assert not bad, bad


def _refusals():
    """What each op raises for float64 operands (a dtype none of them takes)."""
    dev = td.shmem.device()
    x = torch.randn(8, 32, device=dev, dtype=torch.float64)
    idx = torch.zeros(8, 2, dtype=torch.int64, device=dev)
    offsets = torch.tensor([0, 8], dtype=torch.int32, device=dev)
    q = torch.randn(1, 2, 64, device=dev, dtype=torch.float64)
    kv = torch.randn(1, 4, 2, 64, device=dev, dtype=torch.float64)
    lens = torch.ones(1, dtype=torch.int32, device=dev)
    calls = {
        "all_reduce": lambda: all_reduce(x), "ag_gemm": lambda: ag_gemm(x, x), "gemm_rs": lambda: gemm_rs(x, x),
        "gemm": lambda: gemm(x, x), "gemm_ar": lambda: gemm_ar(x, x),
        "all_reduce_rmsnorm": lambda: all_reduce_rmsnorm(x, x, x[0], 1e-6),
        "grouped_gemm": lambda: grouped_gemm(x, x[None], offsets),
        "ep_dispatch": lambda: ep_dispatch(x, idx, torch.ones(8, 2, device=dev), num_experts=2 * td.world_size(),
                                           max_tokens=8),
        "sp_flash_decode": lambda: sp_flash_decode(q, kv, kv, lens),
        "local_flash_decode": lambda: local_flash_decode(q, kv, kv, lens),
    }
    found = {}
    for name, call in calls.items():
        try:
            call()
            found[name] = "no error"
        except TypeError as exc:
            found[name] = "float16" in str(exc) or "float32" in str(exc) or "bfloat16" in str(exc)
        except Exception as exc:  # noqa: BLE001 - anything else is the finding
            found[name] = f"{type(exc).__name__}: {exc}"
    return found


@gpu_only
def test_ops_refuse_other_dtypes_naming_theirs(ranks):
    for found in ranks(ranks.gpu_world, _refusals):
        assert all(v is True for v in found.values()), found
