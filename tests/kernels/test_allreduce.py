"""All-reduce, all_reduce_rmsnorm and gemm_ar on CPU ranks (worlds 2, 3, 4, 8) against fp64 references and
against the definition bit for bit (fp32 sums in rank order 0..W-1): both algorithms, odd sizes, every dtype,
fresh inputs every call, results compared byte for byte across ranks, across repeated calls and across
algorithms; heap-resident (zero-copy) and in-place inputs; 100 back-to-back calls; FP8 output; groups of ranks;
bad input; the torch ops under torch.compile; on GPUs bf16 against NCCL, CUDA-graph replay and a straggler; code
generation for sm_90."""

import pytest
import torch
import torch.distributed as dist

import triton_dist as td
from triton_dist.kernels import all_reduce, all_reduce_rmsnorm, gemm_ar
from triton_dist.kernels.fp8 import E4M3_MAX

from triton_dist.timing import graph_of

from ..conftest import collective_outcome, error_names, gpu_only
from ..sm90 import compile_sm90

ALGOS = ("one_shot", "two_shot")
CPU = {"num_programs": 2, "block": 16}  # rows of 16 elements: several rows per program and per slice
GEMM_CPU = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "num_programs": 2}


def _gather(t, group=None):
    parts = [torch.empty_like(t) for _ in range(td.world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return parts


def _same_everywhere(t, group=None):
    """Whether ``t`` has the same bytes on every rank of ``group``."""
    raw = t.detach().cpu().contiguous().view(-1).view(torch.uint8)
    return all(torch.equal(p, raw) for p in _gather(raw, group))


def _rank_order_sum(parts, dtype):
    """The definition: fp32 sum in rank order, rounded to ``dtype`` (as the kernels round: the Triton
    interpreter truncates fp32 to bfloat16, GPUs round to nearest even like torch)."""
    total = parts[0].float().clone()
    for p in parts[1:]:
        total += p.float()
    if dtype == torch.bfloat16 and td.shmem.device().type == "cpu":
        total = (total.view(torch.int32) & -65536).view(torch.float32)
    return total.to(dtype)


def _inputs(shape, dtype, seed, group=None, same=False):
    gen = torch.Generator().manual_seed(seed * 1000 + (0 if same else dist.get_rank()))
    return (torch.randn(shape, generator=gen) * 4).to(dtype)


# ----------------------------------------------------------------------------------------------- all_reduce
def _check_all_reduce(cases, group=None, config=CPU):
    """Every case with both algorithms, fresh inputs: the problems found."""
    dev, problems = td.shmem.device(), []
    for seed, (shape, dtype_name) in enumerate(cases):
        dtype = getattr(torch, dtype_name)
        x = _inputs(shape, dtype, seed, group)
        parts = _gather(x, group)
        ref64 = torch.stack([p.double() for p in parts]).sum(0)
        exact = _rank_order_sum(parts, dtype)
        results = []
        for algo in ALGOS:
            out = torch.full(shape, float("nan"), dtype=dtype, device=dev)  # poisoned: every element is written
            all_reduce(x.to(dev), out=out, algo=algo, group=group, config=config)
            err = (out.double().cpu() - ref64).abs().max().item() if out.numel() else 0.0
            tol = torch.finfo(dtype).eps * ref64.abs().max().item() + 1e-5
            if err > tol or not torch.equal(out.cpu(), exact):
                problems.append(f"{algo} {shape} {dtype_name}: error {err:.3g} (tol {tol:.3g}) or not the "
                                f"rank-order sum")
            if not _same_everywhere(out, group):
                problems.append(f"{algo} {shape} {dtype_name}: differs across ranks")
            again = all_reduce(x.to(dev), algo=algo, group=group, config=config)
            if not torch.equal(again, out):
                problems.append(f"{algo} {shape} {dtype_name}: a repeated call differs")
            results.append(out)
        if not torch.equal(results[0], results[1]):
            problems.append(f"{shape} {dtype_name}: one-shot and two-shot differ")
    return problems


CASES = [((37,), "float32"), ((5, 13), "float16"), ((3, 7, 11), "bfloat16"), ((2,), "float32"),
         ((160,), "bfloat16")]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_all_reduce_matches_fp64_and_the_rank_order_sum(ranks, world):
    assert ranks(world, _check_all_reduce, CASES) == [[]] * world


def test_all_reduce_8_ranks(ranks):
    assert ranks(8, _check_all_reduce, [((67,), "float16")]) == [[]] * 8


def _check_heap_resident(shape, dtype_name):
    """Zero-copy inputs (x in the heap, read in place by the peers), in-place calls (out = x), and x overwritten
    right after each call returns (the next call must still be right)."""
    dtype, problems = getattr(torch, dtype_name), []
    x = td.shmem.empty(shape, dtype, name="ar_heap_x")
    for i, (algo, in_place) in enumerate([(a, p) for p in (False, True) for a in ALGOS] * 2):
        fresh = _inputs(shape, dtype, 100 + i)
        x.copy_(fresh)  # straight after the previous call: no peer may still read x
        exact = _rank_order_sum(_gather(fresh), dtype)
        out = all_reduce(x, out=x if in_place else None, algo=algo, config=CPU)
        if not torch.equal(out.cpu(), exact) or (in_place and out.data_ptr() != x.data_ptr()):
            problems.append(f"call {i}: {algo} in place={in_place}")
    return problems


@pytest.mark.parametrize("world", [2, 3])
def test_all_reduce_heap_resident_and_in_place(ranks, world):
    assert ranks(world, _check_heap_resident, (5, 9), "bfloat16") == [[]] * world


def _check_back_to_back(calls):
    """``calls`` calls with fresh inputs and nothing in between: both algorithms, copied and zero-copy inputs,
    and every 10th call the size changes (the workspace grows once)."""
    dev, bad = td.shmem.device(), []
    heap = td.shmem.empty((64,), torch.float16, name="ar_back_to_back")
    for i in range(calls):
        n = 37 if i < calls // 2 else 61
        x = _inputs((n,), torch.float16, 1000 + i)
        src = heap[:n].copy_(x) if i % 4 >= 2 else x.to(dev)
        out = all_reduce(src, algo=ALGOS[i % 2], config=CPU)
        if not torch.equal(out.cpu(), _rank_order_sum(_gather(x), torch.float16)):
            bad.append(i)
    return bad


def test_all_reduce_100_back_to_back_calls(ranks):
    assert ranks(2, _check_back_to_back, 100) == [[]] * 2


def _check_auto_and_nccl():
    x = _inputs((50,), torch.float32, 7).to(td.shmem.device())
    exact = _rank_order_sum(_gather(x.cpu()), torch.float32)
    auto = all_reduce(x)
    nccl = all_reduce(x, algo="nccl")
    op = torch.ops.triton_dist.all_reduce(x, "two_shot")
    return torch.equal(auto.cpu(), exact), torch.allclose(nccl.cpu(), exact, atol=1e-5), torch.equal(op, auto)


def test_all_reduce_auto_nccl_and_torch_op(ranks):
    assert ranks(2, _check_auto_and_nccl) == [(True, True, True)] * 2


def _check_eager_and_captured_configs():
    """"auto" with different tuned choices for eager and captured calls (a stand-in for the GPU tuner): both plans
    are made by the first (eager) call, so a captured call finds its workspace (it could not make one)."""
    from triton_dist import hardware
    from triton_dist.kernels.allreduce import config as knobs

    dev = td.shmem.device()
    saved = knobs.tunable, knobs.tuned, hardware.capturing
    chosen = {"all_reduce": ({**CPU, "algo": "nccl", "num_warps": 4}, {**CPU, "algo": "two_shot", "num_warps": 4}),
              "all_reduce_rmsnorm": ({"algo": "one_shot", "num_programs": 2, "num_warps": 4},
                                     {"algo": "two_shot", "num_programs": 1, "num_warps": 4}),
              "gemm_ar": tuple({**GEMM_CPU, "path": p, "partial": q, "use_tma": None, "GROUP_M": 2,
                                "num_stages": 1, "num_warps": 4} for p, q in (("fused", "out"), ("fused", "fp32")))}
    knobs.tunable, knobs.tuned = (lambda device, world: True), (lambda op, *args: chosen[op])
    try:
        x, res, w = (_inputs(s, torch.float32, 8 + i).to(dev) for i, s in enumerate([(3, 20), (3, 20), (20,)]))
        calls = lambda: (all_reduce(x), *all_reduce_rmsnorm(x, res, w, 1e-5), gemm_ar(x, w[None]))  # noqa: E731
        eager = calls()
        hardware.capturing = lambda: True  # what a capture sees: no workspace may be made now
        captured = calls()
    finally:
        knobs.tunable, knobs.tuned, hardware.capturing = saved
    return [all(torch.allclose(e, c, atol=1e-5) for e, c in zip(eager, captured)),
            torch.equal(captured[0].cpu(), _rank_order_sum(_gather(x.cpu()), torch.float32))]  # two-shot's bits


def test_auto_takes_the_captured_config_while_a_graph_records(ranks):
    assert ranks(2, _check_eager_and_captured_configs) == [[True, True]] * 2


# ----------------------------------------------------------------------------------------------- + RMSNorm
def _fp8_step(v):
    """The spacing of float8_e4m3fn numbers around |v| (3 mantissa bits; subnormals below 2**-6)."""
    exp = torch.floor(torch.log2(v.abs().clamp(min=2.0 ** -6)))
    return 2.0 ** (exp - 3)


def _check_rmsnorm(cases, group=None):
    dev, problems, eps = td.shmem.device(), [], 1e-5
    for seed, (shape, dtype_name, fp8) in enumerate(cases):
        dtype = getattr(torch, dtype_name)
        x = _inputs(shape, dtype, seed, group)
        residual = _inputs(shape, dtype, 50 + seed, group, same=True)  # the replicated residual stream
        weight = _inputs(shape[-1:], dtype, 90 + seed, group, same=True)
        s = torch.stack([p.double() for p in _gather(x, group)]).sum(0)
        got = {}
        for algo in ALGOS:
            res = all_reduce_rmsnorm(x.to(dev), residual.to(dev), weight.to(dev), eps, out_fp8=fp8, group=group,
                                     algo=algo, config={"num_programs": 2})
            got[algo] = res
            normed, new_res = res[0].cpu(), res[1].cpu()
            ref_res = residual.double() + s
            tol = torch.finfo(dtype).eps * ref_res.abs().max().item() + 1e-5
            if (new_res.double() - ref_res).abs().max().item() > tol:
                problems.append(f"{algo} {shape} {dtype_name}: new_residual off")
            v = new_res.double()  # the norm is taken of the residual as stored
            ref = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps) * weight.double()
            if fp8:
                scales = res[2].cpu().double()
                ref_scales = ref.abs().amax(-1, keepdim=True) / E4M3_MAX
                if ((scales - ref_scales).abs() > 1e-3 * ref_scales + 1e-12).any():
                    problems.append(f"{algo} {shape} {dtype_name}: FP8 scales off")
                want = ref / scales.clamp(min=1e-30)
                if ((normed.double() - want).abs() > _fp8_step(want)).any():
                    problems.append(f"{algo} {shape} {dtype_name}: FP8 values off by more than one step")
            elif (normed.double() - ref).abs().max().item() > 4 * torch.finfo(dtype).eps * ref.abs().max() + 1e-5:
                problems.append(f"{algo} {shape} {dtype_name}: normed off")
            if not all(_same_everywhere(t, group) for t in res):
                problems.append(f"{algo} {shape} {dtype_name}: differs across ranks")
        if not all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                   for a, b in zip(got["one_shot"], got["two_shot"])):
            problems.append(f"{shape} {dtype_name}: one-shot and two-shot differ")
    return problems


RMS_CASES = [((3, 40), "float32", False), ((5, 24), "bfloat16", False), ((2, 3, 33), "float16", True),
             ((4, 48), "bfloat16", True), ((1, 24), "float32", True)]  # one token: two-shot slices left empty


@pytest.mark.parametrize("world", [2, 3])
def test_all_reduce_rmsnorm_matches_fp64(ranks, world):
    assert ranks(world, _check_rmsnorm, RMS_CASES) == [[]] * world


def _check_rmsnorm_zero_copy_and_op():
    dev = td.shmem.device()
    x = td.shmem.empty((3, 20), torch.float32, name="arn_heap_x")
    x.copy_(_inputs((3, 20), torch.float32, 3))
    residual = _inputs((3, 20), torch.float32, 4, same=True).to(dev)
    weight = torch.ones(20, device=dev)
    heap = all_reduce_rmsnorm(x, residual, weight, 1e-6, config={"num_programs": 2})  # zero-copy
    copied = all_reduce_rmsnorm(x.clone(), residual, weight, 1e-6, config={"num_programs": 2})
    op = torch.ops.triton_dist.all_reduce_rmsnorm(x.clone(), residual, weight, 1e-6, True)
    fp8 = all_reduce_rmsnorm(x.clone(), residual, weight, 1e-6, out_fp8=True)
    torch_path = all_reduce_rmsnorm(x.clone(), residual, weight, 1e-6, algo="nccl")
    return (all(torch.equal(a, b) for a, b in zip(heap, copied)), len(op) == 3,
            all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(op, fp8)),
            all(torch.allclose(a, b, atol=1e-5) for a, b in zip(torch_path, copied)))


def test_all_reduce_rmsnorm_zero_copy_torch_path_and_op(ranks):
    assert ranks(2, _check_rmsnorm_zero_copy_and_op) == [(True, True, True, True)] * 2


# ----------------------------------------------------------------------------------------------- gemm_ar
def _check_gemm_ar(cases, group=None):
    dev, problems = td.shmem.device(), []
    for seed, (m, n, k, dtype_name, config) in enumerate(cases):
        dtype = getattr(torch, dtype_name)
        a, w = _inputs((m, k), dtype, seed, group), _inputs((n, k), dtype, 40 + seed, group) / k ** 0.5
        ref = torch.stack([pa.double() @ pw.double().T for pa, pw in zip(_gather(a, group), _gather(w, group))]).sum(0)
        out = gemm_ar(a.to(dev), w.to(dev), group=group, config={**GEMM_CPU, **config})
        tol = (2e-3 if dtype == torch.float16 else 1e-5) * max(ref.abs().max().item(), 1.0)
        if out.shape != ref.shape or (out.double().cpu() - ref).abs().max().item() > tol:
            problems.append(f"{(m, n, k, dtype_name, config)}: off the fp64 reference")
        if not _same_everywhere(out, group):
            problems.append(f"{(m, n, k, dtype_name, config)}: differs across ranks")
        one_program = gemm_ar(a.to(dev), w.to(dev), group=group, config={**GEMM_CPU, **config, "num_programs": 1})
        if not torch.equal(one_program, out):
            problems.append(f"{(m, n, k, dtype_name, config)}: depends on the schedule")
    return problems


GEMM_CASES = [(5, 37, 24, "float16", {}), (18, 20, 40, "float32", {"partial": "fp32", "use_tma": True}),
              (1, 48, 16, "float16", {"GROUP_M": 1})]


@pytest.mark.parametrize("world", [2, 3])
def test_gemm_ar_matches_fp64(ranks, world):
    assert ranks(world, _check_gemm_ar, GEMM_CASES) == [[]] * world


def _check_gemm_ar_paths():
    dev = td.shmem.device()
    a, w = _inputs((4, 16), torch.float32, 1).to(dev), _inputs((24, 16), torch.float32, 2).to(dev)
    fused = gemm_ar(a, w)
    return (torch.allclose(gemm_ar(a, w, config={"path": "nccl"}), fused, atol=1e-4),
            torch.equal(torch.ops.triton_dist.gemm_ar(a, w), fused))


def test_gemm_ar_torch_path_and_op(ranks):
    assert ranks(2, _check_gemm_ar_paths) == [(True, True)] * 2


# ----------------------------------------------------------------------------------------------- groups, misuse
def _check_groups():
    pairs = [dist.new_group(r) for r in ([0, 1], [2, 3])]
    singles = [dist.new_group([r]) for r in range(4)]
    pair, single = pairs[dist.get_rank() // 2], singles[dist.get_rank()]
    problems = []
    for _ in range(3):  # interleaved: the pairs' flags and epochs are their own
        problems += _check_all_reduce([((21,), "float16")], pair)
        problems += _check_rmsnorm([((3, 17), "float32", True)], pair)
        problems += _check_gemm_ar([(3, 20, 16, "float32", {})], pair)
    problems += _check_all_reduce([((21,), "float32")], single)  # a group of one: a copy
    problems += _check_rmsnorm([((2, 8), "float32", False)], single)
    problems += _check_gemm_ar([(3, 8, 16, "float32", {})], single)
    assert td.shmem.team(pair).size == 2 and td.shmem.team(single).size == 1
    return problems


def test_all_reduce_ops_on_groups(ranks):
    assert ranks(4, _check_groups) == [[]] * 4


def _check_bad_input():
    dev = td.shmem.device()
    x = torch.randn(4, 8, device=dev)
    w = torch.ones(8, device=dev)
    return error_names([
        lambda: all_reduce([1.0]),
        lambda: all_reduce(x.int()),
        lambda: all_reduce(x, algo="three_shot"),
        lambda: all_reduce(x, out=torch.empty(4, 9, device=dev)),
        lambda: all_reduce(x, out=x.half()),
        lambda: all_reduce(x.view(-1)[:16].view(2, 8), out=x.view(-1)[8:24].view(2, 8)),  # overlapping out
        lambda: all_reduce(x, config={"blocks": 4}),
        lambda: all_reduce_rmsnorm(x, x[:2], w, 1e-6),
        lambda: all_reduce_rmsnorm(x, x, torch.ones(7, device=dev), 1e-6),
        lambda: all_reduce_rmsnorm(x, x, w, 0.0),
        lambda: all_reduce_rmsnorm(x, x.half(), w, 1e-6),
        lambda: all_reduce_rmsnorm(x.int(), x, w, 1e-6),
        lambda: gemm_ar(x, torch.ones(5, 7, device=dev)),
        lambda: gemm_ar(x, torch.ones(5, 8, device=dev).half()),
        lambda: gemm_ar(x[0], w),
        lambda: torch.ops.triton_dist.all_reduce_rmsnorm(x, x, w, -1.0),
    ])


def test_all_reduce_ops_reject_bad_input(ranks):
    expected = ["TypeError", "TypeError", "ValueError", "ValueError", "ValueError", "ValueError", "ValueError",
                "ValueError", "ValueError", "ValueError", "ValueError", "TypeError", "ValueError", "TypeError",
                "ValueError", "ValueError"]
    assert ranks(2, _check_bad_input) == [expected] * 2


def _mismatch_then_recover():
    """A call whose shape differs on the last rank, for each op with check mode on (CollectiveMismatchError on
    every rank at once) and for all_reduce with it off (the call ends within the wait timeout); then reset() and
    good calls. Per rank: [(what was raised, seconds)], whether the good calls were right."""
    dev, odd, seen = td.shmem.device(), td.rank() == td.world_size() - 1, []
    td.shmem.set_wait_timeout(2.0)
    calls = [lambda: all_reduce(torch.ones(40 if odd else 37, device=dev), algo="two_shot", config=CPU),
             lambda: all_reduce_rmsnorm(torch.ones(3 if odd else 2, 8, device=dev),
                                        torch.ones(3 if odd else 2, 8, device=dev), torch.ones(8, device=dev), 1e-6),
             lambda: gemm_ar(torch.ones(5 if odd else 4, 16, device=dev), torch.ones(8, 16, device=dev))]
    for check_calls, call in [(True, c) for c in calls] + [(False, calls[0])]:
        td.shmem.check_calls(check_calls)
        kind, _, seconds = collective_outcome(call)
        seen.append((kind, seconds))
        td.shmem.reset()
    td.shmem.check_calls(True)
    td.shmem.set_wait_timeout(60)
    good = _check_all_reduce([((37,), "float32")]) + _check_rmsnorm([((2, 8), "float32", False)]) + \
        _check_gemm_ar([(4, 8, 16, "float32", {})])
    return seen, good


def test_a_mismatched_call_raises_or_ends_then_reset_recovers(ranks):
    for seen, good in ranks(3, _mismatch_then_recover):
        assert [kind for kind, _ in seen[:3]] == ["CollectiveMismatchError"] * 3, seen
        assert seen[3][0] in (None, "CollectiveMismatchError", "WaitTimeoutError"), seen
        assert all(seconds < 8.0 for _, seconds in seen), seen  # a 2 s wait timeout, not the default 60 s
        assert good == [], good


def _check_compile():
    dev = td.shmem.device()
    x, res, w = (_inputs((4, 16), torch.float32, s).to(dev) for s in (1, 2, 3))

    def block(x, res, w):
        y = all_reduce(x * 2.0)
        normed, new_res = all_reduce_rmsnorm(y, res, w[0], 1e-6)
        return gemm_ar(normed, w), new_res

    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")(x, res, w)
    eager = block(x, res, w)
    return all(torch.equal(c, e) for c, e in zip(compiled, eager))


def test_all_reduce_ops_under_torch_compile(ranks):
    assert ranks(2, _check_compile) == [True] * 2


def _bench_check():
    import os
    import sys

    bench = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks")
    sys.path.insert(0, os.path.abspath(bench))
    return __import__("bench_allreduce").check()


def test_benchmark_contenders_agree_on_cpu(ranks):
    for checked, problems in ranks(2, _bench_check):
        assert problems == [] and len(checked) >= 6, (checked, problems)


# ----------------------------------------------------------------------------------------------- GPU
def _check_bf16_against_nccl(numels):
    bad = []
    for numel in numels:
        x = torch.randn(numel, device="cuda", dtype=torch.bfloat16)
        ref = x.float()
        dist.all_reduce(ref)
        exact = _rank_order_sum([p.cpu() for p in _gather(x)], torch.bfloat16).cuda()
        for algo in ("auto", "one_shot", "two_shot"):
            for _ in range(3):
                out = all_reduce(x, algo=algo)
                if algo != "auto" and not torch.equal(out, exact) or not _same_everywhere(out):
                    bad.append((numel, algo))
                if ((out.float() - ref).abs() > 2e-2 * ref.abs() + 1e-2).any():
                    bad.append((numel, algo, "far from NCCL"))
    # x 2 bytes past an aligned address between aligned calls of the same plan (bound launches only where aligned)
    x = torch.randn(1000, device="cuda", dtype=torch.bfloat16)
    exact = _rank_order_sum([p.cpu() for p in _gather(x)], torch.bfloat16).cuda()
    odd = torch.empty(1001, device="cuda", dtype=torch.bfloat16)[1:].copy_(x)
    for algo in ("one_shot", "two_shot"):
        for i, t in enumerate((x, odd, x, odd)):
            if not torch.equal(all_reduce(t, algo=algo), exact):
                bad.append(("unaligned", algo, i))
    return bad


@gpu_only
def test_all_reduce_bf16_against_nccl(ranks):
    sizes = [1, 1000, 4097, 1 << 18, (3 << 20) + 5, 16 << 20]
    assert ranks(2, _check_bf16_against_nccl, sizes) == [[]] * 2


def _check_graph_replay():
    x = torch.randn(3, 4096, device="cuda", dtype=torch.bfloat16)
    res = torch.randn_like(x)
    w8 = torch.randn(4096, 2048, device="cuda", dtype=torch.bfloat16) / 64
    a = torch.randn(3, 2048, device="cuda", dtype=torch.bfloat16)
    weight = torch.rand(4096, device="cuda", dtype=torch.bfloat16)
    # explicit configurations: "auto" may tune eager and captured calls differently (other bits); then auto
    calls = lambda: (all_reduce(x, algo="one_shot"), all_reduce(x, algo="two_shot"),  # noqa: E731
                     *all_reduce_rmsnorm(x, res, weight, 1e-6, out_fp8=True, algo="two_shot"),
                     gemm_ar(a, w8, config={"path": "fused"}), all_reduce(x))
    outs = []

    def record():
        outs[:] = calls()

    graph = graph_of(record)  # one eager call (compiles, tunes, makes the workspaces), then the capture
    ok = True
    for i in range(5):
        for t in (x, res, a):
            t.copy_(torch.randn_like(t))
        td.shmem.barrier()
        graph.replay()
        eager = calls()
        ok &= all(torch.equal(o.view(torch.uint8), e.view(torch.uint8)) for o, e in zip(outs[:-1], eager[:-1]))
        ok &= torch.allclose(outs[-1].float(), eager[0].float(), rtol=2e-2, atol=1e-2)
    return ok


@gpu_only
def test_all_reduce_ops_cuda_graph_replay(ranks):
    assert ranks(2, _check_graph_replay) == [True] * 2


def _check_straggler():
    ok = True
    x = torch.randn(1 << 16, device="cuda", dtype=torch.bfloat16)
    exact = _rank_order_sum([p.cpu() for p in _gather(x)], torch.bfloat16).cuda()
    for late in range(td.world_size()):
        for algo in ALGOS:
            if td.rank() == late:
                torch.cuda._sleep(200_000_000)
            ok &= torch.equal(all_reduce(x, algo=algo), exact)
    return ok


@gpu_only
def test_all_reduce_straggler_rank(ranks):
    assert ranks(2, _check_straggler) == [True] * 2


def _check_decode_shapes():
    bad = []
    for m in (1, 16, 128):
        a = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16) / 64
        ref = a.float() @ w.float().T
        dist.all_reduce(ref)
        out = gemm_ar(a, w, config={"path": "fused"})
        if ((out.float() - ref).abs() > 2e-2 * ref.abs() + 2e-2 * ref.abs().mean()).any() or \
                not _same_everywhere(out):
            bad.append(("gemm_ar", m))
        x, res = torch.randn(m, 8192, device="cuda", dtype=torch.bfloat16), torch.randn(m, 8192, device="cuda")
        res = res.to(torch.bfloat16)
        weight = torch.rand(8192, device="cuda", dtype=torch.bfloat16)
        for algo in ALGOS:
            normed, new_res = all_reduce_rmsnorm(x, res, weight, 1e-6, algo=algo)
            ref_n = torch.nn.functional.rms_norm(res + all_reduce(x, algo="nccl"), (8192,), weight, 1e-6)
            if ((normed.float() - ref_n.float()).abs() > 3e-2 * ref_n.float().abs() + 3e-2).any():
                bad.append(("rmsnorm", m, algo))
    return bad


@gpu_only
def test_gemm_ar_and_rmsnorm_at_decode_shapes(ranks):
    assert ranks(2, _check_decode_shapes) == [[]] * 2


# ----------------------------------------------------------------------------------------------- sm_90
AR_SIG = dict(x="*bf16", out="*bf16", residual="*bf16", weight="*bf16", new_residual="*bf16", scales="*fp32",
              staging="*bf16", reduced="*bf16", arrived="*i32", published="*i32", done="*i32", state="*i32",
              rows="i32", row_len="i32", numel="i32", stage_elems="i32", slice_elems="i32", eps="fp32", ctx="*i64",
              BLOCK="constexpr", WORLD="constexpr", WORLD_P2="constexpr", TWO_SHOT="constexpr",
              ZERO_COPY="constexpr", EPILOGUE="constexpr")
AR_ALIGNED = ("x", "out", "residual", "weight", "new_residual", "staging", "reduced", "row_len", "numel", "stage_elems",
              "slice_elems")


@pytest.mark.parametrize("variant", ["one_shot", "two_shot_rmsnorm_fp8"])
def test_all_reduce_kernel_compiles_for_sm90(variant):
    if variant == "one_shot":
        sig, consts = AR_SIG, dict(BLOCK=2048, WORLD=2, WORLD_P2=2, TWO_SHOT=False, ZERO_COPY=False, EPILOGUE=0)
    else:
        sig = {**AR_SIG, "out": "*fp8e4nv", "reduced": "*fp32"}
        consts = dict(BLOCK=8192, WORLD=4, WORLD_P2=4, TWO_SHOT=True, ZERO_COPY=True, EPILOGUE=2)
    ops = compile_sm90("triton_dist.kernels.allreduce.kernels", "all_reduce_kernel", sig, consts,
                       aligned=AR_ALIGNED)["ops"]
    assert ops.get("atom.global.sys.release.exch.b32", 0) > 0, ops  # dl.signal
    assert any("acquire" in op and "sys" in op for op in ops), ops  # dl.wait
    assert any(op.startswith("ld.global.v4") for op in ops), ops  # 16-byte loads of the peers' rows


def test_gemm_ar_kernel_compiles_for_sm90():
    sig = dict(a="tensordesc<bf16[64,128]>", w="tensordesc<bf16[64,128]>", out="*bf16", partials="*bf16",
               flags="*i32", state="*i32", M="i32", N="i32", K="i32", stride_am="i32", stride_wn="i32",
               partial_elems="i32", ctx="*i64", BLOCK_M="constexpr", BLOCK_N="constexpr", BLOCK_K="constexpr",
               GROUP_M="constexpr", USE_TMA="constexpr", DOT_PRECISION="constexpr", WORLD="constexpr",
               WORLD_P2="constexpr")
    consts = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, USE_TMA=True, DOT_PRECISION="tf32", WORLD=2,
                  WORLD_P2=2)
    ops = compile_sm90("triton_dist.kernels.allreduce.gemm_ar", "gemm_ar_kernel", sig, consts,
                       aligned=("out", "partials", "N", "K", "partial_elems"))["ops"]
    assert any(op.startswith("wgmma.mma_async") for op in ops), ops
    assert any(op.startswith("cp.async.bulk.tensor") for op in ops), ops  # TMA loads of a and w
    assert ops.get("atom.global.sys.release.exch.b32", 0) > 0, ops
