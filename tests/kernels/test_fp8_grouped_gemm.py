"""The grouped GEMM's FP8 mode (``grouped_gemm(x8, w8, ..., scale_x=, scale_w=)``, ``quantize=``) and
``fp8.quantize_stack``.

CPU (interpreter): per-tensor, rowwise and 128-blockwise operands, plain and SiLU-gated, both data paths (TMA
descriptors, masks), against fp64 products of the dequantised operands (quantised by torch in ``fp8_inputs``, not
by the package), NaN-poisoned outputs (rows outside every group stay untouched), K and N not multiples of 128;
``quantize=`` forward against the same recipe in torch and its straight-through backward against fp64;
``quantize_stack`` against per-expert torch quantisation (R not a multiple of 128); bad input; the fake
implementation. sm_90: FP8 wgmma in both scale modes. GPU: bf16 results at MoE shapes (skewed loads), and the
``quantize=`` training step's gradients.

``fp8_grads`` (the backward's GEMMs in FP8 too): the forward and both gradients against fp64 of the recipe
(``_fp8_grads_recipe``: each GEMM's operands quantised by ``fp8.quantize`` along its reduction, dequantised),
every mode, both weight layouts, plain and SiLU-gated, fp32 and fp16, an empty expert, ragged groups (one of more
than 128 rows: two block steps), NaN in the rows outside the groups (zero gradients there); bitwise reruns,
activation checkpointing and torch.compile(fullgraph); the weight cache keeping the transposed stack; the weight
gradient's FP8 modes on their own.
"""

import pytest
import torch

from triton_dist.kernels import fp8
from triton_dist.kernels.fp8 import quantize_stack
from triton_dist.kernels.grouped_gemm import grouped_gemm, grouped_gemm_torch, grouped_weight_grad
from triton_dist.kernels.silu_gate import silu_gate_backward

from ..conftest import cpu_only, error_names, gpu_only
from ..sm90 import compile_sm90
from .fp8_inputs import A_KIND, dequantize, fp8_steps, quantize, rel_err
from .test_grouped_gemm import _groups, _in_groups, _moe_counts

MODES = ["tensor", "row", "block"]


def _fp8_experts(x, w, mode):
    """x [rows, K] and w [E, N, K] quantised by torch in ``mode``: (x8, scale_x, w8, scale_w, fp64 x, fp64 w)."""
    x8, scale_x = quantize(x, A_KIND[mode])
    parts = [quantize(w[e], mode) for e in range(w.shape[0])]
    w8 = torch.stack([q for q, _ in parts])
    scale_w = torch.cat([s for _, s in parts]) if mode == "tensor" else torch.stack([s for _, s in parts])
    dw = torch.stack([dequantize(q, s, mode) for q, s in parts])
    return x8, scale_x, w8, scale_w, dequantize(x8, scale_x, A_KIND[mode]), dw


def _inputs(counts, k, n, experts, gen, align=16, tail=5):
    offsets, rows = _groups(counts, align, tail, gen)
    x = torch.randn(rows, k, generator=gen) * torch.rand(rows, 1, generator=gen) * 4
    w = torch.randn(experts, n, k, generator=gen) / k ** 0.5
    return offsets, x, w


@cpu_only
@pytest.mark.parametrize("activation", ["none", "silu_gate"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("use_tma", [None, False])
def test_fp8_grouped_gemm_matches_fp64(mode, activation, use_tma):
    """Expert 1 empty, ragged groups with padding between them, K = 160 (a 32-wide last K block), N = 72 (gated:
    I = 36) or 144 (a 16-row last weight block)."""
    gen = torch.Generator().manual_seed(hash((mode, activation, use_tma)) % 1000)
    counts = [19, 0, 26, 7]
    n = 72 if activation == "silu_gate" else 144
    offsets, x, w = _inputs(counts, 160, n, len(counts), gen)
    x8, sx, w8, sw, dx, dw = _fp8_experts(x, w, mode)
    rows, n_out = x.shape[0], n // 2 if activation == "silu_gate" else n
    out = torch.full((rows, n_out), float("nan"))
    grouped_gemm(x8, w8, offsets, torch.tensor(counts, dtype=torch.int32), activation, out=out, scale_x=sx,
                 scale_w=sw, out_dtype=torch.float32, config={"use_tma": use_tma, "num_programs": 3})
    ref = grouped_gemm_torch(dx, dw, offsets, torch.tensor(counts, dtype=torch.int32), activation)
    inside = _in_groups(offsets, counts, rows)
    assert rel_err(out[inside], ref[inside]) < 1e-5
    assert out[~inside].isnan().all()


def _quantize_recipe(x, w, offsets, counts, mode, activation, probe):
    """fp64 torch reference of ``grouped_gemm(x, w, ..., quantize=mode)`` and its backward for the loss
    ``sum(y * probe)`` over the rows inside the groups: (y, grad_x, grad_w). Forward: x and w quantised as torch
    quantises them (x's per-tensor amax over the rows inside the groups only). Backward: straight-through, the
    GEMMs on the unquantised x and w; SiLU-gated, the gate differentiated at the FP8 pre-activation (kept)."""
    inside = _in_groups(offsets, counts, x.shape[0])
    cnt = torch.tensor(counts, dtype=torch.int32)
    x, w = x.double(), w.double()
    _, _, _, _, _, w_fp8 = _fp8_experts(w.new_zeros(1, w.shape[2]), w, mode)
    x8, scale_x = quantize(x[inside], A_KIND[mode])
    x_fp8 = torch.zeros_like(x).index_put_((inside,), dequantize(x8, scale_x, A_KIND[mode]))
    h = grouped_gemm_torch(x_fp8, w_fp8, offsets, cnt).requires_grad_()
    y = h if activation == "none" else torch.nn.functional.silu(h[:, :h.shape[1] // 2]) * h[:, h.shape[1] // 2:]
    (y * torch.where(inside[:, None], probe.double(), 0)).sum().backward()
    grad_x, grad_w = torch.zeros_like(x), torch.zeros_like(w)
    for e, (start, n) in enumerate(zip(offsets.tolist(), counts)):
        dh = h.grad[start:start + n]
        grad_x[start:start + n] = dh @ w[e]
        grad_w[e] = dh.T @ x[start:start + n]
    return y.detach(), grad_x, grad_w


def _quantize_step(x, w, offsets, counts, mode, activation, gen):
    """``grouped_gemm(..., quantize=mode)`` forward and backward on x's device against ``_quantize_recipe``: the
    relative errors of y, grad_x, grad_w (inside the groups), and y's against the unquantised product."""
    inside = _in_groups(offsets, counts, x.shape[0])
    cnt = torch.tensor(counts, dtype=torch.int32)
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = grouped_gemm(xg, wg, offsets.to(x.device), cnt.to(x.device), activation, quantize=mode)
    probe = torch.randn(y.shape, generator=gen)
    (y.float() * torch.where(inside[:, None], probe, 0).to(y.device)).sum().backward()
    y_ref, grad_x, grad_w = _quantize_recipe(x.cpu(), w.cpu(), offsets, counts, mode, activation, probe)
    y = y.detach().cpu()
    exact = grouped_gemm_torch(x.cpu().double(), w.cpu().double(), offsets, cnt, activation)
    return (rel_err(y[inside], y_ref[inside]), rel_err(xg.grad.cpu(), grad_x), rel_err(wg.grad.cpu(), grad_w),
            rel_err(y[inside], exact[inside]))


@cpu_only
@pytest.mark.parametrize("activation", ["none", "silu_gate"])
@pytest.mark.parametrize("mode", MODES)
def test_fp8_grouped_gemm_quantize_forward_and_straight_through_backward(mode, activation):
    """``quantize=`` against the FP8 training recipe in torch (``_quantize_recipe``); a row outside the groups
    holds a huge value (x's per-tensor scale must not see it), gradients are zero there."""
    gen = torch.Generator().manual_seed(7 + MODES.index(mode))
    counts = [9, 21, 0]
    offsets, x, w = _inputs(counts, 144, 96 if activation == "silu_gate" else 48, len(counts), gen)
    x[~_in_groups(offsets, counts, x.shape[0])] = 1e4
    y_err, grad_x_err, grad_w_err, vs_exact = _quantize_step(x, w, offsets, counts, mode, activation, gen)
    assert y_err < 1e-4 and grad_x_err < 1e-5 and grad_w_err < 1e-5, (y_err, grad_x_err, grad_w_err)
    assert vs_exact > 100 * y_err  # FP8 ran


# ----------------------------------------------------------------------------------------------- fp8_grads
def _deq(t, kind):
    """fp64 ``t`` [R, C] as the recipe multiplies it: quantised by ``fp8.quantize`` (the kernels' rule in torch)
    from its fp32 values in ``kind`` (a scale per tensor, row, 1x128 group or 128x128 block), dequantised."""
    q, scale = fp8.quantize(t.float(), kind)
    return q.double() * fp8.expand(scale.double(), kind, *t.shape)


def _deq_tokens(t, kind):
    """``_deq`` along the rows (the tokens): a scale per column ("row") or one ("tensor")."""
    return _deq(t.T, kind).T


def _weight_grad_recipe(dy, x, groups, mode):
    """fp64 [E, N, K] ``dy[g].T @ x[g]`` of the FP8 operands: "tensor" / "row" scales per column (or one) over the
    rows inside the groups, "block" per column of each 128-row step of an expert's rows."""
    inside = torch.zeros(dy.shape[0], dtype=torch.bool)
    for start, n in groups:
        inside[start:start + n] = True
    dw = torch.zeros((len(groups), dy.shape[1], x.shape[1]), dtype=torch.float64)
    if mode != "block":
        dy, x = (_deq_tokens(torch.where(inside[:, None], t, 0), mode) for t in (dy, x))
    for e, (start, n) in enumerate(groups):
        step = 128 if mode == "block" else max(n, 1)
        for first in range(start, start + n, step):
            rows = slice(first, min(start + n, first + step))
            if mode == "block":
                dw[e] += _deq_tokens(dy[rows], "row").T @ _deq_tokens(x[rows], "row")
            else:
                dw[e] += dy[rows].T @ x[rows]
    return dw


def _fp8_grads_recipe(x, w, offsets, counts, mode, activation, w_layout, probe):
    """fp64 (y, grad_x, grad_w, plain) of ``grouped_gemm(x, w, ..., quantize=mode, fp8_grads=True)`` for the loss
    ``sum(y * probe)`` over the rows inside the groups. Forward: x quantised along K (the rows inside the groups),
    each expert's weight along K ("kn": its transpose). Backward: the pre-activation's gradient dh along N times
    each expert's weight transposed, quantised along N; grad_w from dh and x along the tokens
    (``_weight_grad_recipe``). SiLU-gated: dh is the op's own (``silu_gate_backward`` at the op's FP8
    pre-activation, in x's dtype), since a last-bit difference of one value can move its FP8 rounding a step.
    ``plain``: the unquantised GEMMs' (grad_x, grad_w) of the same dh (the straight-through backward)."""
    rows = x.shape[0]
    inside = _in_groups(offsets, counts, rows)
    groups = list(zip(offsets.tolist(), counts))
    w_nk = w if w_layout == "nk" else w.transpose(1, 2)
    xq = torch.zeros(x.shape, dtype=torch.float64)
    xq[inside] = _deq(x[inside], A_KIND[mode])
    h = torch.zeros((rows, w_nk.shape[1]), dtype=torch.float64)
    for e, (start, n) in enumerate(groups):
        h[start:start + n] = xq[start:start + n] @ _deq(w_nk[e], mode).T
    h.requires_grad_()
    y = h if activation == "none" else torch.nn.functional.silu(h[:, :h.shape[1] // 2]) * h[:, h.shape[1] // 2:]
    grad_y = torch.where(inside[:, None], probe, 0).to(x.dtype)
    (y * grad_y.double()).sum().backward()
    dh = grad_y
    if activation == "silu_gate":
        with torch.no_grad():
            pre = grouped_gemm(x, w, offsets, torch.tensor(counts, dtype=torch.int32), quantize=mode)
        dh = silu_gate_backward(pre, grad_y)
    dhq = torch.zeros(dh.shape, dtype=torch.float64)
    dhq[inside] = _deq(dh[inside], A_KIND[mode])
    grad_x, plain_x = torch.zeros(x.shape, dtype=torch.float64), torch.zeros(x.shape, dtype=torch.float64)
    plain_w = torch.zeros(w_nk.shape, dtype=torch.float64)
    for e, (start, n) in enumerate(groups):
        grad_x[start:start + n] = dhq[start:start + n] @ _deq(w_nk[e].T, mode).T
        plain_x[start:start + n] = dh[start:start + n].double() @ w_nk[e].double()
        plain_w[e] = dh[start:start + n].double().T @ x[start:start + n].double()
    grad_w = _weight_grad_recipe(dh, x, groups, mode)
    if w_layout == "kn":
        grad_w, plain_w = grad_w.transpose(1, 2), plain_w.transpose(1, 2)
    return y.detach(), grad_x, grad_w, (plain_x, plain_w)


def _fp8_grads_case(mode, w_layout, activation, dtype, seed):
    """Inputs of ``fp8_grads`` tests: (x, w, offsets, counts, rows inside the groups); an empty expert, a group of
    140 rows (two 128-row steps), NaN outside the groups; K = 144, N = 40 (gated: 2I = 80)."""
    gen = torch.Generator().manual_seed(seed)
    counts = [19, 0, 140, 7]
    offsets, x, w = _inputs(counts, 144, 80 if activation == "silu_gate" else 40, len(counts), gen)
    inside = _in_groups(offsets, counts, x.shape[0])
    x[~inside] = float("nan")
    if w_layout == "kn":
        w = w.transpose(1, 2).contiguous()
    return x.to(dtype), w.to(dtype), offsets, counts, inside


def _fp8_grads_step(fn, x, w, probe, inside):
    """(y, grad_x, grad_w) of ``fn(x, w)`` for the loss sum(y * probe) over the rows inside the groups."""
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fn(xg, wg)
    (y * torch.where(inside[:, None], probe, 0).to(y.dtype)).sum().backward()
    return y.detach(), xg.grad, wg.grad


FP8_GRADS_CASES = [("nk", "none", torch.float32), ("nk", "silu_gate", torch.float32), ("kn", "none", torch.float32),
                   ("nk", "silu_gate", torch.float16), ("kn", "none", torch.float16)]


@cpu_only
@pytest.mark.parametrize("w_layout,activation,dtype", FP8_GRADS_CASES)
@pytest.mark.parametrize("mode", MODES)
def test_fp8_grads_grouped_gemm_matches_the_recipe(mode, w_layout, activation, dtype):
    """The forward, grad_x and grad_w against ``_fp8_grads_recipe`` (fp32: sums of exact FP8 products; fp16: the
    results rounded to fp16), zero gradients outside the groups, apart from the straight-through gradients."""
    x, w, offsets, counts, inside = _fp8_grads_case(mode, w_layout, activation, dtype, MODES.index(mode))
    cnt = torch.tensor(counts, dtype=torch.int32)
    probe = torch.randn(x.shape[0], w.shape[1] // 2 if activation == "silu_gate" else
                        w.shape[2 if w_layout == "kn" else 1], generator=torch.Generator().manual_seed(5))
    y, grad_x, grad_w = _fp8_grads_step(
        lambda a, b: grouped_gemm(a, b, offsets, cnt, activation, w_layout=w_layout, quantize=mode, fp8_grads=True),
        x, w, probe, inside)
    y_ref, want_x, want_w, (plain_x, plain_w) = _fp8_grads_recipe(x, w, offsets, counts, mode, activation, w_layout,
                                                                  probe)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    errs = (rel_err(y[inside], y_ref[inside]), rel_err(grad_x, want_x), rel_err(grad_w, want_w))
    assert max(errs) < tol, errs
    assert (grad_x[~inside] == 0).all()
    assert rel_err(grad_x, plain_x) > 10 * tol and rel_err(grad_w, plain_w) > 10 * tol  # FP8 ran


def _fp8_grads_reruns(mode):
    """The gradients of ``fp8_grads`` (SiLU-gated) eagerly, again, under activation checkpointing and under
    torch.compile(fullgraph=True): the largest difference of each from the first ones."""
    from torch.utils.checkpoint import checkpoint

    x, w, offsets, counts, inside = _fp8_grads_case(mode, "nk", "silu_gate", torch.float32, 3)
    cnt = torch.tensor(counts, dtype=torch.int32)
    probe = torch.randn(x.shape[0], w.shape[1] // 2, generator=torch.Generator().manual_seed(4))

    def layer(a, b):
        return grouped_gemm(a, b, offsets, cnt, "silu_gate", quantize=mode, fp8_grads=True)

    def grads(fn):
        return _fp8_grads_step(fn, x, w, probe, inside)[1:]

    eager = grads(layer)
    others = (grads(layer), grads(lambda a, b: checkpoint(layer, a, b, use_reentrant=False)),
              grads(torch.compile(layer, fullgraph=True)))
    return [max((a - b).abs().max().item() for a, b in zip(eager, o)) for o in others]


@cpu_only
@pytest.mark.parametrize("mode", ["block"])  # (row's reruns: bitwise in the weight-cache test)
def test_fp8_grads_grouped_gemm_reruns_bitwise_under_checkpointing_and_compile(ranks, mode):
    for rerun, checkpointed, compiled in ranks(1, _fp8_grads_reruns, mode):
        assert rerun == 0.0 and checkpointed == 0.0 and compiled < 1e-6, (rerun, checkpointed, compiled)


@cpu_only
@pytest.mark.parametrize("mode", MODES)
def test_fp8_grads_weight_cache_keeps_the_transposed_stack(mode):
    """Inside ``fp8.weight_cache``: a weight stack's forward copy and its transposes' copy (grad_x's) are kept, two
    micro-batches quantise each once, and the gradients are bitwise those without the cache."""
    x, w, offsets, counts, inside = _fp8_grads_case(mode, "nk", "none", torch.float32, 9)
    x, w, offsets, inside = x[:48], w[:2, :, :136], offsets[:3], inside[:48]
    x = x[:, :136].contiguous()
    cnt = torch.tensor(counts[:2], dtype=torch.int32)
    probe = torch.randn(48, w.shape[1], generator=torch.Generator().manual_seed(2))
    param = torch.nn.Parameter(w.clone())

    def grads():
        xg = x.clone().requires_grad_()
        param.grad = None
        y = grouped_gemm(xg, param, offsets, cnt, quantize=mode, fp8_grads=True)
        (y * torch.where(inside[:, None], probe, 0)).sum().backward()
        return xg.grad, param.grad

    plain = grads()
    calls = []
    quantise = fp8.quantize_stack

    def counted(*args, **kwargs):
        calls.append(args[1])
        return quantise(*args, **kwargs)

    fp8.quantize_stack = counted
    try:
        with fp8.weight_cache() as cache:
            kept = [grads()]
            first = len(calls)
            kept.append(grads())
    finally:
        fp8.quantize_stack = quantise
    assert len(cache) == 2 and first and len(calls) == first, (len(cache), calls)  # the second quantised nothing
    assert all(torch.equal(a, b) for got in kept for a, b in zip(got, plain))


@cpu_only
@pytest.mark.parametrize("mode", MODES)
def test_fp8_grouped_weight_grad_matches_the_recipe(mode):
    """``grouped_weight_grad(..., quantize=mode)`` on its own: a group of 300 rows (three block steps, the last
    partial), an empty one, rows between the groups holding NaN, without counts (groups run to the next offset)."""
    gen = torch.Generator().manual_seed(20 + MODES.index(mode))
    offsets = torch.tensor([0, 300, 300, 333], dtype=torch.int32)
    dy, x = torch.randn(340, 24, generator=gen), torch.randn(340, 40, generator=gen) * 3
    dy[333:], x[333:] = float("nan"), float("nan")
    got = grouped_weight_grad(dy, x, offsets, None, 3, mode)
    want = _weight_grad_recipe(dy, x, [(0, 300), (300, 0), (300, 33)], mode)
    assert rel_err(got, want) < 1e-5 and (got[1] == 0).all()


@cpu_only
@pytest.mark.parametrize("mode,rows", [("tensor", 40), ("row", 40), ("block", 200), ("block", 128)])
def test_quantize_stack_matches_torch(mode, rows):
    """Each expert as torch quantises one weight (within one FP8 step: the kernels' conversion may round
    differently), the scales stacked; a 128x128 block never straddles two experts (200 rows: 72 of zeros added)."""
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(3, rows, 160, generator=gen) * torch.rand(3, rows, 1, generator=gen)
    q, scales = quantize_stack(w, mode)
    parts = [quantize(w[e], mode) for e in range(3)]
    ref_scales = torch.cat([s for _, s in parts]) if mode == "tensor" else torch.stack([s for _, s in parts])
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert scales.shape == ref_scales.shape and torch.allclose(scales, ref_scales, rtol=1e-6, atol=0)
    assert max(fp8_steps(q[e], parts[e][0]) for e in range(3)) <= 1


def _stack_transposed_failures(device):
    """``quantize_stack(w, mode, transposed=True)`` against ``quantize_stack`` of the contiguous transposes,
    bitwise, for ragged stacks in every high-precision dtype (and an empty stack); {case: why} of the failures."""
    gen = torch.Generator().manual_seed(31)
    failures = {}
    for mode in ("tensor", "row", "block"):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            for e, r, c in ((3, 200, 136), (2, 128, 40), (0, 16, 8)):
                w = (torch.randn(e, r, c, generator=gen) * torch.rand(e, 1, c, generator=gen)).to(dtype).to(device)
                q, s = quantize_stack(w, mode, transposed=True)
                q0, s0 = quantize_stack(w.transpose(1, 2).contiguous(), mode)
                if not (q.shape == q0.shape and torch.equal(q.view(torch.uint8), q0.view(torch.uint8))
                        and s.shape == s0.shape and torch.equal(s, s0)):
                    failures[(mode, str(dtype), e, r, c)] = f"{tuple(q.shape)} {tuple(s.shape)} vs {tuple(s0.shape)}"
    return failures


@cpu_only
def test_quantize_stack_of_transposes_is_bitwise_theirs():
    """The transposed quantiser's stack axis (an MoE weight stack's copy for grad_x with ``fp8_grads``): each
    expert's transpose quantised as ``quantize_stack`` quantises the contiguous transposes."""
    assert not _stack_transposed_failures("cpu")


@gpu_only
def test_quantize_stack_of_transposes_is_bitwise_theirs_on_gpu(ranks):
    failures = ranks.on_one_gpu(_stack_transposed_failures, "cuda")
    assert not failures, failures


def test_fp8_grouped_gemm_rejects_bad_input():
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(8, 128, generator=gen), torch.randn(2, 16, 128, generator=gen)
    offs = torch.tensor([0, 4, 8], dtype=torch.int32)
    x8, sx, w8, sw, _, _ = _fp8_experts(x, w, "row")
    calls = [
        lambda: grouped_gemm(x8, w8, offs, scale_x=sx),                                    # no scale_w
        lambda: grouped_gemm(x8, w8, offs, scale_x=sx, scale_w=sw[:1]),                    # one expert's scales
        lambda: grouped_gemm(x8, w8, offs, scale_x=sx, scale_w=sw, scaling="tensor"),      # mode and shapes
        lambda: grouped_gemm(x8, w8.transpose(1, 2).contiguous(), offs, scale_x=sx, scale_w=sw,
                             w_layout="kn"),                                               # FP8 is "nk"
        lambda: grouped_gemm(x, w, offs, quantize="row", out_dtype=torch.float32),         # quantize: no out_dtype
        lambda: grouped_gemm(x8, w8, offs, scale_x=sx, scale_w=sw, quantize="row"),        # quantize FP8
        lambda: grouped_gemm(x, w, offs, quantize="half"),                                 # mode
        lambda: grouped_gemm(x, w, offs, scaling="row"),                                   # scaling without FP8
        lambda: quantize_stack(w[0], "row"),                                               # not a stack
        lambda: quantize_stack(w, "group"),                                                # a weight's modes
        lambda: grouped_gemm(x, w, offs, fp8_grads=True),                                  # fp8_grads: quantize
        lambda: torch.ops.triton_dist.grouped_gemm(x, w, offs, None, "none", "nk", None, fp8_grads=True),
        lambda: grouped_gemm(x, w, offs, quantize="row", fp8_grads="yes"),                 # not a bool
        lambda: grouped_weight_grad(x, x, offs, None, 2, "half"),                          # mode
    ]
    assert error_names(calls) == ["TypeError", "ValueError", "ValueError", "ValueError", "ValueError", "ValueError",
                                  "ValueError", "ValueError", "TypeError", "ValueError", "ValueError", "ValueError",
                                  "TypeError", "ValueError"]


@cpu_only
def test_fp8_fake_impl():
    from torch._subclasses.fake_tensor import FakeTensorMode

    gen = torch.Generator().manual_seed(1)
    x8, sx, w8, sw, _, _ = _fp8_experts(torch.randn(12, 128, generator=gen), torch.randn(2, 32, 128, generator=gen),
                                        "block")
    offs = torch.tensor([0, 5, 12], dtype=torch.int32)
    with FakeTensorMode() as fake_mode:
        args = [fake_mode.from_tensor(t) for t in (x8, w8, offs)]
        out = torch.ops.triton_dist.grouped_gemm(*args, None, "silu_gate", scale_x=fake_mode.from_tensor(sx),
                                                 scale_w=fake_mode.from_tensor(sw))
        assert tuple(out.shape) == (12, 16) and out.dtype == torch.bfloat16
        x, w = fake_mode.from_tensor(torch.randn(12, 128)), fake_mode.from_tensor(torch.randn(2, 32, 128))
        out = torch.ops.triton_dist.grouped_gemm(x, w, args[2], quantize="tensor")
        assert tuple(out.shape) == (12, 32) and out.dtype == torch.float32
        out = torch.ops.triton_dist.grouped_gemm(x, w.transpose(1, 2).contiguous(), args[2], None, "none", "kn",
                                                 "block", fp8_grads=True)
        assert tuple(out.shape) == (12, 32) and out.dtype == torch.float32
        dw = torch.ops.triton_dist.grouped_weight_grad(out, x, args[2], None, 2, "row")
        assert tuple(dw.shape) == (2, 32, 128) and dw.dtype == torch.float32


@pytest.mark.parametrize("scales,imprecise", [("rows", 128), ("blocks", None)])
def test_fp8_grouped_gemm_compiles_for_sm90(scales, imprecise):
    """FP8 wgmma (e4m3 x e4m3 -> f32) from TMA loads of x and a weight in the stack; promoted (per-tensor /
    rowwise) and block-scaled, SiLU-gated."""
    sig = dict(x="tensordesc<fp8e4nv[128,128]>", w="tensordesc<fp8e4nv[64,128]>",
               out_desc="tensordesc<bf16[1,128,64]>", out="*bf16", offsets="*i32", counts="*i32",
               **{n: "i32" for n in ("E", "rows", "N", "K", "w_rows", "stride_xm", "stride_we", "stride_wn",
                                     "stride_om", "stride_sa", "stride_sw", "stride_swe")},
               scale_a="*fp32", scale_w="*fp32",
               **{n: "constexpr" for n in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "E_PAD", "HAS_COUNTS",
                                           "USE_TMA", "EPILOGUE_SUBTILE", "FLATTEN", "WARP_SPECIALIZE",
                                           "DOT_PRECISION", "SILU_GATE", "SCALES", "MAX_IMPRECISE_ACC")})
    res = compile_sm90("triton_dist.kernels.grouped_gemm", "grouped_gemm_kernel", sig,
                       dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, E_PAD=32, HAS_COUNTS=True, USE_TMA=True,
                            EPILOGUE_SUBTILE=False, FLATTEN=False, WARP_SPECIALIZE=False, DOT_PRECISION="tf32",
                            SILU_GATE=True, SCALES=scales, MAX_IMPRECISE_ACC=imprecise),
                       aligned=("K", "N", "stride_xm", "stride_wn", "stride_om"))
    ops = res["ops"]
    assert any(k.startswith("wgmma.mma_async.sync.aligned.") and k.endswith(".f32.e4m3.e4m3") for k in ops), ops
    assert any(k.startswith("cp.async.bulk.tensor.2d.shared") for k in ops), ops  # TMA loads


@pytest.mark.parametrize("mode", ["rows", "blocks"])
def test_fp8_grouped_weight_grad_compiles_for_sm90(mode):
    """The weight gradient's FP8 modes: FP8 wgmma (e4m3 x e4m3 -> f32) on token-major FP8 copies loaded by pointers
    ("rows") or on bf16 tiles loaded by TMA and quantised in the kernel ("blocks")."""
    rows = mode == "rows"
    sig = dict(dy="*fp8e4nv" if rows else "tensordesc<bf16[128,128]>",
               x="*fp8e4nv" if rows else "tensordesc<bf16[128,64]>", dw="tensordesc<bf16[1,128,64]>", dw_ptr="*bf16",
               offsets="*i32", counts="*i32",
               **{n: "i32" for n in ("E", "rows", "N", "K", "stride_dym", "stride_xm", "stride_we", "stride_wn",
                                     "stride_sdy", "stride_sx")},
               scale_dy="*fp32", scale_x="*fp32",
               **{n: "constexpr" for n in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "HAS_COUNTS", "USE_TMA", "DOT_PRECISION",
                                           "FP8", "MAX_IMPRECISE_ACC")})
    res = compile_sm90("triton_dist.kernels.grouped_gemm", "grouped_weight_grad_kernel", sig,
                       dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, HAS_COUNTS=True, USE_TMA=True,
                            DOT_PRECISION="tf32", FP8=mode, MAX_IMPRECISE_ACC=128 if rows else None),
                       aligned=("N", "K", "stride_dym", "stride_xm", "stride_we", "stride_wn"))
    ops = res["ops"]
    assert any(k.startswith("wgmma.mma_async.sync.aligned.") and k.endswith(".f32.e4m3.e4m3") for k in ops), ops
    if mode == "blocks":
        assert any(k.startswith("cp.async.bulk.tensor.2d.shared") for k in ops), ops  # TMA loads


# ----------------------------------------------------------------------------------------------- GPU
@gpu_only
@pytest.mark.parametrize("activation", ["none", "silu_gate"])
@pytest.mark.parametrize("mode", MODES)
def test_fp8_grouped_gemm_gpu_bf16(ranks, mode, activation):
    assert ranks.on_one_gpu(_check_gpu_fp8, mode, activation)


def _check_gpu_fp8(mode, activation):
    """MoE shapes, skewed loads, bf16 results against fp64 of the dequantised operands; NaN outside the groups."""
    gen = torch.Generator().manual_seed(3 + MODES.index(mode))
    experts, k, n = 16, 1024, 1536 if activation == "silu_gate" else 768
    counts = _moe_counts(experts, 4096, True, gen)
    offsets, x, w = _inputs(counts, k, n, experts, gen, tail=100)
    x8, sx, w8, sw, dx, dw = _fp8_experts(x, w, mode)
    rows = x.shape[0]
    out = torch.full((rows, n // 2 if activation == "silu_gate" else n), float("nan"), device="cuda",
                     dtype=torch.bfloat16)
    cnt = torch.tensor(counts, dtype=torch.int32)
    grouped_gemm(*(t.cuda() for t in (x8, w8, offsets, cnt)), activation, out=out, scale_x=sx.cuda(),
                 scale_w=sw.cuda())
    ref = grouped_gemm_torch(dx, dw, offsets, cnt, activation)
    inside = _in_groups(offsets, counts, rows)
    out = out.cpu()
    return rel_err(out[inside], ref[inside]) < 1e-2 and bool(out[~inside].isnan().all())


@gpu_only
@pytest.mark.parametrize("mode", MODES)
def test_fp8_grouped_gemm_gpu_quantize_training_step(ranks, mode):
    """bf16 x and w, ``quantize=``, SiLU-gated, at MoE shapes: forward and gradients against the FP8 training
    recipe in fp64 (``_quantize_recipe``; bf16's rounding of the kept pre-activation and the results)."""
    errs = ranks.on_one_gpu(_check_gpu_quantize, mode)
    assert max(errs[:3]) < 2e-2 and errs[3] > 2 * errs[0], errs


def _check_gpu_quantize(mode):
    gen = torch.Generator().manual_seed(11)
    experts, k, n = 8, 1024, 1024
    counts = _moe_counts(experts, 2048, False, gen)
    offsets, x, w = _inputs(counts, k, n, experts, gen)
    return _quantize_step(x.to("cuda", torch.bfloat16), w.to("cuda", torch.bfloat16), offsets, counts, mode,
                          "silu_gate", gen)


@gpu_only
@pytest.mark.parametrize("w_layout", ["nk", "kn"])
@pytest.mark.parametrize("mode", MODES)
def test_fp8_grads_grouped_gemm_gpu_bf16(ranks, mode, w_layout):
    """bf16 x and w, ``quantize=mode, fp8_grads=True``, at MoE shapes with skewed loads (groups of several 128-row
    steps): the forward and both gradients against the recipe in fp64 (``_fp8_grads_recipe``; bf16's rounding of
    the results), and apart from the straight-through gradients."""
    errs = ranks.on_one_gpu(_check_gpu_fp8_grads, mode, w_layout)
    assert max(errs[:3]) < 2e-2 and min(errs[3:]) > 2 * max(errs[1:3]), errs


def _check_gpu_fp8_grads(mode, w_layout):
    gen = torch.Generator().manual_seed(13)
    experts, k, n = 8, 1024, 768
    counts = _moe_counts(experts, 2048, True, gen)
    offsets, x, w = _inputs(counts, k, n, experts, gen)
    if w_layout == "kn":
        w = w.transpose(1, 2).contiguous()
    x, w = x.bfloat16(), w.bfloat16()
    inside = _in_groups(offsets, counts, x.shape[0])
    cnt = torch.tensor(counts, dtype=torch.int32)
    probe = torch.randn(x.shape[0], n, generator=gen)
    y, grad_x, grad_w = _fp8_grads_step(
        lambda a, b: grouped_gemm(a, b, offsets.cuda(), cnt.cuda(), w_layout=w_layout, quantize=mode, fp8_grads=True),
        x.cuda(), w.cuda(), probe.cuda(), inside.cuda())
    y_ref, want_x, want_w, (plain_x, plain_w) = _fp8_grads_recipe(x, w, offsets, counts, mode, "none", w_layout,
                                                                  probe)
    grad_x, grad_w = grad_x.cpu(), grad_w.cpu()
    return (rel_err(y.cpu()[inside], y_ref[inside]), rel_err(grad_x, want_x), rel_err(grad_w, want_w),
            rel_err(grad_x, plain_x), rel_err(grad_w, plain_w))
