"""The GEMM core (``triton_dist.kernels.gemm``) and its ``config=`` overrides.

CPU: both data paths (TMA descriptors, masks) under the interpreter on odd shapes, segment order, bad input,
misspelt config knobs (the autotuner's own rules: tests/test_autotune.py). GPU: bf16/fp16 against fp32 for every
tuning candidate. sm_90: the TMA + wgmma code the core must produce, with and without epilogue sub-tiling.
"""

import pytest
import torch

import importlib
import types

from triton_dist import autotune
from triton_dist.kernels.gemm import gemm, gemm_candidates, gemm_config, launch_gemm
from triton_dist.kernels.grouped_gemm import grouped_gemm

from ..conftest import cpu_only, gpu_only
from ..sm90 import compile_sm90
from .fp8_inputs import rel_err

gemm_module = importlib.import_module("triton_dist.kernels.gemm")  # (the package exports the op under this name)


@cpu_only  # CPU tensors: interpreter only (GPU ranks run test_gemm_gpu_every_candidate)
@pytest.mark.parametrize("m,n,k,dtype,use_tma", [
    (33, 24, 40, torch.float16, None),   # TMA (aligned K, N), ragged M
    (33, 23, 37, torch.float16, None),   # odd N, K -> masks
    (20, 16, 8, torch.float32, True),
    (5, 7, 3, torch.float32, False),
])
def test_gemm_matches_torch_in_interpreter(m, n, k, dtype, use_tma):
    gen = torch.Generator().manual_seed(m * n + k)
    for _ in range(2):  # fresh inputs, poisoned output
        a = torch.randn(m, k, generator=gen).to(dtype)
        w = torch.randn(n, k, generator=gen).to(dtype)
        out = torch.full((m, n), float("nan"), dtype=dtype)
        gemm(a, w, out=out, config={"use_tma": use_tma, "num_programs": 3})
        ref = a.double() @ w.double().T
        tol = 2e-3 if dtype == torch.float16 else 1e-6
        assert ((out.double() - ref).abs().max() / ref.abs().max()) < tol


@cpu_only
@pytest.mark.parametrize("m,n,k,use_tma", [(17, 1, 15, False), (33, 24, 40, None)])
def test_bf16_gemm_in_interpreter(m, n, k, use_tma):
    """bf16 operands under the interpreter (which holds bf16 as uint16 bit patterns: its own ``tl.dot`` multiplied
    those, relative errors of 1e9; ``interpreter.repair_bf16_dot``), split-K too."""
    gen = torch.Generator().manual_seed(m + n + k)
    a = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    ref = a.double() @ w.double().T
    for split_k in (1, 2):
        out = gemm(a, w, config={"use_tma": use_tma, "SPLIT_K": split_k, "num_programs": 3})
        assert out.dtype == torch.bfloat16
        assert ((out.double() - ref).abs().max() / ref.abs().max()) < 2e-2


@cpu_only
def test_wide_masked_tiles_store_both_halves():
    """Masked stores of tiles wider than 128 go in two column halves (``tile_store``): every column of a ragged
    256-wide tile lands once, in place."""
    m, n, k = 19, 300, 24
    a = torch.randn(m, k, dtype=torch.float32)
    w = torch.randn(n, k, dtype=torch.float32)
    out = torch.full((m, n), float("nan"))
    gemm(a, w, out=out, config=dict(BLOCK_M=16, BLOCK_N=256, BLOCK_K=16, use_tma=False, num_programs=2))
    assert ((out.double() - a.double() @ w.double().T).abs().max()) < 1e-4


@cpu_only
@pytest.mark.parametrize("silu_gate", [False, True])
def test_split_columns_match_whole_tiles(silu_gate):
    """SPLIT_N (the tile's columns as two accumulators, each half its own dot and B descriptor): right at ragged
    N, where a tile's right half or all of it lies past N, with and without the SiLU gate (four accumulators)."""
    m, n, k = 37, 48, 40
    a = torch.randn(m, k, dtype=torch.float32)
    w = torch.randn(2 * n if silu_gate else n, k, dtype=torch.float32)
    cfg = gemm_config(m, n, k, torch.float32, torch.device("cpu"), BLOCK_N=32, SPLIT_N=True, use_tma=True,
                      num_programs=2)
    out = torch.full((1, m, n), float("nan"))
    launch_gemm(a, w, out, cfg, silu_gate=silu_gate)
    ref = a.double() @ w.double().T
    if silu_gate:
        ref = torch.nn.functional.silu(ref[:, :n]) * ref[:, n:]
    assert ((out[0].double() - ref).abs().max() / ref.abs().max()) < 1e-5


@cpu_only
@pytest.mark.parametrize("m,n,k,dtype,use_tma,split_k", [
    (33, 24, 150, torch.float16, None, 3),  # TMA, ragged M and a short last K step
    (33, 23, 37, torch.float32, False, 4),  # masks; 3 K steps in 4 shares: the last share is empty
    (20, 40, 64, torch.float32, True, 2),
])
def test_split_k_sums_every_share_once(m, n, k, dtype, use_tma, split_k):
    """SPLIT_K (each tile's K in shares, the last share to arrive sums them): right against fp64 on fresh inputs
    into a poisoned output; bitwise the same whichever program arrives last (other grids); the tile counters back
    at 0 after every call (the next launch, or a graph replay, starts from 0)."""
    gen = torch.Generator().manual_seed(m + n + k)
    for _ in range(2):
        a = torch.randn(m, k, generator=gen).to(dtype)
        w = torch.randn(n, k, generator=gen).to(dtype)
        out = torch.full((m, n), float("nan"), dtype=dtype)
        gemm(a, w, out=out, config={"use_tma": use_tma, "num_programs": 3, "SPLIT_K": split_k})
        ref = a.double() @ w.double().T
        assert ((out.double() - ref).abs().max() / ref.abs().max()) < (2e-3 if dtype == torch.float16 else 1e-6)
        for programs in (2, 5):
            again = gemm(a, w, config={"use_tma": use_tma, "num_programs": programs, "SPLIT_K": split_k})
            assert torch.equal(again, out)
        assert all(not space["tile_counts"].any() for space in gemm_module._SPLIT_K_SPACE.values())


def test_split_k_rejects_what_it_cannot_do():
    """SPLIT_K must be a positive int, and cannot take the SiLU gate (a product of sums); the fused ops' kernels
    have no split-K, so their config= does not know the key."""
    from triton_dist.kernels import allgather_gemm

    cpu = torch.device("cpu")
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="SPLIT_K"):
            gemm_module.split_k_of({"SPLIT_K": bad})
    with pytest.raises(ValueError, match="SiLU"):
        gemm_module.split_k_of({"SPLIT_K": 2}, silu_gate=True)
    assert "SPLIT_K" not in allgather_gemm.default_config(8, 16, 16, torch.float32, cpu, 2)
    with pytest.raises(ValueError, match="SPLIT_K"):
        gemm(torch.randn(4, 8), torch.randn(3, 8), config={"SPLIT_K": 0})


def test_split_k_candidates_fill_the_gpu_where_tiles_are_few(monkeypatch):
    """The tuner's split-K tiles (``split_k_configs``): offered where a shape's tiles leave SMs idle (small M, long
    K), with every split at least four K steps and the items within one wave; never for the fused ops' sweep."""
    monkeypatch.setattr(gemm_module, "num_sms", lambda index=None: 132)
    cuda = torch.device("cuda")
    split = [c for c in gemm_candidates(128, 4096, 8192, torch.bfloat16, cuda, split_k=True) if c.get("SPLIT_K")]
    assert split and all(c["SPLIT_K"] >= 2 for c in split)
    for c in split:
        tiles = -(-128 // c["BLOCK_M"]) * -(-4096 // c["BLOCK_N"])
        assert tiles * c["SPLIT_K"] <= 132 and -(-8192 // c["BLOCK_K"]) // c["SPLIT_K"] >= 4
    assert not any(c.get("SPLIT_K") for c in gemm_candidates(128, 4096, 8192, torch.bfloat16, cuda))
    assert not any(c.get("SPLIT_K") for c in gemm_candidates(4096, 4096, 4096, torch.bfloat16, cuda, split_k=True))
    assert not any(c.get("SPLIT_K") for c in gemm_candidates(128, 4096, 128, torch.bfloat16, cuda, split_k=True))


def test_decode_tiles_only_at_decode_rows(monkeypatch):
    """16-row tiles (``decode_tiles``) among the tuner's candidates at M <= 16 in bf16 / fp16, split-K ones
    within one wave; never above 16 rows, for FP8 operands or fp32."""
    monkeypatch.setattr(gemm_module, "num_sms", lambda index=None: 132)
    cuda = torch.device("cuda")
    for m in (1, 16):
        for dtype in (torch.bfloat16, torch.float16):
            rows16 = [c for c in gemm_candidates(m, 4096, 4096, dtype, cuda, split_k=True) if c["BLOCK_M"] == 16]
            assert any(c.get("SPLIT_K") for c in rows16) and any(not c.get("SPLIT_K") for c in rows16)
            assert all(-(-4096 // c["BLOCK_N"]) * c["SPLIT_K"] <= 132 * (c.get("programs_per_sm") or 1)
                       for c in rows16 if c.get("SPLIT_K"))
            assert any(c.get("programs_per_sm") == 2 and c.get("SPLIT_K") for c in rows16)
    assert not any(c["BLOCK_M"] == 16 for c in gemm_candidates(17, 4096, 4096, torch.bfloat16, cuda, split_k=True))
    assert not any(c["BLOCK_M"] == 16 for c in gemm_candidates(8, 4096, 4096, torch.float32, cuda, split_k=True))
    row = types.SimpleNamespace(mode="row", fast_accum=False)
    assert not any(c["BLOCK_M"] == 16 for c in gemm_candidates(8, 4096, 4096, torch.float8_e4m3fn, cuda, row,
                                                                split_k=True))


@cpu_only
def test_segments_are_clipped_and_visited_in_any_order():
    """C[s] = A[s] @ B.T with ragged segments (seg_rows not a multiple of BLOCK_M), started from segment 2 and
    walked backwards: every row is written exactly once with the right values."""
    segments, seg_rows, n, k = 3, 11, 16, 24
    a = torch.randn(segments * seg_rows, k, dtype=torch.float16)
    w = torch.randn(n, k, dtype=torch.float16)
    c = torch.full((segments, seg_rows, n), float("nan"), dtype=torch.float16)
    cfg = gemm_config(segments * seg_rows, n, k, torch.float16, torch.device("cpu"), num_programs=2)
    launch_gemm(a, w, c, cfg, first_segment=2, segment_step=-1)
    ref = (a.double() @ w.double().T).view(segments, seg_rows, n)
    assert ((c.double() - ref).abs().max() / ref.abs().max()) < 2e-3


def test_gemm_rejects_bad_input():
    a = torch.randn(4, 8)
    for bad, exc in [((a.int(), a.int()), TypeError), ((a, a.half()), TypeError), ((a, torch.randn(3, 9)), ValueError),
                     ((a.t(), torch.randn(3, 4)), ValueError), ((a.reshape(-1), a), ValueError), (([1], a), TypeError)]:
        with pytest.raises(exc):
            gemm(*bad)


def test_config_overrides_reject_unknown_knobs():
    """Every op's ``config=`` goes through autotune.with_overrides: a misspelt knob raises instead of being
    ignored; a non-dict raises TypeError; no config gives the defaults (a copy)."""
    defaults = {"BLOCK_M": 128, "num_warps": 8}
    assert autotune.with_overrides(defaults, {"num_warps": 4}) == {"BLOCK_M": 128, "num_warps": 4}
    copy = autotune.with_overrides(defaults, None)
    assert copy == defaults and copy is not defaults
    with pytest.raises(ValueError, match="BLOCKM"):
        autotune.with_overrides(defaults, {"BLOCKM": 64})
    with pytest.raises(TypeError):
        autotune.with_overrides(defaults, [("BLOCK_M", 64)])
    a = torch.randn(8, 16, device="cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match="BLOCKM"):
        gemm(a, a, config={"BLOCKM": 16})


@pytest.mark.parametrize("knob,value", [("BLOCK_M", 0), ("BLOCK_N", 24), ("BLOCK_K", 3), ("BLOCK_K", 8),
                                        ("GROUP_M", 0), ("num_warps", 3), ("num_stages", 0), ("BLOCK_M", True)])
def test_config_overrides_reject_impossible_tiles(knob, value):
    """A tile value no kernel can take is a ValueError naming the knob before any launch (it was a
    ZeroDivisionError, or a failure inside the kernel's compilation), for gemm and grouped_gemm alike."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    a = torch.randn(8, 16, device=dev)
    with pytest.raises(ValueError, match=knob):
        gemm(a, a, config={knob: value})
    with pytest.raises(ValueError, match=knob):
        grouped_gemm(a, a[None], torch.tensor([0, 8], dtype=torch.int32, device=dev), config={knob: value})


def test_gemm_rejects_cpu_tensors_without_interpreter(monkeypatch):
    """A compiled kernel must never get host pointers (the first GPU run: NaN, then an illegal address that
    poisoned the CUDA context): CPU tensors outside the interpreter are a ValueError, on any machine."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="interpreter"):
        gemm(torch.randn(4, 8), torch.randn(3, 8))
    with pytest.raises(ValueError):
        gemm(torch.randn(4, 8, device="meta"), torch.randn(3, 8, device="meta"))


# ----------------------------------------------------------------------------------------------- GPU
def _gpu_check(m, n, k, dtype, cfg):
    """Worst relative error of three calls on fresh inputs into a NaN-poisoned output (the first launch plain, the
    later ones through the bound launch)."""
    worst = 0.0
    for _ in range(3):
        a = torch.randn(m, k, device="cuda", dtype=dtype)
        w = torch.randn(n, k, device="cuda", dtype=dtype) / 8
        out = gemm(a, w, out=torch.full((m, n), float("nan"), device="cuda", dtype=dtype), config=cfg)
        ref = a.float() @ w.float().T
        err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
        worst = max(worst, err if err == err else float("inf"))
    return worst


@gpu_only
@pytest.mark.parametrize("m,n,k", [(4096, 4096, 4096), (1000, 1536, 1032), (517, 520, 4104), (333, 250, 77),
                                   (96, 1024, 8200),  # split-K: few tiles, a long K with a short last step
                                   (5, 1032, 8200)])  # decode: 16-row tiles, split-K, a ragged last N tile
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gemm_gpu_every_candidate(ranks, m, n, k, dtype):
    assert ranks.on_one_gpu(_gpu_check_every_candidate, m, n, k, dtype) == []


def _gpu_check_every_candidate(m, n, k, dtype):
    """(config, error) of every candidate (and the tuned choice, None) off by 1e-2 or more."""
    bad = []
    for cfg in gemm_candidates(m, n, k, dtype, torch.device("cuda"), split_k=True) + [None]:
        err = _gpu_check(m, n, k, dtype, cfg)
        if not err < 1e-2:
            bad.append((cfg, err))
    return bad


def _gpu_eager_plans():
    """Repeated eager calls through their plans (``gemm.EagerGemm``) against torch in fp64, fresh inputs and a
    poisoned ``out`` every repeat: bf16 with and without ``out``, FP8 rowwise and per-tensor (new scales every
    call), a misaligned view of the same layout (the checked path), an unaligned shape (no plan). Returns
    (failures, plans made, checked launches after the first calls)."""
    import importlib
    import os

    from triton_dist.kernels import fp8

    gemm_module = importlib.import_module("triton_dist.kernels.gemm")
    checked = []
    original = gemm_module.launch_gemm
    gemm_module.launch_gemm = lambda *a, **k: (checked.append(1), original(*a, **k))[1]
    tuning = os.environ.get("TRITON_DIST_AUTOTUNE")
    os.environ["TRITON_DIST_AUTOTUNE"] = "0"  # the default configurations: no tuning launches in the count
    gen = torch.Generator(device="cuda").manual_seed(3)
    failures = []
    plans_before = len(gemm_module._EAGER._plans)
    try:
        for m, n, k in [(333, 520, 1024), (128, 4096, 8192), (1000, 1536, 2048)]:  # FP8 rows 16-byte aligned
            for rep in range(4):
                a = torch.randn(m, k, device="cuda", generator=gen, dtype=torch.bfloat16)
                w = torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16)
                ref = a.double() @ w.double().t()
                out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
                for got in (gemm(a, w), gemm(a, w, out=out)):
                    err = ((got.double() - ref).abs().max() / ref.abs().max()).item()
                    if not err < 1e-2:
                        failures.append(("bf16", m, n, k, rep, err))
                for mode in ("row", "tensor"):
                    a8, sa = fp8.quantize_fp8(a, mode)
                    w8, sw = fp8.quantize_fp8(w, mode)
                    want = (a8.double() * sa.double()) @ (w8.double() * sw.double().reshape(-1, 1)).t() \
                        if mode == "row" else (a8.double() @ w8.double().t()) * (sa * sw).double()
                    got = gemm(a8, w8, scale_a=sa, scale_w=sw)
                    err = ((got.double() - want).abs().max() / want.abs().max()).item()
                    if not err < 1e-2:
                        failures.append((mode, m, n, k, rep, err))
            first = len(checked)
            storage = torch.randn(m * k + 1, device="cuda", generator=gen).to(torch.bfloat16)
            shifted = storage[1:].view(m, k)  # the layout of a plan, 2-byte aligned: TMA cannot take it
            ref = shifted.double() @ w.double().t()
            err = ((gemm(shifted, w).double() - ref).abs().max() / ref.abs().max()).item()
            if not err < 1e-2 or len(checked) != first + 1:
                failures.append(("misaligned", m, n, k, err, len(checked) - first))
        odd = torch.randn(33, 77, device="cuda", generator=gen, dtype=torch.bfloat16)  # K 77: no TMA, no plan
        for _ in range(2):
            ref = odd.double() @ odd.double().t()
            err = ((gemm(odd, odd).double() - ref).abs().max() / ref.abs().max()).item()
            if not err < 1e-2:
                failures.append(("odd", err))
    finally:
        gemm_module.launch_gemm = original
        if tuning is None:
            os.environ.pop("TRITON_DIST_AUTOTUNE")
        else:
            os.environ["TRITON_DIST_AUTOTUNE"] = tuning
    return failures, len(gemm_module._EAGER._plans) - plans_before, len(checked)


def _gemm_gradients(a0, w0, r, fn, frozen_a=False):
    """(loss, grad_a, grad_w) of ``(fn(a, w) * r).sum()`` on fresh leaves (grad_a None where ``frozen_a``)."""
    a, w = a0.clone().requires_grad_(not frozen_a), w0.clone().requires_grad_()
    loss = fn(a, w, r)
    loss.backward()
    return loss.detach(), a.grad, w.grad


def _gemm_loss(a, w, r):
    return (gemm(a, w) * r).sum()


@cpu_only
@pytest.mark.parametrize("m,n,k", [(13, 10, 24), (7, 9, 5)])
def test_gemm_gradients_match_fp64_eager_compiled_and_checkpointed(m, n, k):
    """``gemm`` is differentiable (``torch.ops.triton_dist.gemm``): the loss and the gradients of a and w against
    fp64 torch, eagerly, under torch.compile (fullgraph; before the op it could not be traced) and activation
    checkpointing, the compiled and checkpointed ones bitwise the eager ones; a frozen input gets none."""
    gen = torch.Generator().manual_seed(m * n + k)
    a0, w0, r = (torch.randn(*shape, generator=gen) for shape in ((m, k), (n, k), (m, n)))
    ref_a, ref_w = a0.double().requires_grad_(), w0.double().requires_grad_()
    ref_loss = ((ref_a @ ref_w.T) * r.double()).sum()
    ref_loss.backward()
    eager = _gemm_gradients(a0, w0, r, _gemm_loss)
    assert rel_err(eager[0], ref_loss.detach()) < 1e-5  # (a sum with cancellation)
    assert rel_err(eager[1], ref_a.grad) < 1e-6 and rel_err(eager[2], ref_w.grad) < 1e-6
    compiled = torch.compile(_gemm_loss, fullgraph=True, backend="aot_eager")
    checkpointed = lambda a, w, r: torch.utils.checkpoint.checkpoint(_gemm_loss, a, w, r, use_reentrant=False)  # noqa
    for fn in (compiled, checkpointed):
        assert all(torch.equal(x, y) for x, y in zip(_gemm_gradients(a0, w0, r, fn), eager))
    loss, grad_a, grad_w = _gemm_gradients(a0, w0, r, _gemm_loss, frozen_a=True)
    assert grad_a is None and torch.equal(grad_w, eager[2])
    with torch.no_grad():  # without grad: the direct call, into out= as before
        out = torch.full((m, n), float("nan"))
        assert gemm(a0.requires_grad_(), w0, out=out) is out
        assert rel_err(out, ref_a.detach() @ ref_w.detach().T) < 1e-6


@cpu_only
def test_gemm_with_grad_rejects_what_has_no_gradient():
    a = torch.randn(8, 16, requires_grad=True)
    w = torch.randn(12, 16)
    with pytest.raises(ValueError, match="without grad"):
        gemm(a, w, out=torch.empty(8, 12))
    assert gemm(a, w, config={"num_programs": 2}).requires_grad  # (config=: the op's forward, test_autograd.py)
    a8 = torch.randn(8, 32).to(torch.float8_e4m3fn).requires_grad_()
    w8 = torch.randn(12, 32).to(torch.float8_e4m3fn)
    one = torch.ones(1)
    with pytest.raises(ValueError, match="FP8"):
        gemm(a8, w8, scale_a=one, scale_w=one)


def _gpu_gemm_gradients():
    """bf16 ``gemm`` gradients on the GPU against fp64 (fresh inputs each repeat): the worst relative error."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    worst = 0.0
    for m, n, k in [(333, 4000, 1000), (1024, 2048, 4096)]:
        for _ in range(2):
            a0, w0, r = (torch.randn(*shape, device="cuda", generator=gen).to(torch.bfloat16)
                         for shape in ((m, k), (n, k), (m, n)))
            ref_a, ref_w = a0.double().requires_grad_(), w0.double().requires_grad_()
            ((ref_a @ ref_w.T) * r.double()).sum().backward()
            _, grad_a, grad_w = _gemm_gradients(a0, w0, r, _gemm_loss)
            worst = max(worst, rel_err(grad_a, ref_a.grad), rel_err(grad_w, ref_w.grad))
    return worst


@gpu_only
def test_gemm_gradients_bf16_on_gpu(ranks):
    assert ranks.on_one_gpu(_gpu_gemm_gradients) < 2e-2


@gpu_only
def test_eager_plans_match_torch_on_gpu(ranks):
    """Three shapes x (bf16, bf16 into out, FP8 rowwise, FP8 per tensor): 12 plans; the checked path ran only for
    the misaligned views (3) and the unaligned shape (2), every other repeat went through a plan."""
    failures, plans, checked = ranks.on_one_gpu(_gpu_eager_plans)
    assert failures == [] and plans == 12 and checked == 5, (failures, plans, checked)


def _gpu_split_k_calls():
    """Split-K through the eager plans (its tuned config set to split-K tiles): fresh inputs into poisoned outputs
    against fp64, bitwise repeats, a call on a side stream (its own workspace), a CUDA graph captured and replayed
    on new inputs; the tile counters at 0 after all of it. Returns the failures."""
    from triton_dist.timing import graph_of

    gen = torch.Generator(device="cuda").manual_seed(11)
    failures = []
    for m, n, k, tile in [(128, 4096, 8192, dict(BLOCK_M=128, BLOCK_N=128, num_warps=4, num_stages=4)),
                          (40, 1000, 7176, dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=5))]:
        cfg = {**gemm_config(m, n, k, torch.bfloat16, torch.device("cuda"), SPLIT_K=1), **tile, "BLOCK_K": 64,
               "SPLIT_K": 7}
        gemm_module._CONFIGS._plans[(m, n, k, torch.bfloat16, torch.device("cuda", torch.cuda.current_device()))] = cfg
        gemm_module._EAGER.clear()  # plans of earlier calls hold the configurations they were made with

        def check(got, a, w, what):
            ref = a.double() @ w.double().t()
            err = ((got.double() - ref).abs().max() / ref.abs().max()).item()
            if not err < 1e-2:
                failures.append((what, m, n, k, err))

        a = torch.empty(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16)
        out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        for rep in range(3):
            a.copy_(torch.randn(m, k, device="cuda", generator=gen))
            out.fill_(float("nan"))
            check(gemm(a, w, out=out), a, w, "eager")
            if not torch.equal(gemm(a, w), out):
                failures.append(("not bitwise", m, n, k, rep))
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            got = gemm(a, w)
        torch.cuda.current_stream().wait_stream(side)
        check(got, a, w, "side stream")
        graph = graph_of(lambda: gemm(a, w, out=out))
        for rep in range(2):
            a.copy_(torch.randn(m, k, device="cuda", generator=gen))
            out.fill_(float("nan"))
            graph.replay()
            check(out, a, w, "graph replay")
    torch.cuda.synchronize()
    if any(space["tile_counts"].any() for space in gemm_module._SPLIT_K_SPACE.values()):
        failures.append("tile counters not back at 0")
    return failures


@gpu_only
def test_split_k_eager_side_stream_and_graph_on_gpu(ranks):
    assert ranks.on_one_gpu(_gpu_split_k_calls) == []


# ----------------------------------------------------------------------------------------------- sm_90
GEMM_SIGNATURE = dict(
    a="tensordesc<bf16[128,64]>", b="tensordesc<bf16[256,64]>", c="tensordesc<bf16[1,128,256]>",
    num_segments="i32", seg_rows="i32", N="i32", K="i32", stride_am="i32", stride_bn="i32", stride_cs="i32",
    stride_cm="i32", first_segment="i32", segment_step="i32",
    **{name: "constexpr" for name in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "USE_TMA", "EPILOGUE_SUBTILE",
                                      "FLATTEN", "WARP_SPECIALIZE", "DOT_PRECISION", "SILU_GATE")})


@pytest.mark.parametrize("subtile,flatten", [(False, False), (True, False), (False, True)])
def test_gemm_compiles_for_sm90_with_tma_and_wgmma(subtile, flatten):
    sig = dict(GEMM_SIGNATURE)
    if subtile:
        sig["c"] = "tensordesc<bf16[1,128,128]>"
    res = compile_sm90("triton_dist.kernels.gemm", "gemm_kernel", sig,
                       dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, USE_TMA=True, EPILOGUE_SUBTILE=subtile,
                            FLATTEN=flatten, WARP_SPECIALIZE=False, DOT_PRECISION="tf32", SILU_GATE=False),
                       aligned=("K", "N"))
    ops = res["ops"]
    assert any(k.startswith("wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16") for k in ops), ops
    assert any(k.startswith("cp.async.bulk.tensor.2d.shared") for k in ops), ops  # TMA loads
    assert any(k.startswith("cp.async.bulk.tensor.3d.global") for k in ops), ops  # TMA store
    assert not any(k.startswith("ld.global.v") for k in ops), ops  # no operand goes through registers


@pytest.mark.parametrize("silu_gate", [False, True])
def test_gemm_masked_path_compiles_for_sm90(silu_gate):
    sig = dict(GEMM_SIGNATURE, a="*bf16", b="*bf16", c="*bf16")
    res = compile_sm90("triton_dist.kernels.gemm", "gemm_kernel", sig,
                       dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, USE_TMA=False, EPILOGUE_SUBTILE=False,
                            FLATTEN=False, WARP_SPECIALIZE=False, DOT_PRECISION="tf32", SILU_GATE=silu_gate))
    assert any(k.startswith("wgmma.mma_async") for k in res["ops"]), res["ops"]
    assert any(k.startswith("ex2.approx") for k in res["ops"]) == silu_gate, res["ops"]  # the gate's sigmoid
