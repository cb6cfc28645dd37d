"""AG+GEMM: ``ag_gemm(a, w) == all_gather(a) @ w.T``.

CPU (interpreter, 2 and 4 ranks): 1-3 chunks per shard, TMA and masked paths, ragged/odd
M, N, K, fp16/fp32 against an fp64 reference with fresh inputs every repeat and the gather buffer poisoned before
every call; the fallback path; the fused SiLU-gate epilogue (``activation="silu_gate"``) on every path;
back-to-back calls (epochs, no barrier); the torch op, its fake and torch.compile(fullgraph=True); bad input.
GPU (torchrun): bf16 against fp32 with 100 fresh repeats, every tuning candidate, a straggler rank, CUDA-graph
replay, the SiLU-gate epilogue (tuned and forced paths). sm_90 code generation for the kernel variants.
"""

import time

import pytest
import torch
import torch.distributed as dist

import triton_dist as td
from triton_dist.kernels import allgather_gemm as agm
from triton_dist.kernels import replay
from triton_dist.kernels.allgather_gemm import ag_gemm

from ..conftest import error_names, gpu_only
from ..sm90 import compile_sm90

# Configs the CPU tests force (small tiles; 3 programs so that several tiles share a program).
CPU_C3 = {"path": "overlap", "n_chunks": 3, "num_programs": 4}
CPU_CE = {"path": "overlap", "n_chunks": 2, "num_programs": 3}
CPU_C1 = {"path": "overlap", "n_chunks": 1, "num_programs": 2}


def _reference(a, w):
    parts = [torch.empty_like(a) for _ in range(td.world_size())]
    dist.all_gather(parts, a.contiguous())
    gathered = torch.cat(parts)
    return gathered, gathered.double() @ w.double().T


def _poison_workspaces():
    for ws in td.shmem.workspaces.cached("ag_gemm"):
        ws.a_full.fill_(float("nan"))
    td.shmem.barrier()  # nobody pushes into our a_full before we poisoned it


def _check(m, n, k, dtype_name, config, repeats, seed=0):
    """Max error relative to the reference's magnitude, and whether the gathered output was exact, over repeats."""
    dtype = getattr(torch, dtype_name)
    dev, r = td.shmem.device(), td.rank()
    agm.buffers(m, k, dtype) if config.get("path") != "fallback" else None
    worst, gathered_ok = 0.0, True
    for i in range(repeats):
        gen = torch.Generator().manual_seed(seed + 1000 * i + r)  # fresh inputs, different on every rank
        a = torch.randn(m, k, generator=gen).to(dtype).to(dev)
        w = torch.randn(n, k, generator=gen).to(dtype).to(dev)
        _poison_workspaces()
        out, gathered = ag_gemm(a, w, return_gathered=True, config=config)
        ref_a, ref = _reference(a, w)
        scale = ref.abs().max().item() + 1e-6
        worst = max(worst, ((out.double() - ref).abs().max().item()) / scale)
        gathered_ok &= torch.equal(gathered.cpu(), ref_a.cpu()) and tuple(out.shape) == (td.world_size() * m, n)
    return worst, gathered_ok


CPU_CASES = [  # (m per rank, n, k, dtype, config): odd sizes, TMA-compatible and not
    (17, 24, 40, "float16", CPU_C3),       # TMA path (K, N multiples of 8), ragged M
    (17, 24, 40, "float16", CPU_CE),
    (13, 23, 37, "float32", CPU_C3),       # odd N and K: masked path
    (9, 17, 19, "float16", {**CPU_CE, "use_tma": False}),
    (34, 24, 40, "float32", {**CPU_C3, "BLOCK_M": 32}),
    (17, 24, 40, "float16", {**CPU_C3, "path": "graph"}),  # no CUDA graphs on CPU: launched directly
    (17, 24, 40, "float16", {**CPU_C3, "gather_first": True}),  # wait for all rows, then one GEMM pass
    (13, 23, 37, "float32", {**CPU_CE, "gather_first": True}),  # masked path
]


@pytest.mark.parametrize("m,n,k,dtype,config", CPU_CASES)
def test_ag_gemm_two_ranks(ranks, m, n, k, dtype, config):
    for worst, gathered_ok in ranks(2, _check, m, n, k, dtype, config, 2):
        assert gathered_ok
        assert worst < (2e-3 if dtype == "float16" else 1e-6), worst


@pytest.mark.parametrize("m,n,k,dtype,config", [(7, 24, 40, "float16", CPU_CE), (5, 23, 37, "float32", CPU_C3),
                                                (7, 24, 40, "float16", {**CPU_CE, "gather_first": True})])
def test_ag_gemm_four_ranks(ranks, m, n, k, dtype, config):
    for worst, gathered_ok in ranks(4, _check, m, n, k, dtype, config, 1):
        assert gathered_ok
        assert worst < (2e-3 if dtype == "float16" else 1e-6), worst


def _check_weight_as_it_lies(m, n, k, config):
    """ag_gemm(a, w) with w the transposed view of a contiguous [K, N] (gemm_rs's backward: grad @ w): read as it
    lies, bitwise the contiguous copy's result, close to fp64; a_full poisoned first. The SiLU gate takes no
    such view (ValueError)."""
    dev, r = td.shmem.device(), td.rank()
    gen = torch.Generator().manual_seed(11 + r)
    a = torch.randn(m, k, generator=gen).to(dev)
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(5)).to(dev)
    w_kn = w.T.contiguous().T
    _poison_workspaces()
    out = ag_gemm(a, w_kn, config=config)
    _, ref = _reference(a, w)
    if not (out.double() - ref).abs().max().item() < 1e-4 * max(ref.abs().max().item(), 1.0):
        return "far from fp64"
    if not torch.equal(out, ag_gemm(a, w, config=config)):
        return "differs from the contiguous weight's"
    try:
        ag_gemm(a, torch.cat([w, w]).T.contiguous().T, config=config, activation="silu_gate")
    except ValueError as exc:
        return "ok" if "contiguous" in str(exc) else f"wrong error: {exc}"
    return "silu_gate took the view"


@pytest.mark.parametrize("world,m,n,k,config", [
    (2, 17, 24, 40, CPU_C3),  # phased, TMA blocks [BLOCK_K, BLOCK_N] of w.T (16-byte rows), ragged M
    (2, 13, 23, 37, CPU_CE),  # pointers (w.T's rows of 23 are not 16-byte aligned)
    (2, 17, 24, 40, {**CPU_C3, "gather_first": True}),  # the GEMM core's kernel over all rows
    (3, 9, 20, 24, {**CPU_C1, "gather_first": True, "use_tma": False}),
    (3, 7, 24, 40, CPU_CE),
])
def test_ag_gemm_reads_a_transposed_weight_as_it_lies(ranks, world, m, n, k, config):
    assert ranks(world, _check_weight_as_it_lies, m, n, k, config) == ["ok"] * world


def test_ag_gemm_eight_ranks(ranks):
    """Seven peer segments, copy pushes to every peer, one wait per chunk over all of them."""
    for worst, gathered_ok in ranks(8, _check, 3, 16, 24, "float16", CPU_CE, 1):
        assert gathered_ok and worst < 2e-3, worst


@pytest.mark.parametrize("m_total,kernel_path", [(256, "graph"), (512, "graph"), (2048, "graph"),
                                                 (4096, "overlap"), (16384, "overlap")])
def test_ag_gemm_tuning_candidates_by_size(m_total, kernel_path):
    """The tuner's menu (GPU sizes, no GPU needed to build it): up to 2048 gathered rows the overlapped kernels
    are offered only from CUDA graphs (eager calls there were host-bound: runs 79-83), above it only eagerly; the
    NCCL fallback always; the SiLU-gate menu is the same with half-width tiles."""
    cands = agm.candidate_configs(m_total // 2, 4096, 8192, torch.bfloat16, torch.device("cuda"), 2)
    assert {c["path"] for c in cands} == {"fallback", kernel_path}, cands
    gated = agm.candidate_configs(m_total // 2, 8192, 8192, torch.bfloat16, torch.device("cuda"), 2, silu_gate=True)
    plain = agm.candidate_configs(m_total // 2, 8192, 8192, torch.bfloat16, torch.device("cuda"), 2)
    assert [c["BLOCK_N"] for c in gated] == [max(16, c["BLOCK_N"] // 2) for c in plain]
    assert all(c["silu_gate"] for c in gated)


def test_ag_gemm_fallback_path(ranks):
    for worst, gathered_ok in ranks(2, _check, 5, 16, 24, "float32", {"path": "fallback"}, 2):
        assert gathered_ok and worst < 1e-6


def _check_silu_gate(m, n_out, k, dtype_name, config, repeats):
    """activation="silu_gate": w = [gate; up] with 2 * n_out rows; the result against silu(x @ gate.T) *
    (x @ up.T) in fp64, fresh inputs every repeat, the output poisoned before every call."""
    dtype = getattr(torch, dtype_name)
    dev, r = td.shmem.device(), td.rank()
    worst = 0.0
    for i in range(repeats):
        gen = torch.Generator().manual_seed(77 + 1000 * i + r)
        a = torch.randn(m, k, generator=gen).to(dtype).to(dev)
        w = (torch.randn(2 * n_out, k, generator=gen) / k ** 0.5).to(dtype).to(dev)
        if config.get("path") != "fallback":
            agm.buffers(m, k, dtype)
            _poison_workspaces()
        out = ag_gemm(a, w, config=config, activation="silu_gate")
        ref = agm.silu_gate_torch(_reference(a, w)[1])
        assert tuple(out.shape) == (td.world_size() * m, n_out), out.shape
        worst = max(worst, ((out.double() - ref).abs().max() / ref.abs().max()).item())
    return worst


@pytest.mark.parametrize("m,n_out,k,dtype,config", [
    (17, 24, 40, "float16", CPU_C3),                            # TMA path: up rows at N in one descriptor
    (13, 23, 37, "float32", CPU_CE),                            # odd N and K: masked path
    (9, 17, 19, "float16", {**CPU_CE, "use_tma": False}),
    (17, 24, 40, "float16", {**CPU_C3, "gather_first": True}),  # the GEMM core's kernel
    (13, 23, 37, "float32", {**CPU_CE, "gather_first": True}),
    (5, 8, 24, "float32", {"path": "fallback"}),                 # matmul, then the unfused activation
])
def test_ag_gemm_silu_gate(ranks, m, n_out, k, dtype, config):
    for worst in ranks(2, _check_silu_gate, m, n_out, k, dtype, config, 2):
        assert worst < (2e-3 if dtype == "float16" else 1e-6), worst


def test_ag_gemm_silu_gate_four_ranks(ranks):
    for worst in ranks(4, _check_silu_gate, 7, 12, 40, "float16", CPU_CE, 1):
        assert worst < 2e-3, worst


def _check_back_to_back(calls):
    """Calls with no barrier in between: only the ready handshake + epochs keep them apart."""
    dev, r = td.shmem.device(), td.rank()
    ok = True
    for i in range(calls):
        # chunkings and the gather-first variant share the workspace and its epochs
        config = (CPU_C3, CPU_CE, CPU_C1, {**CPU_CE, "gather_first": True})[i % 4]
        a = (torch.randn(11, 16) + 100 * r + i).to(dev)
        w = torch.randn(8, 16).to(dev)
        out = ag_gemm(a, w, config=config)
        ref = _reference(a, w)[1]
        ok &= bool(((out.double() - ref).abs().max() / ref.abs().max()) < 1e-6)
    return ok


def test_ag_gemm_back_to_back_calls(ranks):
    assert ranks(2, _check_back_to_back, 8) == [True, True]


def _check_start_gather(m, k, repeats):
    """``start_gather``: the gathered rows exact, with an ag_gemm of the same shape (another workspace, its own
    epochs) and back-to-back gathers between a start and its finish; the gather's workspace poisoned first."""
    dev, r = td.shmem.device(), td.rank()
    ok = True
    for i in range(repeats):
        gen = torch.Generator().manual_seed(100 * i + r)
        a, b = (torch.randn(m, k, generator=gen).to(dev) for _ in range(2))
        w = torch.randn(8, k, generator=gen).to(dev)
        for ws in td.shmem.workspaces.cached("ag_gemm.gather"):
            ws.a_full.fill_(float("nan"))
        td.shmem.barrier()
        finish = agm.start_gather(a)
        out = ag_gemm(a, w, config=CPU_C3 if i % 2 else CPU_C1)  # its own a_full: the gather's rows untouched
        gathered = finish().clone()
        ref_rows, ref = _reference(a, w)
        ok &= torch.equal(gathered, ref_rows) and bool(((out.double() - ref).abs().max() / ref.abs().max()) < 1e-6)
        ok &= torch.equal(agm.start_gather(b)(), _reference(b, w)[0])  # the next gather on the same workspace
    return ok


@pytest.mark.parametrize("world,m,k", [(1, 5, 16), (2, 7, 24), (3, 1, 40)])
def test_start_gather_is_exact_around_an_ag_gemm(ranks, world, m, k):
    assert ranks(world, _check_start_gather, m, k, 3) == [True] * world


def _check_torch_op_and_compile():
    from torch._subclasses.fake_tensor import FakeTensorMode

    dev, r = td.shmem.device(), td.rank()
    a = torch.randn(6, 16, generator=torch.Generator().manual_seed(r)).to(dev)
    w = torch.randn(8, 16, generator=torch.Generator().manual_seed(9 + r)).to(dev)
    ref_a, ref = _reference(a, w)
    out, gathered = torch.ops.triton_dist.ag_gemm(a, w, True)  # the registered op (default config)
    op_ok = torch.allclose(out.double(), ref, atol=1e-5) and torch.equal(gathered, ref_a)
    out2, empty = torch.ops.triton_dist.ag_gemm(a, w, False)
    op_ok &= tuple(empty.shape) == (0, 16) and torch.allclose(out2.double(), ref, atol=1e-5)
    gated = agm.silu_gate_torch(ref)
    out3, _ = torch.ops.triton_dist.ag_gemm(a, w, False, "silu_gate")
    op_ok &= torch.allclose(out3.double(), gated, atol=1e-5)
    with FakeTensorMode() as mode:  # the fake impl: shapes without running anything
        fa, fw = mode.from_tensor(a), mode.from_tensor(w)
        fo, fg = torch.ops.triton_dist.ag_gemm(fa, fw, True)
        fs, _ = torch.ops.triton_dist.ag_gemm(fa, fw, False, "silu_gate")
    fake_ok = (tuple(fo.shape) == tuple(ref.shape) and tuple(fg.shape) == tuple(ref_a.shape)
               and tuple(fs.shape) == tuple(gated.shape))

    def f(x, y):
        return ag_gemm(x, y) * 2.0 + ag_gemm(x, y, activation="silu_gate").sum()

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    compile_ok = torch.allclose(compiled(a, w).double(), ref * 2 + gated.sum(), atol=1e-4)
    return op_ok, fake_ok, compile_ok


def test_ag_gemm_torch_op_fake_and_compile(ranks):
    for result in ranks(2, _check_torch_op_and_compile):
        assert result == (True, True, True)


def _traced_group_names():
    """The group names the ag_gemm calls of a compiled function carry in its graph (the heap's group and a group of
    its first two ranks)."""
    names = []

    def capture(gm, example_inputs):
        names.extend(n.args[4] for n in gm.graph.nodes
                     if n.target in (torch.ops.triton_dist.ag_gemm, torch.ops.triton_dist.ag_gemm.default))
        return gm

    pair = dist.new_group([0, 1])  # every rank creates it; its members use it
    a = torch.randn(4, 16, device=td.shmem.device())
    w = torch.randn(8, 16, device=td.shmem.device())
    torch.compile(lambda x, y: ag_gemm(x, y), fullgraph=True, backend=capture)(a, w)
    if td.rank() < 2:
        torch.compile(lambda x, y: ag_gemm(x, y, group=pair), fullgraph=True, backend=capture)(a, w)
    with pytest.raises(ValueError, match="not 5"):
        td.shmem.group_named(names[0].rpartition("/")[0] + "/5")
    return names


def test_a_compiled_graph_carries_its_group_size(ranks):
    """Compile caches key on a graph's code: the ops' output shapes depend on the group's size, so the graph must
    carry it, or a graph traced at 2 ranks is reused by a run at 4 from the same cache (docs/design/shmem.md).
    3 ranks: one of them outside the pair group."""
    results = ranks(3, _traced_group_names)
    for names in results:
        assert names[0] == "heap/3", names
    assert [len(names) for names in results] == [2, 2, 1] and results[0][1].endswith("/2")


def _check_bad_input():
    dev = td.shmem.device()
    a = torch.randn(4, 8, device=dev)
    w = torch.randn(6, 8, device=dev)
    cases = [
        lambda: ag_gemm([1, 2], w),                                    # not a tensor
        lambda: ag_gemm(a.to(torch.int32), w.to(torch.int32)),         # dtype
        lambda: ag_gemm(a, w.half()),                                  # mixed dtypes
        lambda: ag_gemm(a, torch.randn(6, 9, device=dev)),             # K mismatch
        lambda: ag_gemm(a[:, ::2], torch.randn(6, 4, device=dev)),     # non-contiguous
        lambda: ag_gemm(a.reshape(-1), w),                             # 1-D
        lambda: ag_gemm(a.to("meta"), w.to("meta")),                   # wrong device
        lambda: torch.ops.triton_dist.ag_gemm(a, w.half()),            # the op checks too
        lambda: ag_gemm(a, w[:5], activation="silu_gate"),             # odd rows: no gate/up halves
        lambda: ag_gemm(a, w, activation="gelu"),                      # unknown activation
        lambda: ag_gemm(a, w, config={"BLOCK_M": 0}),                  # no such tile (was ZeroDivisionError)
        lambda: ag_gemm(a, w, config={"path": "nope"}),                # unknown path (was run as "overlap")
    ]
    return error_names(cases)


def _check_cpu_tensors_without_interpreter():
    import os

    a = torch.randn(4, 8)
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "0"
    try:
        ag_gemm(a, torch.randn(6, 8))
        return None
    except ValueError as exc:
        return str(exc)
    finally:
        if old is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = old


def test_ag_gemm_rejects_cpu_tensors_without_interpreter(ranks):
    """GPU ranks: CPU tensors are on the wrong device; CPU ranks: they need the interpreter. Never a launch."""
    for msg in ranks(2, _check_cpu_tensors_without_interpreter):
        assert msg is not None


def test_ag_gemm_rejects_bad_input(ranks):
    for names in ranks(2, _check_bad_input):
        assert names == ["TypeError", "TypeError", "TypeError", "ValueError", "ValueError", "ValueError",
                         "ValueError", "TypeError", "ValueError", "ValueError", "ValueError", "ValueError"], names


# ----------------------------------------------------------------------------------------------- GPU
def _gpu_reference(a, w):
    gathered = torch.empty((td.world_size() * a.shape[0], a.shape[1]), dtype=a.dtype, device=a.device)
    dist.all_gather_into_tensor(gathered, a)
    return gathered, gathered.float() @ w.float().T


def _check_gpu(m, n, k, config, repeats, straggler_s=0.0):
    worst, gathered_ok = 0.0, True
    for i in range(repeats):
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 8
        if config is None or config.get("path") != "fallback":
            agm.buffers(m, k, torch.bfloat16)
            _poison_workspaces()
        if straggler_s and td.rank() == td.world_size() - 1:
            torch.cuda.synchronize()
            time.sleep(straggler_s)  # this rank enters late; the others must wait, not read stale rows
        if config is None:
            out, gathered = torch.ops.triton_dist.ag_gemm(a, w, True)
        else:
            out, gathered = ag_gemm(a, w, return_gathered=True, config=config)
        ref_a, ref = _gpu_reference(a, w)
        err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
        worst = max(worst, err if err == err else float("inf"))
        gathered_ok &= torch.equal(gathered, ref_a)
    return worst, gathered_ok


GPU_SHAPES = [(1000, 1536, 1024), (2048, 4096, 2048), (517, 520, 4104), (256, 1024, 1000)]


@gpu_only
@pytest.mark.parametrize("m,n,k", GPU_SHAPES)
def test_ag_gemm_gpu_bf16_100_repeats(ranks, m, n, k):
    for worst, gathered_ok in ranks(ranks.gpu_world, _check_gpu, m, n, k, None, 100):
        assert gathered_ok and worst < 1e-2, worst


def _check_gpu_every_candidate(m, n, k):
    """(config, error, gathered rows right) of every candidate that is off (on this rank)."""
    bad = []
    for cfg in agm.candidate_configs(m, n, k, torch.bfloat16, torch.device("cuda"), td.world_size()) + [
            {"path": "overlap", "n_chunks": 4}, {"path": "overlap", "use_tma": False}]:
        worst, gathered_ok = _check_gpu(m, n, k, cfg, 10)
        if not (gathered_ok and worst < 1e-2):
            bad.append((cfg, worst, gathered_ok))
    return bad


@gpu_only
@pytest.mark.parametrize("m,n,k", GPU_SHAPES[:3])
def test_ag_gemm_gpu_every_candidate(ranks, m, n, k):
    assert ranks(ranks.gpu_world, _check_gpu_every_candidate, m, n, k) == [[]] * ranks.gpu_world


def _check_gpu_silu_gate(m, n_out, k, config, repeats):
    """activation="silu_gate" in bf16 against silu(x @ gate.T) * (x @ up.T) from an fp32 GEMM, fresh inputs
    every repeat, a_full poisoned (config None: the tuned configuration through the torch op)."""
    worst = 0.0
    for _ in range(repeats):
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(2 * n_out, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        if config is None or config.get("path") != "fallback":
            agm.buffers(m, k, torch.bfloat16)
            _poison_workspaces()
        if config is None:
            out = torch.ops.triton_dist.ag_gemm(a, w, False, "silu_gate")[0]
        else:
            out = ag_gemm(a, w, config=config, activation="silu_gate")
        ref = agm.silu_gate_torch(_gpu_reference(a, w)[1])
        err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
        worst = max(worst, err if err == err and out.shape == ref.shape else float("inf"))
    return worst


@gpu_only
@pytest.mark.parametrize("m,n_out,k,config", [
    (1000, 1536, 1024, None), (517, 520, 4104, None), (64, 2048, 1000, None),
    (1000, 1536, 1024, {"path": "overlap", "n_chunks": 2}),
    (517, 520, 4104, {"path": "overlap", "use_tma": False}),
    (1000, 1536, 1024, {"path": "overlap", "FLATTEN": True, "EPILOGUE_SUBTILE": True, "num_stages": 4}),
    (200, 1032, 1024, {"path": "overlap", "gather_first": True}),
    (256, 1024, 1000, {"path": "graph"}),
])
def test_ag_gemm_gpu_silu_gate(ranks, m, n_out, k, config):
    for worst in ranks(ranks.gpu_world, _check_gpu_silu_gate, m, n_out, k, config, 20):
        assert worst < 1e-2, worst


def _check_graph_path(m, n, k):
    """Path "graph": fresh activations every call, a weight updated in place, then more distinct weights than
    the cache captures (those launch directly). Every result against the fp32 reference."""
    cfg = {"path": "graph"}
    worst = 0.0
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 8
    weights = [w] * 6 + [None] * 2 + [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 8
                                      for _ in range(replay.MAX_WEIGHTS + 2)]
    for i, wi in enumerate(weights):
        if wi is None:  # in place, same address: the captured graph must see the new values
            w.copy_(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 8)
            wi = w
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        out = ag_gemm(a, wi, config=cfg)
        ref = _gpu_reference(a, wi)[1]
        err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
        worst = max(worst, err if err == err else float("inf"))
    return worst, len(agm._GRAPHS.graphs)


@gpu_only
@pytest.mark.parametrize("m,n,k", [(256, 1024, 1000), (1000, 1536, 1024)])
def test_ag_gemm_gpu_graph_path(ranks, m, n, k):
    for worst, graphs in ranks(2, _check_graph_path, m, n, k):
        assert worst < 1e-2 and graphs >= 1, (worst, graphs)


@gpu_only
@pytest.mark.parametrize("n_chunks,gather_first", [(1, False), (4, False), (2, True)])
def test_ag_gemm_gpu_straggler(ranks, n_chunks, gather_first):
    cfg = {"path": "overlap", "n_chunks": n_chunks, "gather_first": gather_first}
    for worst, gathered_ok in ranks(ranks.gpu_world, _check_gpu, 2048, 2048, 4096, cfg, 3, 0.3):
        assert gathered_ok and worst < 1e-2, worst


SKINNY = {"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 64, "num_stages": 6, "num_warps": 4}


@gpu_only
@pytest.mark.parametrize("m,n,k,config", [
    (64, 4096, 1000, {"path": "overlap", "gather_first": True}),  # M = 128 on 2 GPUs, ragged K
    (64, 4096, 1000, {"path": "graph", "gather_first": True, **SKINNY}),  # replayed, 128-row tiles span ranks
    (200, 1032, 1024, {"path": "overlap", "gather_first": True, "n_chunks": 3, "use_tma": False}),
])
def test_ag_gemm_gpu_gather_first(ranks, m, n, k, config):
    """Small M, gather first then one GEMM pass: 100 fresh repeats, a_full poisoned before every call."""
    for worst, gathered_ok in ranks(ranks.gpu_world, _check_gpu, m, n, k, config, 100):
        assert gathered_ok and worst < 1e-2, worst


def _check_graph(n_chunks):
    m, n, k = 1024, 2048, 1024
    cfg = {"path": "overlap", "n_chunks": n_chunks}
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 8
    ag_gemm(a, w, config=cfg)  # compile + workspace outside the capture
    torch.ops.triton_dist.ag_gemm(a, w, False)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ag_gemm(a, w, config=cfg)
        out_op, _ = torch.ops.triton_dist.ag_gemm(a, w, False)
    worst = 0.0
    for _ in range(5):
        a.copy_(torch.randn_like(a))
        td.shmem.barrier()
        graph.replay()
        ref = _gpu_reference(a, w)[1]
        for o in (out, out_op):
            worst = max(worst, ((o.float() - ref).abs().max() / ref.abs().max()).item())
    return worst


@gpu_only
@pytest.mark.parametrize("n_chunks", [1, 4])
def test_ag_gemm_gpu_cuda_graph_replay(ranks, n_chunks):
    for worst in ranks(ranks.gpu_world, _check_graph, n_chunks):
        assert worst < 1e-2, worst


def _check_gpu_compile():
    a = torch.randn(1024, 512, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(768, 512, device="cuda", dtype=torch.bfloat16)
    f = torch.compile(lambda x, y: torch.relu(ag_gemm(x, y)), fullgraph=True)
    ref = torch.relu(_gpu_reference(a, w)[1])
    return ((f(a, w).float() - ref).abs().max() / ref.abs().max()).item()


@gpu_only
def test_ag_gemm_gpu_torch_compile(ranks):
    for worst in ranks(ranks.gpu_world, _check_gpu_compile):
        assert worst < 1e-2


# ----------------------------------------------------------------------------------------------- sm_90
AG_SIGNATURE = dict(
    a_local="tensordesc<bf16[128,64]>", a_full="tensordesc<bf16[128,64]>", b="tensordesc<bf16[256,64]>",
    c="tensordesc<bf16[1,128,256]>", arrived="*i32", state="*i32", ctx="*i64",
    m_shard="i32", N="i32", K="i32", stride_al="i32", stride_af="i32", stride_bn="i32", stride_cs="i32",
    stride_cm="i32", chunk_rows="i32",
    **{name: "constexpr" for name in ("N_CHUNKS", "BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "USE_TMA",
                                      "EPILOGUE_SUBTILE", "FLATTEN", "WARP_SPECIALIZE", "FENCE_ASYNC_PROXY",
                                      "DOT_PRECISION", "SILU_GATE")})


@pytest.mark.parametrize("n_chunks,flatten,silu_gate", [(1, False, False), (2, True, False), (1, False, True)])
def test_ag_gemm_compiles_for_sm90_with_tma_and_wgmma(n_chunks, flatten, silu_gate):
    block_n = 128 if silu_gate else 256  # the gated tile: two 128-wide accumulators
    sig = dict(AG_SIGNATURE, b=f"tensordesc<bf16[{block_n},64]>", c=f"tensordesc<bf16[1,128,{block_n}]>")
    res = compile_sm90("triton_dist.kernels.allgather_gemm", "ag_gemm_kernel", sig,
                       dict(N_CHUNKS=n_chunks, BLOCK_M=128, BLOCK_N=block_n, BLOCK_K=64, GROUP_M=8, USE_TMA=True,
                            EPILOGUE_SUBTILE=False, FLATTEN=flatten, WARP_SPECIALIZE=False, FENCE_ASYNC_PROXY=True,
                            DOT_PRECISION="tf32", SILU_GATE=silu_gate), aligned=("K", "N"))
    ops = res["ops"]
    assert any(k.startswith("wgmma.mma_async") for k in ops), ops
    assert any(k.startswith("cp.async.bulk.tensor.2d") for k in ops), ops  # TMA loads of A and W
    assert any(k.startswith("cp.async.bulk.tensor.3d") for k in ops), ops  # TMA store of the output tile
    assert any(k.startswith("atom.global.sys.acquire") or k.startswith("ld.global.sys.acquire") for k in ops), ops
    assert ops.get("fence.proxy.async.global", 0) == n_chunks, ops  # one fence per chunk wait, none per tile
    assert any(k.startswith("ex2.approx") for k in ops) == silu_gate, ops  # the sigmoid, only when gated


def test_gathered_kernel_compiles_for_sm90():
    res = compile_sm90("triton_dist.kernels.allgather_gemm", "gathered_kernel",
                       dict(arrived="*i32", state="*i32", ctx="*i64", N_CHUNKS="constexpr",
                            FENCE_ASYNC_PROXY="constexpr"), dict(N_CHUNKS=2, FENCE_ASYNC_PROXY=True))
    ops = res["ops"]
    assert ops.get("ld.global.sys.acquire.b32", 0) > 0 or any("acquire" in k for k in ops), ops
    assert ops.get("fence.proxy.async.global", 0) == 2, ops  # after each chunk's wait: the GEMM reads by TMA


def test_ready_handshake_compiles_for_sm90():
    res = compile_sm90("triton_dist.kernels.allgather_gemm", "ready_handshake_kernel",
                       dict(ready="*i32", state="*i32", epoch_out="*i32", ctx="*i64"))
    ops = res["ops"]
    assert any(k.startswith("atom.global.sys.release") for k in ops), ops
    assert ops.get("ld.global.sys.acquire.b32", 0) > 0, ops
