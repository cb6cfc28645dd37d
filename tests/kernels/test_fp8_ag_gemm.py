"""FP8 AG+GEMM: ``scaled_ag_gemm(a, w, scale_a, scale_w) == all_gather(deq(a)) @ deq(w).T``, and ``ag_gemm(a, w,
scale_a=..., scale_w=...)`` the same bits (``scaled_ag_gemm`` is its alias).

CPU (interpreter; 2, 3 and 4 ranks): the three scaling modes on the overlapped kernel (chunks, TMA and masks,
ragged M / N / K), gather-first and the NCCL fallback, fp32 and bf16 results against an fp64 reference of the
dequantised inputs, fresh inputs per call and the gather buffers poisoned; the gathered FP8 rows; the SiLU gate;
``torch.ops.triton_dist.fused_all_gather_scaled_matmul`` (torch's schema), its fake and torch.compile; bad input.
GPU: bf16 results at larger shapes, every tuning candidate. sm_90: FP8 wgmma in the phased kernel.
"""

import pytest
import torch
import torch.distributed as dist

import triton_dist as td
from triton_dist.kernels import allgather_gemm as agm
from triton_dist.kernels.allgather_gemm import scaled_ag_gemm

from ..conftest import error_names, gpu_only
from ..sm90 import compile_sm90
from .fp8_inputs import operands, rel_err
from .test_allgather_gemm import AG_SIGNATURE

OVERLAP = {"path": "overlap", "n_chunks": 2, "num_programs": 3}


def _gathered(t):
    parts = [torch.empty_like(t) for _ in range(td.world_size())]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts)


def _poison():
    for ws in td.shmem.workspaces.cached("ag_gemm"):
        ws.a_full.view(torch.uint8).fill_(0x7F)  # NaN in e4m3
        if ws.scale_full is not None:
            ws.scale_full.fill_(float("nan"))
    td.shmem.barrier()  # nobody pushes into our buffers before we poisoned them


def _check(cases, repeats=1):
    """Worst relative error of each case (m, n, k, mode, out dtype, config) and whether the gathered rows came
    back exactly."""
    dev, r = td.shmem.device(), td.rank()
    results = []
    for i, (m, n, k, mode, out_dtype, config) in enumerate(cases):
        worst, gathered_ok = 0.0, True
        for rep in range(repeats):
            gen = torch.Generator().manual_seed(100 * i + 10 * rep + r)
            a, sa, w, sw, da, dw = operands(m, k=k, n=n, mode=mode, gen=gen)
            _poison()
            out, gathered = scaled_ag_gemm(a.to(dev), w.to(dev), sa.to(dev), sw.to(dev), out_dtype=out_dtype,
                                           return_gathered=True, config=config)
            ref = _gathered(da) @ dw.T
            worst = max(worst, rel_err(out.cpu(), ref))
            gathered_ok &= torch.equal(gathered.cpu().view(torch.uint8), _gathered(a.view(torch.uint8)))
            gathered_ok &= out.dtype == out_dtype and tuple(out.shape) == (td.world_size() * m, n)
        results.append((worst, gathered_ok))
    return results


F32, BF16 = torch.float32, torch.bfloat16
TWO_RANKS = [  # (m per rank, n, k, mode, out dtype, config)
    (9, 24, 48, "tensor", F32, OVERLAP),                          # TMA (K, N multiples of 16), ragged M
    (9, 23, 37, "row", F32, OVERLAP),                             # odd N, K: masks
    (9, 24, 160, "block", F32, OVERLAP),                          # a short last 128-group of K
    (9, 40, 130, "block", BF16, {**OVERLAP, "use_tma": False}),   # bf16 out, masks, ragged groups
    (9, 24, 48, "row", BF16, {**OVERLAP, "gather_first": True}),  # one GEMM pass over every rank's rows
    (5, 24, 136, "block", F32, {**OVERLAP, "gather_first": True}),
    (5, 24, 48, "tensor", F32, {"path": "fallback"}),             # all_gather + one scaled GEMM
    (5, 24, 136, "block", F32, {"path": "fallback"}),
]


def test_fp8_ag_gemm_two_ranks(ranks):
    for per_rank in ranks(2, _check, TWO_RANKS):
        for (worst, gathered_ok), case in zip(per_rank, TWO_RANKS):
            assert gathered_ok, case
            assert worst < (8e-3 if case[4] == BF16 else 1e-5), (case, worst)


@pytest.mark.parametrize("world,cases", [
    (3, [(5, 24, 160, "block", F32, OVERLAP), (5, 23, 37, "row", F32, {**OVERLAP, "gather_first": True}),
         (1, 24, 48, "tensor", F32, OVERLAP)]),  # one row per rank: each still keeps its own scale
    (4, [(3, 24, 48, "tensor", F32, OVERLAP), (3, 24, 160, "block", F32, {**OVERLAP, "n_chunks": 1})]),
])
def test_fp8_ag_gemm_three_and_four_ranks(ranks, world, cases):
    for per_rank in ranks(world, _check, cases):
        for (worst, gathered_ok), case in zip(per_rank, cases):
            assert gathered_ok and worst < 1e-5, (case, worst)


def _check_op_is_alias(configs):
    """``ag_gemm`` with FP8 operands and scales against ``scaled_ag_gemm``: per (mode, config), whether both gave the
    same bits (results and gathered rows), and the worst relative error against the fp64 reference."""
    dev, r = td.shmem.device(), td.rank()
    results = []
    for i, (mode, config) in enumerate((m, c) for m in ("tensor", "row", "block") for c in configs):
        gen = torch.Generator().manual_seed(300 + 10 * i + r)
        a, sa, w, sw, da, dw = (t.to(dev) if j < 4 else t for j, t in enumerate(operands(5, 24, 160, mode, gen)))
        kw = dict(out_dtype=F32, return_gathered=True, config=config)
        out, gathered = agm.ag_gemm(a, w, scale_a=sa, scale_w=sw, scaling=mode, **kw)
        ref_out, ref_gathered = scaled_ag_gemm(a, w, sa, sw, **kw)
        bf16 = agm.ag_gemm(a, w, scale_a=sa, scale_w=sw, config=config)  # the default result: bfloat16
        same = torch.equal(out, ref_out) and torch.equal(gathered.view(torch.uint8), ref_gathered.view(torch.uint8))
        same &= bf16.dtype == BF16 and torch.equal(bf16, scaled_ag_gemm(a, w, sa, sw, config=config))
        results.append((same, rel_err(out.cpu(), _gathered(da) @ dw.T)))
    return results


@pytest.mark.parametrize("world,configs", [(1, [None]), (2, [None, OVERLAP, {**OVERLAP, "gather_first": True}])])
def test_ag_gemm_with_scales_is_scaled_ag_gemm(ranks, world, configs):
    for per_rank in ranks(world, _check_op_is_alias, configs):
        for same, err in per_rank:
            assert same and err < 1e-5, per_rank


def _check_silu_gate_and_torch_op():
    """The SiLU gate on FP8 operands; then the torch-style op (per-tensor and rowwise, B = W.T column-major),
    its fake impl and a torch.compile'd call."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    dev, r = td.shmem.device(), td.rank()
    gen = torch.Generator().manual_seed(7 + r)
    a, sa, w, sw, da, dw = operands(6, 12, 48, "row", gen, w_rows=24)
    gated = scaled_ag_gemm(a.to(dev), w.to(dev), sa.to(dev), sw.to(dev), out_dtype=F32, config=OVERLAP,
                           activation="silu_gate")
    h = _gathered(da) @ dw.T
    silu_err = rel_err(gated.cpu(), agm.silu_gate_torch(h))
    group_name = dist.group.WORLD.group_name
    errs = []
    for mode in ("tensor", "row"):
        a, sa, w, sw, da, dw = (t.to(dev) if i < 4 else t for i, t in enumerate(operands(6, 16, 48, mode, gen)))
        b_scale = sw if mode == "tensor" else sw.t()  # torch's B scales: [1] or [1, N]
        gathered, (out,) = torch.ops.triton_dist.fused_all_gather_scaled_matmul(
            a, [w.t()], sa, [b_scale], 0, group_name, [None], [None], [torch.bfloat16], [False])
        errs.append(rel_err(out.cpu(), _gathered(da) @ dw.T))
        errs.append(float(not torch.equal(gathered.view(torch.uint8), _gathered(a.view(torch.uint8)))))
    replicated = torch.ops.triton_dist.fused_all_gather_scaled_matmul(  # row-wise replicated A scales
        a, [w.t()], _gathered(sa), [sw.t()], 0, group_name, [None], [None], [torch.float32], [True])[1][0]
    errs.append(rel_err(replicated.cpu(), _gathered(da) @ dw.T))
    with FakeTensorMode() as fake_mode:
        fa, fw, fsa, fsw = (fake_mode.from_tensor(t) for t in (a, w, sa, sw))
        fg, (fo,) = torch.ops.triton_dist.fused_all_gather_scaled_matmul(
            fa, [fw.t()], fsa, [fsw.t()], 0, group_name, [None], [None], [torch.bfloat16], [False])
    fake_ok = (tuple(fg.shape), tuple(fo.shape), fo.dtype, fg.dtype) == ((12, 48), (12, 16), BF16, a.dtype)

    def f(x, sx, y, sy):
        return scaled_ag_gemm(x, y, sx, sy, out_dtype=F32) * 2.0

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    errs.append(rel_err(compiled(a, sa, w, sw).cpu(), 2 * _gathered(da) @ dw.T))
    return silu_err, errs, fake_ok


def test_fp8_ag_gemm_silu_gate_torch_op_fake_and_compile(ranks):
    for silu_err, errs, fake_ok in ranks(2, _check_silu_gate_and_torch_op):
        assert silu_err < 1e-5 and fake_ok
        assert errs[1] == errs[3] == 0 and max(errs[0], errs[2]) < 8e-3 and max(errs[4:]) < 1e-5, errs


def _check_bad_input():
    dev = td.shmem.device()
    gen = torch.Generator().manual_seed(3)
    a, sa, w, sw, _, _ = operands(4, 8, 32, "row", gen)
    a, sa, w, sw = a.to(dev), sa.to(dev), w.to(dev), sw.to(dev)
    one = torch.ones(1, device=dev)
    name = dist.group.WORLD.group_name
    cases = [
        lambda: scaled_ag_gemm(a, w, sa, sw.t().contiguous()),                # [1, N]: no mode has it
        lambda: scaled_ag_gemm(a, w, sa.double(), sw),                        # scales not fp32
        lambda: scaled_ag_gemm(a, w.to(torch.float8_e5m2), sa, sw),           # mixed FP8 formats
        lambda: scaled_ag_gemm(a.float(), w, sa, sw),                         # not FP8
        lambda: scaled_ag_gemm(a, w, None, sw),                               # a scale missing
        lambda: scaled_ag_gemm(a, w, sa, sw, scaling="block"),                # shapes of another mode
        lambda: scaled_ag_gemm(a, w, one, one, out_dtype=torch.float8_e4m3fn),  # no FP8 result
        lambda: scaled_ag_gemm(a, w[:7], one, one, activation="silu_gate"),   # odd rows
        lambda: agm.ag_gemm(a, w),                                            # FP8 without scales
        lambda: torch.ops.triton_dist.fused_all_gather_scaled_matmul(         # a bias
            a, [w.t()], sa, [sw.t()], 0, name, [torch.zeros(8, device=dev)], [None], [BF16], [False]),
        lambda: torch.ops.triton_dist.fused_all_gather_scaled_matmul(         # K gathered (the last dim)
            a, [w.t()], one, [one], 1, name, [None], [None], [BF16], [False]),
        lambda: torch.ops.triton_dist.fused_all_gather_scaled_matmul(         # a scale per B missing
            a, [w.t(), w.t()], sa, [sw.t()], 0, name, [None, None], [None, None], [BF16, BF16], [False, False]),
        lambda: agm.ag_gemm(a, w, scale_a=sa),                                # FP8 with one scale
        lambda: agm.ag_gemm(a.float(), w.float(), scale_a=sa, scale_w=sw),    # scales with fp32 operands
        lambda: agm.ag_gemm(a.float(), w.float(), out_dtype=BF16),            # an FP8 keyword without scales
        lambda: scaled_ag_gemm(a.float(), w.float(), None, None),             # the alias: scales required
    ]
    return error_names(cases)


def test_fp8_ag_gemm_rejects_bad_input(ranks):
    for names in ranks(2, _check_bad_input):
        assert names == ["ValueError", "TypeError", "TypeError", "TypeError", "TypeError", "ValueError",
                         "ValueError", "ValueError", "TypeError", "ValueError", "ValueError", "ValueError",
                         "TypeError", "TypeError", "ValueError", "TypeError"], names


# ----------------------------------------------------------------------------------------------- GPU
def _check_gpu(m, n, k, mode, config, repeats):
    worst = 0.0
    for i in range(repeats):
        gen = torch.Generator().manual_seed(1000 * i + td.rank())
        a, sa, w, sw, da, dw = operands(m, n, k, mode, gen)
        out = scaled_ag_gemm(a.cuda(), w.cuda(), sa.cuda(), sw.cuda(), config=config)
        full = torch.empty((td.world_size() * m, k), dtype=torch.float64, device="cuda")
        dist.all_gather_into_tensor(full, da.cuda())
        worst = max(worst, rel_err(out, full @ dw.cuda().T))
    return worst


@gpu_only
@pytest.mark.long  # the op tunes at each shape (GPU tier run160: up to 125 s): started first
@pytest.mark.parametrize("mode", ["tensor", "row", "block"])
@pytest.mark.parametrize("m,n,k", [(1024, 1536, 1024), (517, 520, 4104), (64, 4096, 1000)])
def test_fp8_ag_gemm_gpu_bf16(ranks, m, n, k, mode):
    for worst in ranks(ranks.gpu_world, _check_gpu, m, n, k, mode, None, 10):
        assert worst < 1e-2, worst


@gpu_only
@pytest.mark.parametrize("mode", ["row", "block"])
def test_fp8_ag_gemm_gpu_every_candidate(ranks, mode):
    m, n, k, e4m3, cuda = 1000, 1536, 1024, torch.float8_e4m3fn, torch.device("cuda")
    cands = agm.candidate_configs(m, n, k, e4m3, cuda, ranks.gpu_world)  # FP8 tiles for FP8 operands
    for cfg in cands + [{**agm.default_config(m, n, k, e4m3, cuda, ranks.gpu_world), "n_chunks": 4}]:
        for worst in ranks(ranks.gpu_world, _check_gpu, m, n, k, mode, cfg, 3):
            assert worst < 1e-2, (cfg, worst)


# ----------------------------------------------------------------------------------------------- sm_90
FP8_AG_SIGNATURE = dict(AG_SIGNATURE, a_local="tensordesc<fp8e4nv[128,128]>", a_full="tensordesc<fp8e4nv[128,128]>",
                        b="tensordesc<fp8e4nv[256,128]>", scale_a="*fp32", scale_full="*fp32", scale_w="*fp32",
                        stride_sa="i32", stride_sw="i32", SCALES="constexpr", MAX_IMPRECISE_ACC="constexpr")


@pytest.mark.parametrize("scales", ["rows", "blocks"])
def test_fp8_ag_gemm_compiles_for_sm90_with_fp8_wgmma(scales):
    res = compile_sm90("triton_dist.kernels.allgather_gemm", "ag_gemm_kernel", FP8_AG_SIGNATURE,
                       dict(N_CHUNKS=2, BLOCK_M=128, BLOCK_N=256, BLOCK_K=128, GROUP_M=8, USE_TMA=True,
                            EPILOGUE_SUBTILE=False, FLATTEN=False, WARP_SPECIALIZE=False, FENCE_ASYNC_PROXY=True,
                            DOT_PRECISION="tf32", SILU_GATE=False, SCALES=scales,
                            MAX_IMPRECISE_ACC=128 if scales == "rows" else None), aligned=("K", "N"))
    ops = res["ops"]
    assert any(k.startswith("wgmma.mma_async.sync.aligned.m64n256k32.f32.e4m3.e4m3") for k in ops), ops
    assert any(k.startswith("cp.async.bulk.tensor.2d") for k in ops), ops  # TMA loads of the FP8 rows
    assert any(k.startswith("cp.async.bulk.tensor.3d") for k in ops), ops  # TMA store of the bf16 tile
    assert ops.get("fence.proxy.async.global", 0) == 2, ops  # one fence per chunk wait
