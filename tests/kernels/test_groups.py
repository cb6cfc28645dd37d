"""Every op of the zoo on groups of ranks and at any world size, against fp64 torch references.

* World sizes 1, 3, 5, 7: every op once (row splits and ring orders that are not powers of two).
* 4 ranks: tensor-parallel groups {0, 1} and {2, 3} run ag_gemm / gemm_rs while an expert-parallel group of all
  four runs dispatch / combine, interleaved call by call for 8 rounds (no op may share flags with another group).
* 6 ranks: groups of 3 and groups of 2 side by side; 8 ranks: two groups of 4.
Inputs are fresh every call and differ on every rank; small fp32 shapes (the interpreter runs them). On GPU ranks
(one per GPU, or several sharing one: the shared-gpu backend) the same checks run at worlds 3 and 4, within
TF32's error.
"""

import math

import pytest
import torch
import torch.distributed as dist

import triton_dist as td
from triton_dist.kernels import ag_gemm, all_gather, ep_combine, ep_dispatch, gemm_rs, sp_flash_decode

from ..conftest import cpu_only, gpu_only


def _gather(x, group):
    x = x.to(td.shmem.device()).contiguous()  # (NCCL groups take device tensors only)
    parts = [torch.empty_like(x) for _ in range(td.world_size(group))]
    dist.all_gather(parts, x, group=group)
    return [p.cpu() for p in parts]


def _rel(out, ref):
    return (out.double().cpu() - ref).abs().max().item() / max(ref.abs().max().item(), 1e-30)


def _tol():
    """fp32 products: exact enough under the interpreter; TF32 tensor cores on a GPU."""
    return 1e-5 if td.shmem.device().type == "cpu" else 5e-3


def _check_all_gather(group, gen, problems):
    x = torch.randn(3, 5, generator=gen)
    out = all_gather(x.to(td.shmem.device()), group=group)
    if not torch.equal(out.cpu(), torch.cat(_gather(x, group))):
        problems.append("all_gather")


def _check_ag_gemm(group, gen, problems):
    a, w = torch.randn(5, 16, generator=gen), torch.randn(24, 16, generator=gen)
    out = ag_gemm(a.to(td.shmem.device()), w.to(td.shmem.device()), group=group)
    ref = torch.cat(_gather(a, group)).double() @ w.double().T
    if not out.shape == ref.shape or _rel(out, ref) > _tol():
        problems.append(f"ag_gemm off by {_rel(out, ref) if out.shape == ref.shape else out.shape}")


def _check_gemm_rs(group, gen, problems, m=7):
    a, w = torch.randn(m, 8, generator=gen), torch.randn(16, 8, generator=gen)
    out = gemm_rs(a.to(td.shmem.device()), w.to(td.shmem.device()), group=group)
    total = torch.stack([p.double() for p in _gather(a.double() @ w.double().T, group)]).sum(0)
    rows = torch.tensor_split(total, td.world_size(group))[td.rank(group)]
    if out.shape != rows.shape or _rel(out, rows) > _tol():
        problems.append(f"gemm_rs off by {_rel(out, rows) if out.shape == rows.shape else out.shape}")


def _check_moe(group, gen, problems, T=3, H=16, K=2):
    w = td.world_size(group)
    E = 2 * w
    idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    weights = torch.rand(T, K, generator=gen)
    x = torch.randn(T, H, generator=gen)
    dev = td.shmem.device()
    res = ep_dispatch(x.to(dev), idx.to(dev), weights.to(dev), num_experts=E, max_tokens=T, group=group)
    first = td.rank(group) * (E // w)
    scale = (torch.arange(E, dtype=torch.float32) % 3 + 1)[first:first + E // w]  # expert e scales its rows
    out = res.x * scale.to(dev)[res.expert_ids.clamp(min=0).long()][:, None]
    y = ep_combine(out, res.handle)
    ref = (weights.double() * (torch.arange(E) % 3 + 1).double()[idx]).sum(1, keepdim=True) * x.double()
    if _rel(y, ref) > _tol():
        problems.append(f"ep_dispatch/combine off by {_rel(y, ref)}")


def _check_flash_decode(group, gen, problems, B=2, Hq=4, Hkv=2, D=16, S=16):
    dev = td.shmem.device()
    lens = torch.randint(0, S + 1, (B,), generator=gen)
    k, v = torch.randn(B, S, Hkv, D, generator=gen), torch.randn(B, S, Hkv, D, generator=gen)
    q = _gather(torch.randn(B, Hq, D, generator=gen), group)[0]  # the same query on every rank of the group
    out = sp_flash_decode(q.to(dev), k.to(dev), v.to(dev), lens.to(torch.int32).to(dev), group=group)
    ks, vs, ls = _gather(k, group), _gather(v, group), _gather(lens, group)
    ref = torch.zeros(B, Hq, D, dtype=torch.float64)
    for b in range(B):
        kb = torch.cat([ks[r][b, :ls[r][b]] for r in range(len(ks))]).double().repeat_interleave(Hq // Hkv, 1)
        vb = torch.cat([vs[r][b, :ls[r][b]] for r in range(len(vs))]).double().repeat_interleave(Hq // Hkv, 1)
        if kb.shape[0]:
            p = torch.softmax(torch.einsum("hd,thd->ht", q[b].double(), kb) / math.sqrt(D), dim=-1)
            ref[b] = torch.einsum("ht,thd->hd", p, vb)
    if (out.double().cpu() - ref).abs().max().item() > _tol():
        problems.append(f"sp_flash_decode off by {(out.double().cpu() - ref).abs().max().item()}")


def _every_op(group, seed):
    """Every op once on ``group`` (None: every rank); the problems found."""
    gen = torch.Generator().manual_seed(seed * 1000 + dist.get_rank())
    problems = []
    for check in (_check_all_gather, _check_ag_gemm, _check_gemm_rs, _check_moe, _check_flash_decode):
        check(group, gen, problems)
    return problems


def _new_groups(*partitions):
    """One torch.distributed group per part of each partition (every rank creates every group, in order); this
    rank's group of each partition."""
    mine = []
    for parts in partitions:
        for ranks in parts:
            g = dist.new_group(ranks)
            if dist.get_rank() in ranks:
                mine.append(g)
    return mine


@cpu_only
@pytest.mark.parametrize("world", [1, 3, 5, 7])  # (6: test_groups_of_2_and_3_on_6_ranks)
def test_every_op_at_world_size(ranks, world):
    assert ranks(world, _every_op, None, world) == [[]] * world


def _tp_beside_ep(rounds):
    tp, ep = _new_groups([[0, 1], [2, 3]], [[0, 1, 2, 3]])
    gen = torch.Generator().manual_seed(dist.get_rank())
    problems = []
    for _ in range(rounds):  # interleaved: each op's flags and epochs belong to its group
        _check_ag_gemm(tp, gen, problems)
        _check_moe(ep, gen, problems)
        _check_gemm_rs(tp, gen, problems, m=5)
    assert td.shmem.team(tp).size == 2 and td.shmem.team(ep).size == 4
    return problems


@cpu_only
def test_tp_groups_beside_an_ep_group_interleaved(ranks):
    assert ranks(4, _tp_beside_ep, 8) == [[]] * 4


@gpu_only
@pytest.mark.parametrize("world", [3, 4])
def test_every_op_at_world_size_on_gpus(ranks, world):
    assert ranks(world, _every_op, None, world) == [[]] * world


@gpu_only
def test_tp_groups_beside_an_ep_group_on_gpus(ranks):
    assert ranks(4, _tp_beside_ep, 10) == [[]] * 4


def _groups_of(partitions, seed):
    problems = []
    for g in _new_groups(*partitions):
        problems += _every_op(g, seed)
    return problems


@cpu_only
def test_groups_of_2_and_3_on_6_ranks(ranks):
    parts = ([[0, 1, 2], [3, 4, 5]], [[0, 1], [2, 3], [4, 5]])
    assert ranks(6, _groups_of, parts, 6) == [[]] * 6


@cpu_only
def test_groups_of_4_on_8_ranks(ranks):
    assert ranks(8, _groups_of, ([[0, 1, 2, 3], [4, 5, 6, 7]],), 8) == [[]] * 8


def _not_a_member():
    g = dist.new_group([0, 1])  # every rank creates it; rank 2 is not in it
    if dist.get_rank() != 2:
        return None
    try:
        td.shmem.team(g)
        return "accepted"
    except ValueError as exc:
        return str(exc)


@cpu_only
def test_a_group_without_this_rank_is_a_clear_error(ranks):
    assert "is not a member of" in ranks(3, _not_a_member)[2]
