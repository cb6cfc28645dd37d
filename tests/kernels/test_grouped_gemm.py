"""The grouped GEMM (``triton_dist.kernels.grouped_gemm``): every expert's rows times its weight, group boundaries
read on the device.

CPU (interpreter): both data paths (TMA descriptors, masks), plain and SiLU-gated, against an fp64 per-expert
reference with fresh inputs each repeat, poisoned outputs (rows outside every group must stay untouched), empty
experts, ragged groups, alignment padding between groups (counts given), groups running to the next offset (no
counts), offsets past the buffer (clamped), bad input, the torch op and its fake implementation. sm_90: the
TMA + wgmma code of both paths. GPU: bf16 at MoE shapes, skewed loads, a CUDA-graph replay with new offsets,
the backward's kernels ("kn" layout, weight gradient). The weight gradient on CPU: both data paths, NaN outside
the groups.
"""

import pytest
import torch

from triton_dist.kernels.grouped_gemm import grouped_gemm, grouped_gemm_torch

from ..conftest import cpu_only, error_names, gpu_only
from ..sm90 import compile_sm90


def _groups(counts, align, tail, gen):
    """Offsets of groups of ``counts`` rows starting on multiples of ``align``, and a buffer ``tail`` rows longer."""
    starts = [0]
    for c in counts:
        starts.append(starts[-1] + -(-c // align) * align)
    return torch.tensor(starts, dtype=torch.int32), starts[-1] + tail


def _in_groups(offsets, counts, rows):
    mask = torch.zeros(rows, dtype=torch.bool)
    for start, n in zip(offsets.tolist(), counts):
        mask[start:start + n] = True
    return mask


def _check(x, w, offsets, counts, activation, config, pass_counts=True, w_layout="nk"):
    """Run on a NaN-poisoned output; error of the group rows vs fp64, and whether every other row is still NaN."""
    rows = x.shape[0]
    n_out = w.shape[2] if w_layout == "kn" else w.shape[1] // 2 if activation == "silu_gate" else w.shape[1]
    out = torch.full((rows, n_out), float("nan"), dtype=x.dtype, device=x.device)
    cnt = torch.tensor(counts, dtype=torch.int32, device=x.device) if pass_counts else None
    grouped_gemm(x, w, offsets.to(x.device), cnt, activation=activation, out=out, config=config, w_layout=w_layout)
    ref = grouped_gemm_torch(x.double().cpu(), w.double().cpu(), offsets, torch.tensor(counts, dtype=torch.int32),
                             activation, w_layout=w_layout)
    inside = _in_groups(offsets, counts, rows)
    out = out.cpu().double()
    scale = max(ref[inside].abs().max().item(), 1.0) if inside.any() else 1.0
    err = (out[inside] - ref[inside]).abs().max().item() / scale if inside.any() else 0.0
    return err, bool(out[~inside].isnan().all())


@cpu_only
@pytest.mark.parametrize("dtype,use_tma,activation,align,w_layout", [
    (torch.float32, False, "none", 1, "nk"),
    (torch.float32, True, "silu_gate", 4, "nk"),
    (torch.float16, None, "none", 4, "nk"),       # aligned K, N: TMA chosen by itself
    (torch.float16, False, "silu_gate", 1, "nk"),
    (torch.float32, True, "none", 4, "kn"),       # w [E, K, N]: K not a multiple of BLOCK_K (the 3-D bounds)
    (torch.float32, False, "none", 1, "kn"),
])
def test_grouped_gemm_matches_fp64(dtype, use_tma, activation, align, w_layout):
    """Ragged groups (a partial last tile, a group of one row, empty experts, a group spanning tiles), repeated
    with fresh inputs; padding between groups and rows past the end stay untouched. "kn": each expert's weight
    [K, N] as it lies; a K step past an expert's K rows must not read the next expert's."""
    gen = torch.Generator().manual_seed(7)
    K, N = 40 if use_tma is False or w_layout == "kn" else 32, 24
    w_rows = 2 * N if activation == "silu_gate" else N
    cfg = {"use_tma": use_tma, "num_programs": 3, **({"BLOCK_K": 32} if w_layout == "kn" else {})}
    for counts in ([5, 0, 1, 37], [0, 16, 3, 0]):
        offsets, rows = _groups(counts, align, 5, gen)
        x = torch.randn(rows, K, generator=gen).to(dtype)
        shape = (len(counts), K, N) if w_layout == "kn" else (len(counts), w_rows, K)
        w = (torch.randn(*shape, generator=gen) / K ** 0.5).to(dtype)
        err, untouched = _check(x, w, offsets, counts, activation, cfg, w_layout=w_layout)
        assert err < (1e-6 if dtype == torch.float32 else 3e-3), (counts, err)
        assert untouched, "rows outside the groups were written"


@cpu_only
@pytest.mark.parametrize("use_tma", [True, False])
def test_weight_grad_matches_fp64(use_tma):
    """``dw[e] = dy[g_e].T @ x[g_e]``: ragged groups (partial last steps, one row, empty experts: zeros), padding
    between groups and rows past the end holding NaN in both operands (never read), tiles past N and K."""
    from triton_dist.kernels.grouped_gemm import launch_weight_grad

    gen = torch.Generator().manual_seed(5)
    counts, N, K = [5, 0, 1, 37], 20, 24
    offsets, rows = _groups(counts, 4, 6, gen)
    inside = _in_groups(offsets, counts, rows)[:, None]
    dy = torch.where(inside, torch.randn(rows, N, generator=gen), float("nan"))
    x = torch.where(inside, torch.randn(rows, K, generator=gen), float("nan"))
    dw = torch.full((len(counts), N, K), float("nan"))
    cfg = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, num_warps=4, num_stages=1, use_tma=use_tma)
    launch_weight_grad(dy, x, offsets, torch.tensor(counts, dtype=torch.int32), dw, cfg)
    for e, (start, n) in enumerate(zip(offsets.tolist(), counts)):
        ref = dy[start:start + n].double().T @ x[start:start + n].double()
        assert torch.allclose(dw[e].double(), ref, atol=1e-5), e


@cpu_only
def test_groups_without_counts_run_to_the_next_offset():
    """No counts: group e is [offsets[e], offsets[e+1]) (its padding rows included); rows past offsets[E] untouched."""
    gen = torch.Generator().manual_seed(3)
    offsets = torch.tensor([0, 3, 3, 20], dtype=torch.int32)
    x = torch.randn(26, 16, generator=gen)
    w = torch.randn(3, 8, 16, generator=gen)
    err, untouched = _check(x, w, offsets, [3, 0, 17], "none", {"num_programs": 2}, pass_counts=False)
    assert err < 1e-6 and untouched


@cpu_only
def test_offsets_past_the_buffer_are_clamped():
    """A group that would end past the buffer writes only the buffer's rows; nothing outside ``out`` is touched."""
    x = torch.randn(10, 8)
    w = torch.randn(2, 4, 8)
    big = torch.full((12, 4), float("nan"))
    out = big[:10]  # the two rows after it must survive
    grouped_gemm(x, w, torch.tensor([0, 6, 40], dtype=torch.int32), out=out, config={"num_programs": 2})
    ref = torch.cat([x[:6] @ w[0].T, x[6:] @ w[1].T])
    assert torch.allclose(out, ref, atol=1e-5) and big[10:].isnan().all()


@cpu_only
def test_all_experts_empty_writes_nothing():
    x = torch.randn(9, 16)
    out = torch.full((9, 8), float("nan"))
    grouped_gemm(x, torch.randn(4, 8, 16), torch.zeros(5, dtype=torch.int32), out=out)
    assert out.isnan().all()


def test_grouped_gemm_rejects_bad_input():
    x, w = torch.randn(8, 16), torch.randn(2, 6, 16)
    offs = torch.tensor([0, 4, 8], dtype=torch.int32)
    calls = [
        lambda: grouped_gemm(x.int(), w.int(), offs),                                   # dtype
        lambda: grouped_gemm(x, w.half(), offs),                                         # mixed dtypes
        lambda: grouped_gemm(x, torch.randn(2, 6, 15), offs),                            # K differs
        lambda: grouped_gemm(x, w[0], offs),                                             # w not 3-D
        lambda: grouped_gemm(x, w, offs.long()),                                         # offsets dtype
        lambda: grouped_gemm(x, w, offs[:2]),                                            # offsets size
        lambda: grouped_gemm(x, w, offs, torch.tensor([1, 2, 3], dtype=torch.int32)),    # counts size
        lambda: grouped_gemm(x, w, offs, activation="gelu"),                             # activation
        lambda: grouped_gemm(x, torch.randn(2, 5, 16), offs, activation="silu_gate"),    # odd gate/up rows
        lambda: grouped_gemm(x.t().contiguous().t(), w, offs),                           # not contiguous
        lambda: grouped_gemm(x, w, offs.to("meta")),                                     # device
        lambda: grouped_gemm(x, w, offs, out=torch.empty(8, 5)),                         # out shape
        lambda: grouped_gemm(x, w, [0, 4, 8]),                                           # not a tensor
        lambda: grouped_gemm(x, w, offs, config={"BLOCKM": 16}),                         # unknown knob
        lambda: grouped_gemm(x, w, offs, w_layout="tn"),                                 # layout
        lambda: grouped_gemm(x, torch.randn(2, 16, 6), offs, activation="silu_gate", w_layout="kn"),  # "nk" only
        lambda: grouped_gemm(x, w, offs, w_layout="kn"),                                 # [E, K, N]: K differs
    ]
    assert error_names(calls) == ["TypeError", "TypeError", "ValueError", "ValueError", "TypeError", "ValueError",
                                  "ValueError", "ValueError", "ValueError", "ValueError", "ValueError",
                                  "ValueError", "TypeError", "ValueError", "ValueError", "ValueError", "ValueError"]


@cpu_only
def test_torch_op_and_fake_impl():
    from torch._subclasses.fake_tensor import FakeTensorMode

    x, w = torch.randn(12, 16), torch.randn(2, 10, 16)
    offs = torch.tensor([0, 5, 12], dtype=torch.int32)
    got = torch.ops.triton_dist.grouped_gemm(x, w, offs, None, "silu_gate")
    assert torch.allclose(got, grouped_gemm_torch(x, w, offs, activation="silu_gate"), atol=1e-5)
    with FakeTensorMode() as mode:
        fx, fw, fo = mode.from_tensor(x), mode.from_tensor(w), mode.from_tensor(offs)
        fake = torch.ops.triton_dist.grouped_gemm(fx, fw, fo, None, "silu_gate")
        assert tuple(fake.shape) == (12, 5) and fake.dtype == x.dtype


# ----------------------------------------------------------------------------------------------- sm_90
def _signature(tma):
    desc = {"x": "tensordesc<bf16[128,64]>", "w": "tensordesc<bf16[128,64]>",
            "out_desc": "tensordesc<bf16[1,128,128]>"} if tma else {"x": "*bf16", "w": "*bf16", "out_desc": "*bf16"}
    return dict(**desc, out="*bf16", offsets="*i32", counts="*i32",
                **{n: "i32" for n in ("E", "rows", "N", "K", "w_rows", "stride_xm", "stride_we", "stride_wn",
                                      "stride_om")},
                **{n: "constexpr" for n in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "E_PAD", "HAS_COUNTS",
                                            "USE_TMA", "EPILOGUE_SUBTILE", "FLATTEN", "WARP_SPECIALIZE",
                                            "DOT_PRECISION", "SILU_GATE")})


@pytest.mark.parametrize("tma", [True, False])
def test_grouped_gemm_compiles_for_sm90(tma):
    """TMA: descriptor loads of x and w, wgmma, TMA stores of whole tiles (masked stores for groups' last tiles).
    Masks: wgmma on register-loaded tiles. Both with the fused SiLU gate and the counts."""
    res = compile_sm90("triton_dist.kernels.grouped_gemm", "grouped_gemm_kernel", _signature(tma),
                       dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, E_PAD=32, HAS_COUNTS=True, USE_TMA=tma,
                            EPILOGUE_SUBTILE=False, FLATTEN=False, WARP_SPECIALIZE=False, DOT_PRECISION="tf32",
                            SILU_GATE=True),
                       aligned=("K", "N", "stride_xm", "stride_wn", "stride_om"))
    ops = res["ops"]
    assert any(k.startswith("wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16") for k in ops), ops
    assert any(k.startswith("cp.async.bulk.tensor.2d.shared") for k in ops) == tma, ops  # TMA loads
    assert any(k.startswith("cp.async.bulk.tensor.3d.global") for k in ops) == tma, ops  # TMA stores
    assert any(k.startswith("st.global") for k in ops), ops  # the masked last tiles
    assert any(k.startswith("ex2.approx") for k in ops), ops  # the gate's sigmoid


# ----------------------------------------------------------------------------------------------- GPU
def _moe_counts(experts, rows, skew, gen):
    if skew:  # half the experts empty, one with a quarter of the rows
        counts = [0] * experts
        counts[0] = rows // 4
        rest = torch.multinomial(torch.ones(experts // 2 - 1), rows - rows // 4, replacement=True, generator=gen)
        for i in rest.tolist():
            counts[1 + i] += 1
        return counts
    return torch.multinomial(torch.ones(experts), rows, replacement=True, generator=gen).bincount(
        minlength=experts).tolist()


@gpu_only
@pytest.mark.parametrize("activation", ["none", "silu_gate"])
@pytest.mark.parametrize("skew", [False, True])
def test_grouped_gemm_gpu_bf16(ranks, activation, skew):
    assert ranks.on_one_gpu(_check_gpu_bf16, activation, skew)


def _check_gpu_bf16(activation, skew):
    gen = torch.Generator().manual_seed(1)
    experts, rows, K, N = 16, 4096, 1024, 768
    counts = _moe_counts(experts, rows, skew, gen)
    offsets, total = _groups(counts, 16, 100, gen)
    x = torch.randn(total, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(experts, 2 * N if activation == "silu_gate" else N, K, device="cuda", dtype=torch.bfloat16)
    err, untouched = _check(x, w / K ** 0.5, offsets, counts, activation, None)
    return err < 2e-2 and untouched


@gpu_only
@pytest.mark.parametrize("skew", [False, True])
def test_grouped_gemm_gpu_backward_kernels_bf16(ranks, skew):
    """The backward's kernels at MoE shapes, bf16, against fp64: the "kn" grouped GEMM (grad_x = dy @ w[e], each
    expert's weight as it lies) and the tuned TMA weight gradient; the rows outside the groups hold NaN."""
    assert ranks.on_one_gpu(_check_gpu_backward, skew)


def _check_gpu_backward(skew):
    from triton_dist.kernels.grouped_gemm import grouped_weight_grad

    gen = torch.Generator().manual_seed(2)
    experts, rows, K, N = 16, 4096, 1024, 768
    counts = _moe_counts(experts, rows, skew, gen)
    offsets, total = _groups(counts, 16, 100, gen)
    inside = _in_groups(offsets, counts, total)[:, None]
    x = torch.where(inside, torch.randn(total, K, generator=gen), float("nan")).to("cuda", torch.bfloat16)
    dy = torch.where(inside, torch.randn(total, N, generator=gen), float("nan")).to("cuda", torch.bfloat16)
    w = (torch.randn(experts, N, K, generator=gen) / K ** 0.5).to("cuda", torch.bfloat16)
    err_kn, untouched = _check(dy, w, offsets, counts, "none", None, w_layout="kn")
    dw = grouped_weight_grad(dy, x, offsets.cuda(), torch.tensor(counts, dtype=torch.int32, device="cuda"), experts)
    err_w = 0.0
    for e, (start, n) in enumerate(zip(offsets.tolist(), counts)):
        ref = dy[start:start + n].double().T @ x[start:start + n].double()
        err_w = max(err_w, ((dw[e].double() - ref).abs().max() / ref.abs().max().clamp(min=1.0)).item())
    return err_kn < 2e-2 and untouched and err_w < 2e-2


@gpu_only
def test_grouped_gemm_gpu_graph_replay_reads_new_offsets(ranks):
    """Captured once, replayed with other group sizes written into the same offsets tensor: no host sync."""
    assert ranks.on_one_gpu(_check_gpu_graph_replay) < 2e-2


def _check_gpu_graph_replay():
    experts, rows, K, N = 8, 1024, 512, 256
    x = torch.randn(rows, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(experts, N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5
    offsets = torch.linspace(0, rows, experts + 1).to(torch.int32).cuda()
    out = torch.zeros(rows, N, device="cuda", dtype=torch.bfloat16)
    grouped_gemm(x, w, offsets, out=out)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        grouped_gemm(x, w, offsets, out=out)
    new = torch.tensor([0, 0, 100, 100, 400, 401, 900, 1000, 1024], dtype=torch.int32)
    offsets.copy_(new)
    out.zero_()
    graph.replay()
    ref = grouped_gemm_torch(x.float(), w.float(), new)
    return ((out.float() - ref.cuda()).abs().max() / ref.abs().max()).item()
