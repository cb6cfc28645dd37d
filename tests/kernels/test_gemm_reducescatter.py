"""GEMM + reduce-scatter: fp64 references on 2 and 4 CPU ranks (fp16/fp32, ragged and tiny M, fresh inputs each
repeat, poisoned outputs and receive buffers), bitwise reproducibility and schedule independence, the small-M
fallback, the torch op under torch.compile, bad input; on GPUs: bf16 vs an fp32 reference 100 times, a straggler
rank, CUDA-graph replay, bitwise reproducibility; code generation for sm_90."""

import pytest
import torch
import torch.distributed as dist

import triton_dist as td
from triton_dist.kernels import gemm_reducescatter as grs
from triton_dist.kernels import replay
from triton_dist.kernels.gemm_reducescatter import gemm_rs, rows_of_rank

from ..conftest import error_names, gpu_only
from ..sm90 import compile_sm90

CPU_TILES = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "num_programs": 0, "path": "overlap", "use_tma": False}


def _inputs(m, n, k, dtype, seed):
    gen = torch.Generator().manual_seed(seed * 1000 + td.rank())  # fresh, different on every rank and repeat
    a = torch.randn(m, k, generator=gen)
    w = torch.randn(n, k, generator=gen) / k ** 0.5
    dev = td.shmem.device()
    return a.to(dev, dtype), w.to(dev, dtype)


def _reference_fp64(a, w):
    """This rank's rows of sum_r a_r @ w_r.T, computed in fp64 on the CPU, returned on a's device."""
    parts = [None] * td.world_size()
    dist.all_gather_object(parts, (a.cpu().double(), w.cpu().double()))
    full = sum(x @ y.T for x, y in parts)
    start, rows = rows_of_rank(a.shape[0], td.world_size(), td.rank())
    return full[start: start + rows].to(a.device)


def _poison_workspaces():
    """NaN into every receive buffer: a partial the kernel did not write in this call would show."""
    for ws in td.shmem.workspaces.cached("gemm_rs"):
        ws.recv.fill_(float("nan"))


def _check_against_fp64(m, n, k, dtype_name, config, repeats):
    dtype = getattr(torch, dtype_name)
    tol = 1e-4 if dtype == torch.float32 else 4e-3
    errors = []
    for rep in range(repeats):
        a, w = _inputs(m, n, k, dtype, rep)
        out = torch.full((rows_of_rank(m, td.world_size(), td.rank())[1], n), float("nan"), dtype=dtype,
                         device=a.device)
        _poison_workspaces()
        td.shmem.barrier()  # nobody pushes into our (now poisoned) buffers before we are done poisoning them
        gemm_rs(a, w, config, out=out)
        ref = _reference_fp64(a, w)
        if out.numel():
            errors.append((out.double() - ref).abs().max().item() / max(ref.abs().max().item(), 1.0))
        again = gemm_rs(a, w, config)  # same inputs again: bitwise the same answer
        if not torch.equal(again, out):
            return f"not reproducible at repeat {rep}"
    return "ok" if max(errors, default=0.0) < tol else f"relative error {max(errors):.3g} >= {tol}"


CASES = {
    2: [(37, 45, 40, "float16", {}),  # ragged rows (19 + 18), ragged N and K tiles
        (32, 48, 32, "float32", {"num_programs": 1, "use_tma": True}),  # one persistent program: deferred signals
        (5, 17, 23, "float32", {"BLOCK_M": 32, "BLOCK_N": 32, "GROUP_M": 1, "use_tma": True})],
    4: [(37, 20, 24, "float16", {"DEFER_SIGNAL": False}),  # 10, 9, 9, 9 rows
        (3, 16, 16, "float32", {})],  # M < W: rank 3 owns no rows
    8: [(19, 16, 16, "float16", {})],  # 3, 3, 3, 2, ... rows: the 8-rank ring, 7 partial slots per tile
}


@pytest.mark.parametrize("world,case", [(w, c) for w, cases in CASES.items() for c in range(len(cases))])
def test_gemm_rs_matches_fp64_reference(ranks, world, case):
    m, n, k, dtype, config = CASES[world][case]
    assert ranks(world, _check_against_fp64, m, n, k, dtype, {**CPU_TILES, **config}, 2) == ["ok"] * world


def _check_weight_as_it_lies(m, n, k, config):
    """gemm_rs(a, w) with w the transposed view of a contiguous [K, N] (the backward's grad @ w): read as it lies,
    bitwise the result of the contiguous copy, close to fp64; the output poisoned first."""
    a, w = _inputs(m, n, k, torch.float32, 7)
    w_kn = w.T.contiguous().T
    assert grs.is_kn(w_kn) and not grs.is_kn(w)
    out = torch.full((rows_of_rank(m, td.world_size(), td.rank())[1], n), float("nan"), device=a.device)
    _poison_workspaces()
    td.shmem.barrier()
    gemm_rs(a, w_kn, config, out=out)
    ref = _reference_fp64(a, w)
    if out.numel() and not (out.double() - ref).abs().max().item() < 1e-4 * max(ref.abs().max().item(), 1.0):
        return "far from fp64"
    return "ok" if torch.equal(out, gemm_rs(a, w, config)) else "differs from the contiguous weight's"


@pytest.mark.parametrize("world,m,n,k,config", [
    (2, 37, 48, 40, {"use_tma": True}),  # ragged rows and K, TMA blocks [BLOCK_K, BLOCK_N] of w.T (16-byte rows)
    (2, 32, 45, 32, {}),  # pointers (w.T's rows of 45 are not 16-byte aligned: no TMA)
    (3, 29, 40, 24, {"num_programs": 1}),  # ragged rows per rank, one persistent program
])
def test_gemm_rs_reads_a_transposed_weight_as_it_lies(ranks, world, m, n, k, config):
    assert ranks(world, _check_weight_as_it_lies, m, n, k, {**CPU_TILES, **config}) == ["ok"] * world


def _check_schedule_independence():
    """Any number of programs, any partial path: the same bits (the sum order is fixed per output tile)."""
    a, w = _inputs(40, 33, 48, torch.float16, 7)
    one_per_tile = gemm_rs(a, w, CPU_TILES)
    persistent = gemm_rs(a, w, {**CPU_TILES, "num_programs": 1})
    fp32_partials = gemm_rs(a, w, {**CPU_TILES, "partial": "fp32"})
    ref = _reference_fp64(a, w)
    closer = (fp32_partials.double() - ref).abs().max() <= (one_per_tile.double() - ref).abs().max()
    return torch.equal(one_per_tile, persistent), bool(closer)


def test_gemm_rs_bits_do_not_depend_on_the_schedule(ranks):
    assert ranks(2, _check_schedule_independence) == [(True, True)] * 2


def _check_cpu_straggler():
    """One rank enters each call late, the others run back to back: the ready handshake keeps every push after
    its destination entered the call."""
    import time

    a, w = _inputs(20, 16, 16, torch.float16, 9)
    ref = _reference_fp64(a, w)
    results = []
    for late in range(td.world_size()):
        if td.rank() == late:
            time.sleep(0.5)
        out = gemm_rs(a, w, CPU_TILES)
        results.append(bool((out.double() - ref).abs().max() < 4e-3 * max(ref.abs().max().item(), 1.0)))
    return all(results)


def test_gemm_rs_straggler_rank_cpu(ranks):
    assert ranks(2, _check_cpu_straggler) == [True] * 2


def _check_fallback_and_op():
    a, w = _inputs(9, 20, 16, torch.float32, 3)  # 9 rows on 2 ranks: the fallback pads to equal chunks
    ref = _reference_fp64(a, w)
    fallback = gemm_rs(a, w, {"path": "fallback"})
    kernel = gemm_rs(a, w, CPU_TILES)
    assert torch.equal(gemm_rs(a, w, {**CPU_TILES, "path": "graph"}), kernel)  # CPU: no graphs, same launch
    op = torch.ops.triton_dist.gemm_rs(a, w)  # default config (CPU: the kernel)
    compiled = torch.compile(lambda x, y: gemm_rs(x, y) * 2.0, fullgraph=True, backend="aot_eager")(a, w)
    close = lambda t: bool((t.double() - ref).abs().max() < 1e-4)  # noqa: E731
    return close(fallback), close(kernel), torch.equal(op, kernel), torch.equal(compiled, 2.0 * kernel)


def test_gemm_rs_fallback_op_and_compile(ranks):
    assert ranks(2, _check_fallback_and_op) == [(True, True, True, True)] * 2


def _check_bad_input():
    a, w = _inputs(8, 8, 16, torch.float32, 0)
    return error_names([lambda: gemm_rs([1.0], w),
                        lambda: gemm_rs(a, w.half()),
                        lambda: gemm_rs(a.int(), w.int()),
                        lambda: gemm_rs(a[0], w),
                        lambda: gemm_rs(a, w[:, :8]),
                        lambda: gemm_rs(a, w, out=torch.empty(3, 3)),
                        lambda: torch.ops.triton_dist.gemm_rs(a, w[:, :8]),
                        lambda: gemm_rs(a, w, config={"path": "overlapp"}),
                        lambda: gemm_rs(a, w, config={"partial": "fp16"}),
                        lambda: gemm_rs(a, w, config={"BLOCK_N": 48})])


def test_gemm_rs_rejects_bad_input(ranks):
    expected = ["TypeError", "TypeError", "TypeError"] + ["ValueError"] * 7
    assert ranks(2, _check_bad_input) == [expected] * 2


def test_rows_of_rank_is_tensor_split():
    for m in (0, 1, 5, 10, 37):
        for world in (1, 2, 3, 4, 8):
            sizes = [t.numel() for t in torch.arange(m).tensor_split(world)]
            firsts = [int(t[0]) if t.numel() else None for t in torch.arange(m).tensor_split(world)]
            for r in range(world):
                start, rows = rows_of_rank(m, world, r)
                assert rows == sizes[r] and (rows == 0 or start == firsts[r])


# ----------------------------------------------------------------------------------------------- GPU
def _reference_fp32(a, w):
    full = a.float() @ w.float().T
    dist.all_reduce(full)
    start, rows = rows_of_rank(a.shape[0], td.world_size(), td.rank())
    return full[start: start + rows]


def _bf16_close(out, ref):
    err = (out.float() - ref).abs()
    return bool((err <= 2e-2 * ref.abs() + 2e-2 * ref.abs().mean()).all())


def _check_bf16_fresh_repeats(m, n, k, config, repeats, kn=False):
    bad = []
    for rep in range(repeats):
        a, w = _inputs(m, n, k, torch.bfloat16, rep)  # generated on the CPU: the same on every run of the suite
        if kn:  # the transposed view of a contiguous [K, N]: read as it lies
            w = w.T.contiguous().T
        out = torch.full((rows_of_rank(m, td.world_size(), td.rank())[1], n), float("nan"), dtype=torch.bfloat16,
                         device=a.device)
        _poison_workspaces()
        td.shmem.barrier()
        gemm_rs(a, w, config, out=out)
        if not _bf16_close(out, _reference_fp32(a, w)):
            bad.append(rep)
    return bad


@gpu_only
@pytest.mark.parametrize("m,n,k,config", [
    (4099, 3072, 1536, {"path": "overlap"}),  # ragged rows, default tiles
    (1024, 2048, 4096, {"path": "overlap", "num_programs": 0}),  # one program per tile
    (512, 4096, 1024, {}),  # small M: default decides (fallback or kernel)
    (2048, 5000, 1000, {"path": "overlap", "partial": "fp32"}),  # ragged N, K; fp32 partials
    (4099, 3072, 1536, {"path": "overlap", "remote_tma": True}),  # partials by TMA, clipped to the peer's rows
    (2048, 4096, 1024, {"path": "overlap", "remote_tma": True, "BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64,
                        "num_stages": 4, "num_warps": 8, "EPILOGUE_SUBTILE": True}),  # half-tile TMA stores
    (520, 4096, 1000, {"path": "graph", "BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "num_stages": 4,
                       "num_warps": 8, "EPILOGUE_SUBTILE": True}),  # small M: one wave of 128x256 tiles, replayed
])
def test_gemm_rs_bf16_100_fresh_repeats(ranks, m, n, k, config):
    assert ranks(2, _check_bf16_fresh_repeats, m, n, k, config, 100) == [[]] * 2


@gpu_only
@pytest.mark.parametrize("m,n,k,config", [
    (4099, 3072, 1536, {"path": "overlap"}),  # TMA blocks [BLOCK_K, BLOCK_N] of w.T, ragged rows
    (2048, 5000, 1000, {"path": "overlap"}),  # w.T's rows of 5000 bf16 are 16-byte aligned; ragged N and K
    (2048, 4100, 1000, {"path": "overlap", "use_tma": False}),  # pointers
])
def test_gemm_rs_bf16_weight_as_it_lies(ranks, m, n, k, config):
    assert ranks(2, _check_bf16_fresh_repeats, m, n, k, config, 20, True) == [[]] * 2


def _check_straggler():
    ok = True
    a, w = _inputs(4096, 4096, 2048, torch.bfloat16, 11)
    ref = _reference_fp32(a, w)
    for late in range(td.world_size()):
        for _ in range(2):
            if td.rank() == late:
                torch.cuda._sleep(300_000_000)  # ~0.2 s of GPU time before this rank enters the call
            out = gemm_rs(a, w, {"path": "overlap"})
            ok &= _bf16_close(out, ref)
    torch.cuda.synchronize()
    return ok


def _check_graph_path(m, n, k):
    """Path "graph": fresh activations every call, a weight updated in place, then more distinct weights than
    the cache captures (those launch directly); every result against the fp32 reference; bitwise equal to the
    direct launch of the same configuration."""
    cfg = {"path": "graph"}
    a, w = _inputs(m, n, k, torch.bfloat16, 0)
    weights = [w] * 6 + [None] * 2 + [_inputs(m, n, k, torch.bfloat16, 50 + i)[1]
                                      for i in range(replay.MAX_WEIGHTS + 2)]
    bad, same = [], True
    for i, wi in enumerate(weights):
        if wi is None:  # in place, same address: the captured graph must see the new values
            w.copy_(_inputs(m, n, k, torch.bfloat16, 30 + i)[1])
            wi = w
        a = _inputs(m, n, k, torch.bfloat16, 100 + i)[0]
        out = gemm_rs(a, wi, cfg)
        if not _bf16_close(out, _reference_fp32(a, wi)):
            bad.append(i)
        same &= torch.equal(out, gemm_rs(a, wi, {**cfg, "path": "overlap"}))
    return bad, same, len(grs._GRAPHS.graphs) >= 1


@gpu_only
@pytest.mark.parametrize("m,n,k", [(128, 2048, 1024), (1000, 1536, 1032)])
def test_gemm_rs_graph_path(ranks, m, n, k):
    assert ranks(2, _check_graph_path, m, n, k) == [([], True, True)] * 2


@gpu_only
def test_gemm_rs_straggler_rank(ranks):
    assert ranks(2, _check_straggler) == [True] * 2


def _check_graph_replay(cfg):
    m, n, k = 2050, 4096, 2048
    a, w = _inputs(m, n, k, torch.bfloat16, 0)
    out = torch.empty(rows_of_rank(m, td.world_size(), td.rank())[1], n, dtype=a.dtype, device=a.device)
    gemm_rs(a, w, cfg, out=out)  # compile + workspace outside the capture
    op_out = torch.ops.triton_dist.gemm_rs(a, w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gemm_rs(a, w, cfg, out=out)
        op_out = torch.ops.triton_dist.gemm_rs(a, w)
    ok = True
    for rep in range(5):
        fresh_a, fresh_w = _inputs(m, n, k, torch.bfloat16, 100 + rep)
        a.copy_(fresh_a)
        w.copy_(fresh_w)
        out.fill_(float("nan"))
        td.shmem.barrier()
        graph.replay()
        eager = gemm_rs(a, w, cfg)
        ok &= torch.equal(out, eager) and torch.equal(op_out, torch.ops.triton_dist.gemm_rs(a, w))
        ok &= _bf16_close(out, _reference_fp32(a, w))
    return ok


@gpu_only
@pytest.mark.parametrize("cfg", [{"path": "overlap"}, {"path": "overlap", "remote_tma": True}])
def test_gemm_rs_cuda_graph_replay(ranks, cfg):
    assert ranks(2, _check_graph_replay, cfg) == [True] * 2


def _check_bitwise_reproducible():
    a, w = _inputs(4096, 8192, 2048, torch.bfloat16, 5)
    first = gemm_rs(a, w, {"path": "overlap"})
    same = all(torch.equal(first, gemm_rs(a, w, {"path": "overlap"})) for _ in range(10))
    schedules = all(torch.equal(first, gemm_rs(a, w, {"path": "overlap", "num_programs": p}))
                    for p in (0, 7, 64))
    schedules &= torch.equal(first, gemm_rs(a, w, {"path": "overlap", "remote_tma": True}))  # same partials
    compiled = torch.compile(lambda x, y: gemm_rs(x, y), fullgraph=True)(a, w)
    return same, schedules, torch.equal(compiled, gemm_rs(a, w))


@gpu_only
def test_gemm_rs_bitwise_reproducible(ranks):
    assert ranks(2, _check_bitwise_reproducible) == [(True, True, True)] * 2


# ----------------------------------------------------------------------------------------------- sm_90
SIGNATURE = dict(a="*bf16", w="*bf16", out="*bf16", recv="*bf16", recv_peer="*bf16", arrived="*i32", ready="*i32",
                 state="*i32", M="i32", N="i32", K="i32", stride_am="i32", stride_wn="i32", own_rows="i32", ctx="*i64",
                 BLOCK_M="constexpr", BLOCK_N="constexpr", BLOCK_K="constexpr", GROUP_M="constexpr",
                 USE_TMA="constexpr", EPILOGUE_SUBTILE="constexpr", DEFER_SIGNAL="constexpr",
                 DOT_PRECISION="constexpr", SLOTS_BLOCK="constexpr", REMOTE_TMA="constexpr")


@pytest.mark.parametrize("dtype,partial,slots,tma,remote_tma", [("bf16", "bf16", 1, True, False),
                                                                ("fp16", "fp32", 4, False, False),
                                                                ("bf16", "bf16", 1, True, True)])
def test_gemm_rs_compiles_for_sm90(dtype, partial, slots, tma, remote_tma):
    bm, bn, bk = 128, 256, 64
    sig = {**SIGNATURE, "a": f"*{dtype}", "w": f"*{dtype}", "out": f"*{dtype}", "recv": f"*{partial}",
           "recv_peer": f"*{partial}"}
    if tma:
        sig.update(a=f"tensordesc<{dtype}[{bm},{bk}]>", w=f"tensordesc<{dtype}[{bn},{bk}]>",
                   out=f"tensordesc<{dtype}[1,{bm},{bn // 2}]>")
    if remote_tma:
        sig.update(recv_peer=f"tensordesc<{partial}[1,{bm},{bn // 2}]>")
    res = compile_sm90("triton_dist.kernels.gemm_reducescatter", "gemm_rs_kernel", sig,
                       {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8, "USE_TMA": tma,
                        "EPILOGUE_SUBTILE": tma, "DEFER_SIGNAL": True, "DOT_PRECISION": "tf32",
                        "SLOTS_BLOCK": slots, "REMOTE_TMA": remote_tma},
                       aligned=("recv", "N", "K", "stride_am", "stride_wn") + (() if tma else ("a", "w", "out")))
    ops = res["ops"]
    assert any(op.startswith("wgmma.mma_async") for op in ops), ops  # Hopper tensor cores
    assert ops.get("atom.global.sys.release.exch.b32", 0) > 0, ops  # dl.signal: release at system scope
    assert any("acquire" in op and "sys" in op for op in ops), ops  # dl.wait: acquire polls
    if remote_tma:  # partial tiles by TMA, published after the bulk stores completed
        assert ops.get("cp.async.bulk.wait_group", 0) > 0, ops
    else:
        assert ops.get("st.global.v4.b32", 0) > 0, ops  # 16-byte stores of partial tiles (to the peer)
    if tma:
        assert any(op.startswith("cp.async.bulk.tensor") for op in ops), ops  # TMA loads / output stores


@pytest.mark.parametrize("tma", [True, False])
def test_gemm_rs_compiles_for_sm90_with_the_weight_as_it_lies(tma):
    """W_KN: w.T [K, N] read as it lies, by TMA blocks [BLOCK_K, BLOCK_N] or pointers; still wgmma."""
    bm, bn, bk = 128, 256, 64
    sig = dict(SIGNATURE, W_KN="constexpr")
    if tma:
        sig.update(a=f"tensordesc<bf16[{bm},{bk}]>", w=f"tensordesc<bf16[{bk},{bn}]>",
                   out=f"tensordesc<bf16[1,{bm},{bn}]>")
    res = compile_sm90("triton_dist.kernels.gemm_reducescatter", "gemm_rs_kernel", sig,
                       {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8, "USE_TMA": tma,
                        "EPILOGUE_SUBTILE": False, "DEFER_SIGNAL": True, "DOT_PRECISION": "tf32", "SLOTS_BLOCK": 1,
                        "REMOTE_TMA": False, "W_KN": True},
                       aligned=("recv", "N", "K", "stride_am", "stride_wn") + (() if tma else ("a", "w", "out")))
    assert any(op.startswith("wgmma.mma_async") for op in res["ops"]), res["ops"]
