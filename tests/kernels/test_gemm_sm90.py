"""The Gluon mainloop (kernels/gemm_sm90.py): against fp64 on an sm_90 GPU in every FP8 scaling mode and in bf16 /
fp16, every configuration, the tuner offering it there; its sm_90 compile on any machine; the op refusing it where
it cannot run."""

import types

import pytest
import torch

from triton_dist.kernels import gemm_sm90
from triton_dist.kernels.gemm import check_tiles, gemm, gemm_candidates, gemm_config, scaled_gemm

from ..conftest import cpu_only, gpu_only
from ..sm90 import compile_sm90
from .fp8_inputs import operands, rel_err


def _errors(m, n, k, mode, out_dtype, fp8_dtype=torch.float8_e4m3fn):
    """{(BLOCK_N, stages): max relative error} of each configuration of the mainloop (``candidates``, with the
    extra slot of EPILOGUE_SUBTILE), two repeats
    with fresh inputs and a result poisoned with NaN each; or a string saying why it cannot run here. Mode
    "block-kmajor": block scales with A's K-major ([M, K/128] of strides (1, M), torch._scaled_mm's layout)."""
    if torch.cuda.get_device_capability()[0] != 9:
        return "not an sm_90 GPU"
    gen = torch.Generator().manual_seed(m + n + k)
    base = gemm_config(m, n, k, torch.float8_e4m3fn, torch.device("cuda"), SPLIT_K=1)
    errs = {}
    for cfg in gemm_sm90.candidates(base, out_dtype, mode.startswith("block"), subtile=True):
        key = (cfg["BLOCK_N"], cfg["num_stages"])
        for _ in range(2):
            a, sa, w, sw, da, dw = (t.cuda() for t in operands(m, n, k, mode, gen, dtype=fp8_dtype))
            out = torch.full((m, n), float("nan"), device="cuda", dtype=out_dtype)
            scaled_gemm(a, w, sa, sw, out=out, out_dtype=out_dtype, config=cfg)
            errs[key] = max(errs.get(key, 0.0), rel_err(out, da @ dw.T))
    return errs


@gpu_only
@pytest.mark.parametrize("mode", ["tensor", "row", "block", "block-kmajor"])
@pytest.mark.parametrize("m,n,k,out_dtype", [
    (1000, 1536, 1040, torch.bfloat16),  # ragged M, N a multiple of 128 plus none, K ragged against 128
    (272, 136, 48, torch.float32),  # one K step, partial tiles on both sides, an fp32 result
    (4096, 4096, 4096, torch.bfloat16),  # several tiles per SM (the persistent walk, loads across tiles)
    (128, 4096, 8192, torch.float16),  # fewer tiles than SMs, a long K
    (384, 256, 208, torch.bfloat16),  # two K steps, the last one ragged
    (520, 264, 384, torch.bfloat16),  # N: a 256-wide tile and one 8 columns in (its second half past N)
    (3, 264, 256, torch.bfloat16),  # three rows: a tile almost all past M
])
def test_gluon_mainloop_matches_fp64(ranks, mode, m, n, k, out_dtype):
    errs = ranks.on_one_gpu(_errors, m, n, k, mode, out_dtype)
    if isinstance(errs, str):
        pytest.skip(errs)
    assert errs and all(err < 1e-2 for err in errs.values()), errs


def _by_name_only(mode):
    if torch.cuda.get_device_capability()[0] != 9:
        return "not an sm_90 GPU"
    a, sa, w, sw, da, dw = (t.cuda() for t in operands(300, 264, 528, mode, torch.Generator().manual_seed(1)))
    out = torch.full((300, 264), float("nan"), device="cuda", dtype=torch.bfloat16)
    scaled_gemm(a, w, sa, sw, out=out, config={"MAINLOOP": "gluon"})
    return rel_err(out, da @ dw.T)


@gpu_only
@pytest.mark.parametrize("mode", ["tensor", "row", "block"])
def test_config_naming_only_the_gluon_mainloop_runs_it(ranks, mode):
    """``config={"MAINLOOP": "gluon"}``: the knobs left out are the mainloop's own (not the core's, which it
    cannot take)."""
    err = ranks.on_one_gpu(_by_name_only, mode)
    if isinstance(err, str):
        pytest.skip(err)
    assert err < 1e-2


@gpu_only
@pytest.mark.parametrize("mode", ["tensor", "row", "block"])
def test_gluon_mainloop_takes_e5m2(ranks, mode):
    """e5m2 operands (both: the FP8 rule) through the same kernel: the wgmmas' other FP8 format."""
    errs = ranks.on_one_gpu(_errors, 1000, 1536, 1040, mode, torch.bfloat16, torch.float8_e5m2)
    if isinstance(errs, str):
        pytest.skip(errs)
    assert errs and all(err < 1e-2 for err in errs.values()), errs


def _split_tail_errors(mode, out_dtype):
    """{(BLOCK_N, stages, shape): (max relative error, bitwise equal on the same inputs)} of each configuration of
    the mainloop with its last round's tiles split along K (TAIL_SPLIT 8), at two shapes sized from the SM count:
    one round and a few tiles more (ragged M and N), and fewer tiles than SMs (every tile split); through the op
    with ``config=`` and through the eager plan (``EagerGemm``), fresh inputs, results poisoned with NaN."""
    from triton_dist.kernels import fp8
    from triton_dist.kernels.gemm import EagerGemm, default_num_programs

    if torch.cuda.get_device_capability()[0] != 9:
        return "not an sm_90 GPU"
    cuda = torch.device("cuda")
    programs = default_num_programs(cuda)
    gen = torch.Generator().manual_seed(7)
    errs = {}
    cands = gemm_sm90.candidates(gemm_config(256, 256, 256, torch.float8_e4m3fn, cuda, SPLIT_K=1), out_dtype,
                                 mode.startswith("block"), subtile=True)
    # row-major block scales also copied K-major first (A_SCALES_K_MAJOR): how the tuner offers them the split tail
    copies = ({}, {"A_SCALES_K_MAJOR": True}) if mode == "block" else ({},)
    for cfg in [{**cfg, **copy, "TAIL_SPLIT": 8} for cfg in cands for copy in copies]:
        columns = -(-200 // cfg["BLOCK_N"])  # N 200: one or two tiles a row of tiles
        for m, n, k in ((128 * -(-(programs + 3) // columns) - 50, 200, 1008), (200, 520, 2064)):
            assert gemm_sm90.tail_split(cfg, m, n, k, programs) > 1, (cfg, m, n, k)  # the path under test runs
            key = (cfg["BLOCK_N"], cfg["num_stages"], cfg["EPILOGUE_SUBTILE"], "A_SCALES_K_MAJOR" in cfg, (m, n, k))
            a, sa, w, sw, da, dw = (t.cuda() for t in operands(m, n, k, mode, gen))
            outs = []
            for eager in (False, True, True):
                out = torch.full((m, n), float("nan"), device="cuda", dtype=out_dtype)
                if eager:
                    scales, _ = fp8.scaled_operands(a, w, sa, sw, None, out_dtype, False, required=True,
                                                    a_strided=True)
                    EagerGemm(a, w, cfg, scales, out_dtype)(a, w, out, sa, sw)
                else:
                    scaled_gemm(a, w, sa, sw, out=out, out_dtype=out_dtype, config=cfg)
                outs.append(out)
            errs[key] = (max(rel_err(out, da @ dw.T) for out in outs),
                         all(torch.equal(outs[0], out) for out in outs[1:]))
    return errs


@gpu_only
@pytest.mark.parametrize("mode", ["tensor", "row", "block", "block-kmajor"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_gluon_mainloop_split_tail_matches_fp64(ranks, mode, out_dtype):
    """TAIL_SPLIT: the last round's tiles in K shares, summed by whichever share arrives last (in share order:
    the same bits each time), the counters back at zero for the next call (three calls on one workspace)."""
    errs = ranks.on_one_gpu(_split_tail_errors, mode, out_dtype)
    if isinstance(errs, str):
        pytest.skip(errs)
    assert errs and all(err < 1e-2 and same for err, same in errs.values()), errs


def _errors_16bit(dtype):
    """{(BLOCK_N, stages, subtile, TAIL_SPLIT, shape): (max relative error, bitwise equal on the same inputs)} of
    each configuration of the mainloop on ``dtype`` operands (64-wide K steps, the sums in the wgmmas' fp32
    accumulators), each also with the split tail (TAIL_SPLIT 8: taken where the last round leaves SMs idle),
    through the op with ``config=`` and through the eager plan, fresh inputs, results poisoned with NaN."""
    from triton_dist.kernels.gemm import EagerGemm, default_num_programs

    if torch.cuda.get_device_capability()[0] != 9:
        return "not an sm_90 GPU"
    cuda = torch.device("cuda")
    programs = default_num_programs(cuda)
    gen = torch.Generator().manual_seed(16)
    shapes = [(1000, 1536, 1000),  # ragged M, K ragged against 64 (K a multiple of 8: TMA's 16-byte rows)
              (272, 136, 48),  # one K step, partial tiles on both sides
              (128 * -(-(programs + 3) // 2) - 50, 200, 1008),  # a round and a few tiles more, ragged M and N
              (128, 4096, 8192),  # fewer tiles than SMs, a long K (every tile split)
              (520, 264, 384),  # N: a 256-wide tile and one 8 columns in
              (3, 264, 256),  # three rows
              (2048, 2048, 512)]  # several tiles per SM
    errs = {}
    for cfg in gemm_sm90.candidates(gemm_config(256, 256, 256, dtype, cuda, SPLIT_K=1), dtype, subtile=True,
                                    dtype=dtype):
        assert cfg["BLOCK_K"] == 64
        for tail in (1, 8):
            cfg = {**cfg, "TAIL_SPLIT": tail}
            for m, n, k in shapes:
                key = (cfg["BLOCK_N"], cfg["num_stages"], cfg["EPILOGUE_SUBTILE"],
                       gemm_sm90.tail_split(cfg, m, n, k, programs), (m, n, k))
                a = torch.randn((m, k), generator=gen).to(dtype).cuda()
                w = torch.randn((n, k), generator=gen).to(dtype).cuda()
                want = a.double() @ w.double().T
                outs = []
                for eager in (False, True, True):
                    out = torch.full((m, n), float("nan"), device="cuda", dtype=dtype)
                    if eager:
                        EagerGemm(a, w, cfg, None, dtype)(a, w, out)
                    else:
                        gemm(a, w, out=out, config=cfg)
                    outs.append(out)
                errs[key] = (max(rel_err(out, want) for out in outs),
                             all(torch.equal(outs[0], out) for out in outs[1:]))
    return errs


@gpu_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gluon_mainloop_on_16bit_operands_matches_fp64(ranks, dtype):
    """bf16 / fp16 operands: the same pipeline with 64-wide K steps and the wgmmas adding into the fp32 sums, at
    every configuration, whole tiles and the split tail (its shares summed in share order: the same bits each
    call)."""
    errs = ranks.on_one_gpu(_errors_16bit, dtype)
    if isinstance(errs, str):
        pytest.skip(errs)
    assert errs and all(err < 1e-2 and same for err, same in errs.values()), errs
    assert any(key[3] > 1 for key in errs)  # the split tail ran


def _offered():
    if torch.cuda.get_device_capability()[0] != 9:
        return "not an sm_90 GPU"
    cuda = torch.device("cuda")
    promoted = types.SimpleNamespace(mode="row", fast_accum=False)
    fast = types.SimpleNamespace(mode="row", fast_accum=True)
    count = lambda scales, **kw: sum(c.get("MAINLOOP") == "gluon" for c in gemm_candidates(  # noqa: E731
        4096, 4096, 4096, torch.float8_e4m3fn, cuda, scales, **kw))
    offers = gemm_sm90.TUNER_OFFERS
    try:
        gemm_sm90.TUNER_OFFERS = True  # (unless TRITON_DIST_GLUON_MAINLOOP=0)
        return count(promoted, split_k=True), count(fast, split_k=True), count(promoted)
    finally:
        gemm_sm90.TUNER_OFFERS = offers


@gpu_only
def test_the_tuner_offers_the_gluon_mainloop_for_promoted_fp8_on_sm90(ranks):
    offered = ranks.on_one_gpu(_offered)
    if isinstance(offered, str):
        pytest.skip(offered)
    # gemm's own sweep with promotion: its configurations; fast accumulation, the fused ops' sweep: none
    assert offered[0] > 0 and offered[1:] == (0, 0)


@cpu_only
def test_the_op_refuses_the_gluon_mainloop_where_it_cannot_run():
    gen = torch.Generator().manual_seed(0)
    a, sa, w, sw, _, _ = operands(32, 32, 32, "row", gen)
    with pytest.raises(ValueError, match="MAINLOOP='gluon' needs FP8 operands .* on an sm_90 GPU; got"):
        scaled_gemm(a, w, sa, sw, config={"MAINLOOP": "gluon"})
    cfgs = gemm_sm90.candidates(gemm_config(32, 32, 32, a.dtype, torch.device("cuda"), SPLIT_K=1))
    assert {c["BLOCK_N"] for c in cfgs} == set(gemm_sm90.BLOCK_NS) and all(gemm_sm90.takes(c, torch.bfloat16)
                                                                           for c in cfgs)
    # block scales too: every BLOCK_N, in 128-column pieces (SPLIT_N is the Triton core's, refused here)
    assert {(c["BLOCK_N"], c["SPLIT_N"]) for c in gemm_sm90.candidates(cfgs[0], torch.float32, True)} \
        == {(128, False), (256, False)}
    for bad in ({"num_stages": 1}, {"num_warps": 8}, {"BLOCK_N": 64}, {"BLOCK_K": 64}, {"num_stages": 7},
                {"SPLIT_N": True}):
        assert not gemm_sm90.takes({**cfgs[0], **bad}, torch.bfloat16), bad
    assert not gemm_sm90.takes({**cfgs[0], "num_stages": 6}, torch.float32)  # its buffer outgrows the memory
    # block scales take a slot's share too: 5 slots of 128 (4 of 256) at most beside a bf16 result, 6 of 128
    # beside half of it (EPILOGUE_SUBTILE; at 256 the half makes no room for a fifth slot)
    assert [(c["BLOCK_N"], c["num_stages"], c["EPILOGUE_SUBTILE"])
            for c in gemm_sm90.candidates(cfgs[0], torch.bfloat16, True, subtile=True)] == \
        [(128, 4, False), (128, 5, False), (128, 6, True), (256, 3, False), (256, 4, False)]
    # the tuner's leave it out (docs/design/fp8.md)
    assert not any(c["EPILOGUE_SUBTILE"] for c in gemm_sm90.candidates(cfgs[0], torch.bfloat16, True))
    assert not gemm_sm90.takes({**cfgs[0], "num_stages": 6}, torch.bfloat16, block_scales=True)
    assert gemm_sm90.takes({**cfgs[0], "num_stages": 6, "EPILOGUE_SUBTILE": True}, torch.bfloat16, block_scales=True)
    assert not gemm_sm90.takes({**cfgs[0], "num_stages": 7, "EPILOGUE_SUBTILE": True}, torch.bfloat16, True)
    # without block scales the half buffer adds a slot only where the result is wide (fp32)
    assert not any(c["EPILOGUE_SUBTILE"] for c in cfgs)
    assert [(c["BLOCK_N"], c["num_stages"]) for c in gemm_sm90.candidates(cfgs[0], torch.float32, subtile=True)
            if c["EPILOGUE_SUBTILE"]] == [(128, 6), (256, 4)]
    assert not gemm_sm90.available(torch.device("cpu"), a.dtype, types.SimpleNamespace(fast_accum=False),
                                   torch.bfloat16)


@cpu_only
def test_the_tuner_offers_the_gluon_mainloop_for_16bit_operands_where_asked(monkeypatch):
    """bf16 / fp16: offered to gemm's tuner only with TRITON_DIST_GLUON_MAINLOOP=all (``TUNER_OFFERS_16BIT``), as
    configurations of 64-wide K steps it takes, with the split tail where the tiles leave SMs idle (M 128: 32
    tiles); ``config={"MAINLOOP": "gluon"}`` on 16-bit operands names the mainloop's own knobs, refused off sm_90."""
    import importlib

    gemm_module = importlib.import_module("triton_dist.kernels.gemm")  # (the package's ``gemm`` is the op)
    monkeypatch.setattr(gemm_module, "num_sms", lambda index=None: 132)
    monkeypatch.setattr(gemm_sm90, "available", lambda *args: True)  # (as on an sm_90 GPU)
    cuda = torch.device("cuda")

    def offered(dtype):
        return [c for c in gemm_candidates(128, 4096, 8192, dtype, cuda, split_k=True) if c.get("MAINLOOP") == "gluon"]

    monkeypatch.setattr(gemm_sm90, "TUNER_OFFERS_16BIT", False)
    assert not offered(torch.bfloat16)
    monkeypatch.setattr(gemm_sm90, "TUNER_OFFERS_16BIT", True)
    for dtype in (torch.bfloat16, torch.float16):
        cands = offered(dtype)
        assert cands and all(c["BLOCK_K"] == 64 and gemm_sm90.takes(c, dtype, dtype=dtype) for c in cands)
        assert not any(gemm_sm90.takes(c, dtype) for c in cands)  # (FP8's K step is 128)
        assert any(gemm_sm90.tail_split(c, 128, 4096, 8192, 132) > 1 for c in cands)
    monkeypatch.undo()
    a = torch.randn(64, 64).to(torch.float16)
    with pytest.raises(ValueError, match="MAINLOOP='gluon' needs .*bf16 / fp16 ones, on an sm_90 GPU"):
        gemm(a, a, config={"MAINLOOP": "gluon"})


@pytest.mark.parametrize("block_n,block_scales,fp8", [(128, False, "e4m3"), (128, True, "e4m3"), (256, False, "e4m3"),
                                                      (256, True, "e4m3"), (128, False, "e5m2"),
                                                      (128, "kmajor", "e4m3"), (128, "kmajor-subtile", "e4m3")])
def test_gluon_mainloop_compiles_for_sm90_overlapping_the_promotion(block_n, block_scales, fp8):
    """Compiled for sm_90 (triton 3.6 in CI, as on the GPU image; the Triton installed too) as the tuner offers
    it: FP8 wgmmas of 128-column pieces, its deepest ring within the shared memory, no spills (at 256 with block
    scales: two sums and a partial, the second piece's wgmmas after the first piece's adds), and ptxas keeping
    the wgmmas asynchronous (were one serialized, every step would wait for its wgmmas before the adds: the
    overlap the kernel exists for; nor may it inject a warpgroup arrive: C7519). Block scales "kmajor": A's
    K-major (row stride 1, as a launch on such scales specializes it); "kmajor-subtile": also the sixth slot a
    C buffer of half a piece makes room for (EPILOGUE_SUBTILE)."""
    if gemm_sm90.gluon is None:
        pytest.skip("this Triton has no Gluon")
    base = gemm_config(32, 32, 32, torch.float8_e4m3fn, torch.device("cuda"), SPLIT_K=1)
    cfg = gemm_sm90.default_config(base, block_scales=block_scales, block_n=block_n)  # its deepest ring
    if block_scales == "kmajor-subtile":
        (cfg,) = [c for c in gemm_sm90.candidates(base, block_scales=True, subtile=True) if c["EPILOGUE_SUBTILE"]]
        assert (cfg["BLOCK_N"], cfg["num_stages"], cfg["EPILOGUE_SUBTILE"]) == (128, 6, True), cfg
    meta = gemm_sm90.meta(cfg, "block" if block_scales else "row")
    options = {"num_warps": meta.pop("num_warps"), "maxnreg": meta.pop("maxnreg")}
    signature = {(128, "e4m3"): "sm90_gemm_signature", (256, "e4m3"): "sm90_gemm_wide_signature",
                 (128, "e5m2"): "sm90_gemm_e5m2_signature"}[block_n, fp8]
    meta["stride_sak"] = 1  # (row-major A scales: a unit K stride, specialized)
    if block_scales in ("kmajor", "kmajor-subtile"):
        signature, meta = f"sm90_gemm_{'subtile' if cfg['EPILOGUE_SUBTILE'] else 'kmajor'}_signature", \
            {**meta, "stride_sa": 1}
        del meta["stride_sak"]
    compiled = compile_sm90("triton_dist.kernels.gemm_sm90", "gemm_fp8_sm90_kernel", signature,
                            dict(meta, num_warps=options["num_warps"]), options=options, assemble=True)
    wgmmas = compiled["ops"].get(f"wgmma.mma_async.sync.aligned.m64n128k32.f32.{fp8}.{fp8}", 0)
    assert wgmmas >= 2 * 4 * block_n // 128, compiled["ops"]  # both consumers, 4 per piece
    assert compiled["shared"] <= gemm_sm90.SHARED_BYTES
    assert compiled["spilled_bytes"] == 0, compiled["spilled_bytes"]
    assert compiled["wgmma_serialized"] == [], compiled["wgmma_serialized"]


@pytest.mark.parametrize("block_n,split_tail", [(128, False), (256, True)])
def test_gluon_mainloop_on_16bit_operands_compiles_for_sm90(block_n, split_tail):
    """bf16 operands as the tuner would offer them (its deepest ring; at 256 with the split tail): 16-bit wgmmas
    of 64-wide K steps as wide as the tile, left asynchronous by ptxas, within the shared memory, no spills (the
    split tail's 256-wide sums added 128 columns at a time), no scales read."""
    if gemm_sm90.gluon is None:
        pytest.skip("this Triton has no Gluon")
    bf16 = torch.bfloat16
    cfg = gemm_sm90.default_config(gemm_config(32, 32, 32, bf16, torch.device("cuda"), SPLIT_K=1), bf16,
                                   block_n=block_n, dtype=bf16)
    assert (cfg["BLOCK_K"], cfg["num_stages"]) == (64, 6 if block_n == 128 else 4), cfg
    meta = gemm_sm90.meta(cfg, None, split_tail=split_tail)
    options = {"num_warps": meta.pop("num_warps"), "maxnreg": meta.pop("maxnreg")}
    meta.update(stride_sak=1, scale_a=None, scale_w=None)
    compiled = compile_sm90("triton_dist.kernels.gemm_sm90", "gemm_fp8_sm90_kernel",
                            "sm90_gemm_16bit_wide_tail_signature" if split_tail else "sm90_gemm_16bit_signature",
                            dict(meta, num_warps=options["num_warps"]),
                            aligned=("c", "partials", "tile_counts") if split_tail else (), options=options,
                            assemble=True)
    # one piece as wide as the tile (no partial to hold beside the sum): 64 x BLOCK_N wgmmas, 4 a K step
    wgmmas = compiled["ops"].get(f"wgmma.mma_async.sync.aligned.m64n{block_n}k16.f32.bf16.bf16", 0)
    assert wgmmas >= 2 * 4, compiled["ops"]  # both consumers
    reads = [op for op in compiled["ops"] if op.startswith(("ld.global", "cp.async.ca", "cp.async.cg"))]
    assert all(op.startswith("ld.global.cg") for op in reads), reads  # (only the split tail's partials)
    assert any(reads) == split_tail
    assert compiled["shared"] <= gemm_sm90.SHARED_BYTES
    # (the split tail at 256: triton 3.9 spills 4 bytes, 3.6 none, as for FP8 below)
    assert compiled["spilled_bytes"] <= (0 if block_n == 128 else 8), compiled["spilled_bytes"]
    assert compiled["wgmma_serialized"] == [], compiled["wgmma_serialized"]


@pytest.mark.parametrize("signature,block_n,block_scales", [("sm90_gemm_tail_signature", 128, False),
                                                            ("sm90_gemm_tail_kmajor_signature", 128, True),
                                                            ("sm90_gemm_tail_wide_signature", 256, False)])
def test_gluon_mainloop_split_tail_compiles_for_sm90(signature, block_n, block_scales):
    """With its last round's tiles split along K (SPLIT_TAIL) at the deepest ring: the epilogue of the tail's
    shares (fp32 partials stored, a GPU-scope acq_rel count, the last share's sum stored from registers) fits the
    shared memory, leaves the wgmmas asynchronous and adds no spill at the 128 tile (at 256, whose two sums fill a
    thread's registers, triton 3.9 spills 8 bytes: 3.6 none)."""
    if gemm_sm90.gluon is None:
        pytest.skip("this Triton has no Gluon")
    base = gemm_config(32, 32, 32, torch.float8_e4m3fn, torch.device("cuda"), SPLIT_K=1)
    cfg = gemm_sm90.default_config(base, block_scales=block_scales, block_n=block_n)
    meta = gemm_sm90.meta(cfg, "block" if block_scales else "row", split_tail=True)
    options = {"num_warps": meta.pop("num_warps"), "maxnreg": meta.pop("maxnreg")}
    meta.update({"stride_sa": 1} if block_scales else {"stride_sak": 1})
    compiled = compile_sm90("triton_dist.kernels.gemm_sm90", "gemm_fp8_sm90_kernel", signature,
                            dict(meta, num_warps=options["num_warps"]), aligned=("c", "partials", "tile_counts"),
                            options=options, assemble=True)  # (aligned: as a launch on torch's tensors has them)
    assert compiled["ops"].get("atom.global.gpu.acq_rel.add.u32", 0) == 2, compiled["ops"]  # one per consumer
    assert compiled["shared"] <= gemm_sm90.SHARED_BYTES
    assert compiled["spilled_bytes"] <= (0 if block_n == 128 else 8), compiled["spilled_bytes"]
    assert compiled["wgmma_serialized"] == [], compiled["wgmma_serialized"]


def test_the_tail_splits_only_a_last_round_that_leaves_most_sms_idle():
    """``tail_split``: the last round's tiles in as many K shares as fill the SMs, at most TAIL_SPLIT, at least one
    K step each; whole tiles where the round is empty or at least half full, or the knob is off."""
    cfg = {"BLOCK_N": 128, "BLOCK_K": 128, "TAIL_SPLIT": 8}
    assert gemm_sm90.tail_split(cfg, 8192, 8192, 8192, 132) == 8  # 4096 tiles: 31 rounds and 4 tiles
    assert gemm_sm90.tail_tiles(cfg, 8192, 8192, 132) == 4
    assert gemm_sm90.tail_split({**cfg, "TAIL_SPLIT": 64}, 8192, 8192, 8192, 132) == 33  # 4 tiles x 33 <= 132
    assert gemm_sm90.tail_split({**cfg, "TAIL_SPLIT": 64}, 8192, 8192, 384, 132) == 3  # one K step a share
    assert gemm_sm90.tail_split(cfg, 128 * 132, 128, 8192, 132) == 1  # no last round
    assert gemm_sm90.tail_split(cfg, 4096, 6144, 4096, 132) == 1  # 84 of 132: more than half full
    assert gemm_sm90.tail_split(cfg, 200, 520, 2064, 132) == 8  # 10 tiles, fewer than the SMs: all split
    assert gemm_sm90.tail_split({**cfg, "BLOCK_N": 256}, 8192, 28672, 8192, 132) == 3  # 40 of 7168 tiles left
    assert gemm_sm90.tail_split({**cfg, "BLOCK_K": 64}, 8192, 8192, 384, 132) == 6  # 16-bit: 64-wide K steps
    assert gemm_sm90.tail_split({"BLOCK_N": 128, "BLOCK_K": 128}, 8192, 8192, 8192, 132) == 1  # knob absent: off
    for bad in (0, True, 2.0):
        with pytest.raises(ValueError, match="TAIL_SPLIT"):
            check_tiles({"TAIL_SPLIT": bad})


@cpu_only
def test_the_arguments_describe_each_call_s_operands():
    """``Arguments`` (an eager plan's) works out the descriptors' fields once; each call's descriptors carry that
    call's tensors (here on the CPU: only the host side is built)."""
    if gemm_sm90.gluon is None:
        pytest.skip("this Triton has no Gluon")
    gen = torch.Generator().manual_seed(0)
    cfg = gemm_sm90.candidates(gemm_config(32, 32, 32, torch.float8_e4m3fn, torch.device("cuda"), SPLIT_K=1))[-1]
    for mode in ("tensor", "row", "block"):
        a, sa, w, sw, _, _ = operands(200, 264, 384, mode, gen)
        c = torch.empty(200, 264, dtype=torch.bfloat16)
        args = gemm_sm90.Arguments(a, w, c, cfg, mode, sa, sw)
        a2, sa2, w2, sw2, _, _ = operands(200, 264, 384, mode, gen)
        got = args(a2, w2, c, sa2, sw2)
        assert [d.base for d in got[:3]] == [a2, w2, c] and got[3] is sa2 and got[4] is sw2
        assert [d.block_shape for d in got[:3]] == [[128, 128], [cfg["BLOCK_N"], 128], [128, 128]]
        assert [d.shape for d in got[:3]] == [[200, 384], [264, 384], [200, 264]]
        assert [d.strides for d in got[:3]] == [[384, 1], [384, 1], [264, 1]]
        assert got[5:] == (200, 264, 384) + ((0, 0) if mode == "tensor" else (sa.stride(0), sw.stride(0))) + \
            ((sa.stride(1),) if mode == "block" else (1,))
        if mode == "block":  # A's scales K-major: their strides as they lie
            sa_k = sa.t().contiguous().t()
            assert gemm_sm90.Arguments(a, w, c, cfg, mode, sa_k, sw)(a, w, c, sa_k, sw)[-3:] == \
                (1, sw.stride(0), sa_k.stride(1)) and sa_k.stride(1) == 200
