"""The GEMM core on FP8 operands (``gemm(a, w, scale_a=..., scale_w=...)`` and its alias ``scaled_gemm``) and the
quantisation kernel.

CPU (interpreter): per-tensor, rowwise and blockwise scales on ragged M / N / K (a short last 128-group), the TMA
and the masked paths, fp32 and bf16 results, e5m2 operands, ``out=``, against an fp64 reference of the dequantised
inputs; ``quantize_fp8`` (the kernel dispatch's senders run) within one FP8 step of torch; bad input (scale shapes
and dtypes, mixed formats, a GPU without FP8). GPU: bf16 results against ``torch._scaled_mm`` and fp64 at larger
shapes, every tuning candidate. sm_90: FP8 wgmma (e4m3) with TMA, the promoted accumulation, block scales.
"""

import importlib
import types

import pytest
import torch

from triton_dist import hardware
from triton_dist.kernels import fp8
from triton_dist.kernels.gemm import gemm, gemm_candidates, scaled_gemm

from ..conftest import cpu_only, gpu_only
from ..sm90 import compile_sm90
from .fp8_inputs import fp8_steps, operands, quantize, rel_err

CPU = {"num_programs": 3}
gemm_module = importlib.import_module("triton_dist.kernels.gemm")  # (the package's ``gemm`` is the op)


@cpu_only
@pytest.mark.parametrize("mode,m,n,k,out_dtype,use_tma", [
    ("tensor", 33, 24, 48, torch.float32, None),    # TMA (K, N multiples of 16), ragged M
    ("tensor", 5, 7, 3, torch.float32, False),
    ("row", 33, 23, 37, torch.float32, None),       # odd N, K: masks
    ("row", 20, 32, 64, torch.bfloat16, True),
    ("block", 37, 150, 300, torch.float32, None),   # ragged N and K blocks (2 of 128 + 44), masks
    ("block", 17, 24, 160, torch.float32, True),    # TMA, a 32-wide last group
    ("block", 17, 136, 256, torch.bfloat16, None),  # a 128-row W block and a short one
])
def test_scaled_gemm_matches_fp64_reference(mode, m, n, k, out_dtype, use_tma):
    gen = torch.Generator().manual_seed(m * n + k)
    a, sa, w, sw, da, dw = operands(m, n, k, mode, gen)
    out = torch.full((m, n), float("nan"), dtype=out_dtype)
    scaled_gemm(a, w, sa, sw, out=out, out_dtype=out_dtype, config={**CPU, "use_tma": use_tma})
    assert rel_err(out, da @ dw.T) < (8e-3 if out_dtype == torch.bfloat16 else 1e-5)


@cpu_only
@pytest.mark.parametrize("mode", ["row", "block"])
def test_split_k_shares_keep_their_scales(mode):
    """SPLIT_K on FP8 operands: each share of K scaled by its own K blocks (block scales: shares that start and
    end inside a 128-group), rowwise scales applied to every partial sum; the same bits as a repeat."""
    m, n, k = 17, 40, 330
    gen = torch.Generator().manual_seed(5)
    a, sa, w, sw, da, dw = operands(m, n, k, mode, gen)
    cfg = {**CPU, "SPLIT_K": 3}
    out = scaled_gemm(a, w, sa, sw, out_dtype=torch.float32, config=cfg)
    assert rel_err(out, da @ dw.T) < 1e-5
    assert torch.equal(out, scaled_gemm(a, w, sa, sw, out_dtype=torch.float32, config=cfg))


@cpu_only
@pytest.mark.parametrize("use_tma,split_k", [(None, 1), (False, 1), (None, 2)])
def test_k_major_block_scales_of_a_are_read_as_they_lie(use_tma, split_k, monkeypatch):
    """A's block scales K-major ([M, K/128] of strides (1, M): torch._scaled_mm's layout) give the bits of the
    same scales row-major, read without a copy (the op's ``Scales`` hold the caller's tensor; the other ops', whose
    kernels move A's scales with its rows, a contiguous one), the repeat (an eager plan) too; the knob
    A_SCALES_K_MAJOR (row-major scales copied K-major by the op) the same bits."""
    m, n, k = 37, 150, 300
    gen = torch.Generator().manual_seed(11)
    a, sa, w, sw, da, dw = operands(m, n, k, "block", gen)
    sa_k = sa.t().contiguous().t()
    assert not sa_k.is_contiguous() and sa_k.stride() == (1, m)
    for cfg in ({**CPU, "use_tma": use_tma, "SPLIT_K": split_k}, None):
        want = scaled_gemm(a, w, sa, sw, out_dtype=torch.float32, config=cfg)
        assert rel_err(want, da @ dw.T) < 1e-5
        for _ in range(2):
            assert torch.equal(scaled_gemm(a, w, sa_k, sw, out_dtype=torch.float32, config=cfg), want)
        copied = {**(cfg or CPU), "A_SCALES_K_MAJOR": True}  # row-major scales copied K-major by the op
        assert torch.equal(scaled_gemm(a, w, sa, sw, out_dtype=torch.float32, config=copied), want)
        assert torch.equal(scaled_gemm(a, w, sa_k, sw, out_dtype=torch.float32, config=copied), want)
    assert fp8.check_scales(a, w, sa_k, sw, a_strided=True).a is sa_k
    assert fp8.check_scales(a, w, sa_k, sw).a.is_contiguous()
    scales = fp8.check_scales(a, w, sa, sw)
    assert scales.k_major_a().a.stride() == (1, m) and torch.equal(scales.k_major_a().a, sa)
    launch, seen = gemm_module._LAUNCH_GEMM, []  # the knob hands the kernel K-major scales: their K stride is M
    monkeypatch.setattr(gemm_module, "_LAUNCH_GEMM", lambda *args, named=None, **meta: (
        seen.append(named["stride_sak"]), launch(*args, named=named, **meta)))
    scaled_gemm(a, w, sa, sw, out_dtype=torch.float32, config={**CPU, "A_SCALES_K_MAJOR": True})
    scaled_gemm(a, w, sa, sw, out_dtype=torch.float32, config=CPU)
    assert seen == [m, 1]
    with pytest.raises(ValueError, match="A_SCALES_K_MAJOR"):
        scaled_gemm(a, w, sa, sw, config={**CPU, "A_SCALES_K_MAJOR": 1})


@cpu_only
@pytest.mark.parametrize("mode,split", [("tensor", True), ("row", True), ("block", True), ("block", False)])
def test_split_columns_scale_each_half(mode, split):
    """SPLIT_N (two accumulators of half the tile's columns): each half scaled by its own columns' scales (block
    scales: per K step, the halves of a 256-wide tile in different 128-row blocks of W; the second tile's right
    half wholly past N), ragged N. Unsplit, a 256-wide tile takes a block scale per column."""
    m, n, k = 20, 300, 256
    gen = torch.Generator().manual_seed(7)
    a, sa, w, sw, da, dw = operands(m, n, k, mode, gen)
    out = scaled_gemm(a, w, sa, sw, out_dtype=torch.float32,
                      config={**CPU, "use_tma": True, "SPLIT_N": split, "BLOCK_N": 256})
    assert rel_err(out, da @ dw.T) < 1e-5


@cpu_only
@pytest.mark.parametrize("block_n,split", [(16, False), (256, True)])
def test_block_scales_of_the_silu_gate_halves(block_n, split):
    """The core's SiLU gate on block-scaled operands, N not a multiple of 128: gate tiles take one W block's scale
    (a tile of <= 128 columns lies in one block), up tiles (rows N..2N of W) straddle blocks and take a scale per
    column; whole and split tiles."""
    from triton_dist.kernels.gemm import gemm_config, launch_gemm

    m, n, k = 20, 152, 256  # (N of 16-byte rows: TMA)
    a, sa, w, sw, da, dw = operands(m, n, k, "block", torch.Generator().manual_seed(11), w_rows=2 * n)
    cfg = gemm_config(m, n, k, a.dtype, a.device, BLOCK_N=block_n, SPLIT_N=split, use_tma=True, num_programs=3)
    out = torch.full((1, m, n), float("nan"))
    launch_gemm(a, w, out, cfg, silu_gate=True, scales=fp8.Scales("block", sa, sw, False))
    h = da @ dw.T
    assert rel_err(out[0], torch.nn.functional.silu(h[:, :n]) * h[:, n:]) < 1e-5


@cpu_only
def test_scaled_gemm_e5m2_fast_accum_and_defaults():
    gen = torch.Generator().manual_seed(1)
    a, sa, w, sw, da, dw = operands(20, 24, 48, "row", gen, dtype=torch.float8_e5m2)
    out = scaled_gemm(a, w, sa, sw, scaling="row", fast_accum=True, config=CPU)  # default: bfloat16
    assert out.dtype == torch.bfloat16 and rel_err(out, da @ dw.T) < 8e-3
    empty = scaled_gemm(a[:0], w, sa[:0], sw, out_dtype=torch.float32)
    zeros = scaled_gemm(a[:, :0], w[:, :0], torch.ones(1), torch.ones(1))
    assert empty.shape == (0, 24) and zeros.shape == (20, 24) and not zeros.float().abs().sum()


@cpu_only
@pytest.mark.parametrize("mode", ["tensor", "row", "block"])
def test_gemm_with_scales_is_scaled_gemm(mode):
    """``gemm`` on FP8 operands with their scales: the same bits as ``scaled_gemm`` (its alias), whichever way the
    result comes (a new tensor, ``out=``; fp32, the default bf16; fast accumulation)."""
    gen = torch.Generator().manual_seed(40)
    a, sa, w, sw, da, dw = operands(9, 40, 160, mode, gen)
    out = gemm(a, w, scale_a=sa, scale_w=sw, scaling=mode, out_dtype=torch.float32, config=CPU)
    assert torch.equal(out, scaled_gemm(a, w, sa, sw, out_dtype=torch.float32, config=CPU))
    assert rel_err(out, da @ dw.T) < 1e-5
    into = torch.full((9, 40), float("nan"), dtype=torch.bfloat16)
    gemm(a, w, into, CPU, scale_a=sa, scale_w=sw, fast_accum=True)
    assert torch.equal(into, scaled_gemm(a, w, sa, sw, fast_accum=True, config=CPU))
    assert torch.equal(gemm(a, w, scale_a=sa, scale_w=sw), scaled_gemm(a, w, sa, sw))  # tuned config, bf16


def test_gemm_fp8_keywords_reject_bad_input():
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    a, sa, w, sw, _, _ = (t.to(dev) for t in operands(8, 16, 32, "row", torch.Generator().manual_seed(4)))
    x, y = a.to(torch.bfloat16), w.to(torch.bfloat16)
    for call, exc, match in [
        (lambda: gemm(a, w), TypeError, "scale_a"),                                  # FP8 without scales
        (lambda: gemm(a, y), TypeError, "scale_a"),                                  # one FP8 operand
        (lambda: gemm(a, w, scale_a=sa), TypeError, "scale_w"),                      # one scale
        (lambda: gemm(x, y, scale_a=sa, scale_w=sw), TypeError, "FP8"),              # scales with bf16 operands
        (lambda: gemm(x, y, out_dtype=torch.float32), ValueError, "FP8"),            # FP8 keywords without scales
        (lambda: gemm(x, y, scaling="row"), ValueError, "FP8"),
        (lambda: gemm(x, y, fast_accum=True), ValueError, "FP8"),
        (lambda: scaled_gemm(x, y, None, None), TypeError, "FP8"),                   # the alias: scales required
    ]:
        with pytest.raises(exc, match=match):
            call()


def _quantize_fp8_matches_torch(scaling, device, rows, cols, transposed):
    """``quantize_fp8``'s kernels against torch's ``quantize`` on ``device``: scales and values bitwise (signed
    zeros included), for bf16 inputs (many of them lie on a rounding tie of e4m3: an ulp off in the scale moves
    them a step), fp16 and fp32; ragged shapes (a short last 128-block both ways), a zero row, a zero block (scale
    1, q 0), tiny values that round to (signed) zero; an empty tensor. ``transposed``: x.T's quantisation read
    from x (against torch's of x.T)."""
    gen = torch.Generator().manual_seed(5)
    for dtype in (torch.bfloat16, torch.float32, torch.float16):
        x = torch.randn(rows, cols, generator=gen) * torch.rand(rows, 1, generator=gen) * 100
        x[7] = 0
        x[:128, 128:256] = 0 if scaling == "block" else x[:128, 128:256]
        x[9, :5] = torch.tensor([-1e-6, 1e-6, -3e-5, 0.0, -0.0])  # below the smallest e4m3 step of their group
        x = x.to(dtype).to(device)
        q, s = fp8.quantize_fp8(x, scaling, transposed=transposed)
        ref_q, ref_s = fp8.quantize(x.float().T if transposed else x.float(), scaling)
        assert s.shape == ref_s.shape and torch.equal(s, ref_s), (scaling, dtype)
        if scaling == "group":  # the same scales laid out K-major, the same values
            q_k, s_k = fp8.quantize_fp8(x, scaling, transposed=transposed, k_major=True)
            assert s_k.stride() == (1, s.shape[0]) and torch.equal(s_k, ref_s) and torch.equal(q_k.view(
                torch.uint8), q.view(torch.uint8)), dtype
        got, want = q.view(torch.uint8).cpu(), ref_q.view(torch.uint8).cpu()
        if _SIGNLESS_ZERO and device == "cpu":  # triton 3.6's interpreter converts -0.0 to fp8 +0
            got, want = torch.where(want == 0x80, 0, got), torch.where(want == 0x80, 0, want)
        assert q.dtype == torch.float8_e4m3fn and torch.equal(got, want), (scaling, dtype, int((got != want).sum()))
        assert not (q[:, 7] if transposed else q[7]).float().any()
    q, s = fp8.quantize_fp8(torch.zeros(0, cols, device=device), scaling, transposed=transposed)
    groups = {"group": (0, 3), "row": (0, 1), "block": (0, 3), "tensor": (1,)}[scaling]
    if transposed:
        groups = {"group": (cols, 0), "row": (cols, 1), "block": (3, 0), "tensor": (1,)}[scaling]
    assert q.shape == ((cols, 0) if transposed else (0, cols)) and s.shape == groups, (q.shape, s.shape)
    with pytest.raises(ValueError, match="scaling"):
        fp8.quantize_fp8(x, "column")
    with pytest.raises(ValueError, match="k_major"):
        fp8.quantize_fp8(x, "row", k_major=True)


@cpu_only
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("scaling", ["row", "block", "tensor", "group"])
def test_quantize_fp8_every_scaling_matches_torch(scaling, transposed):
    _quantize_fp8_matches_torch(scaling, "cpu", 130, 300, transposed)


@gpu_only
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("scaling", ["row", "block", "tensor", "group"])
def test_quantize_fp8_every_scaling_matches_torch_on_gpu(scaling, transposed):
    """The same on the GPU (compiled kernels; torch's CUDA ops), at sizes of a layer's activation."""
    _quantize_fp8_matches_torch(scaling, "cuda", 517, 300, transposed)


@cpu_only
def test_quantize_fp8_within_one_step_of_torch():
    """The senders' quantisation (a Triton kernel) against torch, per token per 1x128 group: scales equal, values
    within one FP8 step (x / scale in fp32 vs fp64 may tie differently); zeros stay zeros; e4m3 rounding itself
    (``fp8.to_e4m3``) exact, signed zeros included."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(9, 300, generator=gen) * torch.rand(9, 1, generator=gen) * 100
    x[3] = 0  # a token of zeros: scale 1, q 0
    x[4, 128:256] = 0
    q, s = fp8.quantize_fp8(x.to(torch.bfloat16))
    ref_q, ref_s = quantize(x.to(torch.bfloat16).float(), "group")
    assert s.shape == (9, 3) and torch.equal(s, ref_s)
    assert fp8_steps(q, ref_q) <= 1 and not q[3].float().any() and float(s[3].min()) == 1.0
    lib_q, lib_s = fp8.quantize(x, "group")  # the torch helper of the library agrees with the test's own
    assert torch.equal(lib_s, quantize(x, "group")[1]) and fp8_steps(lib_q, quantize(x, "group")[0]) == 0
    v = ((torch.rand(4096, generator=gen) * 2 - 1) * torch.exp2(torch.randint(-14, 9, (4096,), generator=gen))).clamp(
        -448, 448)  # normal, subnormal and underflowing e4m3 values, carries into the exponent (124.3 -> 128)
    got, want = _to_e4m3(v).view(torch.uint8), v.to(torch.float8_e4m3fn).view(torch.uint8)
    if _SIGNLESS_ZERO:  # triton 3.6's interpreter converts -0.0 to fp8 +0 (a GPU and triton 3.8+ keep the sign)
        got, want = torch.where(want == 0x80, 0, got), torch.where(want == 0x80, 0, want)
    assert torch.equal(got, want)
    deq = q.double() * s.double().repeat_interleave(128, 1)[:, :300]
    assert ((deq - x.to(torch.bfloat16).double()).abs() <= x.abs().amax(1, keepdim=True).double() / 16).all()


_SIGNLESS_ZERO = tuple(int(p) for p in __import__("triton").__version__.split(".")[:2]) < (3, 8)


def _to_e4m3(v):
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(x, y, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(y + offs, fp8.to_e4m3(tl.load(x + offs, mask=offs < n)), mask=offs < n)

    out = torch.empty(v.shape, dtype=torch.float8_e4m3fn)
    kernel[(triton.cdiv(v.numel(), 1024),)](v, out, v.numel(), BLOCK=1024)
    return out


def test_scaled_gemm_rejects_bad_input(monkeypatch):
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(3)
    a, sa, w, sw, _, _ = (t.to(dev) for t in operands(8, 160, 256, "block", gen))
    one = torch.ones(1, device=dev)
    cases = [
        (lambda: scaled_gemm(a, w, sa, sw[:1]), ValueError),                  # W's block scales: 1 of 2 row blocks
        (lambda: scaled_gemm(a, w, one, sw), ValueError),                     # modes mixed
        (lambda: scaled_gemm(a, w, sa, sw, scaling="tensor"), ValueError),    # shapes of another mode
        (lambda: scaled_gemm(a, w, sa, sw, scaling="blocks"), ValueError),    # no such mode
        (lambda: scaled_gemm(a, w, sa.half(), sw), TypeError),                # scales not fp32
        (lambda: scaled_gemm(a, w, [1.0], sw), TypeError),                    # a scale that is no tensor
        (lambda: scaled_gemm(a, w.to(torch.float8_e5m2), one, one), TypeError),  # mixed FP8 formats
        (lambda: scaled_gemm(a.half(), w, one, one), TypeError),              # not FP8
        (lambda: scaled_gemm(a, w[:, :128], one, one), ValueError),           # inner dimensions differ
        (lambda: scaled_gemm(a, w, one, one, out_dtype=torch.float8_e4m3fn), ValueError),  # an FP8 result
        (lambda: scaled_gemm(a, w, sa, sw, config={"BLOCK_K": 256}), ValueError),  # a K step over two groups
        (lambda: scaled_gemm(a, w, one, one, out=torch.empty(8, 160, device=dev)), ValueError),  # out: not bf16
    ]
    for call, exc in cases:
        with pytest.raises(exc):
            call()
    with pytest.raises(TypeError, match="scale_a"):  # FP8 operands without scales: the error names them
        gemm(a, w)
    # a GPU without FP8 tensor cores (compute capability below 8.9): a clear error, before any launch
    monkeypatch.setattr(hardware, "_capability", lambda index: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ValueError, match="8.9"):
        fp8.check_device(types.SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0)))


# ----------------------------------------------------------------------------------------------- GPU
def _gpu_errors(m, n, k, mode, cfg):
    """The relative error of ``scaled_gemm`` (``cfg``: a config, None: tuned) against fp64 (and cuBLAS where it
    takes the mode); mode "block-kmajor": A's block scales K-major, as torch._scaled_mm takes them."""
    gen = torch.Generator().manual_seed(m + n + k)
    a, sa, w, sw, da, dw = (t.cuda() for t in operands(m, n, k, mode, gen))  # (.cuda() keeps K-major strides)
    mode = mode.split("-")[0]
    out = scaled_gemm(a, w, sa, sw, config=cfg)
    err = rel_err(out, da @ dw.T)
    if mode != "block" and not (n % 16 or k % 16):  # cuBLAS agrees too (bf16 out, fast accumulation off;
        # torch._scaled_mm takes only N and K in multiples of 16)
        ref = torch._scaled_mm(a, w.t(), sa if mode == "row" else sa.reshape(()), sw.t() if mode == "row"
                               else sw.reshape(()), out_dtype=torch.bfloat16)
        err = max(err, rel_err(out, ref.double()))
    return err


@gpu_only
@pytest.mark.long  # the op tunes at each shape (GPU tier run160: up to 125 s): started first
@pytest.mark.parametrize("mode", ["tensor", "row", "block", "block-kmajor"])
@pytest.mark.parametrize("m,n,k", [(4096, 4096, 4096), (1000, 1536, 1032), (517, 520, 4104), (128, 4096, 8192)])
def test_scaled_gemm_gpu(ranks, mode, m, n, k):
    assert ranks.on_one_gpu(_gpu_errors, m, n, k, mode, None) < 1e-2


def _gpu_errors_of_every_candidate(m, n, k, mode):
    """(config, error) of every candidate off by 1e-2 or more."""
    cands = gemm_candidates(m, n, k, torch.float8_e4m3fn, torch.device("cuda"),
                            types.SimpleNamespace(mode=mode.split("-")[0], fast_accum=False))
    errs = [(cfg, _gpu_errors(m, n, k, mode, cfg)) for cfg in cands]
    return [(cfg, err) for cfg, err in errs if not err < 1e-2]


@gpu_only
@pytest.mark.parametrize("mode", ["row", "block", "block-kmajor"])
def test_scaled_gemm_gpu_every_candidate(ranks, mode):
    assert ranks.on_one_gpu(_gpu_errors_of_every_candidate, 1000, 1536, 1032, mode) == []


@pytest.mark.parametrize("mode", [None, "row", "block"])
def test_every_candidate_is_a_config_the_op_takes(mode, monkeypatch):
    """What the tuner may pick passes as ``config=`` too (the GPU test above runs every candidate so), split-K
    tiles and the Gluon mainloop's included (with block scales also copying A's K-major first)."""
    from triton_dist import autotune
    from triton_dist.kernels import gemm_sm90
    from triton_dist.kernels.gemm import gemm_config

    monkeypatch.setattr(gemm_module, "num_sms", lambda index=None: 132)
    monkeypatch.setattr(gemm_sm90, "available", lambda *args: mode is not None)  # (as on an sm_90 GPU)
    cuda, dtype = torch.device("cuda"), torch.bfloat16 if mode is None else torch.float8_e4m3fn
    scales = None if mode is None else types.SimpleNamespace(mode=mode, fast_accum=False)
    for m in (128, 256, 4096):
        base = gemm_config(m, 4096, 4096, dtype, cuda, scales, **gemm_module.OP_KNOBS)  # the gemm op's defaults
        cands = gemm_candidates(m, 4096, 4096, dtype, cuda, scales, split_k=True)
        for cand in cands:
            assert autotune.with_overrides(base, cand) == {**base, **cand}
        assert any(c.get("MAINLOOP") == "gluon" for c in cands) == (mode is not None)
        assert any(c.get("A_SCALES_K_MAJOR") for c in cands) == (mode == "block")


@pytest.mark.parametrize("mode,k_major", [("tensor", False), ("row", False), ("block", False), ("block", True)])
def test_tuner_offers_the_split_tail_where_the_last_round_is_mostly_idle(mode, k_major, monkeypatch):
    """At 8192^3 on 132 SMs the 128 tile leaves 4 tiles for a 33rd round: the tuner also times the Gluon
    candidates with that round split along K (TAIL_SPLIT), never on row-major block scales read as they lie (timed
    slower: docs/design/fp8.md), and nowhere without a tail to split (4096^3: the last round holds 100 tiles)."""
    from triton_dist.kernels import gemm_sm90

    monkeypatch.setattr(gemm_module, "num_sms", lambda index=None: 132)
    monkeypatch.setattr(gemm_sm90, "available", lambda *args: True)  # (as on an sm_90 GPU)
    scales = types.SimpleNamespace(mode=mode, fast_accum=False, a_k_major=k_major)
    cuda = torch.device("cuda")
    tails = [c for c in gemm_candidates(8192, 8192, 8192, torch.float8_e4m3fn, cuda, scales, split_k=True)
             if c.get("TAIL_SPLIT")]
    assert tails and all(c["MAINLOOP"] == "gluon" and c["TAIL_SPLIT"] == gemm_sm90.TUNER_TAIL_SPLIT for c in tails)
    assert all(gemm_sm90.tail_split(c, 8192, 8192, 8192, 132) == 8 for c in tails)
    assert {c["BLOCK_N"] for c in tails} == {128}  # 256 columns: 2048 tiles, 68 in the last round (half full)
    if mode == "block":
        assert all(bool(c.get("A_SCALES_K_MAJOR")) == (not k_major) for c in tails)  # row-major: copied first
    assert not any(c.get("TAIL_SPLIT") for c in gemm_candidates(4096, 4096, 4096, torch.float8_e4m3fn, cuda,
                                                                scales, split_k=True))


@pytest.mark.parametrize("mode,fast_accum", [("tensor", False), ("row", False), ("row", True), ("block", False)])
def test_fp8_block_tiles_keep_both_accumulators_in_registers(mode, fast_accum):
    """Block scales keep each K step's product apart from the sum (two fp32 accumulators): every candidate of gemm
    and ag_gemm keeps both in a thread's registers (128x256 on 8 warps spilled on sm_90 and ran 4x slower); the
    other modes keep the 128x256 tiles, promoted ones as two 128-wide accumulators (SPLIT_N: a K step's partial
    sum is half a tile)."""
    from triton_dist.kernels import allgather_gemm as agm
    from triton_dist.kernels.gemm import FP8_ACC_PER_THREAD

    cuda, e4m3 = torch.device("cuda"), torch.float8_e4m3fn
    scales = types.SimpleNamespace(mode=mode, fast_accum=fast_accum)
    cands = gemm_candidates(4096, 4096, 4096, e4m3, cuda, scales)
    cands += agm.candidate_configs(2048, 4096, 4096, e4m3, cuda, 2, scales=scales)
    assert cands and all(c["BLOCK_K"] == 128 for c in cands)
    largest = max(c["BLOCK_M"] * c["BLOCK_N"] / (32 * c["num_warps"]) for c in cands)
    assert largest == (FP8_ACC_PER_THREAD if mode == "block" else 2 * FP8_ACC_PER_THREAD)
    promoted = mode != "block" and not fast_accum
    split = [c for c in cands if c["SPLIT_N"]]
    assert all(promoted and c["BLOCK_N"] >= 256 for c in split) and (len(split) > 0) == promoted
    whole = gemm_candidates(4096, 4096, 4096, e4m3, cuda, scales)  # each split candidate also as one accumulator
    assert all({**c, "SPLIT_N": False} in whole for c in whole if c["SPLIT_N"])


# ----------------------------------------------------------------------------------------------- sm_90
FP8_GEMM_SIGNATURE = dict(
    a="tensordesc<fp8e4nv[128,128]>", b="tensordesc<fp8e4nv[256,128]>", c="tensordesc<bf16[1,128,256]>",
    num_segments="i32", seg_rows="i32", N="i32", K="i32", stride_am="i32", stride_bn="i32", stride_cs="i32",
    stride_cm="i32", first_segment="i32", segment_step="i32",
    **{name: "constexpr" for name in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "USE_TMA", "EPILOGUE_SUBTILE",
                                      "FLATTEN", "WARP_SPECIALIZE", "DOT_PRECISION", "SILU_GATE")},
    scale_a="*fp32", scale_w="*fp32", stride_sa="i32", stride_sw="i32", SCALES="constexpr",
    MAX_IMPRECISE_ACC="constexpr")
FP8_GEMM_BIG = dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=128, GROUP_M=8, USE_TMA=True, EPILOGUE_SUBTILE=False,
                    FLATTEN=False, WARP_SPECIALIZE=False, DOT_PRECISION="tf32", SILU_GATE=False)


@pytest.mark.parametrize("scales,imprecise,use_tma,split", [
    ("rows", 128, True, True), ("rows", 128, True, False), ("rows", None, True, False), ("blocks", None, True, False),
    ("blocks", None, False, False)])
def test_scaled_gemm_compiles_for_sm90_with_fp8_wgmma(scales, imprecise, use_tma, split):
    sig = FP8_GEMM_SIGNATURE if use_tma else dict(FP8_GEMM_SIGNATURE, a="*fp8e4nv", b="*fp8e4nv", c="*bf16")
    if split:  # SPLIT_N: B's descriptor of half the tile's columns
        sig = dict(sig, b="tensordesc<fp8e4nv[128,128]>")
    res = compile_sm90("triton_dist.kernels.gemm", "gemm_kernel", sig,
                       dict(FP8_GEMM_BIG, USE_TMA=use_tma, BLOCK_N=256 if use_tma else 128, SCALES=scales,
                            MAX_IMPRECISE_ACC=imprecise), aligned=("K", "N"))
    ops = res["ops"]
    assert any(k.startswith("wgmma.mma_async.sync.aligned.") and k.endswith(".f32.e4m3.e4m3") for k in ops), ops
    if use_tma:
        assert any(k.startswith("cp.async.bulk.tensor.2d.shared") for k in ops), ops  # TMA loads
        assert any(k.startswith("cp.async.bulk.tensor.3d.global") for k in ops), ops  # TMA store (bf16)


@pytest.mark.parametrize("scaling", ["group", "block", "row", "tensor"])
def test_quantize_transposed_kernel_compiles_for_sm90(scaling):
    """x.T's quantisation read from x: loads along H, stores along T (the compiler transposes through shared
    memory), no spills."""
    res = compile_sm90("triton_dist.kernels.fp8", "quantize_transposed_kernel",
                       dict(x="*bf16", q="*fp8e4nv", scales="*fp32", amax="*i32", T="i32", H="i32",
                            SCALING="constexpr", BT="constexpr", BH="constexpr"),
                       dict(SCALING=scaling, BT=128, BH=128 if scaling == "block" else 64),
                       aligned=("x", "q", "T", "H"), options=dict(num_warps=8 if scaling == "block" else 4),
                       assemble=True)
    ops = res["ops"]
    assert any(k.startswith("ld.global") for k in ops) and any(k.startswith("st.global") for k in ops), ops
    assert res["spilled_bytes"] == 0, res["spilled_bytes"]


def test_quantize_fp8_kernel_compiles_for_sm90():
    res = compile_sm90("triton_dist.kernels.fp8", "quantize_fp8_kernel",
                       dict(x="*bf16", q="*fp8e4nv", scales="*fp32", T="i32", H="i32", BT="constexpr",
                            BH="constexpr"), dict(BT=16, BH=512), aligned=("x", "q", "H"))
    ops = res["ops"]
    assert any(k.startswith("ld.global") for k in ops) and any(k.startswith("st.global") for k in ops), ops
