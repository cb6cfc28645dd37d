"""FP8 GEMM+RS: ``scaled_gemm_rs`` == this rank's rows of ``sum_r deq(a_r) @ deq(w_r).T``, and ``gemm_rs(a, w,
scale_a=..., scale_w=...)`` the same bits (``scaled_gemm_rs`` is its alias).

CPU (interpreter; 2, 3 and 4 ranks): the three scaling modes, ragged M / N / K_local (rows split like
tensor_split), bf16 and fp32 partials, the fallback, against an fp64 reference of the dequantised inputs with fresh
inputs and poisoned receive buffers; bitwise reproducibility; ``torch.ops.triton_dist.
fused_scaled_matmul_reduce_scatter`` (torch's schema, sum and avg), its fake and torch.compile; bad input.
GPU: bf16 at larger shapes. sm_90: FP8 wgmma in the kernel.
"""

import pytest
import torch
import torch.distributed as dist

import triton_dist as td
from triton_dist.kernels.gemm_reducescatter import gemm_rs, rows_of_rank, scaled_gemm_rs

from ..conftest import error_names, gpu_only
from ..sm90 import compile_sm90
from .fp8_inputs import operands, rel_err

TILES = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "num_programs": 0, "path": "overlap"}
F32, BF16 = torch.float32, torch.bfloat16


def _reference(da, dw):
    """This rank's rows of sum_r da_r @ dw_r.T (fp64)."""
    parts = [None] * td.world_size()
    dist.all_gather_object(parts, (da, dw))
    full = sum(x @ y.T for x, y in parts)
    start, rows = rows_of_rank(da.shape[0], td.world_size(), td.rank())
    return full[start: start + rows]


def _check(cases):
    """Per case (m, n, k_local, mode, out dtype, config): the relative error and whether a second call gave the
    same bits."""
    dev, r = td.shmem.device(), td.rank()
    results = []
    for i, (m, n, k, mode, out_dtype, config) in enumerate(cases):
        gen = torch.Generator().manual_seed(50 * i + r)
        a, sa, w, sw, da, dw = (t.to(dev) if j < 4 else t for j, t in enumerate(operands(m, n, k, mode, gen)))
        for ws in td.shmem.workspaces.cached("gemm_rs"):
            ws.recv.fill_(float("nan"))
        td.shmem.barrier()
        out = scaled_gemm_rs(a, w, sa, sw, out_dtype=out_dtype, config=config)
        again = scaled_gemm_rs(a, w, sa, sw, out_dtype=out_dtype, config=config)
        ok = out.dtype == out_dtype and torch.equal(out, again)
        ref = _reference(da, dw)  # collective: on every rank, also one without rows
        results.append((rel_err(out.cpu(), ref) if out.numel() else 0.0, ok))
    return results


TWO_RANKS = [  # (M, N, K per rank, mode, out dtype, config)
    (37, 24, 48, "tensor", F32, {**TILES, "use_tma": True}),     # ragged rows 19 + 18, TMA
    (37, 23, 37, "row", F32, TILES),                              # odd N, K: masks
    (20, 24, 160, "block", F32, {**TILES, "use_tma": True}),      # a short last 128-group of K
    (21, 40, 130, "block", BF16, {**TILES, "partial": "fp32"}),   # fp32 partials, bf16 out
    (20, 24, 48, "row", BF16, TILES),                             # bf16 partials
    (9, 24, 136, "block", F32, {"path": "fallback"}),             # the scaled GEMM, then reduce_scatter
    (9, 24, 48, "row", F32, {"path": "fallback"}),
]


def test_fp8_gemm_rs_two_ranks(ranks):
    for per_rank in ranks(2, _check, TWO_RANKS):
        for (err, ok), case in zip(per_rank, TWO_RANKS):
            assert ok and err < (3e-2 if case[4] == BF16 else 1e-5), (case, err)  # bf16: partials rounded too


@pytest.mark.parametrize("world,cases", [
    (3, [(10, 24, 160, "block", F32, TILES), (8, 23, 37, "tensor", F32, TILES)]),
    (4, [(11, 24, 48, "row", F32, TILES), (3, 16, 136, "block", F32, TILES)]),  # 3 rows: rank 3 owns none
])
def test_fp8_gemm_rs_three_and_four_ranks(ranks, world, cases):
    for per_rank in ranks(world, _check, cases):
        for (err, ok), case in zip(per_rank, cases):
            assert ok and err < 1e-5, (case, err)


def _check_op_is_alias(configs):
    """``gemm_rs`` with FP8 operands and scales against ``scaled_gemm_rs``: per (mode, config), whether both gave
    the same bits, and the relative error against the fp64 reference."""
    dev, r = td.shmem.device(), td.rank()
    results = []
    for i, (mode, config) in enumerate((m, c) for m in ("tensor", "row", "block") for c in configs):
        gen = torch.Generator().manual_seed(400 + 10 * i + r)
        a, sa, w, sw, da, dw = (t.to(dev) if j < 4 else t for j, t in enumerate(operands(21, 24, 160, mode, gen)))
        out = gemm_rs(a, w, config=config, scale_a=sa, scale_w=sw, scaling=mode, out_dtype=F32)
        same = torch.equal(out, scaled_gemm_rs(a, w, sa, sw, out_dtype=F32, config=config))
        bf16 = gemm_rs(a, w, config=config, scale_a=sa, scale_w=sw)  # the default result: bfloat16
        same &= bf16.dtype == BF16 and torch.equal(bf16, scaled_gemm_rs(a, w, sa, sw, config=config))
        results.append((same, rel_err(out.cpu(), _reference(da, dw))))
    return results


@pytest.mark.parametrize("world,configs", [(1, [None]), (2, [None, TILES, {**TILES, "partial": "fp32"}])])
def test_gemm_rs_with_scales_is_scaled_gemm_rs(ranks, world, configs):
    for per_rank in ranks(world, _check_op_is_alias, configs):
        for same, err in per_rank:
            assert same and err < 1e-5, per_rank


def _check_torch_op_fake_and_compile():
    from torch._subclasses.fake_tensor import FakeTensorMode

    dev, r = td.shmem.device(), td.rank()
    gen = torch.Generator().manual_seed(11 + r)
    name = dist.group.WORLD.group_name
    errs = []
    for mode, op, k in (("tensor", "sum", 48), ("row", "avg", 48), ("block", "sum", 160)):
        a, sa, w, sw, da, dw = (t.to(dev) if j < 4 else t for j, t in enumerate(operands(12, 16, k, mode, gen)))
        b_scale = sw if mode == "tensor" else sw.t()  # B's scales: [1], [1, N], [K/128, N/128] (an extension)
        out = torch.ops.triton_dist.fused_scaled_matmul_reduce_scatter(
            a, w.t(), sa, b_scale, op, 0, 0, name, [12, 16], None, None, torch.float32, False)
        errs.append(rel_err(out.cpu(), _reference(da, dw) / (td.world_size() if op == "avg" else 1)))
    with FakeTensorMode() as fake_mode:
        fa, fw, fsa, fsw = (fake_mode.from_tensor(t) for t in (a, w, sa, sw))
        fo = torch.ops.triton_dist.fused_scaled_matmul_reduce_scatter(
            fa, fw.t(), fsa, fsw.t(), "sum", 0, 0, name, [12, 16], None, None, torch.bfloat16, False)
    fake_ok = tuple(fo.shape) == (6, 16) and fo.dtype == BF16

    def f(x, sx, y, sy):
        return scaled_gemm_rs(x, y, sx, sy, out_dtype=F32) + 1.0

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    errs.append(rel_err(compiled(a, sa, w, sw).cpu() - 1.0, _reference(da, dw)))
    return errs, fake_ok


def test_fp8_gemm_rs_torch_op_fake_and_compile(ranks):
    for errs, fake_ok in ranks(2, _check_torch_op_fake_and_compile):
        assert fake_ok and max(errs) < 1e-5, errs


def _check_bad_input():
    dev = td.shmem.device()
    a, sa, w, sw, _, _ = (t.to(dev) for t in operands(8, 16, 256, "block", torch.Generator().manual_seed(5)))
    name = dist.group.WORLD.group_name
    one = torch.ones(1, device=dev)
    cases = [
        lambda: scaled_gemm_rs(a, w, sa[:, :1], sw),                           # A's block scales: 2 groups
        lambda: scaled_gemm_rs(a, w, sa, sw, scaling="row"),                    # shapes of another mode
        lambda: scaled_gemm_rs(a, w, sa, sw.half()),                            # scales not fp32
        lambda: scaled_gemm_rs(a, w.to(torch.float8_e5m2), one, one),           # mixed FP8 formats
        lambda: scaled_gemm_rs(a, w, sa, sw, config={**TILES, "BLOCK_K": 256}),  # a K step over two groups
        lambda: scaled_gemm_rs(a, w, one, one, out=torch.empty(4, 16, device=dev)),  # out: fp32, not bf16
        lambda: torch.ops.triton_dist.fused_scaled_matmul_reduce_scatter(       # output_shape not A @ B's
            a, w.t(), one, one, "sum", 0, 0, name, [8, 15], None, None, BF16, False),
        lambda: torch.ops.triton_dist.fused_scaled_matmul_reduce_scatter(       # a result scale
            a, w.t(), one, one, "sum", 0, 0, name, [8, 16], None, one, BF16, False),
        lambda: torch.ops.triton_dist.fused_scaled_matmul_reduce_scatter(       # reduce_op max
            a, w.t(), one, one, "max", 0, 0, name, [8, 16], None, None, BF16, False),
        lambda: gemm_rs(a, w),                                                  # FP8 without scales
        lambda: gemm_rs(a, w, scale_w=sw),                                      # FP8 with one scale
        lambda: gemm_rs(a.float(), w.float(), scale_a=one, scale_w=one),        # scales with fp32 operands
        lambda: gemm_rs(a.float(), w.float(), fast_accum=True),                 # an FP8 keyword without scales
        lambda: scaled_gemm_rs(a.float(), w.float(), None, None),               # the alias: scales required
    ]
    return error_names(cases)


def test_fp8_gemm_rs_rejects_bad_input(ranks):
    for names in ranks(2, _check_bad_input):
        assert names == ["ValueError", "ValueError", "TypeError", "TypeError", "ValueError", "ValueError",
                         "ValueError", "ValueError", "ValueError", "TypeError", "TypeError", "TypeError",
                         "ValueError", "TypeError"], names


# ----------------------------------------------------------------------------------------------- GPU
def _check_gpu(m, n, k, mode, repeats):
    worst = 0.0
    for i in range(repeats):
        gen = torch.Generator().manual_seed(1000 * i + td.rank())
        a, sa, w, sw, da, dw = operands(m, n, k, mode, gen)
        out = scaled_gemm_rs(a.cuda(), w.cuda(), sa.cuda(), sw.cuda())
        worst = max(worst, rel_err(out.cpu(), _reference(da, dw)))
    return worst


@gpu_only
@pytest.mark.long  # the op tunes at each shape (GPU tier run160: up to 125 s): started first
@pytest.mark.parametrize("mode", ["tensor", "row", "block"])
@pytest.mark.parametrize("m,n,k", [(2048, 1536, 1024), (517, 520, 2052), (64, 4096, 1000)])
def test_fp8_gemm_rs_gpu_bf16(ranks, m, n, k, mode):
    for worst in ranks(ranks.gpu_world, _check_gpu, m, n, k, mode, 5):
        assert worst < 1e-2, worst


# ----------------------------------------------------------------------------------------------- sm_90
@pytest.mark.parametrize("scales", ["rows", "blocks"])
def test_fp8_gemm_rs_compiles_for_sm90_with_fp8_wgmma(scales):
    sig = dict(a="tensordesc<fp8e4nv[128,128]>", w="tensordesc<fp8e4nv[256,128]>", out="tensordesc<bf16[1,128,256]>",
               recv="*bf16", recv_peer="*bf16", arrived="*i32", ready="*i32", state="*i32", M="i32", N="i32",
               K="i32", stride_am="i32", stride_wn="i32", own_rows="i32", ctx="*i64",
               **{name: "constexpr" for name in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "USE_TMA",
                                                 "EPILOGUE_SUBTILE", "DEFER_SIGNAL", "DOT_PRECISION", "SLOTS_BLOCK",
                                                 "REMOTE_TMA")},
               scale_a="*fp32", scale_w="*fp32", stride_sa="i32", stride_sw="i32", SCALES="constexpr",
               MAX_IMPRECISE_ACC="constexpr")
    res = compile_sm90("triton_dist.kernels.gemm_reducescatter", "gemm_rs_kernel", sig,
                       dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=128, GROUP_M=8, USE_TMA=True, EPILOGUE_SUBTILE=False,
                            DEFER_SIGNAL=True, DOT_PRECISION="tf32", SLOTS_BLOCK=1, REMOTE_TMA=False, SCALES=scales,
                            MAX_IMPRECISE_ACC=128 if scales == "rows" else None),
                       aligned=("recv", "N", "K", "stride_am", "stride_wn"))
    ops = res["ops"]
    assert any(k.startswith("wgmma.mma_async.sync.aligned.m64n256k32.f32.e4m3.e4m3") for k in ops), ops
    assert any(k.startswith("cp.async.bulk.tensor.2d") for k in ops), ops
    assert any(k.startswith("atom.global.sys.release") for k in ops), ops  # the partials' flags
