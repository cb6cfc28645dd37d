"""FP8 MoE dispatch: ``ep_dispatch(..., quant="fp8")`` quantises in the senders, FP8 x with ``x_scales`` travels as
it is; rows arrive grouped by local expert as float8_e4m3fn with their 1x128 group scales; ep_combine stays bf16.

CPU (interpreter; 2, 3 and 4 ranks): every received row and its scales against torch's quantisation of its token
(scales equal, values within one FP8 step; a pre-quantised row bit for bit), a ragged last group of H, unused slots,
a rank without tokens, the one- and two-launch layouts with column parts; combine of bf16 expert outputs against
an fp64 reference of the dequantised tokens; the FP8 inference path of a DeepSeek-V3-style block (the received rows
and their group scales straight into the FP8 grouped GEMM with 128x128-block expert weights, then combine);
``torch.ops.triton_dist.ep_dispatch_fp8`` + ep_combine and their fakes; bad input. GPU: T=4096-like shapes. sm_90:
the FP8 dispatch kernel variants.
"""

import pytest
import torch
import torch.distributed as dist

import triton_dist as td
from triton_dist.kernels.moe_ep import ep_combine, ep_dispatch

from ..conftest import error_names, gpu_only
from ..sm90 import compile_sm90
from .fp8_inputs import fp8_steps, quantize
from .test_moe_ep import _DISPATCH_SIG

TWO_LAUNCH = {"fused_layout": False, "num_chunks": 3, "layout_chunks": 1, "num_programs": 3, "push_programs": 2,
              "block_h": 128, "h_parts": 2, "tail_chunks": 1, "tail_parts": 2}


def _tokens(T, H, E, K, seed, given):
    """This rank's tokens (bf16, or FP8 + scales when ``given``), router ids (some unused) and weights."""
    g = torch.Generator().manual_seed(1000 * seed + td.rank())
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else \
        torch.zeros((0, K), dtype=torch.int64)
    if T:
        idx[torch.rand(T, K, generator=g) < 0.2] = -1
    weights = torch.rand(T, K, generator=g)
    x = (torch.randn(T, H, generator=g) * torch.rand(T, 1, generator=g) * 8).to(torch.bfloat16)
    q, s = quantize(x.float(), "group")
    return x, q, s, idx, weights


def _run(T, H, E, K, seed, given=False, config=None, align=1, zero_rank=None):
    dev, r, w = td.shmem.device(), td.rank(), td.world_size()
    T = 0 if r == zero_rank else T
    x, q, s, idx, weights = _tokens(T, H, E, K, seed, given)
    every = [None] * w
    dist.all_gather_object(every, (q.view(torch.uint8), s, idx, weights))  # (FP8 tensors do not unpickle)
    every = [(e[0].view(torch.float8_e4m3fn),) + tuple(e[1:]) for e in every]
    max_tokens = max(e[0].shape[0] for e in every) + 1
    if given:
        res = ep_dispatch(q.to(dev), idx.to(dev), weights.to(dev), num_experts=E, max_tokens=max_tokens,
                          align=align, config=config, x_scales=s.to(dev))
    else:
        res = ep_dispatch(x.to(dev), idx.to(dev), weights.to(dev), num_experts=E, max_tokens=max_tokens,
                          align=align, config=config, quant="fp8")
    problems, worst_steps = [], 0
    el = E // w
    rx, rs, rid = res.x.cpu(), res.scales.cpu(), res.expert_ids.cpu()
    offsets = res.expert_offsets.cpu().tolist()
    if rx.dtype != torch.float8_e4m3fn or tuple(rs.shape) != (rx.shape[0], (H + 127) // 128):
        problems.append(f"got {rx.dtype} rows and scales {list(rs.shape)}")
    for le, e in enumerate(range(r * el, (r + 1) * el)):
        group = [(src, t) for src in range(w) for t in range(every[src][2].shape[0]) for j in range(K)
                 if int(every[src][2][t, j]) == e]
        if int(res.expert_counts[le]) != len(group):
            problems.append(f"expert {le}: {int(res.expert_counts[le])} rows, expected {len(group)}")
        for i, (src, t) in enumerate(group):
            row = offsets[le] + i
            if not torch.equal(rs[row], every[src][1][t]) or int(rid[row]) != le:
                problems.append(f"row {row} (rank {src} token {t}): scales {rs[row].tolist()} vs "
                                f"{every[src][1][t].tolist()}")
                break
            worst_steps = max(worst_steps, fp8_steps(rx[row], every[src][0][t]))
    if worst_steps > (0 if given else 1):
        problems.append(f"received rows {worst_steps} FP8 steps from torch's quantisation")
    # experts: bf16 outputs of the dequantised rows, scaled by 1 + local expert id; combine back in bf16
    deq = res.x.float() * res.scales.repeat_interleave(128, dim=1)[:, :H]
    out = (deq * (1.0 + res.expert_ids.clamp(min=0).float())[:, None]).to(torch.bfloat16)
    y = ep_combine(out, res.handle, config=config).cpu()
    ref = torch.zeros((T, H), dtype=torch.float64)
    dq = every[r][0].double() * every[r][1].double().repeat_interleave(128, dim=1)[:, :H]
    for t in range(T):
        for j in range(K):
            e = int(idx[t, j])
            if e >= 0:
                ref[t] += float(weights[t, j]) * (1.0 + e % el) * dq[t]
    if y.dtype != torch.bfloat16 or (T and not torch.allclose(y.double(), ref, rtol=3e-2, atol=3e-2)):
        problems.append(f"combine: {y.dtype}, off by {(y.double() - ref).abs().max().item() if T else 0:.3g}")
    return problems


def _dispatch_experts_combine(T, H, E, K, seed):
    """ep_dispatch(x8, x_scales=) -> grouped_gemm(recv.x, w8, ..., scale_x=recv.scales, scale_w=block scales) ->
    ep_combine, against fp64 of the dequantised tokens and weights (the same expert weights on every rank), each
    expert output rounded to bf16 as the grouped GEMM gives it."""
    from triton_dist.kernels.grouped_gemm import grouped_gemm

    from .fp8_inputs import dequantize

    dev, r, w = td.shmem.device(), td.rank(), td.world_size()
    x, q, s, idx, weights = _tokens(T, H, E, K, seed, False)
    experts = [quantize(torch.randn(H, H, generator=torch.Generator().manual_seed(e)) / H ** 0.5, "block")
               for e in range(E)]
    el = E // w
    mine = experts[r * el:(r + 1) * el]
    w8 = torch.stack([q_w for q_w, _ in mine]).to(dev)
    sw = torch.stack([s_w for _, s_w in mine]).to(dev)
    res = ep_dispatch(q.to(dev), idx.to(dev), weights.to(dev), num_experts=E, max_tokens=T + 1, x_scales=s.to(dev))
    out = grouped_gemm(res.x, w8, res.expert_offsets, res.expert_counts, scale_x=res.scales, scale_w=sw)
    y = ep_combine(out, res.handle).cpu().double()
    dq = dequantize(q, s, "group")
    ref = torch.zeros((T, H), dtype=torch.float64)
    for t in range(T):
        for j in range(K):
            e = int(idx[t, j])
            if e >= 0:
                expert_out = (dq[t] @ dequantize(*experts[e], "block").T).to(torch.bfloat16).double()
                ref[t] += float(weights[t, j]) * expert_out
    return (y - ref).abs().max().item() / ref.abs().max().item()


def test_fp8_dispatch_grouped_gemm_combine_2_ranks(ranks):
    for err in ranks(2, _dispatch_experts_combine, 6, 256, 4, 2, 5):
        assert err < 2e-2, err  # combine sums bf16 partials per rank (the expert outputs' rounding is in the reference)


@pytest.mark.parametrize("given", [False, True])
def test_fp8_dispatch_combine_2_ranks(ranks, given):
    for problems in ranks(2, _run, 7, 200, 8, 3, 1, given, None, 2):  # H = 200: a 72-wide last group
        assert problems == []


def test_fp8_dispatch_combine_3_ranks_two_launches(ranks):
    for problems in ranks(3, _run, 6, 256, 6, 2, 2, False, TWO_LAUNCH):
        assert problems == []


def test_fp8_dispatch_combine_4_ranks_a_rank_without_tokens(ranks):
    for problems in ranks(4, _run, 5, 136, 8, 2, 3, True, None, 1, 3):
        assert problems == []


def _check_torch_ops_and_bad_input():
    from torch._subclasses.fake_tensor import FakeTensorMode

    dev = td.shmem.device()
    x, q, s, idx, weights = (t.to(dev) for t in _tokens(4, 160, 4, 2, 9, False))
    rx, rs, ids, rw, counts, offsets, token_pos = torch.ops.triton_dist.ep_dispatch_fp8(x, None, idx, weights, 4, 5,
                                                                                        1)
    y = torch.ops.triton_dist.ep_combine(rx.float().mul(rs.repeat_interleave(128, 1)[:, :160]).to(x.dtype),
                                         token_pos, 4, 2, 5, 1, None, "fp8")
    given = torch.ops.triton_dist.ep_dispatch_fp8(q, s, idx, weights, 4, 5, 1)
    with FakeTensorMode() as mode:
        fake = torch.ops.triton_dist.ep_dispatch_fp8(*(mode.from_tensor(t) for t in (x, s, idx, weights)), 4, 5, 1)
    ok = (rx.dtype == torch.float8_e4m3fn, tuple(rs.shape) == (rx.shape[0], 2), tuple(y.shape) == (4, 160),
          y.dtype == x.dtype, torch.equal(given[1][:int(offsets[-1])], rs[:int(offsets[-1])]),
          tuple(fake[0].shape) == tuple(rx.shape), fake[0].dtype == rx.dtype, tuple(fake[1].shape) == tuple(rs.shape))
    kw = dict(num_experts=4, max_tokens=5)
    cases = [
        lambda: ep_dispatch(q, idx, weights, **kw),                                 # FP8 x without x_scales
        lambda: ep_dispatch(q, idx, weights, x_scales=s[:, :1], **kw),              # x_scales: one group short
        lambda: ep_dispatch(q, idx, weights, x_scales=s.double(), **kw),            # x_scales not fp32
        lambda: ep_dispatch(x, idx, weights, x_scales=s, **kw),                     # scales with bf16 x
        lambda: ep_dispatch(x, idx, weights, quant="int8", **kw),                   # no such quantisation
        lambda: ep_dispatch(q.view(torch.float8_e5m2), idx, weights, x_scales=s, **kw),  # e5m2 rows
    ]
    return ok, error_names(cases)


def test_fp8_dispatch_torch_ops_fakes_and_bad_input(ranks):
    for ok, names in ranks(2, _check_torch_ops_and_bad_input):
        assert all(ok), ok
        assert names == ["TypeError", "ValueError", "TypeError", "ValueError", "ValueError", "TypeError"], names


# ----------------------------------------------------------------------------------------------- GPU
@gpu_only
@pytest.mark.parametrize("T,given", [(512, False), (512, True), (64, False)])
def test_fp8_dispatch_combine_gpu(ranks, T, given):
    for problems in ranks(ranks.gpu_world, _run, T, 7168 // 8, 16, 4, 5, given):
        assert problems == []


# ----------------------------------------------------------------------------------------------- sm_90
@pytest.mark.parametrize("fp8,bt,bh", [("quantize", 16, 512), ("given", 2, 1024)])
def test_fp8_dispatch_compiles_for_sm90(fp8, bt, bh):
    sig = dict(_DISPATCH_SIG, x="*fp8e4nv" if fp8 == "given" else "*bf16", recv_x="*fp8e4nv",
               x_scales="*fp32", recv_scales="*fp32", FP8="constexpr")
    consts = dict(K=8, EL=32, BT=bt, BH=bh, K_PAD=8, EL_PAD=32, W_PAD=2, RB=128, MAXC=1024, FUSED_LAYOUT=False,
                  TB=2, CG=4, SENDERS_HELP=True, TIMELINE=False, PDL=True, DEFER_SIGNAL=True, EVICT="", FP8=fp8)
    ops = compile_sm90("triton_dist.kernels.moe_ep", "ep_dispatch_kernel", sig, consts,
                       aligned=("x", "recv_x", "H"))["ops"]
    assert any(k.startswith("st.global") for k in ops) and any(k.startswith("atom.global.sys.release") for k in ops)
