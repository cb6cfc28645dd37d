"""All-gather by SM pushes: correctness on 2 and 4 ranks, odd sizes and dtypes, 100 repeated calls with fresh
inputs, bad input, CUDA-graph replay (GPU), and code generation for sm_90."""

import pytest
import torch
import torch.distributed as dist

import triton_dist as td
from triton_dist.kernels.allgather import all_gather

from ..conftest import error_names, gpu_only
from ..sm90 import compile_sm90


def _reference(x):
    parts = [None] * td.world_size()
    dist.all_gather_object(parts, x.cpu())
    return torch.cat(parts)


def _check(shape, dtype_name, repeats, chunks):
    dtype = getattr(torch, dtype_name)
    dev = td.shmem.device()
    out = td.shmem.empty((td.world_size() * shape[0], *shape[1:]), dtype, name="ag_out")
    for _ in range(repeats):
        x = (torch.randn(shape, device=dev) * 50).to(dtype)  # fresh inputs every repeat
        out.fill_(-1)  # poison; the barrier keeps peers' next pushes after our poisoning
        td.shmem.barrier()
        all_gather(x, out, config={"n_chunks": chunks, "num_programs": 3, "block": 16})
        if not torch.equal(out.cpu(), _reference(x)):
            return False
    return True


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("shape,dtype,chunks", [((5, 7), "float32", 2), ((33,), "float16", 3),
                                                ((3, 5), "int8", 1), ((2, 3, 129), "bfloat16", 4)])
def test_all_gather_matches_torch(ranks, world, shape, dtype, chunks):
    assert ranks(world, _check, shape, dtype, 2, chunks) == [True] * world


def test_all_gather_8_ranks(ranks):
    assert ranks(8, _check, (3, 5), "float16", 2, 2) == [True] * 8


def _check_repeated_no_barrier(calls):
    dev = td.shmem.device()
    out = td.shmem.empty((td.world_size() * 40,), torch.float32, name="ag_out")
    ok = True
    for i in range(calls):
        x = torch.randn(40, device=dev) + 1000 * td.rank() + i
        if i % 3 == 2:  # 4 bytes past an aligned address: narrower words than the layout's plan
            x = torch.empty(41, device=dev)[1:].copy_(x)
        all_gather(x, out)  # back to back: the ready handshake alone protects `out`
        ok &= torch.equal(out.cpu(), _reference(x))
    return ok


@pytest.mark.parametrize("world", [2])
def test_all_gather_100_repeated_calls(ranks, world):
    assert ranks(world, _check_repeated_no_barrier, 100) == [True] * world


def _check_bad_input():
    x = torch.randn(4, device=td.shmem.device())
    return error_names([lambda: all_gather([1, 2]),
                        lambda: all_gather(x, torch.empty(4 * td.world_size(), device=x.device)),
                        lambda: all_gather(x, td.shmem.empty((3,), torch.float32)),
                        lambda: all_gather(torch.tensor(1.0, device=x.device))])


@pytest.mark.parametrize("world", [2])
def test_all_gather_rejects_bad_input(ranks, world):
    for errors in ranks(world, _check_bad_input):
        assert errors == ["TypeError", "ValueError", "ValueError", "ValueError"]


def _check_graph_replay():
    x = torch.randn(1 << 16, device="cuda", dtype=torch.bfloat16)
    out = td.shmem.empty((td.world_size() * x.numel(),), torch.bfloat16)
    all_gather(x, out)  # compile + workspace outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        all_gather(x, out)
    ok = True
    for i in range(5):
        x.copy_(torch.randn_like(x))
        out.fill_(float("nan"))
        td.shmem.barrier()
        graph.replay()
        ref = torch.empty_like(out)
        dist.all_gather_into_tensor(ref, x)
        ok &= torch.equal(out, ref)
    return ok


@gpu_only
def test_all_gather_cuda_graph_replay(ranks):
    assert all(ranks(ranks.gpu_world, _check_graph_replay))


def _check_large_bf16():
    x = torch.randn(3 << 20, device="cuda", dtype=torch.bfloat16) + td.rank()
    out = all_gather(x)
    ref = torch.empty_like(out)
    dist.all_gather_into_tensor(ref, x)
    return torch.equal(out, ref)


@gpu_only
def test_all_gather_large_bf16(ranks):
    assert all(ranks(2, _check_large_bf16))


def test_all_gather_compiles_for_sm90_with_vector_stores():
    sig = dict(src="*i64", out="*i64", arrived="*i32", ready="*i32", state="*i32", shard_words="i64",
               chunk_words="i64", n_chunks="i32", ctx="*i64", BLOCK="constexpr", FLAGS_BLOCK="constexpr")
    res = compile_sm90("triton_dist.kernels.allgather", "all_gather_push_kernel", sig,
                       {"BLOCK": 2048, "FLAGS_BLOCK": 64}, aligned=("src", "out", "chunk_words", "shard_words"))
    ops = res["ops"]
    assert ops.get("st.global.v2.b64", 0) > 0, ops  # 16-byte stores to the peer
    assert any(k.startswith("atom.global.sys.release") or k.startswith("atom.release.sys") for k in ops) or \
        any("release" in k for k in ops), ops
