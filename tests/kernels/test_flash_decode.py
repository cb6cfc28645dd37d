"""Sequence-parallel flash-decode: every rank's shard of the KV cache generated from a seed (so each rank can build
the fp64 reference over the whole sequence alone), garbage (NaN) past each shard's length, ragged and empty shards,
GQA group sizes 1/4/8, D = 64 and 128, split counts 1..3, paged KV, repeated calls, the torch op and its fake,
bad input; GPU: bf16 vs fp32 reference and CUDA-graph replay; code generation for sm_90."""

import math

import pytest
import torch

import triton_dist as td
from triton_dist.kernels.flash_decode import choose_splits, local_flash_decode, sp_flash_decode

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
           page_size=0, tol=None):
    """lens[r][b]: tokens of sequence b on rank r. Returns the max abs error over ``calls`` back-to-back calls."""
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
        out = sp_flash_decode(q, k, v, kv_lens, block_table=block_table, softmax_scale=scale,
                              config={"n_splits": n_splits})
        ref = _reference(q, shards, lens, scale_used)
        worst = max(worst, (out.double().cpu() - ref).abs().max().item())
    return worst


def _tol(dtype):
    return {"float32": 2e-5, "float16": 4e-3, "bfloat16": 3e-2}[dtype]


CASES = [  # batch, Hq, Hkv, D, s_max, lens per rank (world 2), dtype, n_splits
    (2, 8, 8, 64, 16, [[16, 5], [9, 16]], "float32", 1),        # MHA (group 1), one split
    (3, 8, 2, 128, 32, [[32, 0, 7], [17, 20, 0]], "float16", 3),  # group 4, D 128, empty shards, 3 splits
    (1, 8, 1, 64, 32, [[30], [0]], "float32", 2),               # group 8 (MQA), rank 1 holds nothing
]


@pytest.mark.parametrize("case", CASES, ids=["mha-f32", "gqa4-d128-f16", "mqa-f32-empty"])
def test_sp_flash_decode_2_ranks(ranks, case):
    batch, hq, hkv, d, s_max, lens, dtype, splits = case
    errs = ranks(2, _check, 7, batch, hq, hkv, d, s_max, lens, dtype, splits)
    assert max(errs) < _tol(dtype), errs


def test_sp_flash_decode_4_ranks(ranks):
    lens = [[16, 3], [0, 16], [5, 0], [16, 1]]
    errs = ranks(4, _check, 11, 2, 8, 2, 64, 16, lens, "float16", 2)
    assert max(errs) < _tol("float16"), errs


def test_sp_flash_decode_repeated_calls_and_scale(ranks):
    """Back-to-back calls with fresh queries and no barrier: the epoch flags and the double-buffered receive
    buffer alone keep calls apart."""
    errs = ranks(2, _check, 3, 2, 4, 4, 64, 16, [[16, 2], [7, 0]], "float32", 2, calls=4, scale=0.3)
    assert max(errs) < _tol("float32"), errs


def test_sp_flash_decode_paged(ranks):
    errs = ranks(2, _check, 5, 2, 4, 1, 64, 32, [[29, 8], [3, 32]], "float16", 2, page_size=8)
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
        (lambda: local_flash_decode(q, k.transpose(2, 3).contiguous().transpose(2, 3),
                                    k.transpose(2, 3).contiguous().transpose(2, 3), lens), ValueError),
    ]
    for i, (fn, exc) in enumerate(bad):
        with pytest.raises(exc):
            fn()
            pytest.fail(f"case {i} did not raise")


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
    errs = ranks(td.world_size(), _check_gpu_bf16, *shape)
    assert max(errs) < 2e-2, errs


@gpu_only
@pytest.mark.parametrize("page_size", [0, 16, 128])
def test_gpu_bf16_nan_past_lengths_and_paged(ranks, page_size):
    """NaN rows past every shard's length (must never reach the output), ragged and empty shards, paged caches
    with pages smaller and larger than a tile."""
    w = td.world_size() if td.shmem.is_initialized() else 2
    lens = [[2048, 700, 0], [1, 2048, 65]] + [[300, 0, 2048]] * (w - 2)
    errs = ranks(w, _check, 9, 3, 32, 8, 128, 2048, lens[:w], "bfloat16", None, calls=2, page_size=page_size)
    assert max(errs) < 3e-2, errs


def _check_graph_replay():
    dev = td.shmem.device()
    me = td.rank()
    batch, q_heads, kv_heads, head_dim, s_local = 4, 32, 8, 128, 8192
    k = torch.randn(batch, s_local, kv_heads, head_dim, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    kv_lens = torch.tensor([s_local, 100 * (me + 1), 0, 4097], dtype=torch.int32, device=dev)
    q = torch.randn(batch, q_heads, head_dim, device=dev, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    sp_flash_decode(q, k, v, kv_lens, out=out)  # compile + workspaces outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sp_flash_decode(q, k, v, kv_lens, out=out)
    ok = True
    for i in range(5):
        q.copy_(torch.randn_like(q))
        kv_lens[3] = 50 * i + me  # ragged lengths change between replays, no recapture
        graph.replay()
        torch.cuda.synchronize()
        eager = sp_flash_decode(q, k, v, kv_lens)
        ok &= bool(torch.equal(out, eager))
    return ok


@gpu_only
def test_gpu_cuda_graph_replay(ranks):
    assert all(ranks(td.world_size(), _check_graph_replay))


# ----------------------------------------------------------------------------------------------- sm_90
SPLIT_SIG = dict(q="*bf16", k_cache="*bf16", v_cache="*bf16", kv_lens="*i32", block_table="*i32",
                 part_o="*fp32", part_lse="*fp32", split_arrivals="*i32", dst_o="*fp32", dst_lse="*fp32",
                 flags="*i32", state="*i32", ctx="*i64", stride_qb="i32", stride_qh="i32", stride_kb="i64",
                 stride_kn="i32", stride_kh="i32", stride_vb="i64", stride_vn="i32", stride_vh="i32",
                 stride_table_b="i32", B="i32", HQ="i32", HKV="i32", s_max="i32", scale_log2="fp32",
                 GROUP="constexpr", GROUP_PAD="constexpr", HEAD_DIM="constexpr", BLOCK_N="constexpr",
                 GROUP_P2="constexpr", SPLIT_CHUNK="constexpr", PAGE_SIZE="constexpr", PUSH="constexpr",
                 FP32_DOT="constexpr")
ALIGNED = ("q", "k_cache", "v_cache", "stride_qb", "stride_qh", "stride_kb", "stride_kn", "stride_kh",
           "stride_vb", "stride_vn", "stride_vh", "part_o", "dst_o")


@pytest.mark.parametrize("page_size,dtype", [(0, "bf16"), (16, "bf16"), (0, "fp32")])
def test_split_kernel_compiles_for_sm90(page_size, dtype):
    consts = dict(GROUP=4, GROUP_PAD=16, HEAD_DIM=128, BLOCK_N=64, GROUP_P2=4, SPLIT_CHUNK=8, PAGE_SIZE=page_size,
                  PUSH=True, FP32_DOT=dtype == "fp32")
    sig = {**SPLIT_SIG, **{name: "*" + dtype for name in ("q", "k_cache", "v_cache")}}
    ops = compile_sm90("triton_dist.kernels.flash_decode", "flash_decode_split_kernel", sig, consts,
                       aligned=ALIGNED)["ops"]
    assert any("release" in k and "sys" in k for k in ops), ops  # the epoch flag to the peer
    assert any(k.startswith("ld.global.cg") for k in ops), ops  # merge of the splits reads L2, not stale L1
    # (tests/sm90.py does not count cp.async / mma.sync; by hand: bn64 s3 w4 bf16 streams K and V with
    # 16-byte cp.async.cg into ~70 KB of shared memory and multiplies with mma.sync m16n8k16.)


def test_merge_kernel_compiles_for_sm90():
    sig = dict(recv_o="*fp32", recv_lse="*fp32", flags="*i32", out="*bf16", state="*i32", ctx="*i64",
               stride_ob="i32", stride_oh="i32", B="i32", HQ="i32", HKV="i32", GROUP="constexpr",
               GROUP_P2="constexpr", HEAD_DIM="constexpr", WORLD_PAD="constexpr", RANK_CHUNK="constexpr")
    ops = compile_sm90("triton_dist.kernels.flash_decode", "flash_decode_merge_kernel", sig,
                       dict(GROUP=4, GROUP_P2=4, HEAD_DIM=128, WORLD_PAD=2, RANK_CHUNK=2),
                       aligned=("recv_o", "out", "stride_ob", "stride_oh"))["ops"]
    assert any("acquire" in k for k in ops), ops
