"""Host cost of one eager call (torchrun --nproc-per-node=N benchmarks/bench_host.py), ours against the baselines.

Small shapes are decided on the host: when the GPU work of a call is ~50 µs, the Python and launch cost of the
call is what the user waits for. This measures it with the GPU kept busy (a long sleep kernel is queued first, so
the host never waits for the device and only its own cost is timed), for every op at a small shape and for the
building blocks (an empty Triton launch, a launch with tensor descriptors, torch.matmul, an NCCL call) and the
torch.ops dispatch of an op.

Every op's figure is printed next to its baseline's, measured in the same run, with the ratio and the target
(<= 1.2x the baseline's host time; ep_dispatch / ep_combine <= 40 us, sp_flash_decode <= 30 us). Runs at any world
size (W=1: torchrun --nproc-per-node=1). With HOST_PROFILE=1, rank 0 also prints a cProfile of each op's eager
calls (top functions by own time: Python, binding, launches).
"""

import os
import pstats

import torch
import torch.distributed as dist
import triton
import triton.language as tl

import triton_dist as td
from harness import host_us, record
from triton_dist.kernels import ag_gemm, all_gather, all_reduce, all_reduce_rmsnorm, ep_combine, ep_dispatch, gemm_rs, sp_flash_decode
from triton_dist.kernels import fp8
from triton_dist.kernels.gemm import gemm, scaled_gemm

CALLS = 50
COMPARE = [  # (ours, baseline (None: a fixed target), target us)
    ("all_gather 1 MiB (ours)", "all_gather 1 MiB NCCL", None),
    ("ag_gemm M=128 (ours)", "ag_gemm M=128 NCCL+cuBLAS", None),
    ("ag_gemm M=2048 (ours)", "ag_gemm M=2048 NCCL+cuBLAS", None),
    ("gemm_rs M=128 (ours)", "gemm_rs M=128 cuBLAS+NCCL", None),
    ("gemm_rs M=2048 (ours)", "gemm_rs M=2048 cuBLAS+NCCL", None),
    ("gemm 128x4096x8192 (ours)", "gemm 128x4096x8192 torch.matmul", None),
    ("gemm 96x2560x7168 (ours)", "gemm 96x2560x7168 torch.matmul", None),
    ("scaled_gemm row 1536x2560x7168 (ours)", "scaled_gemm row 1536x2560x7168 torch._scaled_mm", None),
    ("ep_dispatch T=128 (ours)", None, 40.0),
    ("ep_dispatch T=128 fused layout (one launch)", None, 40.0),
    ("ep_combine T=128 (ours)", None, 40.0),
    ("sp_flash_decode B=1 S=128K (ours)", None, 30.0),
    ("all_reduce 1 MiB (ours)", "all_reduce 1 MiB NCCL", None),
    ("all_reduce_rmsnorm 16x8192 (ours)", "all_reduce_rmsnorm 16x8192 NCCL+torch", None),
]


@triton.jit
def _empty_kernel(a, b, c, n0, n1, n2, n3, BLOCK: tl.constexpr):
    pass


@triton.jit
def _desc_kernel(a, b, c, n0, BLOCK: tl.constexpr):
    pass


def _per_call(prof, top=22):
    """The functions of a cProfile by own time: µs per call of the op (not per call of the function)."""
    stats = pstats.Stats(prof).stats
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    return "\n".join(f"{tt / CALLS * 1e6:8.2f} {ct / CALLS * 1e6:8.2f}  x{nc / CALLS:<4.3g} "
                     f"{os.path.basename(fn)}:{line}({func})" for (fn, line, func), (_, nc, tt, ct, _) in rows)


def main():
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    td.init(backend="cuda", heap_size=2 << 30)
    world, me = td.world_size(), td.rank()
    profiling = os.environ.get("HOST_PROFILE") == "1" and me == 0
    dev = torch.device("cuda")
    bf = dict(dtype=torch.bfloat16, device=dev)
    cases = {}

    # building blocks
    x = torch.randn(1024, 1024, **bf)
    cases["empty triton launch (7 args)"] = (lambda: _empty_kernel[(1,)](x, x, x, 1, 2, 3, 4, BLOCK=64), None)
    from triton.tools.tensor_descriptor import TensorDescriptor

    def desc_launch():
        d = [TensorDescriptor(x, [1024, 1024], [1024, 1], [128, 64]) for _ in range(3)]
        _desc_kernel[(1,)](d[0], d[1], d[2], 5, BLOCK=64)
    cases["triton launch, 3 new descriptors"] = (desc_launch, None)
    a128 = torch.randn(128 // world, 8192, **bf)
    w4k = torch.randn(8192 // world, 8192, **bf)
    full = torch.empty(128, 8192, **bf)
    cases["torch.matmul"] = (lambda: torch.matmul(full, w4k.T), None)
    cases["NCCL all_gather_into_tensor"] = (lambda: dist.all_gather_into_tensor(full, a128), None)

    # the ops, small shapes, and their baselines
    cases["ag_gemm M=128 (ours)"] = (lambda: ag_gemm(a128, w4k), "ag_gemm")
    cases["ag_gemm M=128 (torch.ops)"] = (lambda: torch.ops.triton_dist.ag_gemm(a128, w4k, False), None)

    def ag_base():
        dist.all_gather_into_tensor(full, a128)
        return torch.matmul(full, w4k.T)
    cases["ag_gemm M=128 NCCL+cuBLAS"] = (ag_base, None)
    cases["ag_gemm M=128 graph-path"] = (lambda: ag_gemm(a128, w4k, config={"path": "graph"}), None)
    a2k = torch.randn(2048 // world, 8192, **bf)
    cases["ag_gemm M=2048 (ours)"] = (lambda: ag_gemm(a2k, w4k), "ag_gemm2048")
    cases["ag_gemm M=2048 overlap"] = (lambda: ag_gemm(a2k, w4k, config={"path": "overlap"}), "ag_gemm_overlap")

    ars = torch.randn(128, 8192 // world, **bf)
    wrs = torch.randn(8192, 8192 // world, **bf)
    rs_out = torch.empty(128 // world, 8192, **bf)
    cases["gemm_rs M=128 (ours)"] = (lambda: gemm_rs(ars, wrs), "gemm_rs")
    cases["gemm_rs M=128 overlap"] = (lambda: gemm_rs(ars, wrs, config={"path": "overlap"}), "gemm_rs_overlap")
    cases["gemm_rs M=128 graph-path"] = (lambda: gemm_rs(ars, wrs, config={"path": "graph"}), None)

    def rs_base():
        p = torch.matmul(ars, wrs.T)
        dist.reduce_scatter_tensor(rs_out, p)
        return rs_out
    cases["gemm_rs M=128 cuBLAS+NCCL"] = (rs_base, None)

    def ag2k_base():
        full2k = torch.empty(2048, 8192, **bf)
        dist.all_gather_into_tensor(full2k, a2k)
        return torch.matmul(full2k, w4k.T)
    cases["ag_gemm M=2048 NCCL+cuBLAS"] = (ag2k_base, None)
    ars2k = torch.randn(2048, 8192 // world, **bf)
    rs2k_out = torch.empty(2048 // world, 8192, **bf)
    cases["gemm_rs M=2048 (ours)"] = (lambda: gemm_rs(ars2k, wrs), "gemm_rs2048")

    def rs2k_base():
        dist.reduce_scatter_tensor(rs2k_out, torch.matmul(ars2k, wrs.T))
        return rs2k_out
    cases["gemm_rs M=2048 cuBLAS+NCCL"] = (rs2k_base, None)
    g_a, g_w = torch.randn(128, 8192, **bf), torch.randn(4096, 8192, **bf)
    cases["gemm 128x4096x8192 (ours)"] = (lambda: gemm(g_a, g_w), "gemm")
    cases["gemm 128x4096x8192 torch.matmul"] = (lambda: torch.matmul(g_a, g_w.T), None)
    s_a, s_w = torch.randn(96, 7168, **bf), torch.randn(2560, 7168, **bf)  # few tiles, long K: split-K (run143b)
    cases["gemm 96x2560x7168 (ours)"] = (lambda: gemm(s_a, s_w), "gemm split-k")
    cases["gemm 96x2560x7168 torch.matmul"] = (lambda: torch.matmul(s_a, s_w.T), None)
    f_a, f_sa = fp8.quantize(torch.randn(1536, 7168, device=dev), "row")  # FP8 rowwise (sm_90: the Gluon mainloop)
    f_w, f_sw = fp8.quantize(torch.randn(2560, 7168, device=dev) / 16, "row")
    cases["scaled_gemm row 1536x2560x7168 (ours)"] = (lambda: scaled_gemm(f_a, f_w, f_sa, f_sw), "scaled_gemm")
    cases["scaled_gemm row 1536x2560x7168 torch._scaled_mm"] = (
        lambda: torch._scaled_mm(f_a, f_w.t(), f_sa, f_sw.t(), out_dtype=torch.bfloat16), None)

    ag_in = torch.randn(1 << 19, **bf)
    ag_out = torch.empty(world << 19, **bf)
    ag_sym = td.shmem.empty((world << 19,), torch.bfloat16, name="bench_host.ag_out")
    cases["all_gather 1 MiB (ours)"] = (lambda: all_gather(ag_in, out=ag_sym), "all_gather")
    cases["all_gather 1 MiB (ours, out allocated)"] = (lambda: all_gather(ag_in), None)
    cases["all_gather 1 MiB NCCL"] = (lambda: dist.all_gather_into_tensor(ag_out, ag_in), None)

    T, H, E, K = 128, 7168, 64, 8
    xt = torch.randn(T, H, **bf)
    idx = torch.stack([torch.randperm(E, device=dev)[:K] for _ in range(T)]).to(torch.int32)
    wts = torch.rand(T, K, device=dev)

    def disp():
        return ep_dispatch(xt, idx, wts, num_experts=E, max_tokens=T)
    cases["ep_dispatch T=128 (ours)"] = (disp, "ep_dispatch")
    cases["ep_dispatch T=128 fused layout (one launch)"] = (
        lambda: ep_dispatch(xt, idx, wts, num_experts=E, max_tokens=T, config={"fused_layout": True}), None)
    cases["ep_dispatch T=128 replayed from a CUDA graph"] = (
        lambda: ep_dispatch(xt, idx, wts, num_experts=E, max_tokens=T, config={"eager_graph": True}), None)
    # combine needs the latest dispatch's handle: it is refreshed right before combine is timed
    cases["ep_combine T=128 (ours)"] = (None, "ep_combine")

    q = torch.randn(1, 32, 128, **bf)
    kc = torch.randn(1, 65536, 8, 128, **bf)
    vc = torch.randn(1, 65536, 8, 128, **bf)
    lens = torch.full((1,), 65536, dtype=torch.int32, device=dev)
    cases["sp_flash_decode B=1 S=128K (ours)"] = (lambda: sp_flash_decode(q, kc, vc, lens), "flash")

    ar_x, ar_out = torch.randn(1 << 19, **bf), torch.empty(1 << 19, **bf)
    cases["all_reduce 1 MiB (ours)"] = (lambda: all_reduce(ar_x, out=ar_out), "all_reduce")
    cases["all_reduce 1 MiB NCCL"] = (lambda: dist.all_reduce(ar_out), None)
    nx, nres, nw = torch.randn(16, 8192, **bf), torch.randn(16, 8192, **bf), torch.randn(8192, **bf)
    cases["all_reduce_rmsnorm 16x8192 (ours)"] = (lambda: all_reduce_rmsnorm(nx, nres, nw, 1e-6), "rmsnorm")

    nx_sum = torch.empty_like(nx)

    def rmsnorm_base():
        dist.all_reduce(nx_sum)
        r = nres + nx_sum
        return torch.nn.functional.rms_norm(r, (8192,), nw, 1e-6), r
    cases["all_reduce_rmsnorm 16x8192 NCCL+torch"] = (rmsnorm_base, None)

    rows = []
    for name, (fn, prof_name) in cases.items():
        if fn is None:  # ep_combine: the handle of the latest dispatch
            r = disp()
            eo = r.x.clone()
            fn = (lambda r=r, eo=eo: ep_combine(eo, r.handle))
        profs = [] if (profiling and prof_name) else None
        t = host_us(fn, CALLS, profile=profs)
        rows.append({"call": name, "host us/call": t})
        if me == 0:
            print(f"{name:45s} {t:8.1f} us", flush=True)
        if profs:
            print(f"---- cProfile {name}: us per call, own / with callees (the profiler's own cost included)\n"
                  + _per_call(profs[0]), flush=True)
    by_name = {r["call"]: r["host us/call"] for r in rows}
    for ours, base, target in COMPARE:
        if ours not in by_name:
            continue
        t = by_name[ours]
        limit = 1.2 * by_name[base] if base else target
        ratio = f"{t / by_name[base]:.2f}x {base}" if base else f"target {target:.0f} us"
        rows.append({"call": f"{ours} vs {base or 'target'}", "host us/call": t, "limit us": limit,
                     "met": t <= limit})
        if me == 0:
            print(f"{ours:40s} {t:8.1f} us  {ratio:48s} {'ok' if t <= limit else 'NOT MET'}", flush=True)
    record("host", rows, notes=f"W={world}; host µs per eager call with the GPU kept busy (median of 5 batches of "
                               f"{CALLS}, max over ranks); python {os.sys.version.split()[0]}")
    td.finalize()


if __name__ == "__main__":
    main()
