"""Autograd through the ops (``kernels/autograd.py``), on CPU ranks (fp32 under the interpreter: exact products):
every gradient against an fp64 torch reference of the whole computation across the ranks — the objective is the
sum of every rank's loss, each rank's loss a random weighting of its own outputs — at 1, 2 and 3 ranks with
uneven row counts; bitwise the same gradients on a second run; the same under torch.compile (fullgraph); calls
that cannot be differentiated (out= with grad) refused, config= with grad the forward's; the grouped GEMM's
gradients (padding between groups, an empty group) in this process; MoE dispatch/combine, gemm_ar and
all_reduce_rmsnorm; a TP chain on groups {0, 1} and {2, 3} of 4 ranks."""

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint

import triton_dist as td
from triton_dist.kernels import ag_gemm, all_gather, all_reduce, fp8, gemm_rs
from triton_dist.kernels import allgather_gemm as agm

from ..conftest import cpu_only, error_names, gpu_only


def _all(seed, shape):
    """Every rank's tensor of ``shape`` (the same on every rank: each rank takes its own), fp64."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(td.world_size())]


def _leaf(t):
    return t.float().to(td.shmem.device()).requires_grad_()


def _rel(got, ref):
    return ((got.double().cpu() - ref).abs().max() / ref.abs().max().clamp(min=1e-30)).item()


def _grads(m, k, n, seed):
    """{what: relative error} of every gradient on this rank."""
    r, world = td.rank(), td.world_size()
    errs = {}
    # ag_gemm: out_r = cat(a) @ w_r.T (plain and with the SiLU gate), loss_r = sum(out_r * R_r)
    for activation in ("none", "silu_gate"):
        cols = 2 * n if activation == "silu_gate" else n
        a64, w64, r64 = _all(seed, (m, k)), _all(seed + 1, (cols, k)), _all(seed + 2, (world * m, n))
        ref_a = [t.clone().requires_grad_() for t in a64]
        ref_w = [t.clone().requires_grad_() for t in w64]
        x = torch.cat(ref_a)
        loss = 0
        for s in range(world):
            h = x @ ref_w[s].T
            out = F.silu(h[:, :n]) * h[:, n:] if activation == "silu_gate" else h
            loss = loss + (out * r64[s]).sum()
        loss.backward()
        for keep in (False, True):
            a, w = _leaf(a64[r]), _leaf(w64[r])
            out = ag_gemm(a, w, activation=activation, keep_gathered=keep)
            (out * r64[r].float().to(out.device)).sum().backward()
            errs[f"ag_gemm {activation} keep={keep} a"] = _rel(a.grad, ref_a[r].grad)
            errs[f"ag_gemm {activation} keep={keep} w"] = _rel(w.grad, ref_w[r].grad)
    # the gathered output used too: its gradient reaches a as a reduce-scatter
    a64, w64 = _all(seed + 3, (m, k)), _all(seed + 4, (n, k))
    rg = _all(seed + 5, (world * m, k))
    ref_a = [t.clone().requires_grad_() for t in a64]
    x = torch.cat(ref_a)
    sum(((x @ w64[s].T).sum() + (x * rg[s]).sum()) for s in range(world)).backward()
    a = _leaf(a64[r])
    out, gath = ag_gemm(a, _leaf(w64[r]), return_gathered=True)
    (out.sum() + (gath * rg[r].float().to(gath.device)).sum()).backward()
    errs["ag_gemm gathered a"] = _rel(a.grad, ref_a[r].grad)
    # gemm_rs: out_r = rows_r(sum_s a_s @ w_s.T), M rows uneven over the ranks
    rows = world * m + (1 if world > 1 else 0)
    a64, w64 = _all(seed + 6, (rows, k)), _all(seed + 7, (n, k))
    weights = torch.randn(rows, n, generator=torch.Generator().manual_seed(seed + 8), dtype=torch.float64)
    ref_a = [t.clone().requires_grad_() for t in a64]
    ref_w = [t.clone().requires_grad_() for t in w64]
    (sum(ai @ wi.T for ai, wi in zip(ref_a, ref_w)) * weights).sum().backward()
    a, w = _leaf(a64[r]), _leaf(w64[r])
    out = gemm_rs(a, w)
    mine = torch.tensor_split(weights, world)[r]
    (out * mine.float().to(out.device)).sum().backward()
    errs["gemm_rs a"], errs["gemm_rs w"] = _rel(a.grad, ref_a[r].grad), _rel(w.grad, ref_w[r].grad)
    # all_gather and all_reduce
    x64, r64 = _all(seed + 9, (m, k)), _all(seed + 10, (world * m, k))
    ref = [t.clone().requires_grad_() for t in x64]
    sum((torch.cat(ref) * r64[s]).sum() for s in range(world)).backward()
    x = _leaf(x64[r])
    (all_gather(x) * r64[r].float().to(x.device)).sum().backward()
    errs["all_gather"] = _rel(x.grad, ref[r].grad)
    r64 = _all(seed + 11, (m, k))
    ref = [t.clone().requires_grad_() for t in x64]
    sum((sum(ref) * r64[s]).sum() for s in range(world)).backward()
    x = _leaf(x64[r])
    (all_reduce(x) * r64[r].float().to(x.device)).sum().backward()
    errs["all_reduce"] = _rel(x.grad, ref[r].grad)
    return errs


@pytest.mark.parametrize("world", [1, 2, 3])
def test_gradients_match_fp64(ranks, world):
    for errs in ranks(world, _grads, 5, 24, 16, world):
        bad = {k: v for k, v in errs.items() if not v < 1e-5}
        assert not bad, bad


def _empty_shard_grads(m, k):
    """ag_gemm (plain, SiLU gate, gathered rows returned) on empty shards ([0, K] or [m, 0] rows on every rank),
    forward and backward: (its outputs and gradients as shapes, every value of them finite and zero)."""
    g = torch.Generator().manual_seed(3 + td.rank())
    got = []
    for kw, n in (({}, 4), ({"activation": "silu_gate"}, 8), ({"return_gathered": True}, 4)):
        a = torch.randn(m, k, generator=g).requires_grad_()
        w = torch.randn(n, k, generator=g).requires_grad_()
        res = ag_gemm(a, w, **kw)
        outs = res if isinstance(res, tuple) else (res,)
        sum(o.sum() for o in outs).backward()
        tensors = outs + (a.grad, w.grad)
        got.append(([tuple(t.shape) for t in tensors], all(bool((t == 0).all()) for t in tensors)))
    return got


@pytest.mark.parametrize("world", [1, 2, 3])
def test_gradients_of_empty_shards(ranks, world):
    """No rows (or K = 0) on every rank: zero outputs and zero gradients of the inputs' shapes (the backward's
    re-gather of the weight gradient once built an empty symmetric workspace and failed on its peer views)."""
    for m, k in ((0, 5), (3, 0)):
        want = [([(world * m, 4), (m, k), (4, k)], True), ([(world * m, 4), (m, k), (8, k)], True),
                ([(world * m, 4), (world * m, k), (m, k), (4, k)], True)]
        assert ranks(world, _empty_shard_grads, m, k) == [want] * world


def _strided_weight_grads(m, k, n):
    """gemm_rs on a weight of any strides (a column slice: neither contiguous nor a transposed view, which the
    forward copies) and a transposed view of a, M uneven over the ranks: {what: relative error vs fp64}."""
    r, world = td.rank(), td.world_size()
    rows = world * m + 1
    a64, w64 = _all(31, (rows, k)), _all(32, (n, k))
    weights = torch.randn(rows, n, generator=torch.Generator().manual_seed(33), dtype=torch.float64)
    ref_a = [t.clone().requires_grad_() for t in a64]
    ref_w = [t.clone().requires_grad_() for t in w64]
    total = sum(x @ y.T for x, y in zip(ref_a, ref_w))
    (total * weights).sum().backward()
    a = a64[r].float().T.contiguous().T.requires_grad_()
    wide = torch.full((n, 2 * k), float("nan"))
    wide[:, ::2] = w64[r].float()
    w = wide[:, ::2].detach().requires_grad_()
    out = gemm_rs(a, w)
    (out * torch.tensor_split(weights, world)[r].float()).sum().backward()
    return {"out": _rel(out, torch.tensor_split(total, world)[r].detach()), "a": _rel(a.grad, ref_a[r].grad),
            "w": _rel(w.grad, ref_w[r].grad)}


@pytest.mark.parametrize("world", [1, 2, 3])
def test_gemm_rs_gradients_of_a_strided_weight(ranks, world):
    """The backward reads w.T as it lies where ag_gemm can (w contiguous, or a transposed view), else a contiguous
    copy: a strided w, which the forward takes, once failed the backward's ag_gemm ("w must be contiguous")."""
    for errs in ranks(world, _strided_weight_grads, 2, 7, 5):
        assert all(e < 1e-5 for e in errs.values()), errs


def _regather_calls():
    """Eager backward calls that gather again (ag_gemm's input, FP8-grads gemm_rs's output gradient): how many
    started by ``start_gather`` (overlapped with the input gradient's GEMM) and how many waited for at once."""
    from triton_dist.kernels import autograd
    calls = {"start_gather": 0, "gathered": 0}

    def counted(name, fn):
        def call(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return call
    saved = autograd.start_gather, autograd.gathered
    autograd.start_gather, autograd.gathered = counted("start_gather", saved[0]), counted("gathered", saved[1])
    try:
        a, w = torch.randn(6, 32, requires_grad=True), torch.randn(16, 32, requires_grad=True)
        ag_gemm(a, w).sum().backward()
        gemm_rs(a, w, quantize="row", fp8_grads=True).sum().backward()
    finally:
        autograd.start_gather, autograd.gathered = saved
    return calls


def test_the_weight_gradients_regather_overlapped(ranks):
    assert ranks(2, _regather_calls) == [{"start_gather": 2, "gathered": 0}] * 2


def _twice_and_compiled():
    """Gradients of a TP MLP-like chain (ag_gemm SiLU gate -> gemm_rs) three times eagerly and once under
    torch.compile(fullgraph=True): (bitwise equal eager runs, compiled error vs eager)."""
    r = td.rank()
    g = torch.Generator().manual_seed(7 + r)
    x0, gu0, d0 = torch.randn(6, 32, generator=g), torch.randn(48, 32, generator=g), torch.randn(32, 24, generator=g)

    def step(fn):
        x, gu, d = (t.clone().requires_grad_() for t in (x0, gu0, d0))
        fn(x, gu, d).backward()
        return [t.grad for t in (x, gu, d)]

    def chain(x, gu, d):
        return (gemm_rs(ag_gemm(x, gu, activation="silu_gate"), d) ** 2).sum()

    first, second, third = step(chain), step(chain), step(chain)
    compiled = step(torch.compile(chain, fullgraph=True))
    same = all(torch.equal(p, q) and torch.equal(p, o) for p, q, o in zip(first, second, third))
    return same, max(_rel(c, e.double()) for c, e in zip(compiled, first))


def test_gradients_bitwise_reproducible_and_compiled(ranks):
    for same, err in ranks(2, _twice_and_compiled):
        assert same and err < 1e-6, (same, err)


def _refusals():
    a = torch.randn(4, 16, requires_grad=True)
    w = torch.randn(8, 16, requires_grad=True)
    return error_names([lambda: gemm_rs(a, w, out=torch.empty(2, 8)),
                        lambda: all_reduce(a, out=torch.empty(4, 16))])


def test_calls_that_cannot_be_differentiated_are_refused(ranks):
    for names in ranks(2, _refusals):
        assert names == ["ValueError"] * 2, names


def _with_configs():
    """{op: (largest relative difference of the output and the inputs' gradients from the call without config,
    what a bad config raised)} of differentiable calls given ``config=`` (each op's own knobs, another path than
    its default where it has one), and whether the caller's config was left behind."""
    from triton_dist.kernels import all_reduce_rmsnorm, gemm, gemm_ar, grouped_gemm, library

    gen = torch.Generator().manual_seed(40 + td.rank())
    m, k, n = 6, 32, 16
    tensors = dict(a=torch.randn(m, k, generator=gen), w=torch.randn(n, k, generator=gen),
                   x=torch.randn(m, n, generator=gen), res=torch.randn(m, n, generator=gen),
                   weight=torch.rand(n, generator=gen) + 0.5, we=torch.randn(2, n, k, generator=gen))
    offsets = torch.tensor([0, 2, m], dtype=torch.int32)
    calls = {
        "gemm": (lambda t, cfg: gemm(t["a"], t["w"], config=cfg), {"BLOCK_N": 32}, "ab"),
        "ag_gemm": (lambda t, cfg: ag_gemm(t["a"], t["w"], config=cfg), {"path": "fallback"}, "ab"),
        "ag_gemm silu_gate": (lambda t, cfg: ag_gemm(t["a"], t["w"], activation="silu_gate", config=cfg),
                              {"path": "fallback"}, "ab"),
        "gemm_rs": (lambda t, cfg: gemm_rs(t["a"], t["w"], config=cfg), {"path": "fallback"}, "ab"),
        "gemm_ar": (lambda t, cfg: gemm_ar(t["a"], t["w"], config=cfg), {"path": "fallback"}, "ab"),
        "all_reduce": (lambda t, cfg: all_reduce(t["x"], config=cfg), {"num_programs": 1}, "x"),
        "all_reduce_rmsnorm": (lambda t, cfg: all_reduce_rmsnorm(t["x"], t["res"], t["weight"], 1e-6, config=cfg),
                               {"num_programs": 1}, "x"),
        "grouped_gemm": (lambda t, cfg: grouped_gemm(t["a"], t["we"], offsets, config=cfg), {"BLOCK_N": 32}, "a"),
    }
    found = {}
    for name, (call, cfg, _) in calls.items():
        results = []
        for config in (None, cfg):
            t = {key: v.clone().requires_grad_() for key, v in tensors.items()}
            out = call(t, config)
            outs = out if isinstance(out, tuple) else (out,)
            sum((o * (i + 1)).sum() for i, o in enumerate(outs)).backward()
            results.append([o.detach() for o in outs] + [v.grad for v in t.values() if v.grad is not None])
        err = max(_rel(got, want.double()) for got, want in zip(results[1], results[0]))
        bad = error_names([lambda: call({key: v.clone().requires_grad_() for key, v in tensors.items()},
                                        {"NO_SUCH_KNOB": 1})])[0]
        found[name] = (err, len(results[0]) == len(results[1]) > 1, bad)
    return found, getattr(library._CALLER_CONFIG, "value", None)


def test_differentiable_calls_take_config_for_their_forward(ranks):
    """``config=`` with grad: the op's forward runs with it (a bad knob is refused from inside the op: the config
    reached it), the backward with its tuned configurations; the same output and gradients as without it, and
    nothing of it left for a later call."""
    for found, left in ranks(2, _with_configs):
        assert left is None
        for name, (err, compared, bad) in found.items():
            assert err < 1e-5 and compared and bad == "ValueError", (name, err, compared, bad)


@cpu_only  # CPU tensors: the interpreter in this process (GPU: test_dtypes / the layers' GPU tests)
@pytest.mark.parametrize("activation,w_layout", [("none", "nk"), ("silu_gate", "nk"), ("none", "kn")])
@pytest.mark.parametrize("counts", [False, True])
def test_grouped_gemm_gradients_match_fp64(activation, w_layout, counts):
    """Groups with alignment padding between them (counts) or packed (offsets only), one empty; padding rows of
    the input and of the incoming gradient hold NaN (what the forward leaves there must not leak into any
    gradient; the input's gradient is zero there). "kn": w [E, K, N], out = x @ w[e]. The SiLU gate both ways: the
    public call (keeps the pre-activation) and the torch op (computes it again in the backward)."""
    from triton_dist.kernels import grouped_gemm

    gen = torch.Generator().manual_seed(11)
    sizes, pad, K, N = [5, 0, 19, 3], 4 if counts else 0, 24, 10
    starts, row = [], 0
    for n in sizes:
        starts.append(row)
        row += n + (pad - n % pad) % pad if pad else n
    row += 3  # rows past every group
    offsets = torch.tensor(starts + [starts[-1] + sizes[-1]], dtype=torch.int32)
    width = 2 * N if activation == "silu_gate" else N
    inside = torch.zeros(row, dtype=torch.bool)
    for s, n in zip(starts, sizes):
        inside[s:s + n] = True
    x64 = torch.where(inside[:, None], torch.randn(row, K, generator=gen, dtype=torch.float64), float("nan"))
    w64 = torch.randn(*((4, K, width) if w_layout == "kn" else (4, width, K)), generator=gen, dtype=torch.float64)
    weighting = torch.randn(row, N, generator=gen, dtype=torch.float64)
    ref_x, ref_w = x64.clone().requires_grad_(), w64.clone().requires_grad_()
    loss = 0
    for e, (s, n) in enumerate(zip(starts, sizes)):
        h = ref_x[s:s + n] @ (ref_w[e] if w_layout == "kn" else ref_w[e].T)
        out = F.silu(h[:, :N]) * h[:, N:] if activation == "silu_gate" else h
        loss = loss + (out * weighting[s:s + n]).sum()
    loss.backward()
    cnt = torch.tensor(sizes, dtype=torch.int32) if counts else None
    calls = [lambda x, w: grouped_gemm(x, w, offsets, cnt, activation=activation, w_layout=w_layout)]
    if activation == "silu_gate":  # the torch op itself keeps only x: its backward computes the pre-activation again
        calls.append(lambda x, w: torch.ops.triton_dist.grouped_gemm(x, w, offsets, cnt, activation, w_layout))
    ref_gx = torch.where(inside[:, None], ref_x.grad, 0)
    for call in calls:
        x, w = x64.float().requires_grad_(), w64.float().requires_grad_()
        call(x, w).backward(torch.where(inside[:, None], weighting.float(), float("nan")))
        assert torch.isfinite(x.grad).all() and torch.isfinite(w.grad).all()
        assert (x.grad[~inside] == 0).all()
        assert _rel(x.grad, ref_gx) < 1e-5 and _rel(w.grad, ref_w.grad) < 1e-5, (_rel(x.grad, ref_gx),
                                                                                 _rel(w.grad, ref_w.grad))


def _moe_grads(T, H, E, K, align, backends=(), configs=(None, None)):
    """Dispatch -> one linear layer per expert (grouped_gemm) -> combine, on this rank's tokens; the gradients of
    x, the top-k weights and the experts' weights against fp64 torch over every rank's tokens (some slots unused,
    one rank without tokens when T allows); the chain under activation checkpointing and, with each of
    ``backends``, under torch.compile(fullgraph=True), forward and backward: their gradients against the eager
    ones ("... vs eager"). ``configs``: the dispatch's and the combine's ``config=``."""
    from triton_dist.kernels import ep_combine, ep_dispatch, grouped_gemm

    r, world = td.rank(), td.world_size()
    el = E // world
    tokens = [T if q != world - 1 or world == 1 else 0 for q in range(world)]  # the last rank: no tokens
    g = torch.Generator().manual_seed(21)
    every = []
    for q in range(world):
        x = torch.randn(tokens[q], H, generator=g, dtype=torch.float64)
        idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(tokens[q])]) if tokens[q] else \
            torch.zeros((0, K), dtype=torch.int64)
        if tokens[q]:
            idx[torch.rand(tokens[q], K, generator=g) < 0.2] = -1
        every.append((x, idx, torch.rand(tokens[q], K, generator=g, dtype=torch.float64),
                      torch.randn(tokens[q], H, generator=g, dtype=torch.float64)))
    experts = torch.randn(E, H, H, generator=g, dtype=torch.float64) / H ** 0.5
    # reference: the sum over the ranks of each rank's weighted outputs
    ref_x = [e[0].clone().requires_grad_() for e in every]
    ref_w = [e[2].clone().requires_grad_() for e in every]
    ref_e = experts.clone().requires_grad_()
    loss = 0
    for q in range(world):
        idx = every[q][1]
        y = torch.zeros(tokens[q], H, dtype=torch.float64)
        for j in range(K):
            used = idx[:, j] >= 0
            f = torch.einsum("th,tnh->tn", ref_x[q], ref_e[idx[:, j].clamp(min=0)])
            y = y + torch.where(used[:, None], ref_w[q][:, j:j + 1] * f, 0.0)
        loss = loss + (y * every[q][3]).sum()
    loss.backward()
    from triton_dist.kernels.moe_ep.buffers import buffers

    def layer(x, idx, w, mine, weighting):
        recv = ep_dispatch(x, idx, w, num_experts=E, max_tokens=max(T, 1), align=align, config=configs[0])
        h = grouped_gemm(recv.x, mine, recv.expert_offsets, recv.expert_counts)
        return (ep_combine(h, recv.handle, config=configs[1]) * weighting).sum()

    def grads(fn):
        x = every[r][0].float().requires_grad_()
        w = every[r][2].float().requires_grad_()
        mine = experts[r * el:(r + 1) * el].float().requires_grad_()
        buffers(E, K, max(T, 1), H, torch.float32, align).recv_slots.fill_(10 ** 9)  # records nobody writes: stale
        td.shmem.barrier()
        fn(x, every[r][1], w, mine, every[r][3].float()).backward()
        return x.grad, w.grad, mine.grad

    eager = grads(layer)
    errs = {"x": _rel(eager[0], ref_x[r].grad) if tokens[r] else 0.0,
            "topk_weights": _rel(eager[1], ref_w[r].grad) if tokens[r] else 0.0,
            "experts": _rel(eager[2], ref_e.grad[r * el:(r + 1) * el])}
    checkpointed = grads(lambda *args: torch.utils.checkpoint.checkpoint(layer, *args, use_reentrant=False))
    errs["checkpoint vs eager"] = max(_rel(c, e.double()) if c.numel() else 0.0 for c, e in zip(checkpointed, eager))
    for backend in backends:
        torch._dynamo.reset()
        compiled = grads(torch.compile(layer, fullgraph=True, backend=backend))
        errs[f"{backend} vs eager"] = max(_rel(c, e.double()) if c.numel() else 0.0 for c, e in zip(compiled, eager))
    return errs


@pytest.mark.parametrize("world,align,backends", [(1, 1, ("aot_eager",)), (2, 4, ("aot_eager", "inductor")),
                                                  (3, 1, ("aot_eager",))])
def test_moe_dispatch_combine_gradients_match_fp64(ranks, world, align, backends):
    """Eagerly, and (the torch ops' autograd, ``moe_ep/training.py``) with activation checkpointing and under
    torch.compile(fullgraph=True), forward and backward: checkpointing and aot_eager give the eager bits, inductor
    (its own fused fp32 arithmetic around the ops) within 1e-6 of them (1.4e-7 seen)."""
    for errs in ranks(world, _moe_grads, 9, 16, 2 * world, 2, align, backends):
        bad = {k: v for k, v in errs.items() if not v < 1e-5}
        assert not bad and errs["aot_eager vs eager"] == errs["checkpoint vs eager"] == 0.0, errs
        assert errs.get("inductor vs eager", 0.0) < 1e-6, errs


def test_moe_gradients_with_configs_match_fp64(ranks):
    """``config=`` with grad: the dispatch's other token chunks (3, not the default 2) reach its records, which
    both backwards walk (the combine of x's gradient, the dispatch of the output's), and the combine's own knobs
    its forward; gradients against fp64, eagerly and with activation checkpointing."""
    configs = ({"num_chunks": 3, "block_tokens": 4}, {"num_programs": 3})
    for errs in ranks(2, _moe_grads, 9, 16, 4, 2, 1, (), configs):
        assert all(v < 1e-5 for v in errs.values()) and errs["checkpoint vs eager"] == 0.0, errs


def _moe_grads_three_times():
    """The MoE chain's gradients (x, top-k weights, experts) three times: bitwise equal?"""
    from triton_dist.kernels import ep_combine, ep_dispatch, grouped_gemm

    g = torch.Generator().manual_seed(5 + td.rank())
    x0, w0 = torch.randn(7, 16, generator=g), torch.rand(7, 2, generator=g)
    idx = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(7)])
    e0 = torch.randn(2, 16, 16, generator=g)
    runs = []
    for _ in range(3):
        x, w, e = (t.clone().requires_grad_() for t in (x0, w0, e0))
        recv = ep_dispatch(x, idx, w, num_experts=4, max_tokens=7)
        ep_combine(grouped_gemm(recv.x, e, recv.expert_offsets, recv.expert_counts), recv.handle).pow(2).sum() \
            .backward()
        runs.append([x.grad, w.grad, e.grad])
    return all(torch.equal(p, q) for run in runs[1:] for p, q in zip(runs[0], run))


def test_moe_gradients_bitwise_reproducible(ranks):
    assert all(ranks(2, _moe_grads_three_times))


def _allreduce_grads(m, k, n, h):
    """gemm_ar and all_reduce_rmsnorm (both outputs used, an fp32 weight beside fp32 activations): every gradient
    against fp64 (the sum of every rank's loss)."""
    from triton_dist.kernels import all_reduce_rmsnorm, gemm_ar

    r, world = td.rank(), td.world_size()
    errs = {}
    a64, w64, g64 = _all(31, (m, k)), _all(32, (n, k)), _all(33, (m, n))
    ref_a = [t.clone().requires_grad_() for t in a64]
    ref_w = [t.clone().requires_grad_() for t in w64]
    total = sum(x @ y.T for x, y in zip(ref_a, ref_w))
    sum((total * g).sum() for g in g64).backward()
    a, w = _leaf(a64[r]), _leaf(w64[r])
    (gemm_ar(a, w) * g64[r].float()).sum().backward()
    errs["gemm_ar a"], errs["gemm_ar w"] = _rel(a.grad, ref_a[r].grad), _rel(w.grad, ref_w[r].grad)
    x64, res64, gn64, gr64 = _all(34, (m, h)), _all(35, (m, h)), _all(36, (m, h)), _all(37, (m, h))
    wt64 = _all(38, (h,))[0] + 1.0  # the same norm weight on every rank (a replicated parameter)
    ref_x = [t.clone().requires_grad_() for t in x64]
    ref_res = [t.clone().requires_grad_() for t in res64]
    ref_wt = wt64.clone().requires_grad_()
    summed = sum(ref_x)
    loss = 0
    for q in range(world):
        new = ref_res[q] + summed
        normed = new * torch.rsqrt(new.pow(2).mean(-1, keepdim=True) + 1e-6) * ref_wt
        loss = loss + (normed * gn64[q]).sum() + (new * gr64[q]).sum()
    loss.backward()
    x, res, wt = _leaf(x64[r]), _leaf(res64[r]), _leaf(wt64)
    normed, new = all_reduce_rmsnorm(x, res, wt, 1e-6)
    ((normed * gn64[r].float()).sum() + (new * gr64[r].float()).sum()).backward()
    errs["rmsnorm x"], errs["rmsnorm residual"] = _rel(x.grad, ref_x[r].grad), _rel(res.grad, ref_res[r].grad)
    # the weight is each rank's copy: its gradient is this rank's loss's, the reference's is every rank's
    wt_ref = torch.autograd.grad(sum((((ref_res[q] + summed) * torch.rsqrt((ref_res[q] + summed).pow(2).mean(
        -1, keepdim=True) + 1e-6) * ref_wt) * gn64[q]).sum() for q in [r]), ref_wt)[0]
    errs["rmsnorm weight"] = _rel(wt.grad, wt_ref)
    return errs


@pytest.mark.parametrize("world", [1, 2, 3])
def test_allreduce_ops_gradients_match_fp64(ranks, world):
    for errs in ranks(world, _allreduce_grads, 5, 24, 16, 32):
        bad = {k: v for k, v in errs.items() if not v < 1e-5}
        assert not bad, bad


def _grads_on_groups():
    """4 ranks as TP groups {0, 1} and {2, 3}: an ag_gemm (SiLU gate) -> gemm_rs chain on each group; every
    gradient against fp64 over the group's members only."""
    from .test_groups import _new_groups

    r = td.rank()
    (tp,) = _new_groups([[0, 1], [2, 3]])
    members = [0, 1] if r < 2 else [2, 3]
    me = members.index(r)
    g = torch.Generator().manual_seed(40)
    data = [(torch.randn(3, 16, generator=g, dtype=torch.float64), torch.randn(20, 16, generator=g,
                                                                                dtype=torch.float64),
             torch.randn(16, 10, generator=g, dtype=torch.float64)) for _ in range(4)]
    mine = [data[q] for q in members]
    refs = [[t.clone().requires_grad_() for t in d] for d in mine]
    x = torch.cat([d[0] for d in refs])
    full = 0  # the group's product, every row: sum over members of silu(gate) * up @ down.T
    for _, gu, down in refs:
        h = x @ gu.T
        full = full + (F.silu(h[:, :10]) * h[:, 10:]) @ down.T
    full.pow(2).sum().backward()  # = the sum over members of their output rows squared
    a, gu, down = (t.float().requires_grad_() for t in mine[me])
    gemm_rs(ag_gemm(a, gu, activation="silu_gate", group=tp), down, group=tp).pow(2).sum().backward()
    return max(_rel(t.grad, ref.grad) for t, ref in zip((a, gu, down), refs[me]))


def test_gradients_on_groups_match_fp64(ranks):
    for err in ranks(4, _grads_on_groups):
        assert err < 1e-5, err


def _quantized_calls(world):
    """ag_gemm (plain and SiLU gate) and gemm_rs with ``quantize`` on high-precision operands (K 160: two
    128-groups, the second short), the FP8 mode turning with the world size: {what: whether it holds}. The forward is the FP8 op on ``fp8.quantize_operands``'
    operands and scales, bit for bit (with and without grad); the gradients are those of the unquantised product
    fed the gradient that reached the FP8 one, bit for bit (straight-through: the same backward on the same a, w
    and output gradient)."""
    g = torch.Generator().manual_seed(17 + td.rank())
    a0, w0, gate_up0 = (torch.randn(*shape, generator=g) for shape in ((5, 160), (24, 160), (48, 160)))

    from triton_dist.kernels import silu_gate  # the gate a training call runs on the kept pre-activation

    results = {}
    for i, (name, weight, activation, op) in enumerate((("ag_gemm", w0, "none", ag_gemm),
                                                        ("gemm_rs", w0, "none", gemm_rs),
                                                        ("ag_gemm silu_gate", gate_up0, "silu_gate", ag_gemm))):
        mode = fp8.MODES[(i + world) % len(fp8.MODES)]
        name = f"{name} {mode}"
        kw = {"activation": activation} if op is ag_gemm else {}
        a8, w8, scales = fp8.quantize_operands(a0, weight, mode)
        fp8_call = dict(scale_a=scales.a, scale_w=scales.w, out_dtype=torch.float32)
        with torch.no_grad():
            if activation == "none":
                fp8_out = op(a8, w8, **fp8_call)
            else:  # the gate fused, or (block scales of halves not whole 128-row blocks) torch's after the product
                fused = mode != "block"
                fp8_out = op(a8, w8, **kw, **fp8_call) if fused else agm.silu_gate_torch(op(a8, w8, **fp8_call))
            results[f"{name} no_grad"] = torch.equal(op(a0, weight, quantize=mode, **kw), fp8_out)
        a, w = a0.clone().requires_grad_(), weight.clone().requires_grad_()
        out = op(a, w, quantize=mode, **kw)
        weighting = torch.randn(out.shape, generator=torch.Generator().manual_seed(5))
        (out * weighting).sum().backward()
        # the reference: the FP8 product, the silu_gate op on it (with grad: as without quantize), and the unquantised
        # product's backward fed the gradient that reached the FP8 product
        h = op(a8, w8, **fp8_call).requires_grad_()
        fp8_out = h if activation == "none" else silu_gate(h)
        (fp8_out * weighting).sum().backward()
        results[f"{name} forward"] = torch.equal(out, fp8_out)
        a_ref, w_ref = a0.clone().requires_grad_(), weight.clone().requires_grad_()
        op(a_ref, w_ref).backward(h.grad)
        results[f"{name} gradients"] = torch.equal(a.grad, a_ref.grad) and torch.equal(w.grad, w_ref.grad)
    return results


@pytest.mark.parametrize("world", [1, 2])  # (3 ranks: tests/nn/test_fp8_training.py, the layers)
def test_quantized_calls_forward_fp8_and_differentiate_straight_through(ranks, world):
    for results in ranks(world, _quantized_calls, world):
        assert all(results.values()), results


def _quantize_refusals():
    a, w = torch.randn(4, 16), torch.randn(8, 16)
    a8, w8, scales = fp8.quantize_operands(a, w, "row")
    return error_names([lambda: ag_gemm(a, w, quantize="fp8"),                                # no such mode
                        lambda: gemm_rs(a, w, quantize="int8"),
                        lambda: ag_gemm(a8, w8, quantize="row"),                              # FP8 already
                        lambda: ag_gemm(a, w, quantize="row", scale_a=scales.a, scale_w=scales.w),
                        lambda: gemm_rs(a, w, quantize="row", out_dtype=torch.bfloat16),
                        lambda: ag_gemm(a, w, quantize="row", return_gathered=True),          # FP8 rows
                        lambda: ag_gemm(a.requires_grad_(), w, quantize="row", keep_gathered=True),
                        lambda: torch.ops.triton_dist.ag_gemm(a, w, False, "none", None, "e4m3"),
                        lambda: torch.ops.triton_dist.gemm_rs(a, w, None, "e4m3")])


def test_quantize_refuses_bad_input(ranks):
    for names in ranks(2, _quantize_refusals):
        assert names == ["ValueError", "ValueError", "TypeError"] + ["ValueError"] * 6, names


# ----------------------------------------------------------------------------------------------- FP8 gradients
# ``fp8_grads=True``: the backward's GEMMs in FP8 too, each operand quantised along that GEMM's reduction dimension.
# The reference is the same recipe in fp64 torch: the same tensors (output gradients, inputs, weights, laid out
# for each GEMM) quantised by ``fp8.quantize`` and the products taken in fp64 from the dequantised operands. Ours
# multiplies the same e4m3 values (products exact in fp32) and sums them in fp32: 1e-5 as the high-precision
# gradients above (6.5e-7 seen). fp16: the results are rounded to fp16, and so are gemm_rs's partials before their
# sum, unit roundoff 2**-11 for the result and each of up to 3 partials: 4 * 2**-11 (3.7e-4 seen).
FP8_GRADS_TOL = {torch.float32: 1e-5, torch.float16: 4 * 2.0 ** -11}
FP8_GRADS_APART = 3e-3  # FP8 rounding of every operand (steps of 2**-4 relative) against a high-precision backward


def _recipe(a, w, mode):
    """``a @ w.T`` of FP8 training's backward in fp64: ``a`` [M, K] quantised as the first operand ("block": 1x128
    groups), ``w`` [N, K] as the second (128x128 blocks), both along K, from their values in fp32."""
    def dequantised(t, scaling):
        q, scale = fp8.quantize(t.float(), scaling)
        return q.double() * fp8.expand(scale.double(), scaling, *t.shape)

    return dequantised(a, "group" if mode == "block" else mode) @ dequantised(w, mode).T


def _fp8_grads(dtype, modes, gate_modes=(), split=False):
    """ag_gemm (plain, and in ``gate_modes`` the torch op's SiLU gate) and gemm_rs with ``quantize`` and
    ``fp8_grads`` on ``dtype`` operands, in each of ``modes``: {what: (relative error against ``_recipe``'s
    gradients, relative distance from the high-precision backward's in fp64)}. ag_gemm: K 160 (two groups), N 136
    (grad_a's reduction: two groups); gemm_rs: M 131 rows, uneven over the ranks (grad_w's reduction: two groups).
    ``split``: on TP groups {0, 1} and {2, 3} of 4 ranks (each its own data), the references over the group's
    members."""
    from .test_groups import _new_groups

    group, world, r, seed = None, td.world_size(), td.rank(), 50
    if split:
        (group,) = _new_groups([[0, 1], [2, 3]])
        world, r, seed = 2, td.rank() % 2, 60 + 10 * (td.rank() // 2)
    gen = torch.Generator().manual_seed(seed)

    def every(*shape):  # every member's tensor of ``shape``, values of ``dtype``, in fp64
        return [torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype).double() for _ in range(world)]

    errs = {}
    for mode in modes:
        for activation in ("none", "silu_gate") if mode in gate_modes else ("none",):
            m, k, n = 5, 160, 136
            cols = 2 * n if activation == "silu_gate" else n
            a64, w64, wt64 = every(m, k), every(cols, k), every(world * m, n)
            x = torch.cat(a64)
            grads = []  # every member's gradient of its output (of h with the gate: at the unquantised h)
            for s in range(world):
                h = (x @ w64[s].T).requires_grad_()
                out = F.silu(h[:, :n]) * h[:, n:] if activation == "silu_gate" else h
                grads.append(torch.autograd.grad((out * wt64[s]).sum(), h)[0])
            ref_a = torch.tensor_split(sum(_recipe(g, w.T.contiguous(), mode) for g, w in zip(grads, w64)), world)[r]
            ref_w = _recipe(grads[r].T.contiguous(), x.T.contiguous(), mode)
            plain_a = torch.tensor_split(sum(g @ w for g, w in zip(grads, w64)), world)[r]
            a, w = (t.to(dtype).requires_grad_() for t in (a64[r], w64[r]))
            out, _ = torch.ops.triton_dist.ag_gemm(a, w, False, activation, td.shmem.group_name(group), mode, True)
            out.backward(wt64[r].to(dtype))
            name = f"ag_gemm {activation} {mode}"
            errs[f"{name} a"] = (_rel(a.grad, ref_a), _rel(a.grad, plain_a))
            errs[f"{name} w"] = (_rel(w.grad, ref_w), _rel(w.grad, grads[r].T @ x))
        rows, k, n = 131, 160, 24
        a64, w64, g64 = every(rows, k), every(n, k), every(rows, n)[0]
        pieces = torch.tensor_split(g64, world)  # member q's output rows' gradient, quantised by member q
        ref_a = torch.cat([_recipe(g, w64[r].T.contiguous(), mode) for g in pieces])
        ref_w = _recipe(g64.T.contiguous(), a64[r].T.contiguous(), mode)
        a, w = (t.to(dtype).requires_grad_() for t in (a64[r], w64[r]))
        gemm_rs(a, w, group=group, quantize=mode, fp8_grads=True).backward(pieces[r].to(dtype))
        errs[f"gemm_rs {mode} a"] = (_rel(a.grad, ref_a), _rel(a.grad, g64 @ w64[r]))
        errs[f"gemm_rs {mode} w"] = (_rel(w.grad, ref_w), _rel(w.grad, g64.T @ a64[r]))
        if not a.grad.dtype == w.grad.dtype == dtype:
            errs[f"gemm_rs {mode} dtypes"] = (float("inf"), 0.0)
    return errs


def _fp8_grads_failures(results, dtype):
    """{rank and what: errors} outside FP8_GRADS_TOL of the recipe or within FP8_GRADS_APART of the high-precision
    backward."""
    return {f"rank {q} {what}": v for q, errs in enumerate(results) for what, v in errs.items()
            if not (v[0] < FP8_GRADS_TOL[dtype] and v[1] > FP8_GRADS_APART)}


# (dtype, W, modes, the SiLU gate's modes): every mode on one rank and on several (the groups' test below runs
# "row" in fp16 on 4). The gate in fp32 only: the reference's gradient of the gate is fp64, ours is rounded to the
# inputs' dtype before it is quantised (in fp16 a rounding that moves a value across an e4m3 tie is likely; in
# fp32 it is not). Each case costs about 30 s of interpreter time per mode: CI's budget keeps the set small.
FP8_GRADS_CASES = [(torch.float32, 1, ("row", "block"), ("row",)), (torch.float32, 3, ("block", "tensor"), ()),
                   (torch.float16, 2, ("row",), ())]


@pytest.mark.parametrize("dtype,world,modes,gate_modes", FP8_GRADS_CASES, ids=["fp32-1", "fp32-3", "fp16-2"])
def test_fp8_grads_match_the_recipe_in_fp64(ranks, dtype, world, modes, gate_modes):
    """Every gradient within FP8_GRADS_TOL of the recipe's and FP8_GRADS_APART from the high-precision backward's
    (the FP8 backward ran), in the modes of FP8_GRADS_CASES."""
    failures = _fp8_grads_failures(ranks(world, _fp8_grads, dtype, modes, gate_modes), dtype)
    assert not failures, failures


def test_fp8_grads_on_groups_match_the_recipe_in_fp64(ranks):
    """TP groups {0, 1} and {2, 3} of 4 ranks, each with its own data."""
    failures = _fp8_grads_failures(ranks(4, _fp8_grads, torch.float16, ("row",), split=True), torch.float16)
    assert not failures, failures


def _fp8_grads_refusals():
    a, w = torch.randn(4, 16, requires_grad=True), torch.randn(8, 16, requires_grad=True)
    a8, w8, scales = fp8.quantize_operands(a.detach(), w.detach(), "row")
    return error_names([lambda: ag_gemm(a, w, fp8_grads=True),                                # without quantize
                        lambda: gemm_rs(a, w, fp8_grads=True),
                        lambda: ag_gemm(a8, w8, scale_a=scales.a, scale_w=scales.w, fp8_grads=True),
                        lambda: torch.ops.triton_dist.ag_gemm(a, w, False, "none", None, None, True),
                        lambda: torch.ops.triton_dist.gemm_rs(a, w, None, None, True),
                        lambda: ag_gemm(a, w, quantize="row", fp8_grads="yes"),               # not a bool
                        lambda: gemm_rs(a, w, quantize="block", fp8_grads=1),
                        lambda: gemm_rs(a, w, quantize="tensor", fp8_grads=None)])


def test_fp8_grads_refuses_bad_input(ranks):
    for names in ranks(2, _fp8_grads_refusals):
        assert names == ["ValueError"] * 5 + ["TypeError"] * 3, names


# ----------------------------------------------------------------------------------------------- GPU, bf16
# The same gradients in bf16 on GPUs. bf16 keeps 8 bits of mantissa, so no bf16 computation is exact: each of ours
# is held to what plain torch achieves on the same bf16 inputs (the same computation, no communication: an
# all-gather is exact, a reduce-scatter sums bf16 partials), both measured against fp64 torch of the whole
# computation. Ours may be BF16_FACTOR times worse (other summation orders, the SiLU gate's pre-activation
# recomputed in the backward, partials summed in fp32 or bf16), and never needs to beat one bf16 rounding at the
# reference's largest value (BF16_FLOOR). A wrong row, a stale buffer or a missing rank's term costs O(1).
BF16_FACTOR = 3.0
BF16_FLOOR = 2.0 ** -8
GPU_OP_SHAPES = [(333, 520, 1032), (512, 1024, 2048)]  # (rows per rank, N, K): rows off every tile, and round


def bf16_bound(torch_err):
    return max(BF16_FACTOR * torch_err, BF16_FLOOR)


def _err(got, ref):
    """max |got - ref| / max |ref|, inf when ``got`` holds a non-finite value (a poisoned one that was read) or has
    another shape, or ``ref`` is all zeros (nothing would be tested)."""
    if got is None or tuple(got.shape) != tuple(ref.shape) or not torch.isfinite(got).all():
        return float("inf")
    scale = ref.double().abs().max()
    return float("inf") if scale == 0 else ((got.double() - ref.double()).abs().max() / scale).item()


def _poison_workspaces():
    """NaN in the buffers peers' rows, partial tiles and MoE rows land in, records nobody wrote in the MoE's
    (as another layer's calls between a forward and its backward would leave them): a value read that this call
    did not write shows."""
    for ws in td.shmem.workspaces.cached("ag_gemm"):
        ws.a_full.fill_(float("nan"))
    for ws in td.shmem.workspaces.cached("gemm_rs"):
        ws.recv.fill_(float("nan"))
    for ws in td.shmem.workspaces.cached("moe_ep"):
        for rows in (ws.recv_x, ws.recv_w, ws.partials):
            rows.fill_(float("nan"))
        ws.recv_slots.fill_(10 ** 9)
    td.shmem.barrier()


class default_configs:
    """The ops' default configurations, not tuned ones (tuning compiles every candidate of every new shape: the
    tuned paths have their own GPU tests); the setting restored afterwards (pool ranks run many tests)."""

    def __enter__(self):
        import os

        self.saved = os.environ.get("TRITON_DIST_AUTOTUNE")
        os.environ["TRITON_DIST_AUTOTUNE"] = "0"

    def __exit__(self, *exc):
        import os

        if self.saved is None:
            os.environ.pop("TRITON_DIST_AUTOTUNE", None)
        else:
            os.environ["TRITON_DIST_AUTOTUNE"] = self.saved


def _ours_on_poisoned_workspaces(fn, inputs, weighting):
    """``fn(*leaves)``'s output and the gradients of sum(out * weighting) w.r.t. the leaves (copies of ``inputs``),
    run twice: first on throwaway inputs of the same shapes (every call of the forward and the backward builds its
    workspaces), then on ``inputs`` with the workspaces poisoned before the forward and before the backward."""
    for throwaway in (True, False):
        leaves = [(torch.randn_like(t) if throwaway else t).detach().clone().requires_grad_() for t in inputs]
        _poison_workspaces()
        out = fn(*leaves)
        _poison_workspaces()
        (out.double() * weighting.double()).sum().backward()
    return [out] + [t.grad for t in leaves]


def _silu_gate(h, activation):
    half = h.shape[1] // 2
    return F.silu(h[:, :half]) * h[:, half:] if activation == "silu_gate" else h


def _gpu_op_grads(m, n, k, seed, dtype=torch.bfloat16):
    """ag_gemm (plain and SiLU gate, the input gathered again or kept) and gemm_rs in bf16 on this rank's GPU:
    {what: (our error, plain torch's bf16 error)} of the output and of every gradient, both against fp64 torch
    of the whole computation (``dtype`` float32: CPU ranks run it too). Every rank makes every rank's inputs from
    one seed (fresh per call) and takes its own; the objective is the sum over the ranks of each rank's output
    weighted by random bf16 values (exact in either dtype). Ours on poisoned workspaces."""
    dev, r, world = td.shmem.device(), td.rank(), td.world_size()
    gen = torch.Generator(device=dev).manual_seed(seed)

    def every(*shape, scale=1.0):
        return [(torch.randn(*shape, device=dev, generator=gen) * scale).to(dtype) for _ in range(world)]

    def torch_run(dtype, inputs, loss_of):
        """(this rank's output, gradients of this rank's inputs) of plain torch in ``dtype``."""
        leaves = [[t.to(dtype, copy=True).requires_grad_() for t in each] for each in inputs]
        outs = loss_of(*leaves)
        sum((o.double() * wt.double()).sum() for o, wt in outs).backward()
        return [outs[r][0]] + [each[r].grad for each in leaves]

    errs = {}
    for activation in ("none", "silu_gate"):
        for keep in (False, True):
            cols = 2 * n if activation == "silu_gate" else n
            a, w, weighting = every(m, k), every(cols, k, scale=k ** -0.5), every(world * m, n)

            def ag_gemm_torch(a_, w_):  # rank s: cat(a) @ w_s.T (then the gate), weighted by its weighting
                x = torch.cat(a_)
                return [(_silu_gate(x @ w_[s].T, activation), weighting[s]) for s in range(world)]

            ref, plain = (torch_run(dt, (a, w), ag_gemm_torch) for dt in (torch.float64, dtype))
            ours = _ours_on_poisoned_workspaces(
                lambda x, y: ag_gemm(x, y, activation=activation, keep_gathered=keep), (a[r], w[r]), weighting[r])
            for what, got, want, theirs in zip(("out", "a", "w"), ours, ref, plain):
                errs[f"ag_gemm {activation} keep={keep} {what}"] = (_err(got, want), _err(theirs, want))
    # gemm_rs: out_r = rows_r(sum_s a_s @ w_s.T), the rows uneven over the ranks when there are several
    rows = world * m + (1 if world > 1 else 0)
    a, w = every(rows, k), every(n, k, scale=k ** -0.5)
    weighting = torch.randn(rows, n, device=dev, generator=gen).to(dtype)  # rank q: its rows of it

    def gemm_rs_torch(a_, w_):
        total = sum(x @ y.T for x, y in zip(a_, w_))  # bf16: each rank's partial rounded, then summed
        return list(zip(torch.tensor_split(total, world), torch.tensor_split(weighting, world)))

    ref, plain = (torch_run(dt, (a, w), gemm_rs_torch) for dt in (torch.float64, dtype))
    ours = _ours_on_poisoned_workspaces(gemm_rs, (a[r], w[r]), torch.tensor_split(weighting, world)[r])
    for what, got, want, theirs in zip(("out", "a", "w"), ours, ref, plain):
        errs[f"gemm_rs {what}"] = (_err(got, want), _err(theirs, want))
    return errs


def _gpu_op_grads_default_configs(m, n, k, seed):
    with default_configs():
        return _gpu_op_grads(m, n, k, seed)


def _bf16_failures(errs):
    return {what: f"ours {ours:.3g} > bound {bf16_bound(theirs):.3g} (plain torch {theirs:.3g})"
            for what, (ours, theirs) in errs.items() if not ours <= bf16_bound(theirs)}


@gpu_only
@pytest.mark.parametrize("m,n,k", GPU_OP_SHAPES)
@pytest.mark.parametrize("world", [1, 2, 4])
def test_op_gradients_bf16_on_gpus(ranks, world, m, n, k):
    """W = 1 on one GPU; W = 2, 4 where the machine (or the several-ranks-on-one-GPU mode) has the ranks."""
    args = (_gpu_op_grads_default_configs, m, n, k, 1000 * world + m)
    for errs in [ranks.on_one_gpu(*args)] if world == 1 else ranks(world, *args):
        assert not _bf16_failures(errs), _bf16_failures(errs)
