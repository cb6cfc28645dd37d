"""The FP8 ops on groups of ranks and in check mode, as their bf16 siblings are (tests/kernels/test_groups.py,
tests/shmem/test_misuse.py).

* 4 ranks: scaled_ag_gemm, scaled_gemm_rs and the FP8 ep_dispatch (quant="fp8" and FP8 x with x_scales) + ep_combine
  on the pairs {0, 1} and {2, 3}, interleaved call by call, then on groups of one; against fp64 references of the
  dequantised inputs.
* 3 ranks, check mode: a call of each FP8 op that differs on the last rank (a shape; FP8 against bf16 rows) raises
  CollectiveMismatchError on every rank at once; then reset() and good calls on every rank.
"""

import torch
import torch.distributed as dist

import triton_dist as td
from triton_dist.kernels import ep_combine, ep_dispatch, quantize_fp8, scaled_ag_gemm, scaled_gemm_rs
from triton_dist.kernels.gemm_reducescatter import rows_of_rank

from ..conftest import collective_outcome, cpu_only
from .fp8_inputs import operands, rel_err

AG = {"path": "overlap", "n_chunks": 2, "num_programs": 3}
RS = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "num_programs": 0, "path": "overlap"}


def _gather(t, group):
    parts = [torch.empty_like(t) for _ in range(td.world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return parts


def _compare(what, out, ref, problems, tol=1e-5):
    if tuple(out.shape) != tuple(ref.shape) or rel_err(out.cpu(), ref) > tol:
        err = rel_err(out.cpu(), ref) if tuple(out.shape) == tuple(ref.shape) else "-"
        problems.append(f"{what}: {out.dtype} {list(out.shape)} against {list(ref.shape)}, off by {err}")


def _operands(m, n, k, mode, gen):
    """(a, w, scale_a, scale_w) on this rank's device, and the fp64 dequantised a and w on the host."""
    a, sa, w, sw, da, dw = operands(m, n, k, mode, gen)
    return [t.to(td.shmem.device()) for t in (a, w, sa, sw)], da, dw


def _check_ag(group, gen, problems, m=5):
    fp8_args, da, dw = _operands(m, 24, 48, "row", gen)
    out = scaled_ag_gemm(*fp8_args, out_dtype=torch.float32, config=AG, group=group)
    _compare("scaled_ag_gemm", out, torch.cat(_gather(da, group)) @ dw.T, problems)


def _check_rs(group, gen, problems, m=7):
    fp8_args, da, dw = _operands(m, 16, 160, "block", gen)
    out = scaled_gemm_rs(*fp8_args, out_dtype=torch.float32, config=RS, group=group)
    start, rows = rows_of_rank(m, td.world_size(group), td.rank(group))
    _compare("scaled_gemm_rs", out, sum(_gather(da @ dw.T, group))[start: start + rows], problems)


def _check_dispatch(group, gen, problems, given, T=3, H=160, K=2):
    """FP8 rows to their experts' ranks and back: expert e scales its dequantised rows by 1 + e % 3 (bf16 out, as
    the tokens came)."""
    dev, world = td.shmem.device(), td.world_size(group)
    E = 2 * world
    idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]).to(dev)
    weights = torch.rand(T, K, generator=gen).to(dev)
    x = torch.randn(T, H, generator=gen).to(torch.bfloat16).to(dev)
    q, s = quantize_fp8(x)  # the senders' quantiser (quant="fp8" runs the same one): exact references
    kw = dict(num_experts=E, max_tokens=T, group=group)
    res = ep_dispatch(q, idx, weights, x_scales=s, **kw) if given else ep_dispatch(x, idx, weights, quant="fp8", **kw)
    factor = (torch.arange(E, dtype=torch.float32) % 3 + 1)[td.rank(group) * 2: td.rank(group) * 2 + 2].to(dev)
    deq = res.x.float() * res.scales.repeat_interleave(128, dim=1)[:, :H]
    y = ep_combine((deq * factor[res.expert_ids.clamp(min=0).long()][:, None]).to(torch.bfloat16), res.handle)
    dq = (q.float() * s.repeat_interleave(128, dim=1)[:, :H]).double().cpu()
    ref = (weights.double().cpu() * (idx.cpu() % 3 + 1).double()).sum(1, keepdim=True) * dq
    if res.x.dtype != torch.float8_e4m3fn:
        problems.append(f"FP8 ep_dispatch delivered {res.x.dtype} rows")
    _compare(f"FP8 ep_dispatch ({'given' if given else 'quantised'}) + ep_combine", y, ref, problems, 3e-2)


def _every_fp8_op(group, gen, problems):
    _check_ag(group, gen, problems)
    _check_dispatch(group, gen, problems, False)
    _check_rs(group, gen, problems)
    _check_dispatch(group, gen, problems, True)


def _check_groups(rounds):
    pairs = [dist.new_group(r) for r in ([0, 1], [2, 3])]
    singles = [dist.new_group([r]) for r in range(4)]
    pair, single = pairs[dist.get_rank() // 2], singles[dist.get_rank()]
    gen = torch.Generator().manual_seed(dist.get_rank())
    problems = []
    for _ in range(rounds):  # interleaved: each op's flags and epochs belong to its group
        _every_fp8_op(pair, gen, problems)
    _every_fp8_op(single, gen, problems)
    assert td.shmem.team(pair).size == 2 and td.shmem.team(single).size == 1
    return problems


@cpu_only
def test_fp8_ops_on_groups(ranks):
    assert ranks(4, _check_groups, 2) == [[]] * 4


def _mismatch_then_recover():
    """Check mode: a call of each FP8 op whose signature differs on the last rank; what each raised and how long
    it took, then reset() and good calls. Per rank: [(what was raised, seconds)], the good calls' problems."""
    dev, odd = td.shmem.device(), td.rank() == td.world_size() - 1
    td.shmem.set_wait_timeout(2.0)
    gen = torch.Generator().manual_seed(td.rank())
    a, w, sa, sw = _operands(5 if odd else 4, 16, 48, "row", gen)[0]
    x = torch.randn(3, 128, generator=gen).to(torch.bfloat16).to(dev)
    idx, weights = torch.zeros(3, 1, dtype=torch.int64, device=dev), torch.ones(3, 1, device=dev)
    calls = [lambda: scaled_ag_gemm(a, w, sa, sw, config=AG),
             lambda: scaled_gemm_rs(a, w, sa, sw, config=RS),
             lambda: ep_dispatch(x, idx, weights, num_experts=3, max_tokens=3, quant=None if odd else "fp8")]
    td.shmem.check_calls(True)
    seen = []
    for call in calls:
        kind, _, seconds = collective_outcome(call)
        seen.append((kind, seconds))
        td.shmem.reset()
    td.shmem.set_wait_timeout(60)
    problems = []
    _every_fp8_op(None, gen, problems)
    return seen, problems


@cpu_only
def test_a_mismatched_fp8_call_raises_on_every_rank_then_reset_recovers(ranks):
    for seen, problems in ranks(3, _mismatch_then_recover):
        assert [kind for kind, _ in seen] == ["CollectiveMismatchError"] * 3, seen
        assert all(seconds < 8.0 for _, seconds in seen), seen  # at once, not after a wait timeout
        assert problems == [], problems
