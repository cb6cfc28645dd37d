"""PyTorch async-TP's ops on the zoo (``kernels/async_tp.py``), on CPU ranks: the cases of PyTorch's own tests of
``fused_all_gather_matmul`` (BATCH 8, M 64, N 16, K 32, three Bs, gather_dim 0, 1 and 2) and
``fused_matmul_reduce_scatter`` (scatter_dim 0, 1 and 2, "avg" and "sum"), against the reference semantics
(values in fp64 and the strides of torch's fallbacks), at 2 and 3 ranks; their gradients against fp64 (the sum of
every rank's loss); under torch.compile (fullgraph) forward and backward as eagerly (within 1e-6);
``torch.ops.symm_mem.*`` routed to them; bad arguments refused. The GPU tier runs the value and gradient checks
in bf16 on the GPU kernels (``test_async_tp_ops_bf16_on_gpus``)."""

import pytest
import torch
import torch.distributed as dist

import triton_dist as td
from triton_dist.kernels import fused_all_gather_matmul, fused_matmul_reduce_scatter, use_for_torch_async_tp

from ..conftest import error_names, gpu_only

SHAPES = {1: (8, 64, 16, 32), 2: (8, 64, 16, 32), 3: (6, 9, 12, 15)}  # (BATCH, M, N, K): PyTorch's at 2 ranks


def _on_rank(t, dtype):
    """A CPU-made tensor on this rank's device in ``dtype`` (fp32 on CPU ranks; bf16 on GPU ranks)."""
    return t.to(td.shmem.device(), dtype)


def _every(t):
    """Every rank's ``t`` (through the host in a gloo group, as ranks sharing a GPU have: it takes no GPU tensors;
    an NCCL group takes no CPU ones)."""
    x = t.detach().contiguous()
    if dist.get_backend() == "gloo":
        x = x.cpu()
    parts = [torch.empty_like(x) for _ in range(td.world_size())]
    dist.all_gather(parts, x)
    return [p.to(t.device) for p in parts]


def _ag_reference(shards, Bs, dim):
    """torch's fallback in fp64: the gathered A (in its layout) and each product."""
    a = torch.stack(shards).double()  # [W, *shard]
    if dim == shards[0].dim() - 1:
        full = torch.cat(list(a), dim=-1)
        return full, [full @ B.double() for B in Bs]
    full = a.movedim(dim + 1, 1).flatten(0, 1)  # gathered dim first, contiguous
    return full.movedim(0, dim), [(full @ B.double()).movedim(0, dim) for B in Bs]


def _rel(got, ref):
    return ((got.double() - ref).abs().max() / ref.abs().max()).item()


def _all_gather_matmul(dtype=torch.float32):
    """{case: (value error, strides equal)} for every gather_dim, and the gradients' errors."""
    r, world = td.rank(), td.world_size()
    BATCH, M, N, K = SHAPES[world]
    results = {}
    for dim in (0, 1, 2):
        shape = [BATCH, M, K]
        shape[dim] //= world
        g = torch.Generator().manual_seed(42 + r)
        a = _on_rank(torch.rand(shape, generator=g), dtype)
        Bs = [_on_rank(torch.rand(shape[-1] * (world if dim == 2 else 1), N, generator=g), dtype) for _ in range(3)]
        got_a, got = fused_all_gather_matmul(a, Bs, dim)
        ref_a, ref = _ag_reference(_every(a), Bs, dim)
        results[f"gather_dim {dim} A"] = (_rel(got_a, ref_a), got_a.stride() == ref_a.stride())
        for i, (o, ro) in enumerate(zip(got, ref)):
            results[f"gather_dim {dim} mm{i}"] = (_rel(o, ro), o.stride() == ro.stride())
        none_a, again = torch.ops.triton_dist.fused_all_gather_matmul(a, Bs, dim, None, return_A=False)
        results[f"gather_dim {dim} torch op"] = (max(_rel(o, ro) for o, ro in zip(again, ref)), none_a is None)
        # gradients: the objective is the sum over the ranks of each rank's weighted outputs
        weights = [_on_rank(torch.randn(o.shape, generator=torch.Generator().manual_seed(7 + r)), dtype) for o in got]
        leaf_a, leaf_bs = a.clone().requires_grad_(), [B.clone().requires_grad_() for B in Bs]
        _, outs = torch.ops.triton_dist.fused_all_gather_matmul(leaf_a, leaf_bs, dim, None)
        sum((o * wt).sum() for o, wt in zip(outs, weights)).backward()
        every_a, every_w = _every(a), [_every(wt) for wt in weights]
        every_b = [_every(B) for B in Bs]
        ref_leaf = [t.double().requires_grad_() for t in every_a]
        ref_bs = [[t.double().requires_grad_() for t in per_b] for per_b in every_b]
        loss = 0
        for q in range(world):
            _, products = _ag_reference(ref_leaf, [ref_bs[i][q] for i in range(3)], dim)
            loss = loss + sum((p * every_w[i][q].double()).sum() for i, p in enumerate(products))
        loss.backward()
        results[f"gather_dim {dim} grad A"] = (_rel(leaf_a.grad, ref_leaf[r].grad), True)
        results[f"gather_dim {dim} grad B"] = (max(_rel(b.grad, ref_bs[i][r].grad) for i, b in enumerate(leaf_bs)),
                                               True)
    return results


def _matmul_reduce_scatter(dtype=torch.float32):
    r, world = td.rank(), td.world_size()
    BATCH, M, N, K = SHAPES[world]
    results = {}
    for dim in (0, 1, 2):
        for op in ("avg", "sum"):
            g = torch.Generator().manual_seed(42 + r)
            a, b = (_on_rank(torch.rand(BATCH, M, K, generator=g), dtype),
                    _on_rank(torch.rand(K, N, generator=g), dtype))
            got = fused_matmul_reduce_scatter(a, b, op, dim)
            total = sum(x.double() @ y.double() for x, y in zip(_every(a), _every(b)))
            ref = total.chunk(world, dim)[r].contiguous() / (world if op == "avg" else 1)
            results[f"scatter_dim {dim} {op}"] = (_rel(got, ref), got.stride() == ref.stride())
        leaf_a, leaf_b = a.clone().requires_grad_(), b.clone().requires_grad_()
        weight = _on_rank(torch.randn(ref.shape, generator=torch.Generator().manual_seed(3 + r)), dtype)
        (torch.ops.triton_dist.fused_matmul_reduce_scatter(leaf_a, leaf_b, "sum", dim, None) * weight).sum().backward()
        ref_a = [t.double().requires_grad_() for t in _every(a)]
        ref_b = [t.double().requires_grad_() for t in _every(b)]
        full_w = torch.cat([w.double() for w in _every(weight)], dim)
        (sum(x @ y for x, y in zip(ref_a, ref_b)) * full_w).sum().backward()
        results[f"scatter_dim {dim} grad"] = (max(_rel(leaf_a.grad, ref_a[r].grad), _rel(leaf_b.grad, ref_b[r].grad)),
                                              True)
    return results


def _one_b_both_layouts(dtype=torch.float32):
    """A single B given as a contiguous [K, N] and as the transposed view of an [N, K] weight (torchtitan's): the
    ops read either as it lies (``_as_read``); {case: relative error} of the outputs and both gradients."""
    r, world = td.rank(), td.world_size()
    g = torch.Generator().manual_seed(5 + r)
    a = _on_rank(torch.rand(world * 3, 5, 8, generator=g), dtype)
    wt = _on_rank(torch.rand(6, 8, generator=g), dtype)  # [N, K]
    errs = {}
    for layout, b in (("[K, N]", wt.t().contiguous()), ("[N, K].t()", wt.t())):
        leaf_a, leaf_w = a[:3].clone().requires_grad_(), wt.clone().requires_grad_()
        b_leaf = leaf_w.t().contiguous() if layout == "[K, N]" else leaf_w.t()
        _, (out,) = torch.ops.triton_dist.fused_all_gather_matmul(leaf_a, [b_leaf], 0, None)
        rs = torch.ops.triton_dist.fused_matmul_reduce_scatter(leaf_a.repeat(world, 1, 1), b_leaf, "sum", 0, None)
        (out.sum() + rs.sum()).backward()
        ref_a = [t.double().requires_grad_() for t in _every(a[:3])]
        ref_w = [t.double().requires_grad_() for t in _every(wt)]
        # the objective: every rank's gathered product and every rank's slice of the reduced sum, summed
        sum((torch.cat(ref_a) @ w.t()).sum() + (x.repeat(world, 1, 1) @ w.t()).sum()
            for x, w in zip(ref_a, ref_w)).backward()
        every_a, every_w = [t.double() for t in _every(a[:3])], [t.double() for t in _every(wt)]
        errs[f"{layout} ag out"] = _rel(out, torch.cat(every_a) @ every_w[r].t())
        errs[f"{layout} rs out"] = _rel(rs, sum(x.repeat(world, 1, 1) @ w.t() for x, w in zip(every_a, every_w))
                                        .chunk(world)[r])
        errs[f"{layout} grad a"] = _rel(leaf_a.grad, ref_a[r].grad)
        errs[f"{layout} grad w"] = _rel(leaf_w.grad, ref_w[r].grad)
    return errs


def test_one_b_in_either_layout(ranks):
    for errs in ranks(2, _one_b_both_layouts):
        assert all(e < 1e-5 for e in errs.values()), errs


def _bf16_on_gpu():
    """The three checks above in bf16 on this rank's GPU: {case: (error, strides as torch's)}."""
    both = {f"one B {k}": (e, True) for k, e in _one_b_both_layouts(torch.bfloat16).items()}
    return {**both, **_all_gather_matmul(torch.bfloat16), **_matmul_reduce_scatter(torch.bfloat16)}


@gpu_only
@pytest.mark.parametrize("world", [1, 2])
def test_async_tp_ops_bf16_on_gpus(ranks, world):
    """The async-TP ops on the GPU kernels (ranks sharing the GPU where there are fewer), forward and backward,
    within bf16's rounding of the fp64 reference."""
    for res in ranks(world, _bf16_on_gpu):
        bad = {k: v for k, v in res.items() if not (v[0] < 2e-2 and v[1])}
        assert not bad, bad


@pytest.mark.parametrize("world", [1, 2, 3])
def test_fused_all_gather_matmul_matches_torch(ranks, world):
    for res in ranks(world, _all_gather_matmul):
        bad = {k: v for k, v in res.items() if not (v[0] < 1e-5 and v[1])}
        assert not bad, bad


@pytest.mark.parametrize("world", [1, 2, 3])
def test_fused_matmul_reduce_scatter_matches_torch(ranks, world):
    for res in ranks(world, _matmul_reduce_scatter):
        bad = {k: v for k, v in res.items() if not (v[0] < 1e-5 and v[1])}
        assert not bad, bad


def _empty_k():
    """Both ops on A with K = 0 (every gather_dim / scatter_dim), forward and backward, eager and compiled:
    {case: whether the results are torch's (zeros of its shapes) and the gradients zeros of the inputs' shapes}."""
    world = td.world_size()
    results = {}
    for compiled in (False, True):
        torch._dynamo.reset()
        for dim in (0, 1, 2):
            full = [2 * world, world, 0]
            shape = list(full)
            shape[dim] //= world
            a, b = torch.rand(shape, requires_grad=True), torch.rand(0, 4, requires_grad=True)

            def gather(a, b, dim=dim):
                return torch.ops.triton_dist.fused_all_gather_matmul(a, [b], dim, None)

            fn = torch.compile(gather, fullgraph=True, backend="aot_eager") if compiled else gather
            got_a, (out,) = fn(a, b)
            want = (tuple(full), tuple(full[:2]) + (4,))
            ok = (tuple(got_a.shape), tuple(out.shape)) == want and bool((out == 0).all())
            (out.sum() + got_a.sum()).backward()
            ok &= a.grad.shape == a.shape and b.grad.shape == b.shape and bool((b.grad == 0).all())
            results[f"fused_all_gather_matmul dim {dim} compiled={compiled}"] = ok
            a = torch.rand(2 * world, 2 * world, 0, requires_grad=True)
            b = torch.rand(0, 2 * world, requires_grad=True)

            def scatter(a, b, dim=dim):
                return torch.ops.triton_dist.fused_matmul_reduce_scatter(a, b, "avg", dim, None)

            fn = torch.compile(scatter, fullgraph=True, backend="aot_eager") if compiled else scatter
            out = fn(a, b)
            want = [2 * world] * 3
            want[dim] = 2
            ok = tuple(out.shape) == tuple(want) and bool((out == 0).all())
            out.sum().backward()
            ok &= a.grad.shape == a.shape and b.grad.shape == b.shape and bool((b.grad == 0).all())
            results[f"fused_matmul_reduce_scatter dim {dim} compiled={compiled}"] = ok
    return results


@pytest.mark.parametrize("world", [1, 2])
def test_empty_k(ranks, world):
    """K = 0 (an empty product, torch's zeros): the ops once folded A's leading dims by ``reshape(-1, K)``,
    which cannot infer the rows of an empty tensor."""
    for res in ranks(world, _empty_k):
        assert all(res.values()), res


def _routed_and_refused():
    """torch.ops.symm_mem's ops routed here (CPU tensors), and what bad arguments raise."""
    use_for_torch_async_tp(("CPU",))
    world = td.world_size()
    a, Bs = torch.rand(4, 6, 8), [torch.rand(8, 5) for _ in range(2)]
    group_name = dist.group.WORLD.group_name
    ref_a, ref = fused_all_gather_matmul(a, Bs, 1, group_name)
    got_a, got = torch.ops.symm_mem.fused_all_gather_matmul(a, Bs, 1, group_name)
    routed = torch.equal(got_a, ref_a) and all(torch.equal(x, y) for x, y in zip(got, ref))
    rs = torch.ops.symm_mem.fused_matmul_reduce_scatter(torch.rand(2 * world, 3, 8), Bs[0], "sum", 0, group_name)
    routed &= tuple(rs.shape) == (2, 3, 5)
    # torch.compile(fullgraph) of both ops, forward and backward, as eager
    x, y = torch.rand(4, 6, 8, requires_grad=True), torch.rand(8, 5, requires_grad=True)

    def chain(x, y):
        _, (o,) = torch.ops.triton_dist.fused_all_gather_matmul(x, [y], 1, None)
        return torch.ops.triton_dist.fused_matmul_reduce_scatter(o, y.t().contiguous(), "sum", 0, None).sum()

    chain(x, y).backward()
    eager = (x.grad.clone(), y.grad.clone())
    x.grad = y.grad = None
    torch.compile(chain, fullgraph=True)(x, y).backward()
    routed &= max(_rel(x.grad, eager[0].double()), _rel(y.grad, eager[1].double())) < 1e-6  # (inductor sums y's
    # two gradient terms in its own order)
    names = error_names([lambda: fused_all_gather_matmul(a, [torch.rand(7, 5)], 0),
                         lambda: fused_all_gather_matmul(a, Bs, 3),
                         lambda: fused_all_gather_matmul(a, [], 0),
                         lambda: fused_matmul_reduce_scatter(a, Bs[0], "max", 0),
                         lambda: fused_matmul_reduce_scatter(torch.rand(world + 1, 3, 8), Bs[0], "sum", 0)])
    return routed, names


def test_torch_async_tp_ops_routed_and_bad_arguments_refused(ranks):
    for routed, names in ranks(2, _routed_and_refused):
        assert routed and names == ["ValueError"] * 5, (routed, names)


# ----------------------------------------------------------------------------------------------- FP8
E4M3 = torch.float8_e4m3fn


def _close(got, ref, dtype):
    """Relative error of ``got`` against the fp64 ``ref`` (an FP8 result: within one e4m3 step, 1/8)."""
    err = (got.double() - ref).abs().max() / ref.abs().max()
    return err.item() < {torch.bfloat16: 1e-2, torch.float32: 1e-5, E4M3: 0.13}[dtype]


def _scaled_all_gather_matmul():
    """PyTorch's cases of fused_all_gather_scaled_matmul: gather_dim 0 / 1 x tensor-wise (FP8, bf16 and fp32
    products), row-wise sharded and row-wise replicated A scales, three Bs; random positive scales."""
    r, world = td.rank(), td.world_size()
    BATCH, M, N, K = 8, 64, 16, 32
    results = {}
    for dim in (0, 1):
        lead = [BATCH, M]
        lead[dim] //= world
        full = [BATCH, M]
        g = torch.Generator().manual_seed(42 + r)
        a = torch.rand(*lead, K, generator=g).to(E4M3)
        Bs = [torch.rand(N, K, generator=g).to(E4M3).T for _ in range(3)]  # views of [N, K] weights, as torch's test
        for mode in ("tensor-wise", "row-wise-sharded", "row-wise-replicated"):
            if mode == "tensor-wise":
                a_scale = torch.rand((), generator=torch.Generator().manual_seed(1)) + 0.05
                b_scales = [torch.rand((), generator=g) + 0.05 for _ in range(3)]
                dtypes = [None, torch.bfloat16, torch.float32]
            else:
                replicated = torch.rand(*full, 1, generator=torch.Generator().manual_seed(2)) + 0.05
                a_scale = replicated if mode == "row-wise-replicated" else \
                    replicated.narrow(dim, r * lead[dim], lead[dim]).contiguous()
                b_scales = [torch.rand(1, N, generator=g) + 0.05 for _ in range(3)]
                dtypes = [torch.bfloat16] * 3
            got_a, got = torch.ops.triton_dist.fused_all_gather_scaled_matmul(
                a, Bs, a_scale, b_scales, dim, dist.group.WORLD.group_name, [None] * 3, [None] * 3, dtypes,
                [False] * 3)
            shards = [t.view(torch.uint8) for t in _every(a.view(torch.uint8))]
            ref_a = torch.stack(shards).movedim(dim + 1, 1).flatten(0, 1).movedim(0, dim)
            deq_a = ref_a.view(E4M3).double() * (a_scale.double() if mode == "tensor-wise" else
                                                 (replicated.double() if mode != "tensor-wise" else None))
            ok = torch.equal(got_a.view(torch.uint8), ref_a) and got_a.stride() == ref_a.stride()
            for o, B, sb, d in zip(got, Bs, b_scales, dtypes):
                want = d or E4M3
                ref = deq_a @ (B.double() * sb.double())
                ok &= o.dtype == want and tuple(o.shape) == tuple(ref.shape) and _close(o, ref, want)
            results[f"gather_dim {dim} {mode}"] = ok
    return results


@pytest.mark.parametrize("world", [1, 2])
def test_fused_all_gather_scaled_matmul_matches_torch(ranks, world):
    for res in ranks(world, _scaled_all_gather_matmul):
        assert all(res.values()), res


def _scaled_matmul_reduce_scatter():
    """PyTorch's cases of fused_scaled_matmul_reduce_scatter: scatter_dim 0 / 1 (and 2: N), row-wise and
    tensor-wise scales, "avg", bf16 out; and a 2-D A with output_shape naming the 3-D product."""
    r, world = td.rank(), td.world_size()
    BATCH, M, N, K = 8, 64, 16, 32
    name = dist.group.WORLD.group_name
    results = {}
    for dim in (0, 1, 2):
        for rowwise in (True, False):
            g = torch.Generator().manual_seed(42 + r)
            a = torch.rand(BATCH, M, K, generator=g).to(E4M3)
            b = torch.rand(N, K, generator=g).to(E4M3).T
            a_scale = torch.rand(BATCH, M, 1, generator=g) + 0.05 if rowwise else torch.rand((), generator=g) + 0.05
            b_scale = torch.rand(1, N, generator=g) + 0.05 if rowwise else torch.rand((), generator=g) + 0.05
            got = torch.ops.triton_dist.fused_scaled_matmul_reduce_scatter(
                a, b, a_scale, b_scale, "avg", dim, dim, name, [BATCH, M, N], out_dtype=torch.bfloat16)
            parts = [(x.view(E4M3).double() * sa.double()) @ (y.view(E4M3).double() * sb.double())
                     for x, sa, y, sb in zip(_every(a.view(torch.uint8)), _every(a_scale),
                                             _every(b.t().contiguous().view(torch.uint8)), _every(b_scale))
                     for y in [y.t()]]
            ref = (sum(parts) / world).chunk(world, dim)[r]
            results[f"scatter_dim {dim} rowwise={rowwise}"] = (got.is_contiguous() and got.dtype == torch.bfloat16
                                                               and _close(got, ref, torch.bfloat16))
        if dim == 1:  # A given 2-D (flattened), the product's shape in output_shape
            flat = torch.ops.triton_dist.fused_scaled_matmul_reduce_scatter(
                a.reshape(BATCH * M, K), b, a_scale, b_scale, "sum", 1, 0, name, [BATCH, M, N],
                out_dtype=torch.float32)
            results["2-D A, output_shape"] = _close(flat, ref * world, torch.float32) and \
                tuple(flat.shape) == (BATCH, M // world, N)
    return results


@pytest.mark.parametrize("world", [1, 2])
def test_fused_scaled_matmul_reduce_scatter_matches_torch(ranks, world):
    for res in ranks(world, _scaled_matmul_reduce_scatter):
        assert all(res.values()), res
