"""Sequence-parallel flash-decode: every rank's shard of the KV cache generated from a seed (so each rank can build
the fp64 reference over the whole sequence alone), garbage (NaN) past each shard's length, ragged and empty shards,
GQA group sizes 1/4/8, D = 64 and 128, split counts 1..3, both combine modes (fused into the split launch, and the
separate merge kernel) and switching between them call by call, paged KV, repeated calls, the torch op and its fake,
the plan cache, bad input; GPU: bf16 vs fp32 reference, CUDA-graph replay (PDL too); code generation for sm_90."""

import math

import pytest
import torch

import triton_dist as td
from triton_dist import hardware
from triton_dist.kernels.flash_decode import (_PLANS, SMEM_PER_BLOCK, choose_splits, default_config,
                                              local_flash_decode, resolved_config, sp_flash_decode,
                                              split_smem_bytes)

from ..conftest import gpu_only
from ..sm90 import compile_sm90


def _shard(seed, rank, batch, s_max, kv_heads, head_dim, lens, dtype, device):
    """Rank ``rank``'s K and V [B, s_max, Hkv, D]; rows past lens[b] are NaN (must never be read)."""
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    k = torch.randn(batch, s_max, kv_heads, head_dim, generator=gen, dtype=torch.float64)
    v = torch.randn(batch, s_max, kv_heads, head_dim, generator=gen, dtype=torch.float64)
    for b, n in enumerate(lens):
        k[b, n:] = float("nan")
        v[b, n:] = float("nan")
    return k.to(dtype).to(device), v.to(dtype).to(device)


def _query(seed, batch, q_heads, head_dim, dtype, device):
    gen = torch.Generator().manual_seed(seed * 1000 + 999)
    return torch.randn(batch, q_heads, head_dim, generator=gen, dtype=torch.float64).to(dtype).to(device)


def _reference(q, shards, lens, scale):
    """fp64 attention of q [B, Hq, D] over the concatenated valid rows of every shard (zeros if none)."""
    q = q.double().cpu()
    batch, q_heads, head_dim = q.shape
    out = torch.zeros(batch, q_heads, head_dim, dtype=torch.float64)
    for b in range(batch):
        k = torch.cat([s[0][b, :lens[r][b]].double().cpu() for r, s in enumerate(shards)])  # [T, Hkv, D]
        v = torch.cat([s[1][b, :lens[r][b]].double().cpu() for r, s in enumerate(shards)])
        if k.shape[0] == 0:
            continue
        group = q_heads // k.shape[1]
        k = k.repeat_interleave(group, dim=1)  # query head h uses KV head h // group
        v = v.repeat_interleave(group, dim=1)
        p = torch.softmax(torch.einsum("hd,thd->ht", q[b], k) * scale, dim=-1)
        out[b] = torch.einsum("ht,thd->hd", p, v)
    return out


def _check(seed, batch, q_heads, kv_heads, head_dim, s_max, lens, dtype_name, n_splits, calls=1, scale=None,
           page_size=0, combine="auto"):
    """lens[r][b]: tokens of sequence b on rank r. Returns the max abs error over ``calls`` back-to-back calls;
    ``combine``: a mode, or a list of one mode per call."""
    dtype = getattr(torch, dtype_name)
    dev = td.shmem.device()
    w, me = td.world_size(), td.rank()
    scale_used = scale if scale is not None else 1.0 / math.sqrt(head_dim)
    shards = [_shard(seed, r, batch, s_max, kv_heads, head_dim, lens[r], dtype, dev) for r in range(w)]
    k, v = shards[me]
    block_table = None
    if page_size:  # scatter this rank's rows into shuffled pages of a paged cache; spare pages hold NaN
        pages_per_seq = s_max // page_size
        n_pages = batch * pages_per_seq + 3
        perm = torch.randperm(n_pages, generator=torch.Generator().manual_seed(seed + me))[:batch * pages_per_seq]
        block_table = perm.view(batch, pages_per_seq).to(torch.int32).to(dev)
        k_paged = torch.full((n_pages, page_size, kv_heads, head_dim), float("nan"), dtype=dtype, device=dev)
        v_paged = torch.full_like(k_paged, float("nan"))
        k_paged[perm] = k.reshape(batch * pages_per_seq, page_size, kv_heads, head_dim)
        v_paged[perm] = v.reshape(batch * pages_per_seq, page_size, kv_heads, head_dim)
        k, v = k_paged, v_paged
    kv_lens = torch.tensor(lens[me], dtype=torch.int32, device=dev)
    worst = 0.0
    for call in range(calls):
        q = _query(seed + call, batch, q_heads, head_dim, dtype, dev)
        mode = combine[call] if isinstance(combine, list) else combine
        out = sp_flash_decode(q, k, v, kv_lens, block_table=block_table, softmax_scale=scale,
                              config={"n_splits": n_splits, "combine": mode})
        ref = _reference(q, shards, lens, scale_used)
        worst = max(worst, (out.double().cpu() - ref).abs().max().item())
    return worst


def _tol(dtype):
    return {"float32": 2e-5, "float16": 4e-3, "bfloat16": 3e-2}[dtype]


CASES = [  # batch, Hq, Hkv, D, s_max, lens per rank (world 2), dtype, n_splits, combine
    (2, 8, 8, 64, 16, [[16, 5], [9, 16]], "float32", 1, "kernel"),         # MHA (group 1), one split
    (2, 8, 8, 64, 16, [[16, 5], [9, 16]], "float32", 1, "fused"),
    (3, 8, 2, 128, 32, [[32, 0, 7], [17, 20, 0]], "float16", 3, "fused"),  # group 4, D 128, empty shards, 3 splits
    (1, 8, 1, 64, 32, [[30], [0]], "float32", 2, "kernel"),                # group 8 (MQA), rank 1 holds nothing
]


@pytest.mark.parametrize("case", CASES, ids=["mha-f32-kernel", "mha-f32-fused", "gqa4-d128-f16-fused",
                                              "mqa-f32-empty-kernel"])
def test_sp_flash_decode_2_ranks(ranks, case):
    batch, hq, hkv, d, s_max, lens, dtype, splits, combine = case
    errs = ranks(2, _check, 7, batch, hq, hkv, d, s_max, lens, dtype, splits, combine=combine)
    assert max(errs) < _tol(dtype), errs


def test_sp_flash_decode_4_ranks(ranks):
    """Fused, then the merge kernel: every rank waits for three peers."""
    lens = [[16, 3], [0, 16], [5, 0], [16, 1]]
    errs = ranks(4, _check, 11, 2, 8, 2, 64, 16, lens, "float16", 2, calls=2, combine=["fused", "kernel"])
    assert max(errs) < _tol("float16"), errs


def test_sp_flash_decode_8_ranks(ranks):
    """The merge at 8 ranks (issue 7's CPU coverage): seven peers' partials, two ranks with empty shards."""
    lens = [[9, 2], [0, 16], [16, 0], [3, 5], [0, 0], [16, 16], [1, 7], [4, 0]]
    errs = ranks(8, _check, 13, 2, 4, 2, 32, 16, lens, "float32", 2, calls=2, combine=["fused", "kernel"])
    assert max(errs) < _tol("float32"), errs


def test_sp_flash_decode_repeated_calls_and_scale(ranks):
    """Back-to-back calls with fresh queries and no barrier, switching combine modes call by call: the epoch flags
    and the double-buffered receive buffer alone keep calls apart, whichever launch advances the epoch."""
    errs = ranks(2, _check, 3, 2, 4, 4, 64, 16, [[16, 2], [7, 0]], "float32", 2, calls=5, scale=0.3,
                 combine=["fused", "fused", "kernel", "kernel", "fused"])
    assert max(errs) < _tol("float32"), errs


def test_sp_flash_decode_paged(ranks):
    errs = ranks(2, _check, 5, 2, 4, 1, 64, 32, [[29, 8], [3, 32]], "float16", 2, page_size=8, combine="fused")
    assert max(errs) < _tol("float16"), errs


def _check_empty_sequence():
    dev = td.shmem.device()
    q = torch.randn(2, 4, 64, device=dev)
    k = torch.full((2, 16, 2, 64), float("nan"), device=dev)
    kv_lens = torch.tensor([0, 16 if td.rank() == 0 else 0], dtype=torch.int64, device=dev)
    k[1] = torch.randn(16, 2, 64, device=dev)
    out = torch.ops.triton_dist.sp_flash_decode(q, k, k, kv_lens)  # the torch op, V = K here
    return bool(torch.equal(out[0], torch.zeros_like(out[0]))), bool(torch.isfinite(out[1]).all())


def test_sp_flash_decode_sequence_empty_everywhere_gives_zeros(ranks):
    assert ranks(2, _check_empty_sequence) == [(True, True)] * 2


def _backward_errors():
    """The message of each backward through a result of inputs that require grad (None: no error), and whether a
    call under no_grad returns a plain tensor."""
    dev = td.shmem.device()
    q = torch.randn(1, 4, 16, device=dev, requires_grad=True)
    k, v = torch.randn(1, 8, 2, 16, device=dev), torch.randn(1, 8, 2, 16, device=dev)
    lens = torch.full((1,), 8, dtype=torch.int32, device=dev)
    found = []
    for call in (lambda: sp_flash_decode(q, k, v, lens), lambda: local_flash_decode(q, k, v, lens)[1],
                 lambda: torch.ops.triton_dist.sp_flash_decode(q, k, v, lens)):
        try:
            call().sum().backward()
            found.append(None)
        except RuntimeError as exc:
            found.append(str(exc))
    with torch.no_grad():
        plain = sp_flash_decode(q, k, v, lens).grad_fn is None
    return found, plain


def test_backward_through_the_inference_only_ops_raises(ranks):
    """sp_flash_decode / local_flash_decode have no backward: with q requiring grad, a backward through their
    results raises (as torch's ops without a derivative do) instead of leaving q's gradient silently out."""
    for found, plain in ranks(2, _backward_errors):
        assert plain and all(msg is not None and "inference-only" in msg for msg in found), found


def test_local_flash_decode_matches_reference():
    """The local kernel alone (no init, no communication): o and natural-log lse of one shard."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    q = _query(1, 3, 8, 64, torch.float32, dev)
    lens = [16, 0, 9]
    k, v = _shard(1, 0, 3, 16, 2, 64, lens, torch.float32, dev)
    o, lse = local_flash_decode(q, k, v, torch.tensor(lens, device=dev), softmax_scale=0.2, config={"n_splits": 2})
    q, k, o, lse = q.cpu(), k.cpu(), o.cpu(), lse.cpu()
    ref = _reference(q, [(k, v)], [lens], 0.2)
    assert (o.double() - ref).abs().max() < 2e-5
    b = 2
    kk = k[b, :9].double().repeat_interleave(4, dim=1)
    want = torch.logsumexp(torch.einsum("hd,thd->ht", q[b].double(), kk) * 0.2, dim=-1)
    assert torch.allclose(lse[b].double(), want, atol=1e-5)
    assert torch.isinf(lse[1]).all() and (o[1] == 0).all()


def test_fake_impl_gives_shape_and_dtype():
    from torch._subclasses.fake_tensor import FakeTensorMode

    import triton_dist.kernels.flash_decode  # noqa: F401  (registers the op)

    with FakeTensorMode():
        q = torch.empty(2, 8, 128, dtype=torch.bfloat16)
        k = torch.empty(2, 64, 2, 128, dtype=torch.bfloat16)
        out = torch.ops.triton_dist.sp_flash_decode(q, k, k, torch.empty(2, dtype=torch.int32))
    assert out.shape == (2, 8, 128) and out.dtype == torch.bfloat16


def test_bad_input_raises():
    q = torch.randn(2, 8, 64)
    k = torch.randn(2, 16, 2, 64)
    lens = torch.tensor([3, 4], dtype=torch.int32)
    bad = [
        (lambda: local_flash_decode([1], k, k, lens), TypeError),
        (lambda: local_flash_decode(q.int(), k, k, lens), TypeError),
        (lambda: local_flash_decode(q, k.half(), k.half(), lens), TypeError),
        (lambda: local_flash_decode(q, k, k, lens.float()), TypeError),
        (lambda: local_flash_decode(q, k, k, lens, softmax_scale="x"), TypeError),
        (lambda: local_flash_decode(q[0], k, k, lens), ValueError),
        (lambda: local_flash_decode(torch.randn(2, 6, 64), torch.randn(2, 16, 4, 64), torch.randn(2, 16, 4, 64),
                                    lens), ValueError),  # 6 heads over 4 KV heads
        (lambda: local_flash_decode(q, k[..., :32], k[..., :32], lens), ValueError),
        (lambda: local_flash_decode(torch.randn(2, 8, 48), torch.randn(2, 16, 2, 48), torch.randn(2, 16, 2, 48),
                                    lens), ValueError),  # head dim 48
        (lambda: local_flash_decode(q, k, k, lens[:1]), ValueError),
        (lambda: local_flash_decode(torch.randn(65536, 1, 16), torch.randn(65536, 1, 1, 16),
                                    torch.randn(65536, 1, 1, 16), torch.zeros(65536, dtype=torch.int32)),
         ValueError),  # grid dimension limit
        (lambda: local_flash_decode(q, k[:1], k[:1], lens), ValueError),
        (lambda: local_flash_decode(q, k, k, lens, softmax_scale=-1.0), ValueError),
        (lambda: local_flash_decode(q, k, k, lens, block_table=torch.zeros(3, 2, dtype=torch.int32)), ValueError),
        (lambda: local_flash_decode(q, k, k, lens, config={"blockn": 32}), ValueError),
        (lambda: local_flash_decode(q, k, k, lens, config={"block_n": 48}), ValueError),
        (lambda: local_flash_decode(q, k, k, lens, config={"num_stages": 0}), ValueError),
        (lambda: local_flash_decode(q, k, k, lens, config={"combine": "nccl"}), ValueError),
        (lambda: local_flash_decode(q, k, k, lens, config={"pdl": "yes"}), ValueError),
        (lambda: local_flash_decode(q, k, k, lens, config=[("block_n", 32)]), TypeError),
        (lambda: local_flash_decode(q, k, k, lens, out=torch.empty(2, 8, 32)), ValueError),
        (lambda: local_flash_decode(q, k, k, lens, lse=torch.empty(2, 8, dtype=torch.float64)), ValueError),
        (lambda: local_flash_decode(q, k.transpose(2, 3).contiguous().transpose(2, 3),
                                    k.transpose(2, 3).contiguous().transpose(2, 3), lens), ValueError),
    ]
    for i, (fn, exc) in enumerate(bad):
        with pytest.raises(exc):
            fn()
            pytest.fail(f"case {i} did not raise")


def test_plan_cache_and_given_outputs():
    """The second call with the same metadata reuses the plan (no validation, config or allocation on the host);
    other metadata or knobs build another. Given out/lse are written in place."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # under torchrun this process drives a GPU
    q = _query(2, 2, 8, 64, torch.float32, dev)
    k, v = _shard(2, 0, 2, 16, 2, 64, [16, 5], torch.float32, dev)
    lens = torch.tensor([16, 5], dtype=torch.int32, device=dev)
    o1, lse1 = local_flash_decode(q, k, v, lens)
    size = len(_PLANS._plans)
    out, lse = torch.empty_like(o1), torch.empty_like(lse1)
    o2, lse2 = local_flash_decode(q, k, v, lens, out=out, lse=lse)
    assert len(_PLANS._plans) == size and o2 is out and lse2 is lse
    assert torch.equal(o1, o2) and torch.equal(lse1, lse2)
    local_flash_decode(q, k, v, lens, softmax_scale=0.5)
    local_flash_decode(q, k, v, lens, config={"n_splits": 2})
    assert len(_PLANS._plans) == size + 2


def test_default_config_fits_hopper():
    """What ran on H200 (bn128 w8 s3 bf16 D=128) is the default; every default fits 227 KB of shared memory."""
    cfg = default_config(1, 8, 65536, 128, "cuda", 132, 2)
    assert (cfg["block_n"], cfg["num_warps"], cfg["num_stages"]) == (128, 8, 3)
    for head_dim in (64, 128, 256):
        for elem in (2, 4):
            c = default_config(1, 8, 65536, head_dim, "cuda", 132, elem)
            assert split_smem_bytes(c["block_n"], c["num_stages"], head_dim, elem) <= SMEM_PER_BLOCK
    q = torch.empty(1, 32, 128)
    k = torch.empty(1, 64, 8, 128)
    cfg = resolved_config(q, k, k, torch.zeros(1, dtype=torch.int32), config={"n_splits": 3, "combine": "kernel"})
    assert cfg["n_splits"] == 3 and cfg["combine"] == "kernel" and cfg["pdl"] is False


def test_choose_splits_fills_waves():
    assert choose_splits(8, 65536, 132) in (32, 33)  # B=1, Hkv=8: ~264 programs = 2 per SM
    assert choose_splits(256, 16384, 132) == 1  # B=32, Hkv=8: 256 programs already fill 97%
    assert choose_splits(8, 64, 132, block_n=64) == 1  # too short to split
    assert 1 <= choose_splits(3, 10 ** 6, 132) <= 256


# ----------------------------------------------------------------------------------------------- GPU
def _check_gpu_bf16(batch, q_heads, kv_heads, head_dim, s_local):
    dev = td.shmem.device()
    w, me = td.world_size(), td.rank()
    gen = torch.Generator().manual_seed(123)
    lens = torch.randint(0, s_local + 1, (w, batch), generator=gen)
    lens[:, 0] = s_local  # one full sequence
    lens[0, -1] = 0  # an empty shard
    shards = []
    for r in range(w):
        g = torch.Generator().manual_seed(500 + r)
        k = torch.randn(batch, s_local, kv_heads, head_dim, generator=g).to(torch.bfloat16)
        v = torch.randn(batch, s_local, kv_heads, head_dim, generator=g).to(torch.bfloat16)
        shards.append((k, v))
    q = torch.randn(batch, q_heads, head_dim, generator=gen).to(torch.bfloat16)
    out = sp_flash_decode(q.to(dev), shards[me][0].to(dev), shards[me][1].to(dev), lens[me].to(dev))
    ref = _reference(q, shards, lens.tolist(), 1.0 / math.sqrt(head_dim))
    return (out.double().cpu() - ref).abs().max().item()


@gpu_only
@pytest.mark.parametrize("shape", [(2, 32, 8, 128, 4096), (3, 16, 16, 64, 1000), (1, 8, 1, 128, 20000)])
def test_gpu_bf16_matches_fp64_reference(ranks, shape):
    errs = ranks(ranks.gpu_world, _check_gpu_bf16, *shape)
    assert max(errs) < 2e-2, errs


@gpu_only
@pytest.mark.parametrize("page_size", [0, 16, 128])
def test_gpu_bf16_nan_past_lengths_and_paged(ranks, page_size):
    """NaN rows past every shard's length (must never reach the output), ragged and empty shards, paged caches
    with pages smaller and larger than a tile."""
    w = ranks.gpu_world
    lens = [[2048, 700, 0], [1, 2048, 65]] + [[300, 0, 2048]] * (w - 2)
    errs = ranks(w, _check, 9, 3, 32, 8, 128, 2048, lens[:w], "bfloat16", None, calls=2, page_size=page_size)
    assert max(errs) < 3e-2, errs


def _check_graph_replay(config):
    dev = td.shmem.device()
    me = td.rank()
    batch, q_heads, kv_heads, head_dim, s_local = 4, 32, 8, 128, 8192
    while config["combine"] == "fused" and batch * kv_heads >= hardware.num_sms(dev.index) and kv_heads > 1:
        kv_heads //= 2  # "fused" takes B * Hkv below this rank's SMs (its share where ranks share the GPU)
    k = torch.randn(batch, s_local, kv_heads, head_dim, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    kv_lens = torch.tensor([s_local, 100 * (me + 1), 0, 4097], dtype=torch.int32, device=dev)
    q = torch.randn(batch, q_heads, head_dim, device=dev, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    sp_flash_decode(q, k, v, kv_lens, out=out, config=config)  # compile + workspaces outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sp_flash_decode(q, k, v, kv_lens, out=out, config=config)
    ok = True
    for i in range(5):
        q.copy_(torch.randn_like(q))
        kv_lens[3] = 50 * i + me  # ragged lengths change between replays, no recapture
        graph.replay()
        torch.cuda.synchronize()
        eager = sp_flash_decode(q, k, v, kv_lens, config=config)
        ok &= bool(torch.equal(out, eager))
        other = sp_flash_decode(q, k, v, kv_lens, config={"combine": "kernel", "pdl": False})  # another launch
        ok &= bool((other.float() - eager.float()).abs().max() < 2e-2)  # path, the same epochs and buffers
    return ok


@gpu_only
@pytest.mark.parametrize("config", [{"combine": "fused"}, {"combine": "kernel"}, {"combine": "kernel", "pdl": True}],
                         ids=["fused", "kernel", "kernel-pdl"])
def test_gpu_cuda_graph_replay(ranks, config):
    assert all(ranks(ranks.gpu_world, _check_graph_replay, config))


def _check_fused_guard():
    """combine='fused' is refused where waiting programs could fill the GPU (B * Hkv >= SMs); 'auto' falls back."""
    dev = td.shmem.device()
    sms = hardware.num_sms(dev.index)  # this rank's SMs (its share when ranks share the GPU)
    q = torch.randn(sms, 8, 64, device=dev, dtype=torch.bfloat16)
    k = torch.randn(sms, 16, 1, 64, device=dev, dtype=torch.bfloat16)
    lens = torch.full((sms,), 16, dtype=torch.int32, device=dev)
    with pytest.raises(ValueError, match="fused"):
        sp_flash_decode(q, k, k, lens, config={"combine": "fused"})
    return resolved_config(q, k, k, lens)["combine"]


@gpu_only
def test_gpu_fused_guard(ranks):
    assert ranks(ranks.gpu_world, _check_fused_guard) == ["kernel"] * ranks.gpu_world


def _check_bound_launches():
    """A repeated call takes the plan's bound launches only where they apply: calls of one plan with a contiguous
    out, an out of other strides, a q and an out that are not 16-byte aligned, in turn, each matching the first."""
    dev = td.shmem.device()
    batch, q_heads, kv_heads, head_dim, s_local = 3, 16, 4, 128, 3000
    g = torch.Generator(device=dev).manual_seed(7 + td.rank())
    k = torch.randn(batch, s_local, kv_heads, head_dim, device=dev, generator=g).to(torch.bfloat16)
    v = torch.randn(batch, s_local, kv_heads, head_dim, device=dev, generator=g).to(torch.bfloat16)
    kv_lens = torch.tensor([s_local, 1000, 17], dtype=torch.int32, device=dev)
    q = torch.randn(batch, q_heads, head_dim, device=dev, generator=g).to(torch.bfloat16)
    first = sp_flash_decode(q, k, v, kv_lens)
    wide = torch.full((batch, q_heads, 2 * head_dim), float("nan"), device=dev, dtype=torch.bfloat16)
    odd = torch.full((q.numel() + 1,), float("nan"), device=dev, dtype=torch.bfloat16)
    q_odd = odd[1:].view_as(q).copy_(q)  # 2 bytes past an aligned address
    out_odd = torch.full((q.numel() + 1,), float("nan"), device=dev, dtype=torch.bfloat16)[1:].view_as(q)
    results = [sp_flash_decode(q, k, v, kv_lens, out=wide[..., :head_dim]), sp_flash_decode(q_odd, k, v, kv_lens),
               sp_flash_decode(q, k, v, kv_lens, out=out_odd), sp_flash_decode(q, k, v, kv_lens)]
    return max((r.float() - first.float()).abs().max().item() for r in results)


@gpu_only
def test_gpu_bound_launches_only_where_they_apply(ranks):
    assert max(ranks(ranks.gpu_world, _check_bound_launches)) < 1e-2


# ----------------------------------------------------------------------------------------------- sm_90
SPLIT_SIG = dict(q="*bf16", k_cache="*bf16", v_cache="*bf16", kv_lens="*i32", block_table="*i32",
                 part_o="*fp32", part_lse="*fp32", split_arrivals="*i32", dst_o="*fp32", dst_lse="*fp32",
                 out="*bf16", flags="*i32", state="*i32", ctx="*i64", stride_qb="i32", stride_qh="i32",
                 stride_kb="i64", stride_kn="i32", stride_kh="i32", stride_vb="i64", stride_vn="i32",
                 stride_vh="i32", stride_table_b="i32", stride_ob="i32", stride_oh="i32", B="i32", HQ="i32",
                 HKV="i32", s_max="i32", num_pages="i32", scale_log2="fp32")
ALIGNED = ("q", "k_cache", "v_cache", "stride_qb", "stride_qh", "stride_kb", "stride_kn", "stride_kh",
           "stride_vb", "stride_vn", "stride_vh", "part_o", "dst_o", "out")


@pytest.mark.parametrize("page_size,dtype,mode,n_splits,pdl", [(0, "bf16", 2, 16, False), (16, "bf16", 1, 32, True),
                                                               (0, "fp32", 2, 1, False)],
                         ids=["fused-bn128", "push-pdl-paged", "fused-fp32-1split"])
def test_split_kernel_compiles_for_sm90(page_size, dtype, mode, n_splits, pdl):
    consts = dict(GROUP=4, GROUP_PAD=16, HEAD_DIM=128, BLOCK_N=128 if dtype == "bf16" else 64, GROUP_P2=4,
                  N_SPLITS=n_splits, SPLIT_CHUNK=16, PAGE_SIZE=page_size, MODE=mode, WORLD=2, WORLD_PAD=2,
                  RANK_CHUNK=2, FP32_DOT=dtype == "fp32", PDL=pdl, CHECK_INDICES=2)
    sig = {**SPLIT_SIG, **{name: "*" + dtype for name in ("q", "k_cache", "v_cache", "out")},
           **{name: "constexpr" for name in consts}}
    res = compile_sm90("triton_dist.kernels.flash_decode", "flash_decode_split_kernel", sig, consts,
                       aligned=ALIGNED)
    ops = res["ops"]
    assert any("release" in k and "sys" in k for k in ops), ops  # the epoch flag to the peer
    assert any(k.startswith("ld.global.cg") for k in ops), ops  # merges read L2, not stale L1
    if mode == 2:  # fused: waits for the peers (acquire poll) and advances the epoch itself (gpu-scope release)
        assert any("acquire" in k and "sys" in k for k in ops), ops
        assert any("gpu" in k and "release" in k for k in ops), ops
    # (sm_90, 4 warps: bn128 s3 bf16 uses 136 KB of shared memory, bn64 s3 70 KB; K and V stream through 16-byte
    # cp.async.cg; griddepcontrol assembles: ptxas runs as part of the compile.)
    assert res["shared"] <= 227 * 1024, res["shared"]


def test_merge_kernel_compiles_for_sm90():
    sig = dict(recv_o="*fp32", recv_lse="*fp32", flags="*i32", out="*bf16", state="*i32", ctx="*i64",
               stride_ob="i32", stride_oh="i32", B="i32", HQ="i32", HKV="i32", GROUP="constexpr",
               GROUP_P2="constexpr", HEAD_DIM="constexpr", WORLD="constexpr", WORLD_PAD="constexpr",
               RANK_CHUNK="constexpr", PDL="constexpr")
    ops = compile_sm90("triton_dist.kernels.flash_decode", "flash_decode_merge_kernel", sig,
                       dict(GROUP=4, GROUP_P2=4, HEAD_DIM=128, WORLD=2, WORLD_PAD=2, RANK_CHUNK=2, PDL=True),
                       aligned=("recv_o", "out", "stride_ob", "stride_oh"))["ops"]
    assert any("acquire" in k for k in ops), ops
