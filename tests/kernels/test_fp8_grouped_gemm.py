"""The grouped GEMM's FP8 mode (``grouped_gemm(x8, w8, ..., scale_x=, scale_w=)``, ``quantize=``) and
``fp8.quantize_stack``.

CPU (interpreter): per-tensor, rowwise and 128-blockwise operands, plain and SiLU-gated, both data paths (TMA
descriptors, masks), against fp64 products of the dequantised operands (quantised by torch in ``fp8_inputs``, not
by the package), NaN-poisoned outputs (rows outside every group stay untouched), K and N not multiples of 128;
``quantize=`` forward against the same recipe in torch and its straight-through backward against fp64;
``quantize_stack`` against per-expert torch quantisation (R not a multiple of 128); bad input; the fake
implementation. sm_90: FP8 wgmma in both scale modes. GPU: bf16 results at MoE shapes (skewed loads), and the
``quantize=`` training step's gradients.
"""

import pytest
import torch

from triton_dist.kernels.fp8 import quantize_stack
from triton_dist.kernels.grouped_gemm import grouped_gemm, grouped_gemm_torch

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
    ]
    assert error_names(calls) == ["TypeError", "ValueError", "ValueError", "ValueError", "ValueError", "ValueError",
                                  "ValueError", "ValueError", "TypeError", "ValueError"]


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
